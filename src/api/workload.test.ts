/**
 * An agent-like workload through the real daemon: an HTTP server holding a counter and
 * 256 MiB of data in memory, with a child process and an open file. It must survive
 * hibernate and resume exactly; while hibernated nothing of it runs or holds memory; pause
 * stops it; rm leaves no trace on the host.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import Database from 'better-sqlite3';
import type { Daemon } from '../daemon/daemon.js';
import { DormantApiError, DormantClient, type SandboxInfo } from '../sdk/client.js';
import { eventually, httpGet, sandboxProcesses } from './testing/host.js';
import { pythonServer } from './testing/servers.js';
import { startTestDaemon, tearDown, testFolder } from './testing/daemon.js';
import { cgroupUsage } from '../sys/cgroup.js';
import { run } from '../sys/exec.js';

const AGENT = pythonServer({
  setup: `
import hashlib, json, os, subprocess, sys, time
blob = bytearray(os.urandom(128 * 1024 * 1024)) + bytearray(b"agent-state" * (128 * 1024 * 1024 // 11))
digest0 = hashlib.sha256(blob).hexdigest()
child = subprocess.Popen(["sleep", "100000"])
notes = open("/srv/notes.txt", "w+")
notes.write("x" * 1234)
notes.flush()
ticks = 0
def child_alive():
    try:
        os.kill(child.pid, 0)
        return child.poll() is None
    except OSError:
        return False`,
  answer: `json.dumps({"count": count, "digest": hashlib.sha256(blob).hexdigest(), "digest0": digest0,
                           "child": child.pid, "childAlive": child_alive(), "offset": notes.tell(), "pid": os.getpid(),
                           "memory": len(blob)})`,
});

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

/** The state the agent reports. */
async function get(host: string): Promise<AgentState> {
  return JSON.parse(await httpGet(host, 8080, '/', 30_000)) as AgentState;
}

describe('an agent-like workload', () => {
  let dir: string;
  let daemon: Daemon;
  let client: DormantClient;
  let sb: SandboxInfo;

  before(async () => {
    ({ dir } = await testFolder('workload', { 'srv/agent.py': AGENT }));
    ({ daemon, client } = await startTestDaemon({ dataDir: join(dir, 'data') }));
    sb = await client.createSandbox({
      rootfs: join(dir, 'rootfs'),
      command: ['/usr/bin/python3', '-u', '/srv/agent.py'],
      ports: [8080],
      memory: '1G',
      onResume: ['sh', '-c', 'echo reconnecting databases'],
    });
  });

  after(() => tearDown(dir, daemon));

  test('hibernate and resume keep counter, 256 MiB of memory, the child process and the file offset', async () => {
    const before = await eventually('agent', () => get(sb.address!), 60_000);
    assert.ok(before.memory > 256 * 1024 * 1024 - 16, 'the agent holds 256 MiB');
    assert.equal(before.digest, before.digest0);
    assert.equal(before.childAlive, true);
    assert.equal(before.offset, 1234);
    const held = (await client.getSandbox(sb.id)).memoryBytes;
    assert.ok(held > 256 * 1024 * 1024, `its cgroup holds the memory (${held})`);

    const h = await client.hibernate(sb.id);
    assert.equal(h.state, 'hibernated');
    assert.deepEqual(sandboxProcesses(sb.id), [], 'none of its processes exist while hibernated');
    const usage = await cgroupUsage(`/dormant/${sb.id}`);
    assert.ok(
      usage === undefined || usage.memoryBytes === 0,
      `its cgroup holds no memory (${JSON.stringify(usage)})`,
    );
    assert.equal(h.memoryBytes, 0);

    await client.resume(sb.id);
    const after = await eventually('resumed agent', () => get(sb.address!), 60_000);
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
    assert.match(logs, /serving/, 'what the agent printed before it slept');
    assert.match(logs, /reconnecting databases\n\[dormant\] on-resume hook exited 0/);
    const last = (await daemon.store.transitions({ sandboxId: sb.id })).at(-1);
    assert.equal(last?.to, 'running');
    assert.match(last?.reason ?? '', /on-resume hook exited 0/);
  });

  test('pause freezes it (nothing answers, memory kept) and resume thaws it in milliseconds', async () => {
    const before = await get(sb.address!);
    await client.pause(sb.id);
    await assert.rejects(httpGet(sb.address!, 8080, '/', 500), /timeout/, 'frozen: nothing answers');
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
    assert.equal((await eventually('agent', () => get(sb.address!), 60_000)).childAlive, true);
  });

  test('rm leaves no trace on the host', async () => {
    const netns = (await run('ip', ['netns', 'list'])).stdout;
    assert.ok(netns.length > 0);
    await client.remove(sb.id);
    assert.deepEqual(sandboxProcesses(sb.id), []);
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
