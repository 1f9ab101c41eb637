/**
 * An agent-like workload through the real daemon: an HTTP server holding a counter and
 * 256 MiB of data in memory, with a child process and an open file. It must survive
 * hibernate and resume exactly; while hibernated nothing of it runs or holds memory; pause
 * stops it; rm leaves no trace on the host.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync, readFileSync, readdirSync } from 'node:fs';
import { mkdtemp, rm } from 'node:fs/promises';
import { request } from 'node:http';
import { join } from 'node:path';
import Database from 'better-sqlite3';
import { startDaemon, type Daemon } from '../daemon/daemon.js';
import { DormantApiError, DormantClient, type SandboxInfo } from '../sdk/client.js';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';
import { cgroupUsage } from '../sys/cgroup.js';
import { run } from '../sys/exec.js';

const AGENT = `
import hashlib, http.server, json, os, subprocess, sys, time
count = 0
blob = bytearray(os.urandom(128 * 1024 * 1024)) + bytearray(b"agent-state" * (128 * 1024 * 1024 // 11))
digest0 = hashlib.sha256(blob).hexdigest()
child = subprocess.Popen(["sleep", "100000"])
notes = open("/srv/notes.txt", "w+")
notes.write("x" * 1234)
notes.flush()
ticks = 0
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global count
        count += 1
        try:
            os.kill(child.pid, 0)
            alive = child.poll() is None
        except OSError:
            alive = False
        body = json.dumps({"count": count, "digest": hashlib.sha256(blob).hexdigest(), "digest0": digest0,
                           "child": child.pid, "childAlive": alive, "offset": notes.tell(), "pid": os.getpid(),
                           "memory": len(blob)}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
print("agent ready", flush=True)
http.server.HTTPServer(("0.0.0.0", 8080), H).serve_forever()
`;

interface AgentState {
  count: number;
  digest: string;
  digest0: string;
  child: number;
  childAlive: boolean;
  offset: number;
  pid: number;
  memory: number;
}

function get(host: string): Promise<AgentState> {
  return new Promise((resolve, reject) => {
    const req = request({ host, port: 8080, path: '/', agent: false, timeout: 30_000 }, (res) => {
      let body = '';
      res.setEncoding('utf8');
      res.on('data', (c: string) => (body += c));
      res.on('end', () => {
        try {
          resolve(JSON.parse(body) as AgentState);
        } catch (e) {
          reject(e instanceof Error ? e : new Error(String(e)));
        }
      });
    });
    req.on('timeout', () => req.destroy(new Error('timeout')));
    req.on('error', reject);
    req.end();
  });
}

async function eventually<T>(what: string, fn: () => Promise<T>, timeoutMs = 60_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  let last: unknown;
  while (Date.now() < deadline) {
    try {
      return await fn();
    } catch (e) {
      last = e;
      await new Promise((r) => setTimeout(r, 200));
    }
  }
  throw new Error(`${what}: not after ${timeoutMs} ms: ${String(last)}`);
}

function livePids(match: string): number[] {
  const pids: number[] = [];
  for (const p of readdirSync('/proc')) {
    if (!/^\d+$/.test(p)) continue;
    try {
      if (/^State:\s+Z/m.test(readFileSync(`/proc/${p}/status`, 'utf8'))) continue;
      if (readFileSync(`/proc/${p}/cgroup`, 'utf8').includes(match)) pids.push(Number(p));
    } catch {
      // Exited while we looked.
    }
  }
  return pids;
}

describe('an agent-like workload', () => {
  let dir: string;
  let daemon: Daemon;
  let client: DormantClient;
  let sb: SandboxInfo;

  before(async () => {
    dir = await mkdtemp('/tmp/dormant-workload-');
    await buildBusyboxRootfs(join(dir, 'rootfs'), { 'srv/agent.py': AGENT });
    daemon = await startDaemon({
      dataDir: join(dir, 'data'),
      listen: '127.0.0.1:0',
      readonlyBinds: [{ source: '/usr', destination: '/usr' }],
      warn: () => undefined,
    });
    client = new DormantClient({ url: daemon.url, token: daemon.adminToken });
    sb = await client.createSandbox({
      rootfs: join(dir, 'rootfs'),
      command: ['/usr/bin/python3', '-u', '/srv/agent.py'],
      ports: [8080],
      memory: '1G',
      onResume: ['sh', '-c', 'echo reconnecting databases'],
    });
  });

  after(async () => {
    for (const s of await client.listSandboxes().catch(() => []))
      await client.remove(s.id).catch(() => undefined);
    await daemon.close();
    await rm(dir, { recursive: true, force: true });
  });

  test('hibernate and resume keep counter, 256 MiB of memory, the child process and the file offset', async () => {
    const before = await eventually('agent', () => get(sb.address!));
    assert.ok(before.memory > 256 * 1024 * 1024 - 16, 'the agent holds 256 MiB');
    assert.equal(before.digest, before.digest0);
    assert.equal(before.childAlive, true);
    assert.equal(before.offset, 1234);
    const held = (await client.getSandbox(sb.id)).memoryBytes;
    assert.ok(held > 256 * 1024 * 1024, `its cgroup holds the memory (${held})`);

    const h = await client.hibernate(sb.id);
    assert.equal(h.state, 'hibernated');
    assert.deepEqual(livePids(sb.id), [], 'none of its processes exist while hibernated');
    const usage = await cgroupUsage(`/dormant/${sb.id}`);
    assert.ok(
      usage === undefined || usage.memoryBytes === 0,
      `its cgroup holds no memory (${JSON.stringify(usage)})`,
    );
    assert.equal(h.memoryBytes, 0);

    await client.resume(sb.id);
    const after = await eventually('resumed agent', () => get(sb.address!));
    assert.equal(after.count, before.count + 1, 'the counter carries on');
    assert.equal(after.digest, before.digest, '256 MiB of memory hash the same');
    assert.equal(after.pid, before.pid, 'same PID inside');
    assert.equal(after.child, before.child);
    assert.equal(after.childAlive, true, 'the child process is alive');
    assert.equal(after.offset, 1234, 'the open file is at the same offset');
    const ex = await client.exec(sb.id, ['sh', '-c', 'cat /srv/notes.txt | wc -c']);
    assert.equal(ex.stdout.trim(), '1234', 'exec works after resume');

    // The post-resume hook ran; its outcome is in the log and in the transition.
    const logs = await client.logs(sb.id);
    assert.match(logs, /agent ready/);
    assert.match(logs, /reconnecting databases\n\[dormant\] on-resume hook exited 0/);
    const last = daemon.store.transitions({ sandboxId: sb.id }).at(-1);
    assert.equal(last?.to, 'running');
    assert.match(last?.reason ?? '', /on-resume hook exited 0/);
  });

  test('pause freezes it (nothing answers, memory kept) and resume thaws it in milliseconds', async () => {
    const before = await get(sb.address!);
    await client.pause(sb.id);
    await assert.rejects(
      new Promise((resolve, reject) => {
        const req = request(
          { host: sb.address!, port: 8080, path: '/', agent: false, timeout: 500 },
          resolve,
        );
        req.on('timeout', () => req.destroy(new Error('timeout: frozen')));
        req.on('error', reject);
        req.end();
      }),
      /frozen/,
    );
    const t0 = performance.now();
    await daemon.controller.resume(sb.id);
    const thawMs = performance.now() - t0;
    assert.ok(thawMs < 1000, `thaw took ${thawMs.toFixed(0)} ms`);
    const after = await get(sb.address!);
    // The request that timed out while frozen is served on thaw, hence +1 or +2.
    assert.ok(after.count === before.count + 1 || after.count === before.count + 2);
    assert.equal(after.digest, before.digest);
  });

  test('a checkpoint from an incompatible node is refused with a clear error, and stays', async () => {
    await client.hibernate(sb.id);
    const ck = (await client.getSandbox(sb.id)).checkpointId!;
    const db = new Database(join(dir, 'data', 'state.db'));
    const original = (db.prepare('SELECT meta FROM checkpoints WHERE id = ?').get(ck) as { meta: string })
      .meta;
    db.prepare("UPDATE checkpoints SET meta = json_set(meta, '$.arch', 'riscv64') WHERE id = ?").run(ck);
    const e = await client.resume(sb.id).catch((x: unknown) => x);
    assert.ok(e instanceof DormantApiError);
    assert.equal(e.code, 'RESTORE_INCOMPATIBLE');
    assert.equal(e.status, 409);
    assert.match(e.message, /made on riscv64, this node is x64/);
    assert.equal((await client.getSandbox(sb.id)).state, 'hibernated', 'the checkpoint stays');
    db.prepare('UPDATE checkpoints SET meta = ? WHERE id = ?').run(original, ck);
    db.close();
    await client.resume(sb.id);
    assert.equal((await eventually('agent', () => get(sb.address!))).childAlive, true);
  });

  test('rm leaves no trace on the host', async () => {
    const netns = (await run('ip', ['netns', 'list'])).stdout;
    assert.ok(netns.length > 0);
    await client.remove(sb.id);
    assert.deepEqual(livePids(sb.id), []);
    assert.equal(readFileSync('/proc/self/mounts', 'utf8').includes(sb.id), false, 'no mounts');
    for (const ctrl of ['memory', 'pids', 'cpu', 'freezer']) {
      assert.equal(existsSync(`/sys/fs/cgroup/${ctrl}/dormant/${sb.id}`), false, `no ${ctrl} cgroup`);
    }
    assert.equal(existsSync(`/sys/fs/cgroup/unified/dormant/${sb.id}`), false);
    assert.equal(
      (await run('ip', ['netns', 'list'])).stdout.includes(sb.id.slice(3)),
      false,
      'no network namespace',
    );
    assert.equal(existsSync(join(dir, 'data', 'runtime', 'sandboxes', sb.id)), false, 'no sandbox folder');
    assert.deepEqual(
      await daemon.vault.listCheckpoints({ sandboxId: sb.id }),
      [],
      'no checkpoints in the vault',
    );
  });
});
