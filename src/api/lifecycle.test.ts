/**
 * The sandbox lifecycle end to end, through the real daemon (HTTP API on loopback, SQLite,
 * vault, runc, CRIU) and the SDK client the CLI uses: a python HTTP server holding a counter
 * in memory is hibernated (processes gone, memory freed, checkpoint in the vault) and
 * resumed with its memory intact; failures leave it running; a restarted daemon finds it.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { readdir } from 'node:fs/promises';
import { existsSync, readFileSync, readdirSync, statSync, writeFileSync } from 'node:fs';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import { stagingDirFor, type Daemon } from '../daemon/daemon.js';
import { DormantClient, type SandboxInfo } from '../sdk/client.js';
import { COUNTER_SERVER_PY } from './testing/servers.js';
import { eventually, filesHolding, httpGet, resumeDamaged, sandboxProcesses } from './testing/host.js';
import { apiError, startTestDaemon, tearDown, testFolder } from './testing/daemon.js';

describe('sandbox lifecycle through the daemon', () => {
  let dir: string;
  let rootfs: string;
  let daemon: Daemon;
  let client: DormantClient;
  let sb: SandboxInfo;
  let failNext: string | undefined;

  const start = async (): Promise<void> => {
    ({ daemon, client } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      failAt: (step) => {
        if (step === failNext) {
          failNext = undefined;
          throw new Error(`injected failure at ${step}`);
        }
      },
    }));
  };

  before(async () => {
    ({ dir, rootfs } = await testFolder('lifecycle', { 'srv/server.py': COUNTER_SERVER_PY }));
    await start();
  });

  after(() => tearDown(dir, daemon));

  test('create: the sandbox runs, serves on its declared port, and shows up in ls', async () => {
    sb = await client.createSandbox({
      name: 'counter',
      rootfs,
      command: ['/usr/bin/python3', '-u', '/srv/server.py'],
      ports: [8080],
      memory: '256M',
    });
    assert.equal(sb.state, 'running');
    assert.equal(sb.name, 'counter');
    assert.ok(sb.address);
    const first = await eventually('server', () => httpGet(sb.address!, 8080));
    assert.match(first, /^1 [0-9a-f]{16}$/);
    assert.deepEqual(
      (await client.listSandboxes()).map((s) => s.id),
      [sb.id],
    );
    const held = (await client.getSandbox(sb.id)).memoryBytes;
    assert.ok(held > 1024 * 1024, `a running python server holds memory (${held} bytes, from its cgroup)`);
    const ex = await client.exec(sb.id, ['sh', '-c', 'echo $((6*7)); echo oops >&2; exit 3']);
    assert.deepEqual([ex.stdout, ex.stderr, ex.exitCode], ['42\n', 'oops\n', 3]);
  });

  test('hibernate: processes gone, checkpoint in the vault, nothing left in staging; resume: memory intact', async () => {
    const token = (await httpGet(sb.address!, 8080)).split(' ')[1];
    // A file the agent wrote: while hibernated it lives only in the vault, encrypted.
    const secret = `FILE-SECRET-${randomBytes(12).toString('hex')}`;
    await client.exec(sb.id, ['sh', '-c', `echo ${secret} > /srv/secret.txt`]);
    assert.deepEqual(filesHolding(join(dir, 'data'), secret).length > 0, true, 'on disk while running');
    const h = await client.hibernate(sb.id);
    assert.equal(h.state, 'hibernated');
    assert.equal(h.memoryBytes, 0);
    assert.ok(h.checkpointId);
    assert.deepEqual(sandboxProcesses(sb.id), [], 'no process of the sandbox runs while it is hibernated');
    await assert.rejects(httpGet(sb.address!, 8080), 'nothing answers while hibernated');
    const cks = await client.listCheckpoints(sb.id);
    assert.equal(cks.length, 1);
    assert.ok(cks[0]!.storedBytes > 0 && cks[0]!.storedBytes < cks[0]!.logicalBytes, 'stored compressed');
    assert.deepEqual(await readdir(stagingDirFor(join(dir, 'data'))), [], 'staging wiped');
    assert.deepEqual(filesHolding(join(dir, 'data'), secret), [], 'the file is nowhere in plaintext');

    const r = await client.resume(sb.id);
    assert.equal(r.state, 'running');
    assert.equal((await client.exec(sb.id, ['cat', '/srv/secret.txt'])).stdout, `${secret}\n`);
    // The counter and the random token lived only in the process's memory.
    assert.equal(await eventually('resumed server', () => httpGet(sb.address!, 8080)), `3 ${token}`);
    const logs = await client.logs(sb.id);
    assert.match(logs, /serving/, 'output from before the hibernate is kept');
  });

  test('idempotent transitions succeed; unknown ids are 404; exec wakes a paused sandbox', async () => {
    const e = await apiError(client.exec('sb-aaaaaaaaaaaaaaaa', ['true']));
    assert.equal(e.code, 'SANDBOX_NOT_FOUND');
    assert.equal(e.status, 404);
    const again = await client.resume(sb.id);
    assert.equal(again.state, 'running', 'resume of a running sandbox is a no-op');
    const paused = await client.pause(sb.id);
    assert.equal(paused.state, 'paused');
    assert.ok(paused.memoryBytes > 0, 'a paused sandbox still holds its memory');
    // exec wakes a sleeping sandbox (the toolbox does, like the wake proxy).
    assert.equal((await client.exec(sb.id, ['true'])).exitCode, 0);
    assert.equal((await client.getSandbox(sb.id)).state, 'running', 'exec woke the paused sandbox');
  });

  test('a paused sandbox hibernates and resumes too', async () => {
    const before = await httpGet(sb.address!, 8080);
    await client.pause(sb.id);
    assert.equal((await client.hibernate(sb.id)).state, 'hibernated');
    assert.equal((await client.resume(sb.id)).state, 'running');
    const [n, token] = before.split(' ');
    assert.equal(await eventually('server', () => httpGet(sb.address!, 8080)), `${Number(n) + 1} ${token}`);
  });

  test('a hibernate that fails after the dump leaves the sandbox running, memory intact', async () => {
    const before = await httpGet(sb.address!, 8080);
    failNext = 'hibernate:dumped';
    const e = await apiError(client.hibernate(sb.id));
    assert.equal(e.code, 'HIBERNATE_FAILED');
    assert.match(e.message, /running again/);
    const s = await client.getSandbox(sb.id);
    assert.equal(s.state, 'running');
    const n = Number(before.split(' ')[0]);
    assert.equal(await httpGet(sb.address!, 8080), `${n + 1} ${before.split(' ')[1]}`);
    assert.equal((await client.listCheckpoints(sb.id)).length, 2, 'no half checkpoint was recorded');
  });

  test('a restarted daemon finds every sandbox as it was, and hibernates and resumes it', async () => {
    const before = await httpGet(sb.address!, 8080);
    await daemon.close();
    await start();
    assert.deepEqual(daemon.reconciled, []);
    const s = await client.getSandbox(sb.id);
    assert.equal(s.state, 'running');
    await client.hibernate(sb.id);
    await client.resume(sb.id);
    const n = Number(before.split(' ')[0]);
    assert.equal(
      await eventually('server', () => httpGet(sb.address!, 8080)),
      `${n + 1} ${before.split(' ')[1]}`,
    );
    assert.equal(
      (await client.listCheckpoints(sb.id)).length,
      2,
      'keeps the last two checkpoints (of three)',
    );
  });

  test('fork: a new sandbox with the same memory and files; both carry on independently', async () => {
    await client.exec(sb.id, ['sh', '-c', 'echo from-parent > /srv/parent-file']);
    const before = await httpGet(sb.address!, 8080);
    const [n, token] = before.split(' ');
    const f = await client.fork(sb.id, { name: 'counter-fork' });
    assert.equal(f.state, 'running');
    assert.notEqual(f.id, sb.id);
    assert.notEqual(f.address, sb.address, 'the fork has its own address');
    assert.equal(
      await eventually('fork', () => httpGet(f.address!, 8080)),
      `${Number(n) + 1} ${token}`,
      'same memory as the parent',
    );
    assert.equal(await httpGet(f.address!, 8080), `${Number(n) + 2} ${token}`);
    assert.equal(
      await httpGet(sb.address!, 8080),
      `${Number(n) + 1} ${token}`,
      'the parent kept running, unaffected',
    );
    assert.equal((await client.exec(f.id, ['cat', '/srv/parent-file'])).stdout, 'from-parent\n');
    await client.exec(f.id, ['sh', '-c', 'echo fork-only > /srv/fork-file']);
    assert.notEqual(
      (await client.exec(sb.id, ['sh', '-c', 'cat /srv/fork-file 2>&1'])).exitCode,
      0,
      'files are separate',
    );
    await client.remove(f.id);
    assert.equal(
      await httpGet(sb.address!, 8080),
      `${Number(n) + 2} ${token}`,
      'the parent survives the fork being removed',
    );
  });

  test('a damaged newest checkpoint is refused by name, and the previous one still restores', async () => {
    await client.hibernate(sb.id);
    const atOlder = await client
      .resume(sb.id)
      .then(() => eventually('server', () => httpGet(sb.address!, 8080)));
    await client.hibernate(sb.id);
    const [newest, older] = await client.listCheckpoints(sb.id);
    assert.ok(newest && older, 'two checkpoints kept');
    // Damage the newest pack: it holds the chunks only the newest checkpoint added.
    const packsDir = join(dir, 'data', 'vault', 'data', 'default', 'packs');
    const packs = readdirSync(packsDir).map((f) => ({ f, t: statSync(join(packsDir, f)).mtimeMs }));
    const newestPack = join(packsDir, packs.sort((a, b) => b.t - a.t)[0]!.f);
    const bytes = readFileSync(newestPack);
    const mid = Math.floor(bytes.length / 2);
    bytes[mid] = (bytes[mid] ?? 0) ^ 0x55;
    writeFileSync(newestPack, bytes);

    const e = await resumeDamaged(client, sb.id);
    assert.match(e.message, new RegExp(`checkpoint ${newest.id}`));
    assert.match(e.hint, new RegExp(`--from ${older.id}`));
    const s = await client.getSandbox(sb.id);
    assert.equal(s.state, 'hibernated');
    assert.equal(s.checkpointId, newest.id, 'the damaged checkpoint is not silently replaced');

    const r = await client.request<SandboxInfo>('POST', `/v1/sandboxes/${sb.id}/resume`, { from: older.id });
    assert.equal(r.state, 'running');
    // The older checkpoint was taken before the request that answered `atOlder`: it answers it again.
    assert.equal(
      await eventually('server', () => httpGet(sb.address!, 8080)),
      atOlder,
      'the state of the older checkpoint',
    );
    const wrong = await apiError(
      client.request('POST', `/v1/sandboxes/${sb.id}/resume`, { from: 'ck-aaaaaaaaaaaaaaaa' }),
    );
    assert.equal(wrong.status, 404);
  });

  test('archive keeps the filesystem; resume starts the command afresh on it', async () => {
    const secret = `ARCHIVED-SECRET-${randomBytes(12).toString('hex')}`;
    await client.exec(sb.id, ['sh', '-c', `echo kept > /srv/note; echo ${secret} > /srv/secret2.txt`]);
    const a = await client.archive(sb.id);
    assert.equal(a.state, 'archived');
    assert.deepEqual(
      (await client.listCheckpoints(sb.id)).map((c) => c.kind),
      ['filesystem'],
      'only the filesystem diff is kept, in the vault',
    );
    assert.deepEqual(sandboxProcesses(sb.id), [], 'its processes ended');
    assert.deepEqual(filesHolding(join(dir, 'data'), secret), [], 'the file is nowhere in plaintext');
    await client.resume(sb.id);
    assert.match(
      await eventually('fresh server', () => httpGet(sb.address!, 8080)),
      /^1 /,
      'a fresh process: its counter starts over',
    );
    assert.equal((await client.exec(sb.id, ['cat', '/srv/note'])).stdout, 'kept\n');
    assert.equal((await client.exec(sb.id, ['cat', '/srv/secret2.txt'])).stdout, `${secret}\n`);
    // Hibernated again, the archive's diff is superseded and goes.
    await client.hibernate(sb.id);
    assert.deepEqual(
      (await client.listCheckpoints(sb.id)).map((c) => c.kind),
      ['memory'],
    );
    await client.resume(sb.id);
    assert.equal((await client.exec(sb.id, ['cat', '/srv/note'])).stdout, 'kept\n');
  });

  test('bad input is a 400 that names the problem', async () => {
    const cases: [Record<string, unknown>, RegExp][] = [
      [{ rootfs, command: [] }, /command/],
      [{ rootfs: 'relative/path', command: ['true'] }, /absolute/],
      [{ rootfs: join(dir, 'missing'), command: ['true'] }, /does not exist/],
      [{ rootfs, command: ['true'], name: 'Bad Name!' }, /name/],
      [{ rootfs, command: ['true'], memory: 'lots' }, /memory/],
      [{ rootfs, command: ['true'], ports: [70000] }, /ports/],
      [{ rootfs, command: ['true'], surprise: 1 }, /surprise|unrecognized/i],
    ];
    for (const [body, re] of cases) {
      const e = await apiError(client.request('POST', '/v1/sandboxes', body));
      assert.equal(e.status, 400, JSON.stringify(body));
      assert.equal(e.code, 'INVALID_ARGUMENT');
      assert.match(e.message, re);
    }
    const unauth = await apiError(new DormantClient({ url: daemon.url, token: 'dmt_wrong' }).listSandboxes());
    assert.equal(unauth.status, 401);
  });

  test('rm removes the sandbox, its processes, network and checkpoints', async () => {
    await client.hibernate(sb.id);
    await client.remove(sb.id);
    assert.equal((await apiError(client.getSandbox(sb.id))).status, 404);
    assert.deepEqual(sandboxProcesses(sb.id), []);
    assert.equal(existsSync(join(dir, 'data', 'runtime', 'sandboxes', sb.id)), false);
  });
});
