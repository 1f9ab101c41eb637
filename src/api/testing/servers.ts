/**
 * The agent stand-in the sandbox tests and benches run: a python HTTP server on port 8080
 * whose answer is "COUNT TOKEN": a counter and a random token that live only in its memory, so
 * a restore that lost memory (or a fresh start) shows. Prints "serving" when it listens.
 */
import assert from 'node:assert/strict';
import type { SandboxInfo } from '../../sdk/client.js';
import { eventually, httpGet } from './host.js';

export const COUNTER_SERVER_PY = `
import http.server, os
count = 0
token = os.urandom(8).hex()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global count
        count += 1
        body = ("%d %s" % (count, token)).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
print("serving", flush=True)
http.server.HTTPServer(("0.0.0.0", 8080), H).serve_forever()
`;

/** [counter, token] from the counter server of sandbox `sb`, waiting for it to answer. */
export async function serveCounter(sb: SandboxInfo): Promise<[number, string]> {
  const body = await eventually(`server of ${sb.id}`, () => httpGet(sb.address!, 8080));
  assert.match(body, /^\d+ [0-9a-f]{16}$/);
  const [n, token] = body.split(' ');
  return [Number(n), token!];
}
