/**
 * Resume with CRIU's lazy pages: the sandbox answers as soon as its processes are back while
 * its memory (here 64 MiB that it hashes on every request) is copied in behind it; a hibernate
 * right after waits for the copy to finish; nothing is left in staging.
 */
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, readdir, rm } from 'node:fs/promises';
import { request } from 'node:http';
import { join } from 'node:path';
import { startDaemon, stagingDirFor, type Daemon } from './daemon.js';
import { DormantClient } from '../sdk/client.js';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';

const SERVER = `
import hashlib, http.server, os
count = 0
blob = bytearray(os.urandom(64 * 1024 * 1024))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global count
        count += 1
        body = ("%d %s" % (count, hashlib.sha256(blob).hexdigest())).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("0.0.0.0", 8080), H).serve_forever()
`;

function get(host: string): Promise<string> {
  return new Promise((resolve, reject) => {
    const req = request({ host, port: 8080, path: '/', agent: false, timeout: 30_000 }, (res) => {
      let body = '';
      res.setEncoding('utf8');
      res.on('data', (c: string) => (body += c));
      res.on('end', () => resolve(body));
    });
    req.on('timeout', () => req.destroy(new Error('timeout')));
    req.on('error', reject);
    req.end();
  });
}

async function eventually<T>(fn: () => Promise<T>, timeoutMs = 60_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    try {
      return await fn();
    } catch (e) {
      if (Date.now() > deadline) throw e;
      await new Promise((r) => setTimeout(r, 200));
    }
  }
}

let dir: string;
let daemon: Daemon;
let client: DormantClient;

before(async () => {
  dir = await mkdtemp('/tmp/dormant-lazy-');
  await buildBusyboxRootfs(join(dir, 'rootfs'), { 'srv/server.py': SERVER });
  daemon = await startDaemon({
    dataDir: join(dir, 'data'),
    listen: '127.0.0.1:0',
    readonlyBinds: [{ source: '/usr', destination: '/usr' }],
    lazyRestore: true,
    warn: () => undefined,
  });
  client = new DormantClient({ url: daemon.url, token: daemon.adminToken });
});

after(async () => {
  for (const s of await client.listSandboxes().catch(() => []))
    await client.remove(s.id).catch(() => undefined);
  await daemon.close();
  await rm(dir, { recursive: true, force: true });
});

test('lazy resume: memory intact, a hibernate right after waits for the pages, staging wiped', async () => {
  const sb = await client.createSandbox({
    rootfs: join(dir, 'rootfs'),
    command: ['/usr/bin/python3', '/srv/server.py'],
    ports: [8080],
  });
  const first = await eventually(() => get(sb.address!));
  const [, digest] = first.split(' ');
  await client.hibernate(sb.id);
  assert.equal((await client.resume(sb.id)).state, 'running');
  // Straight away: the hibernate queues behind the page copy instead of dumping a half-loaded process.
  assert.equal((await client.hibernate(sb.id)).state, 'hibernated');
  await client.resume(sb.id);
  assert.equal(
    await eventually(() => get(sb.address!)),
    `2 ${digest}`,
    'counter and 64 MiB of memory intact',
  );
  // Once the pages are in, the staging folder is gone.
  await client.pause(sb.id);
  await client.resume(sb.id);
  assert.deepEqual(await readdir(stagingDirFor(join(dir, 'data'))), []);
});
