/**
 * The agent stand-ins the sandbox tests and benches run: python HTTP servers whose answers come
 * from state that lives only in their memory, so a restore that lost memory (or a fresh start)
 * shows. The plainest answers "COUNT TOKEN": a counter and a random token.
 */
import assert from 'node:assert/strict';
import type { SandboxInfo } from '../../sdk/client.js';
import { eventually, httpGet } from './host.js';

/** What a {@link pythonServer} holds and answers. */
export interface PythonServer {
  /** Python run once before it serves: its own imports and the state `answer` reads. */
  setup?: string;
  /** A python expression (a str), the answer to each GET, read after the global `count` went up. */
  answer: string;
  /** Python expressions for the address it listens on; default "0.0.0.0" and 8080. */
  host?: string;
  port?: string;
  /** Its listen backlog (python's default is 5); a burst of concurrent connections wants more. */
  backlog?: number;
  /** Keeps connections open (HTTP/1.1) with a thread per connection, as a load test's client wants. */
  keepAlive?: boolean;
}

/**
 * The python source of an HTTP server that answers every GET with a 200 and `answer`, counting
 * the requests in the global `count`, without logging them. Prints "serving" when it starts.
 */
export function pythonServer(s: PythonServer): string {
  return `
import http.server
${s.setup ?? ''}
count = 0
class H(http.server.BaseHTTPRequestHandler):
${s.keepAlive ? '    protocol_version = "HTTP/1.1"\n' : ''}    def do_GET(self):
        global count
        count += 1
        body = (${s.answer}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
${s.keepAlive ? '' : '        self.send_header("Connection", "close")\n'}        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
class S(http.server.${s.keepAlive ? 'ThreadingHTTPServer' : 'HTTPServer'}):
    request_queue_size = ${String(s.backlog ?? 5)}
print("serving", flush=True)
S((${s.host ?? '"0.0.0.0"'}, ${s.port ?? '8080'}), H).serve_forever()
`;
}

/** The counter and its random token, only in memory, as "COUNT TOKEN". */
const COUNTER = { setup: 'import os\ntoken = os.urandom(8).hex()', answer: '"%d %s" % (count, token)' };

export const COUNTER_SERVER_PY = pythonServer(COUNTER);

/**
 * {@link COUNTER_SERVER_PY} with more: `setup` run first (a file held open, say), `backlog`
 * for many concurrent requests, `keepAlive` for a load generator.
 */
export function counterServer(more: Omit<PythonServer, 'answer'>): string {
  return pythonServer({ ...COUNTER, ...more, setup: `${COUNTER.setup}\n${more.setup ?? ''}` });
}

/** [counter, token] from the counter server of sandbox `sb`, waiting for it to answer. */
export async function serveCounter(sb: SandboxInfo): Promise<[number, string]> {
  const body = await eventually(`server of ${sb.id}`, () => httpGet(sb.address!, 8080));
  assert.match(body, /^\d+ [0-9a-f]{16}$/);
  const [n, token] = body.split(' ');
  return [Number(n), token!];
}

/**
 * A python HTTP server on port 8080 holding BLOCKS MiB (default 96) of random bytes in one
 * anonymous mapping (private; with SHARED=1 shared with a forked worker), with the SHA-256 of
 * each MiB. A thread checks every block against its sum (a pass, then PAUSE seconds (0.2) of
 * rest, over and over) and appends the numbers of the blocks that differ to
 * /tmp/memory-damaged, so memory that came back wrong (zeros from a lazy restore that lost its
 * page server, say) leaves a mark in the writable layer. GET answers "PASSES BAD TOKEN".
 */
export const MEMORY_CHECKER_PY = pythonServer({
  setup: `
import hashlib, mmap, os, threading, time
MIB = 1 << 20
n = int(os.environ.get("BLOCKS", "96"))
# One anonymous mapping, apart from the interpreter's own objects: private (what CRIU restores
# lazily) unless SHARED=1 (MAP_SHARED, as memory shared with forked workers is).
shared = os.environ.get("SHARED") == "1"
mem = mmap.mmap(-1, n * MIB, flags=mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE)
if shared and os.fork() == 0:
    # A worker that shares the memory and only waits.
    while True:
        time.sleep(3600)
for i in range(n):
    mem[i * MIB:(i + 1) * MIB] = os.urandom(MIB)
view = memoryview(mem)
# The sums in one small buffer: wrong memory there reads as a mismatch, not a broken object.
sums = b"".join(hashlib.sha256(view[i * MIB:(i + 1) * MIB]).digest() for i in range(n))
token = os.urandom(8).hex()
seen = {"passes": 0, "bad": 0}
def check():
    while True:
        bad = [i for i in range(n) if hashlib.sha256(view[i * MIB:(i + 1) * MIB]).digest() != sums[i * 32:(i + 1) * 32]]
        if bad:
            with open("/tmp/memory-damaged", "a") as f:
                f.write(" ".join(map(str, bad)) + "\\n")
        seen["passes"] += 1
        seen["bad"] = len(bad)
        time.sleep(float(os.environ.get("PAUSE", "0.2")))
threading.Thread(target=check, daemon=True).start()
`,
  answer: '"%d %d %s" % (seen["passes"], seen["bad"], token)',
});

interface MemoryCheck {
  passes: number;
  bad: number;
  token: string;
}

/** {passes, bad, token} from the memory checker of sandbox `sb`, waiting for it to answer. */
export async function checkMemory(sb: SandboxInfo): Promise<MemoryCheck> {
  const body = await eventually(`checker of ${sb.id}`, () => httpGet(sb.address!, 8080));
  assert.match(body, /^\d+ \d+ [0-9a-f]{16}$/);
  const [passes, bad, token] = body.split(' ');
  return { passes: Number(passes), bad: Number(bad), token: token! };
}

/** {@link checkMemory} once the checker of `sb` has finished `passes` passes in all. */
export function checkerPasses(sb: SandboxInfo, passes: number, timeoutMs = 60_000): Promise<MemoryCheck> {
  return eventually(
    `${String(passes)} passes of the checker of ${sb.id}`,
    async () => {
      const m = await checkMemory(sb);
      if (m.passes < passes) throw new Error(`${String(m.passes)} passes`);
      return m;
    },
    timeoutMs,
  );
}
