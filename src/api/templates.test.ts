/**
 * Templates end to end through the real daemon (HTTP API, SQLite, vault, runc, CRIU): a
 * sandbox made from a template has the template's memory (a python server's counter and
 * random token, held only in its memory) and files, its own id, address and hostname (never
 * the template's, not even for its first instructions), and memory of its own; a template is
 * built from a rootfs once its ready probe passes; tenants see only their own and the public
 * ones; a damaged template is refused by name with nothing left behind.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync, readdirSync, statSync, writeFileSync } from 'node:fs';
import { readdir } from 'node:fs/promises';
import { join } from 'node:path';
import { stagingDirFor, type Daemon } from '../daemon/daemon.js';
import { DormantClient, type SandboxInfo } from '../sdk/client.js';
import { pythonServer } from './testing/servers.js';
import { eventually, httpGet, leftovers } from './testing/host.js';
import { apiError, startTestDaemon, tearDown, testFolder } from './testing/daemon.js';

/**
 * A counter and a random token only in memory (answered as "COUNT TOKEN"), and a thread that
 * prints the hostname every few milliseconds: the log shows the name the processes see.
 */
const SERVER_PY = pythonServer({
  setup: `import os, socket, threading, time
token = os.urandom(8).hex()
def names():
    while True:
        print("name", socket.gethostname(), flush=True)
        time.sleep(0.002)
threading.Thread(target=names, daemon=True).start()
time.sleep(float(os.environ.get("LISTEN_AFTER", "0")))`,
  answer: '"%d %s" % (count, token)',
});

const PY = ['/usr/bin/python3', '-u', '/srv/server.py'];

/** The hostnames sandbox `id` printed (its log: only what ran there, from its first instruction). */
async function namesSeen(client: DormantClient, id: string): Promise<Set<string>> {
  const log = await client.logs(id);
  return new Set([...log.matchAll(/^name (\S+)$/gm)].map((m) => m[1]!));
}

