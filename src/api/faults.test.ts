/**
 * Faults during hibernate and resume, through the real daemon: CRIU fails (its staging folder
 * is full), the data directory fills up while the checkpoint is written to the vault, and a
 * vault object is corrupted on disk. A failed hibernate leaves the sandbox running with its
 * memory intact and an error that says why; a corrupted checkpoint is refused by name, the
 * sandbox stays hibernated, and the previous checkpoint still restores.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdir, open, readdir, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { stagingDirFor, type Daemon } from '../daemon/daemon.js';
import { DormantApiError, DormantClient, type SandboxInfo } from '../sdk/client.js';
import { run } from '../sys/exec.js';
import { eventually, httpGet, leftovers, resumeDamaged, sandboxProcesses } from './testing/host.js';
import { apiError, startTestDaemon, tearDown, testFolder } from './testing/daemon.js';
import { pythonServer } from './testing/servers.js';

/** A counter, a random token, and `MIB` MiB of random bytes, all only in memory. */
const SERVER = pythonServer({
  setup: `
import hashlib, os
token = os.urandom(8).hex()
blob = os.urandom(int(os.environ.get("MIB", "1")) * 1024 * 1024)
digest = hashlib.sha256(blob).hexdigest()[:16]`,
  answer: '"%d %s %s" % (count, token, hashlib.sha256(blob).hexdigest()[:16] == digest and digest)',
});

/** [counter, "token digest"] from the sandbox's server. */
async function serve(sb: SandboxInfo): Promise<[number, string]> {
  const body = await eventually(`server of ${sb.id}`, () => httpGet(sb.address!, 8080), 30_000);
  assert.match(body, /^\d+ [0-9a-f]{16} [0-9a-f]{16}$/, 'memory intact (the digest still matches)');
  const [n, ...rest] = body.split(' ');
  return [Number(n), rest.join(' ')];
}

async function filesUnder(dir: string, suffix: string): Promise<string[]> {
  const out: string[] = [];
  for (const e of await readdir(dir, { withFileTypes: true, recursive: true }))
    if (e.isFile() && e.name.endsWith(suffix)) out.push(join(e.parentPath, e.name));
  return out;
}

