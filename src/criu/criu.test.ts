/**
 * The real CRIU, driven through dormant's own code: a process serving HTTP on a TCP port is
 * checkpointed and restored, and its answers prove its memory survived, not just its PID.
 */
import { after, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { mkdtemp, rm, readdir } from 'node:fs/promises';
import { readFileSync } from 'node:fs';
import { request } from 'node:http';
import { createServer } from 'node:net';
import { DormantError, ErrorCode } from '../domain/errors.js';
import { criuEnvironment, dumpProcess, getCriu, restoreProcess } from './criu.js';

const PYTHON = '/usr/bin/python3';

/** A tiny HTTP server whose state lives only in its memory: a counter and a random token. */
const SERVER = `
import http.server, os, sys
count = 0
token = os.urandom(8).hex()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global count
        count += 1
        body = ("%d %s %d\\n" % (count, token, os.getpid())).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
`;

function alive(pid: number): boolean {
  try {
    return !/^\d+ \(.*\) [ZX]/.test(readFileSync(`/proc/${pid}/stat`, 'utf8'));
  } catch {
    return false;
  }
}

async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.listen(0, '127.0.0.1', () => {
      const addr = s.address();
      s.close(() => (typeof addr === 'object' && addr ? resolve(addr.port) : reject(new Error('no port'))));
    });
  });
}

function get(port: number): Promise<string> {
  return new Promise((resolve, reject) => {
    const req = request({ host: '127.0.0.1', port, path: '/', agent: false, timeout: 5000 }, (res) => {
      let body = '';
      res.setEncoding('utf8');
      res.on('data', (c: string) => (body += c));
      res.on('end', () => resolve(body.trim()));
    });
    req.on('timeout', () => req.destroy(new Error('timeout')));
    req.on('error', reject);
    req.end();
  });
}

async function waitFor<T>(what: string, fn: () => Promise<T>, timeoutMs = 10_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  let last: unknown;
  while (Date.now() < deadline) {
    try {
      return await fn();
    } catch (e) {
      last = e;
      await new Promise((r) => setTimeout(r, 50));
    }
  }
  throw new Error(`${what}: not ready after ${timeoutMs} ms (${String(last)})`);
}

describe('criu through dormant', () => {
  const pids: number[] = [];
  const dirs: string[] = [];
  after(async () => {
    for (const pid of pids) if (alive(pid)) process.kill(pid, 'SIGKILL');
    for (const d of dirs) await rm(d, { recursive: true, force: true });
  });

  test('this node needs the breakpoint fallback exactly when criu check says so', async () => {
    const criu = await getCriu();
    assert.deepEqual(criu.env, criuEnvironment(criu.check));
    if (!criu.check.hardwareBreakpointsWork) assert.equal(criu.env.CRIU_FAULT, '130');
    assert.deepEqual(criuEnvironment({ hardwareBreakpointsWork: false }), { CRIU_FAULT: '130' });
    assert.deepEqual(criuEnvironment({ hardwareBreakpointsWork: true }), {});
  });

  test('an HTTP server is checkpointed, killed, restored, and carries on counting', async () => {
    const port = await freePort();
    // Its own session (detached) and /dev/null for stdio: CRIU cannot dump a host file as stdio.
    const child = spawn(PYTHON, ['-c', SERVER, String(port)], { detached: true, stdio: 'ignore' });
    const pid = child.pid!;
    pids.push(pid);
    child.unref();

    const first = await waitFor('server', () => get(port));
    const [, token, pidInside] = first.split(' ');
    assert.equal(first.split(' ')[0], '1');
    assert.equal(await get(port), `2 ${token} ${pidInside}`);
    assert.equal(await get(port), `3 ${token} ${pidInside}`);

    // Images go to a memory-backed folder, as the design requires for real checkpoints.
    const images = await mkdtemp('/dev/shm/dormant-criu-test-');
    dirs.push(images);
    const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()));
    await dumpProcess({ pid, imagesDir: images, timeoutMs: 60_000 });
    await exited;
    assert.equal(alive(pid), false, 'after a dump without --leave-running the process is gone');
    await assert.rejects(get(port), 'nothing listens while it is checkpointed');
    const files = await readdir(images);
    assert.ok(
      files.some((f) => f.startsWith('pages-')),
      `memory pages were written (${files.join(', ')})`,
    );

    const restored = await restoreProcess({ imagesDir: images, timeoutMs: 60_000 });
    assert.equal(restored.pid, pid, 'CRIU restores the same PID');
    assert.ok(alive(pid));
    // The counter and the random token were only ever in the process's memory.
    assert.equal(await waitFor('restored server', () => get(port)), `4 ${token} ${pidInside}`);
    assert.equal(await get(port), `5 ${token} ${pidInside}`);
  });

  test('a failed dump is CRIU_DUMP_FAILED and carries criu log', async () => {
    const images = await mkdtemp('/dev/shm/dormant-criu-test-');
    dirs.push(images);
    // No such process: criu must fail cleanly, and say so in its log.
    const err = await dumpProcess({ pid: 999_999_999, imagesDir: images, timeoutMs: 30_000 }).then(
      () => assert.fail('dump of a non-existent pid succeeded'),
      (e: unknown) => e,
    );
    assert.ok(err instanceof DormantError);
    assert.equal(err.code, ErrorCode.CRIU_DUMP_FAILED);
    assert.match(err.message, /criu log/);
    assert.ok(typeof err.details?.log === 'string' && err.details.log.length > 0);
  });

  test('a failed restore leaves the images in place and says why', async () => {
    const images = await mkdtemp('/dev/shm/dormant-criu-test-');
    dirs.push(images);
    const err = await restoreProcess({ imagesDir: images, timeoutMs: 30_000 }).then(
      () => assert.fail('restore from an empty folder succeeded'),
      (e: unknown) => e,
    );
    assert.ok(err instanceof DormantError);
    assert.equal(err.code, ErrorCode.CRIU_RESTORE_FAILED);
    assert.match(err.message, /criu log/);
  });
});