describe('templates through the daemon', () => {
  let dir: string;
  let rootfs: string;
  let daemon: Daemon;
  let admin: DormantClient;
  let alice: DormantClient;
  let bob: DormantClient;
  let origin: SandboxInfo;

  before(async () => {
    ({ dir, rootfs } = await testFolder('templates', { 'srv/server.py': SERVER_PY }));
    ({ daemon, client: admin } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      allowedSourceRoots: [dir],
    }));
    const tenant = async (name: string): Promise<DormantClient> =>
      new DormantClient({ url: daemon.url, token: (await admin.createToken({ tenant: name })).token });
    alice = await tenant('alice');
    bob = await tenant('bob');
  });

  after(() => tearDown(dir, daemon));

  test('from a running sandbox: new sandboxes have its memory and files, their own id, address and hostname', async () => {
    origin = await alice.createSandbox({
      name: 'origin',
      rootfs,
      command: PY,
      ports: [8080],
      memory: '256M',
    });
    const first = await eventually('server', () => httpGet(origin.address!, 8080));
    const token = first.split(' ')[1]!;
    await httpGet(origin.address!, 8080);
    await alice.exec(origin.id, ['sh', '-c', 'echo from-the-template > /srv/note']);
    // Count 2 when the template is taken: its sandboxes answer 3 first.
    const tpl = await alice.createTemplate({ name: 'warm', from: 'origin' });
    assert.match(tpl.id, /^tp-/);
    assert.equal(tpl.origin, `sandbox ${origin.id}`);
    assert.equal(tpl.tenant, 'alice');
    assert.equal(tpl.public, false);
    assert.ok(tpl.storedBytes !== null && tpl.storedBytes > 0);
    assert.equal(
      await httpGet(origin.address!, 8080),
      `3 ${token}`,
      'the source keeps running, memory and all',
    );

    const a = await alice.createSandbox({ template: 'warm', name: 'a' });
    const b = await alice.createSandbox({ template: tpl.id, name: 'b' });
    assert.equal(a.state, 'running');
    assert.deepEqual(a.command, origin.command);
    assert.equal(new Set([a.id, b.id, origin.id]).size, 3);
    assert.equal(new Set([a.address, b.address, origin.address]).size, 3, 'each has its own address');
    // The template's memory, answered at once: nothing started afresh.
    assert.equal(await httpGet(a.address!, 8080), `3 ${token}`);
    assert.equal(await httpGet(a.address!, 8080), `4 ${token}`);
    assert.equal(await httpGet(b.address!, 8080), `3 ${token}`, 'independent memory: b did not see a count');
    assert.equal(await httpGet(origin.address!, 8080), `4 ${token}`);
    // Its files: the template's, in a writable layer of its own.
    assert.equal((await alice.exec(a.id, ['cat', '/srv/note'])).stdout, 'from-the-template\n');
    await alice.exec(a.id, ['sh', '-c', 'echo a-only > /srv/note']);
    assert.equal((await alice.exec(b.id, ['cat', '/srv/note'])).stdout, 'from-the-template\n');
    // Its own hostname, from the first instruction it ran (no line of its log names another).
    for (const s of [a, b]) {
      assert.equal((await alice.exec(s.id, ['hostname'])).stdout.trim(), s.name);
      await eventually('names', async () => assert.ok((await namesSeen(alice, s.id)).size > 0));
      assert.deepEqual([...(await namesSeen(alice, s.id))], [s.name], `${s.name} only ever saw its own name`);
    }
    await alice.remove(a.id);
    await alice.remove(b.id);
  });

  test('the template outlives its source pruning its checkpoints and being removed', async () => {
    for (let i = 0; i < 3; i++) {
      await alice.hibernate(origin.id);
      await alice.resume(origin.id);
    }
    await alice.remove(origin.id);
    const c = await alice.createSandbox({ template: 'warm' });
    assert.match(await httpGet(c.address!, 8080), /^3 /);
    await alice.remove(c.id);
  });

  test('built from a rootfs and a command: checkpointed once its ready probe passes, the builder removed', async () => {
    const before = new Set((await admin.listSandboxes()).map((s) => s.id));
    const tpl = await alice.createTemplate({
      name: 'built',
      rootfs,
      command: PY,
      env: { LISTEN_AFTER: '1.5' },
      ports: [8080],
      memory: '256M',
      ready: { port: 8080, timeout: '30s' },
    });
    assert.equal(tpl.origin, `rootfs ${rootfs}`);
    assert.deepEqual(
      (await admin.listSandboxes()).filter((s) => !before.has(s.id)),
      [],
      'the builder sandbox is gone',
    );
    const s = await alice.createSandbox({ template: 'built' });
    // Listening already: the template was taken once the port was open.
    assert.match(await httpGet(s.address!, 8080), /^1 [0-9a-f]{16}$/);
    await alice.remove(s.id);

    const e = await apiError(
      alice.createTemplate({ name: 'never', rootfs, command: PY, ready: { port: 9999, timeout: '2s' } }),
    );
    assert.equal(e.code, 'TEMPLATE_NOT_READY');
    assert.equal(e.status, 422);
    assert.match(e.message, /nothing listened on port 9999/);
    assert.deepEqual(
      (await admin.listSandboxes()).filter((x) => !before.has(x.id)),
      [],
      'the failed builder is gone too',
    );
    assert.ok(!(await alice.listTemplates()).some((t) => t.name === 'never'));
  });

  test('tenants: a private template is invisible to another; an admin publishes one; a tenant’s own name wins', async () => {
    assert.deepEqual(
      (await bob.listTemplates()).map((t) => t.name),
      [],
    );
    for (const p of [bob.getTemplate('warm'), bob.createSandbox({ template: 'warm' })]) {
      const e = await apiError(p);
      assert.equal(e.code, 'TEMPLATE_NOT_FOUND');
      assert.equal(e.status, 404);
    }
    assert.equal((await apiError(alice.createTemplate({ name: 'warm', from: 'x' }))).status, 404);
    const busy = await alice.createSandbox({ rootfs, command: ['sleep', 'infinity'] });
    const taken = await apiError(alice.createTemplate({ name: 'warm', from: busy.id }));
    assert.equal(taken.code, 'TEMPLATE_NAME_TAKEN');
    assert.equal(taken.status, 409);
    assert.equal(
      (await apiError(alice.createTemplate({ name: 'pub', from: busy.id, public: true }))).status,
      403,
    );
    assert.equal((await apiError(bob.publishTemplate('warm', true))).status, 403);

    const pub = await admin.publishTemplate((await alice.getTemplate('warm')).id, true);
    assert.equal(pub.public, true);
    assert.deepEqual(
      (await bob.listTemplates()).map((t) => t.name),
      ['warm'],
    );
    const s = await bob.createSandbox({ template: 'warm' });
    assert.equal(s.tenant, 'bob');
    assert.match(await httpGet(s.address!, 8080), /^3 /, 'the public template’s memory');
    assert.equal(
      (await apiError(bob.removeTemplate('warm'))).status,
      403,
      'used, not removed, by another tenant',
    );

    // Bob's own "warm" shadows the public one for bob.
    const mine = await bob.createTemplate({ name: 'warm', from: s.id });
    assert.equal((await bob.getTemplate('warm')).id, mine.id);
    const s2 = await bob.createSandbox({ template: 'warm' });
    assert.match(
      await httpGet(s2.address!, 8080),
      /^4 /,
      'from bob’s template (taken after one more request)',
    );
    for (const x of [s, s2]) await bob.remove(x.id);
    await bob.removeTemplate('warm');
    assert.equal((await bob.getTemplate('warm')).id, pub.id, 'the public one again');
    await alice.remove(busy.id);
  });

  test('rm: the template and its checkpoint go; sandboxes made from it stay', async () => {
    const tpl = await alice.getTemplate('built');
    const s = await alice.createSandbox({ template: 'built' });
    // Its images, decrypted, in memory (the staging tmpfs) for the next create, and only there.
    const cache = join(stagingDirFor(join(dir, 'data')), 'template-cache');
    assert.ok((await readdir(cache)).includes(tpl.checkpointId));
    assert.equal(statSync(cache).mode & 0o777, 0o700);
    await alice.removeTemplate('built');
    assert.ok(!(await readdir(cache)).includes(tpl.checkpointId), 'dropped from memory with the template');
    assert.ok(!(await alice.listTemplates()).some((t) => t.name === 'built'));
    assert.ok(
      !(await admin.listCheckpoints()).some((c) => c.id === tpl.checkpointId),
      'its checkpoint is gone',
    );
    assert.equal((await apiError(alice.createSandbox({ template: 'built' }))).code, 'TEMPLATE_NOT_FOUND');
    assert.match(await httpGet(s.address!, 8080), /^1 /, 'a sandbox made from it runs on');
    await alice.remove(s.id);
    await alice.removeTemplate('built');
  });

  test('a damaged template is refused by name, and nothing of the attempt is left', async () => {
    const busy = await alice.createSandbox({ rootfs, command: PY, ports: [8080], memory: '256M' });
    await eventually('server', () => httpGet(busy.address!, 8080));
    const tpl = await alice.createTemplate({ name: 'fragile', from: busy.id });
    await alice.remove(busy.id);
    // Damage the newest pack of alice's: it holds the chunks the template's checkpoint added.
    const packsDir = join(dir, 'data', 'vault', 'data', 'alice', 'packs');
    const packs = readdirSync(packsDir).map((f) => ({ f, t: statSync(join(packsDir, f)).mtimeMs }));
    const newest = join(packsDir, packs.sort((x, y) => y.t - x.t)[0]!.f);
    const bytes = readFileSync(newest);
    const mid = Math.floor(bytes.length / 2);
    bytes[mid] = (bytes[mid] ?? 0) ^ 0x55;
    writeFileSync(newest, bytes);

    const before = new Set((await admin.listSandboxes()).map((s) => s.id));
    const e = await apiError(alice.createSandbox({ template: 'fragile', name: 'from-fragile' }));
    assert.equal(e.code, 'TEMPLATE_DAMAGED');
    assert.equal(e.status, 409);
    assert.match(e.message, new RegExp(`template fragile \\(${tpl.id}\\) is damaged`));
    // As a failed create: a failed record that says why, nothing running, mounted or wired.
    const made = (await admin.listSandboxes()).filter((s) => !before.has(s.id));
    assert.deepEqual(
      made.map((s) => s.state),
      ['failed'],
    );
    assert.deepEqual(leftovers(made[0]!.id), []);
    const staging = stagingDirFor(join(dir, 'data'));
    assert.deepEqual(await readdir(staging), ['template-cache'], 'staging wiped but for the cache');
    assert.ok(
      !(await readdir(join(staging, 'template-cache'))).some((f) => f.startsWith(tpl.checkpointId)),
      'nothing of the damaged checkpoint kept in memory',
    );
    await alice.remove(made[0]!.id);

    // Its checkpoint record gone: said before anything is made.
    const other = await alice.createSandbox({ rootfs, command: ['sleep', 'infinity'] });
    const rec = await alice.createTemplate({ name: 'unrecorded', from: other.id });
    await alice.remove(other.id);
    await daemon.store.deleteCheckpoint(rec.checkpointId);
    const before2 = (await admin.listSandboxes()).length;
    const e2 = await apiError(alice.createSandbox({ template: 'unrecorded' }));
    assert.equal(e2.code, 'TEMPLATE_DAMAGED');
    assert.match(e2.message, /checkpoint record is missing/);
    assert.equal((await admin.listSandboxes()).length, before2, 'no sandbox record');
    await alice.removeTemplate('fragile');
    await alice.removeTemplate('unrecorded');
  });
});