describe('faults: a failed hibernate keeps the sandbox; a damaged checkpoint is refused by name', () => {
  let dir: string;
  let rootfs: string;
  const mounts: string[] = [];
  const daemons: Daemon[] = [];

  const mountTmpfs = async (at: string, size: string): Promise<void> => {
    await mkdir(at, { recursive: true });
    await run('mount', ['-t', 'tmpfs', '-o', `size=${size},mode=0700`, 'tmpfs', at], { timeoutMs: 10_000 });
    mounts.push(at);
  };
  const unmount = async (at: string): Promise<void> => {
    await run('umount', [at], { timeoutMs: 30_000 });
    mounts.splice(mounts.indexOf(at), 1);
  };
  const start = async (dataDir: string): Promise<{ daemon: Daemon; client: DormantClient }> => {
    const started = await startTestDaemon({ dataDir, proxy: false, policy: false });
    daemons.push(started.daemon);
    return started;
  };
  const stop = async (daemon: Daemon, client: DormantClient): Promise<void> => {
    const ids = (await client.listSandboxes()).map((s) => s.id);
    for (const id of ids) await client.remove(id);
    for (const id of ids) assert.deepEqual(leftovers(id), []);
    await daemon.close();
    daemons.splice(daemons.indexOf(daemon), 1);
  };
  const create = (client: DormantClient, name: string, mib: number) =>
    client.createSandbox({
      name,
      rootfs,
      command: ['/usr/bin/python3', '-u', '/srv/server.py'],
      env: { MIB: String(mib) },
      ports: [8080],
      memory: '384M',
    });

  before(async () => {
    ({ dir, rootfs } = await testFolder('faults', { 'srv/server.py': SERVER }));
  });

  after(async () => {
    for (const d of daemons) {
      for (const s of await d.controller.list()) await d.controller.remove(s.id).catch(() => undefined);
    }
    // Unmount before the daemons wipe their staging folders (a mount point cannot be removed).
    for (const m of [...mounts].reverse())
      await run('umount', ['-l', m], { timeoutMs: 30_000 }).catch(() => undefined);
    for (const d of daemons) await d.close().catch(() => undefined);
    await tearDown(dir);
  });

  test('criu fails (its staging folder is full): the sandbox runs on, and the error carries criu’s log', async (t) => {
    const data = join(dir, 'criu-fails');
    const { daemon, client } = await start(data);
    const sb = await create(client, 'criu-fails', 8);
    const [n, rest] = await serve(sb);
    const staging = stagingDirFor(data);
    await mountTmpfs(staging, '1m');
    let e: DormantApiError;
    try {
      e = await apiError(client.hibernate(sb.id));
    } finally {
      await unmount(staging);
    }
    t.diagnostic(e.message.slice(0, 600));
    assert.equal(e.code, 'HIBERNATE_FAILED');
    assert.match(e.message, /running again/);
    assert.match(e.message, /Error \(criu\//, 'criu’s own error lines are in the message');
    const s = await client.getSandbox(sb.id);
    assert.equal(s.state, 'running');
    assert.match(s.lastError ?? '', /checkpoint of sandbox/);
    assert.deepEqual(await serve(sb), [n + 1, rest], 'same process, same memory');
    assert.deepEqual(await client.listCheckpoints(sb.id), []);
    assert.deepEqual(await readdir(staging), [], 'staging wiped');
    // With room again, the same sandbox hibernates and resumes.
    assert.equal((await client.hibernate(sb.id)).state, 'hibernated');
    assert.equal((await client.resume(sb.id)).state, 'running');
    assert.deepEqual(await serve(sb), [n + 2, rest]);
    await stop(daemon, client);
  });

  test('the data directory fills up during hibernate: the sandbox runs on and the error says the disk is full', async (t) => {
    const data = join(dir, 'full');
    await mountTmpfs(data, '64m');
    const { daemon, client } = await start(data);
    // 96 MiB of random bytes cannot be compressed into a 64 MiB vault.
    const sb = await create(client, 'disk-full', 96);
    const [n, rest] = await serve(sb);
    const e = await apiError(client.hibernate(sb.id));
    t.diagnostic(e.message.slice(0, 600));
    assert.equal(e.code, 'HIBERNATE_FAILED');
    assert.match(e.message, /running again/);
    assert.match(e.message, /ENOSPC|no space left/i, e.message);
    assert.equal((await client.getSandbox(sb.id)).state, 'running');
    assert.deepEqual(await serve(sb), [n + 1, rest], 'same process, same memory');
    assert.deepEqual(await client.listCheckpoints(sb.id), []);
    assert.deepEqual(await readdir(stagingDirFor(data)), [], 'staging wiped');
    const v = await daemon.vault.verify();
    assert.equal(v.ok, true, JSON.stringify(v.problems));
    await daemon.vault.gc();
    assert.deepEqual((await daemon.vault.verify()).orphans, { packs: 0, indexes: 0, temporaries: 0 });
    // Room again (the disk grows): the same sandbox hibernates and resumes with its memory.
    await run('mount', ['-o', 'remount,size=512m', data], { timeoutMs: 10_000 });
    assert.equal((await client.hibernate(sb.id)).state, 'hibernated');
    assert.equal((await client.resume(sb.id)).state, 'running');
    assert.deepEqual(await serve(sb), [n + 2, rest]);
    await stop(daemon, client);
    await unmount(data);
  });

  test('a corrupted vault object: resume refuses naming the checkpoint; it stays hibernated; the previous checkpoint restores', async (t) => {
    const data = join(dir, 'corrupt');
    const { daemon, client } = await start(data);
    const sb = await create(client, 'corrupt', 4);
    const [n, rest] = await serve(sb);
    const ck1 = (await client.hibernate(sb.id)).checkpointId!;
    const packs1 = new Set(await filesUnder(join(data, 'vault'), '.pack'));
    await client.resume(sb.id);
    await serve(sb); // n + 1: the newer checkpoint differs from the older one in memory.
    const ck2 = (await client.hibernate(sb.id)).checkpointId!;
    assert.notEqual(ck1, ck2);
    const fresh = (await filesUnder(join(data, 'vault'), '.pack')).filter((p) => !packs1.has(p));
    assert.ok(fresh.length > 0, 'the second checkpoint wrote chunks of its own');
    for (const p of fresh) {
      const fh = await open(p, 'r+');
      try {
        const at = Math.floor((await stat(p)).size / 2);
        const b = Buffer.alloc(1);
        await fh.read(b, 0, 1, at);
        b[0] = b[0]! ^ 0x5a;
        await fh.write(b, 0, 1, at);
      } finally {
        await fh.close();
      }
    }
    const v = await daemon.vault.verify();
    assert.equal(v.ok, false);
    assert.ok(
      v.problems.some((p) => p.checkpoints.includes(ck2)),
      'verify names the damaged checkpoint',
    );
    assert.ok(!v.problems.some((p) => p.checkpoints.includes(ck1)), 'and not the older one');

    const e = await resumeDamaged(client, sb.id);
    t.diagnostic(
      `resume of the damaged checkpoint (${e.late ? 'found as its pages streamed in' : 'refused'}): ${e.message}`,
    );
    assert.match(e.message, e.late ? /its processes were ended/ : /stays hibernated/);
    assert.match(e.message, new RegExp(`checkpoint ${ck2}`), 'the error names the damaged checkpoint');
    assert.match(e.hint, new RegExp(`--from ${ck1}`), 'and the older one to resume from');
    const s = await client.getSandbox(sb.id);
    assert.equal(s.state, 'hibernated');
    assert.equal(s.checkpointId, ck2, 'the damaged checkpoint is not silently replaced');
    assert.deepEqual(sandboxProcesses(sb.id), [], 'nothing half-restored runs');

    // The previous checkpoint (two are kept) still restores.
    const older = await client.request<SandboxInfo>('POST', `/v1/sandboxes/${sb.id}/resume`, { from: ck1 });
    assert.equal(older.state, 'running');
    assert.deepEqual(await serve(sb), [n + 1, rest], 'the older checkpoint’s memory: the counter of then');
    await stop(daemon, client);
  });
});
