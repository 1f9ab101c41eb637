/**
 * Sandbox metadata through the real daemon (HTTP API, SQLite, runc, the policy loop and the
 * meter): labels at create and fork, `GET /v1/sandboxes` filters and pages that really filter
 * and page, `PATCH` of labels and of the idle policy (which the policy loop acts on at once),
 * an idempotent delete (the API and the CLI), and the per-sandbox CPU, memory and disk metrics.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { Daemon } from '../daemon/daemon.js';
import { DormantClient, type SandboxInfo } from '../sdk/client.js';
import { eventually, untilState } from './testing/host.js';
import { apiError, startTestDaemon, tearDown, testFolder } from './testing/daemon.js';

const BIN = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'bin', 'dormant');
const SLEEPER = ['sh', '-c', 'while true; do sleep 1; done'];

describe('sandbox metadata through the daemon', () => {
  let dir: string;
  let rootfs: string;
  let daemon: Daemon;
  let client: DormantClient;
  let alice: DormantClient;
  let gold: SandboxInfo;
  let plain: SandboxInfo;
  let paused: SandboxInfo;

  const dormant = (args: string[]): Promise<{ code: number; stdout: string; stderr: string }> =>
    new Promise((resolve) => {
      execFile(
        process.execPath,
        [BIN, ...args],
        {
          env: { ...process.env, DORMANT_URL: daemon.url, DORMANT_TOKEN: daemon.adminToken, NO_COLOR: '1' },
          timeout: 60_000,
        },
        (err, stdout, stderr) => {
          resolve({ code: err ? (typeof err.code === 'number' ? err.code : -1) : 0, stdout, stderr });
        },
      );
    });

  /** Every id a listing with `query` names, page after page. */
  const listed = async (query: Parameters<DormantClient['querySandboxes']>[0], c = client) => {
    const ids: string[] = [];
    for await (const s of c.allSandboxes(query)) ids.push(s.id);
    return ids;
  };

  before(async () => {
    ({ dir, rootfs } = await testFolder('metadata'));
    ({ daemon, client } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      allowedSourceRoots: [dir],
      proxy: false,
      policy: { intervalMs: 200 },
      meterIntervalMs: 200,
    }));
    const t = await client.createToken({ tenant: 'alice' });
    alice = new DormantClient({ url: daemon.url, token: t.token });
  });

  after(() => tearDown(dir, daemon));

  test('labels at create come back in the view, and bad ones are refused before anything runs', async () => {
    gold = await client.createSandbox({
      name: 'gold',
      rootfs,
      command: SLEEPER,
      labels: { team: 'search', tier: 'gold', 'app.example.com/part': 'crawler' },
    });
    assert.deepEqual(gold.labels, { team: 'search', tier: 'gold', 'app.example.com/part': 'crawler' });
    assert.deepEqual((await client.getSandbox('gold')).labels, gold.labels);
    paused = await client.createSandbox({
      name: 'paused',
      rootfs,
      command: SLEEPER,
      labels: { team: 'search' },
    });
    plain = await client.createSandbox({ name: 'plain', rootfs, command: SLEEPER });
    assert.deepEqual(plain.labels, {});
    await client.pause(paused.id);

    const bad = await apiError(
      client.createSandbox({ rootfs, command: SLEEPER, labels: { 'no spaces': 'x' } }),
    );
    assert.equal(bad.code, 'INVALID_ARGUMENT');
    assert.match(bad.message, /labels/);
    const long = await apiError(
      client.createSandbox({ rootfs, command: SLEEPER, labels: { k: 'v'.repeat(257) } }),
    );
    assert.equal(long.code, 'INVALID_ARGUMENT');
    assert.equal((await client.querySandboxes()).sandboxes.length, 3, 'nothing made by a refused create');
  });

  test('label and state filters really filter; an unknown state is a 400 naming the valid ones', async () => {
    assert.deepEqual(await listed({ label: 'team=search' }), [gold.id, paused.id]);
    assert.deepEqual(await listed({ label: ['team=search', 'tier=gold'] }), [gold.id]);
    assert.deepEqual(await listed({ label: 'tier' }), [gold.id], 'a key alone: has the label');
    assert.deepEqual(await listed({ label: 'team=ads' }), []);
    assert.deepEqual(await listed({ state: 'paused' }), [paused.id]);
    assert.deepEqual(await listed({ state: 'running' }), [gold.id, plain.id]);
    assert.deepEqual(await listed({ state: 'running,paused' }), [gold.id, paused.id, plain.id]);
    assert.deepEqual(await listed({ state: 'running', label: 'team=search' }), [gold.id]);
    assert.deepEqual(await listed({ name: 'plain' }), [plain.id]);
    const e = await apiError(client.querySandboxes({ state: 'running,sleeping' }));
    assert.equal(e.code, 'INVALID_ARGUMENT');
    assert.match(e.message, /sleeping/);
    assert.match(e.message, /running, paused, hibernating, hibernated/, 'the valid states are named');
    assert.equal((await apiError(client.querySandboxes({ label: '-bad' }))).code, 'INVALID_ARGUMENT');
  });

  test('pages: limit and cursor walk every sandbox once, in a stable order', async () => {
    const all = (await client.querySandboxes({ limit: 1000 })).sandboxes.map((s) => s.id);
    assert.deepEqual(all, [gold.id, paused.id, plain.id]);
    const first = await client.querySandboxes({ limit: 2 });
    assert.equal(first.sandboxes.length, 2);
    assert.ok(first.nextCursor, 'more remain: a cursor');
    const second = await client.querySandboxes({ limit: 2, cursor: first.nextCursor });
    assert.deepEqual(
      [...first.sandboxes, ...second.sandboxes].map((s) => s.id),
      all,
    );
    assert.equal(second.nextCursor, undefined, 'the last page has no cursor');
    assert.deepEqual(await listed({ limit: 1 }), all, 'one at a time: no repeats, none missed');
    assert.equal((await apiError(client.querySandboxes({ cursor: 'garbage' }))).code, 'INVALID_ARGUMENT');
    assert.equal((await apiError(client.querySandboxes({ limit: 1001 }))).code, 'INVALID_ARGUMENT');
  });

  test('a tenant lists only its own; an admin sees all and may filter by tenant', async () => {
    const hers = await alice.createSandbox({
      name: 'hers',
      rootfs,
      command: SLEEPER,
      labels: { team: 'search' },
    });
    assert.deepEqual(await listed({ label: 'team=search' }, alice), [hers.id]);
    assert.deepEqual(await listed({ tenant: 'admin' }, alice), [], 'a tenant cannot widen its scope');
    assert.deepEqual(await listed({ label: 'team=search' }), [gold.id, paused.id, hers.id]);
    assert.deepEqual(await listed({ tenant: 'alice' }), [hers.id]);
    // Alice may call hers "gold" too: she means hers; an admin must say which.
    const aliceGold = await alice.createSandbox({ name: 'gold', rootfs, command: SLEEPER });
    assert.equal((await alice.getSandbox('gold')).id, aliceGold.id);
    const e = await apiError(client.getSandbox('gold'));
    assert.equal(e.code, 'SANDBOX_NAME_AMBIGUOUS');
    assert.ok(e.message.includes(gold.id) && e.message.includes(aliceGold.id), e.message);
    assert.equal((await client.getSandbox(gold.id)).id, gold.id, 'the id still works');
    await alice.remove(aliceGold.id);
    await alice.remove(hers.id);
  });

  test('forks keep their parent labels unless given new ones', async () => {
    const same = await client.fork(gold.id, { name: 'gold-fork' });
    assert.deepEqual(same.labels, gold.labels);
    const own = await client.request<SandboxInfo>('POST', `/v1/sandboxes/${gold.id}/fork`, {
      labels: { team: 'ads' },
    });
    assert.deepEqual(own.labels, { team: 'ads' });
    assert.deepEqual(await listed({ label: 'team=ads' }), [own.id]);
    for (const f of [same, own]) await client.remove(f.id);
  });

  test('PATCH changes labels (null removes one) and is recorded as an event', async () => {
    const s = await client.updateSandbox('gold', {
      labels: { tier: 'silver', 'app.example.com/part': null },
    });
    assert.deepEqual(s.labels, { team: 'search', tier: 'silver' });
    assert.deepEqual((await client.getSandbox(gold.id)).labels, s.labels, 'stored');
    assert.deepEqual(await listed({ label: 'tier=gold' }), []);
    assert.deepEqual(await listed({ label: 'tier=silver' }), [gold.id]);
    assert.equal(s.state, 'running');
    const events = (await daemon.store.transitions({ sandboxId: gold.id })).map((t) => t.reason);
    assert.ok(
      events.some((r) => /^update: .*labels \+tier -app\.example\.com\/part/.test(r)),
      events.join('\n'),
    );
    const e = await apiError(client.updateSandbox('gold', { labels: { 'bad key': 'x' } }));
    assert.equal(e.code, 'INVALID_ARGUMENT');
    assert.equal((await apiError(client.updateSandbox('gold', { idle: 'soon' }))).code, 'INVALID_ARGUMENT');
  });

  test('PATCH idle: the policy loop hibernates the sandbox on the new timeout; null clears it', async () => {
    const cleared = await client.updateSandbox(plain.id, { idle: '1h', archiveAfter: 60_000 });
    assert.deepEqual(cleared.policy, { hibernateAfterMs: 3_600_000, archiveAfterMs: 60_000 });
    assert.deepEqual((await client.updateSandbox(plain.id, { archiveAfter: null })).policy, {
      hibernateAfterMs: 3_600_000,
    });
    await new Promise((r) => setTimeout(r, 1500));
    assert.equal((await client.getSandbox(plain.id)).state, 'running', 'idle 1h: not yet');
    const s = await client.updateSandbox(plain.id, { idle: 1000 });
    assert.equal(s.policy.hibernateAfterMs, 1000);
    const slept = await untilState(client, plain.id, 'hibernated', 30_000);
    assert.ok(slept.checkpointId, 'hibernated by the policy loop, with a checkpoint');
    const reasons = (await daemon.store.transitions({ sandboxId: plain.id })).map((t) => t.reason);
    assert.ok(reasons.includes('update: idle 1s'), reasons.join('\n'));
    assert.deepEqual((await client.updateSandbox(plain.id, { idle: null })).policy, {});
  });

  test('metrics: samples of CPU, memory and the writable layer over time', async () => {
    const t0 = Date.now();
    // 8 MiB on the writable layer, then 3 s of busy loop while the meter samples every 200 ms.
    // The assertions poll: on a loaded machine the meter's passes may come late, which dilutes
    // one window's share but not what the samples show over the whole run.
    await client.exec(gold.id, [
      'sh',
      '-c',
      'dd if=/dev/zero of=/big bs=1M count=8 2>/dev/null; sync; timeout 3 sh -c "while :; do :; done"; true',
    ]);
    const m = await eventually('samples that show the work', async () => {
      const r = await client.sandboxMetrics(gold.id, t0);
      if (r.samples.length < 3) throw new Error(`${r.samples.length} samples`);
      const cpu = r.samples.map((x) => x.cpuPercent ?? 0);
      if (Math.max(...cpu) <= 10) throw new Error(`a busy loop shows as CPU: ${cpu.join(' ')}`);
      const disk = r.samples.at(-1)!.diskBytes ?? 0;
      if (disk < 8 * 1024 ** 2) throw new Error(`the 8 MiB file shows on the layer: ${disk}`);
      return r;
    });
    for (const x of m.samples) {
      assert.ok(x.at >= t0, 'only samples since `since`');
      assert.ok(x.memoryBytes > 0, 'memory held');
      assert.ok(x.diskBytes !== null, 'a quota sandbox: the layer use is known');
    }
    const all = await client.sandboxMetrics(gold.id, 0);
    assert.ok(all.samples.length > m.samples.length, 'an earlier since: more samples');
    assert.deepEqual((await client.sandboxMetrics(gold.id, Date.now() + 60_000)).samples, []);
  });

  test('delete is idempotent: a gone or never-made sandbox answers 204; the CLI says so and exits 0', async () => {
    await client.remove(paused.id);
    await client.remove(paused.id);
    const res = await fetch(`${daemon.url}/v1/sandboxes/sb-0000000000000000`, {
      method: 'DELETE',
      headers: { authorization: `Bearer ${daemon.adminToken}` },
    });
    assert.equal(res.status, 204);
    for (const cmd of ['rm', 'kill']) {
      const r = await dormant([cmd, 'paused']);
      assert.equal(r.code, 0, r.stderr);
      assert.match(r.stdout, /paused: no such sandbox/);
    }
    const j = await dormant(['rm', paused.id, '--json']);
    assert.deepEqual(JSON.parse(j.stdout), { deleted: paused.id, alreadyGone: true });
  });

  test('the CLI: create --label, ls --label/--state, update', async () => {
    const c = await dormant([
      'create',
      '--name',
      'cli',
      '--rootfs',
      rootfs,
      '--label',
      'team=cli',
      '--json',
      '--',
      ...SLEEPER,
    ]);
    assert.equal(c.code, 0, c.stderr);
    const made = JSON.parse(c.stdout) as SandboxInfo;
    assert.deepEqual(made.labels, { team: 'cli' });
    const ls = await dormant(['ls', '--label', 'team=cli', '--state', 'running', '--json']);
    assert.deepEqual(
      (JSON.parse(ls.stdout) as SandboxInfo[]).map((s) => s.id),
      [made.id],
    );
    const none = await dormant(['ls', '--label', 'team=cli', '--state', 'paused,hibernated', '--json']);
    assert.deepEqual(JSON.parse(none.stdout), []);
    const table = await dormant(['ls', '--label', 'team']);
    assert.match(table.stdout, /team=cli/, 'the table shows labels');
    const u = await dormant([
      'update',
      'cli',
      '--idle',
      '5m',
      '--label',
      'x=1',
      '--unlabel',
      'team',
      '--json',
    ]);
    assert.equal(u.code, 0, u.stderr);
    const after = JSON.parse(u.stdout) as SandboxInfo;
    assert.deepEqual(after.labels, { x: '1' });
    assert.equal(after.policy.hibernateAfterMs, 300_000);
    const back = await dormant(['update', 'cli', '--idle', 'default', '--json']);
    assert.deepEqual((JSON.parse(back.stdout) as SandboxInfo).policy, {});
    const bad = await dormant(['ls', '--state', 'bogus']);
    assert.notEqual(bad.code, 0);
    assert.match(bad.stderr, /bogus/);
  });
});
