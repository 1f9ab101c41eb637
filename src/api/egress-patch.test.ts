/**
 * Egress changed after create (PATCH /v1/sandboxes/:id `egress`), and the egress an imported
 * checkpoint gets, against a real daemon, real sandboxes and a test-made "outside" host in
 * 198.18.0.0/15 (testing/outside.ts). No sandbox here connects to anything but that namespace.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { createWriteStream } from 'node:fs';
import { join } from 'node:path';
import { Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import type { Daemon } from '../daemon/daemon.js';
import { DormantClient, type SandboxInfo } from '../sdk/client.js';
import { writeOciLayout } from '../runtime/testing/oci-layout.js';
import { apiError, startTestDaemon, tearDown, testFolder } from './testing/daemon.js';
import { startOutside, type Outside } from './testing/outside.js';

const LOOP = ['/bin/sh', '-c', 'while true; do sleep 1; done'];

describe('egress changed after create, and on import', () => {
  let dir: string;
  let rootfs: string;
  let daemon: Daemon | undefined;
  let client: DormantClient;
  let outside: Outside;

  before(async () => {
    ({ dir, rootfs } = await testFolder('egress-patch'));
    outside = await startOutside((p) => ({ 'api.egress.test': `${p}2` }));
    ({ daemon, client } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      policy: false,
      proxy: false,
      allowedSourceRoots: [dir],
      egressResolvers: [outside.address],
      defaultEgress: { node: { mode: 'internet' }, tenants: {} },
    }));
  });

  after(async () => {
    await tearDown(dir, daemon);
    await outside.close();
  });

  /** Whether a fetch of the outside host from inside succeeds (busybox wget, 3 s timeout). */
  const reaches = async (sb: SandboxInfo): Promise<boolean> => {
    const url = `http://${outside.address}:8080/`;
    const r = await client.exec(sb.id, ['wget', '-q', '-T', '3', '-O', '-', url], { timeoutMs: 15_000 });
    return r.exitCode === 0;
  };

  const events = async (id: string): Promise<string[]> =>
    (await daemon!.store.transitions({ sandboxId: id })).map((t) => t.reason);

  test('a running sandbox follows a new policy at once: none closes it, internet opens it, a list that leaves the host out closes it', async () => {
    const sb = await client.createSandbox({ name: 'running', rootfs, command: LOOP, memory: '64M' });
    assert.ok(await reaches(sb), 'internet at first');
    const closed = await client.updateSandbox(sb.id, { egress: 'none' });
    assert.equal(closed.egress, 'none');
    assert.equal((await client.getSandbox(sb.id)).egress, 'none');
    assert.ok(!(await reaches(sb)), 'none: the outside host is out of reach');
    assert.equal((await client.updateSandbox(sb.id, { egress: 'internet' })).egress, 'internet');
    assert.ok(await reaches(sb), 'internet again');
    const list = `${outside.prefix}128/25`;
    assert.equal((await client.updateSandbox(sb.id, { egress: [list] })).egress, list);
    assert.ok(!(await reaches(sb)), 'a list without the host');
    // By name, resolved by the node as at create.
    assert.equal(
      (await client.updateSandbox(sb.id, { egress: 'api.egress.test' })).egress,
      'api.egress.test',
    );
    assert.ok(await reaches(sb), 'a list with its name');
    assert.ok((await events(sb.id)).includes('update: egress none'), (await events(sb.id)).join('\n'));
    await client.remove(sb.id);
  });

  test('a bad policy is a 400 with its code, and the old one still holds', async () => {
    const sb = await client.createSandbox({ name: 'kept', rootfs, command: LOOP, memory: '64M' });
    for (const bad of ['198.18.0.0/33', 'none,internet', 'bad_name']) {
      const e = await apiError(client.updateSandbox(sb.id, { egress: bad, idle: '5m' }));
      assert.equal(e.code, 'EGRESS_POLICY_INVALID', bad);
      assert.equal(e.status, 400);
    }
    const unresolvable = await apiError(client.updateSandbox(sb.id, { egress: 'nope.egress.test' }));
    assert.equal(unresolvable.code, 'EGRESS_HOST_UNRESOLVABLE');
    // A good policy beside labels past the limit (64): refused whole, the firewall untouched.
    const many = Object.fromEntries(Array.from({ length: 65 }, (_, i) => [`k${String(i)}`, 'v']));
    const tooMany = await apiError(client.updateSandbox(sb.id, { egress: 'none', labels: many }));
    assert.equal(tooMany.status, 400);
    assert.match(tooMany.message, /too many labels/);
    const now = await client.getSandbox(sb.id);
    assert.equal(now.egress, 'internet');
    assert.equal(now.policy.hibernateAfterMs, undefined, 'nothing else in the refused request changed');
    assert.ok(await reaches(sb), 'the old policy still holds');
    await client.remove(sb.id);
  });

  test('a hibernated sandbox gets its new policy at its resume', async () => {
    const sb = await client.createSandbox({ name: 'sleeper', rootfs, command: LOOP, memory: '64M' });
    await client.hibernate(sb.id);
    const patched = await client.updateSandbox(sb.id, { egress: 'none' });
    assert.equal(patched.state, 'hibernated');
    assert.equal(patched.egress, 'none');
    await client.resume(sb.id);
    assert.ok(!(await reaches(sb)), 'none after the resume');
    await client.hibernate(sb.id);
    await client.updateSandbox(sb.id, { egress: 'internet' });
    await client.resume(sb.id);
    assert.ok(await reaches(sb), 'internet after the next resume');
    await client.remove(sb.id);
  });

  test("an imported checkpoint gets the tenant's egress and reaches the outside host", async () => {
    const layout = join(dir, 'layout');
    await writeOciLayout(layout, { layers: [rootfs], tag: 'latest', config: {} });
    const image = `${layout}:latest`;
    const src = await client.createSandbox({ name: 'exported', image, command: LOOP, memory: '64M' });
    const h = await client.hibernate(src.id);
    const archive = join(dir, 'src.tar.zst');
    const r = await client.exportCheckpoint(h.checkpointId!, { allowPlaintext: true });
    await pipeline(
      Readable.fromWeb(r.body as Parameters<typeof Readable.fromWeb>[0]),
      createWriteStream(archive, { flags: 'wx' }),
    );
    const imported = await client.importCheckpoint({ archive, image, name: 'imported' });
    assert.equal(imported.egress, 'internet');
    await client.resume(imported.id);
    assert.ok(await reaches(imported), 'the imported sandbox has a way out');
    await client.remove(imported.id);
    await client.remove(src.id);
  });
});
