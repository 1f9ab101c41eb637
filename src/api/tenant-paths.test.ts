/**
 * A daemon on its defaults (`dormant serve` with no `--allow-root`): a tenant's token names no
 * host path at all. Its rootfs, image and archive paths are refused with 403 before the daemon
 * touches them; an admin keeps host paths; a tenant imports by uploading the archive; and an
 * error a tenant sees (an exec timeout) names no host path or runc command line.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { constants } from 'node:fs';
import { open, readdir } from 'node:fs/promises';
import { join } from 'node:path';
import { stagingDirFor, type Daemon } from '../daemon/daemon.js';
import { startTestDaemon, tearDown, testFolder } from './testing/daemon.js';
import { writeOciLayout } from '../runtime/testing/oci-layout.js';
import { call, type Answer } from './testing/http.js';
import { ErrorSchema } from './openapi.js';
import { errnoCode } from '../domain/errors.js';
import { run } from '../sys/exec.js';

const errorOf = (r: Answer) => ErrorSchema.parse(r.body).error;

describe('tenant tokens on a daemon with no allowed folders', () => {
  let dir: string;
  let rootfs: string;
  let layout: string;
  let daemon: Daemon;
  let admin: string;
  /** A tenant token of the admin's own tenant: it sees the sandboxes the admin makes. */
  let tenant: string;
  const api = (token: string, method: string, path: string, body?: unknown) =>
    call(daemon.url, token, method, path, body);

  before(async () => {
    ({ dir, rootfs } = await testFolder('tenant-paths'));
    layout = join(dir, 'layout');
    await writeOciLayout(layout, { layers: [rootfs], tag: 'latest', config: {} });
    ({ daemon } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      readonlyBinds: [],
      proxy: false,
      policy: false,
    }));
    admin = daemon.adminToken;
    const minted = await api(admin, 'POST', '/v1/tokens', { tenant: 'default' });
    assert.equal(minted.status, 201, minted.text);
    tenant = (minted.body as { token: string }).token;
  });

  after(() => tearDown(dir, daemon));

  test('rootfs, image and archive paths of a tenant are 403 HOST_PATH_FORBIDDEN', async () => {
    const cases: [string, Record<string, unknown>][] = [
      ['/v1/sandboxes', { rootfs: '/', command: ['cat', '/etc/shadow'] }],
      ['/v1/sandboxes', { rootfs, command: ['true'] }],
      ['/v1/sandboxes', { rootfs: '/no/such/folder', command: ['true'] }],
      ['/v1/sandboxes', { image: `${layout}:latest`, command: ['true'] }],
      ['/v1/checkpoints/import', { archive: '/etc/passwd' }],
    ];
    for (const [path, body] of cases) {
      const r = await api(tenant, 'POST', path, body);
      assert.equal(r.status, 403, `${JSON.stringify(body)}: ${r.text}`);
      const e = errorOf(r);
      assert.equal(e.code, 'HOST_PATH_FORBIDDEN');
      assert.match(e.message, /cannot name host paths/);
      assert.match(e.hint ?? '', /--allow-root/);
    }
    assert.deepEqual(await daemon.controller.list(), [], 'no sandbox was created');
  });

  test('the daemon does not open the file a tenant names', async () => {
    // A FIFO: opening it for reading would hang the request, and while a reader holds it a
    // non-blocking writer's open succeeds. Neither happens.
    const fifo = join(dir, 'fifo.tar');
    await run('mkfifo', [fifo]);
    const r = await api(tenant, 'POST', '/v1/checkpoints/import', { archive: fifo });
    assert.equal(r.status, 403, r.text);
    const opened = await open(fifo, constants.O_WRONLY | constants.O_NONBLOCK).then(
      async (h) => {
        await h.close();
        return true;
      },
      (e: unknown) => {
        assert.equal(errnoCode(e), 'ENXIO');
        return false;
      },
    );
    assert.equal(opened, false, 'nobody has the FIFO open');
  });

  test('an admin keeps host paths; a tenant imports by upload; errors name no host path', async () => {
    const made = await api(admin, 'POST', '/v1/sandboxes', {
      image: `${layout}:latest`,
      command: ['sh', '-c', 'echo started; exec sleep 100000'],
      name: 'base',
    });
    assert.equal(made.status, 201, made.text);
    const id = (made.body as { id: string }).id;

    // An exec timeout as the tenant sees it: the command, not runc's command line.
    const slow = await api(tenant, 'POST', `/v1/sandboxes/${id}/exec`, {
      command: ['sleep', '30'],
      timeoutMs: 500,
    });
    assert.equal(slow.status, 504, slow.text);
    assert.equal(errorOf(slow).code, 'COMMAND_TIMEOUT');
    assert.match(errorOf(slow).message, /sleep 30: killed after 500 ms/);
    for (const leak of [join(dir, 'data'), '/run/', 'runc', '--root'])
      assert.ok(!slow.text.includes(leak), `the tenant's error names ${leak}: ${slow.text}`);

    const hib = await api(admin, 'POST', `/v1/sandboxes/${id}/hibernate`);
    assert.equal(hib.status, 200, hib.text);
    const ckId = (hib.body as { checkpointId: string }).checkpointId;
    const exported = await fetch(`${daemon.url}/v1/checkpoints/${ckId}/export?allowPlaintext=true`, {
      headers: { authorization: `Bearer ${admin}` },
    });
    assert.equal(exported.status, 200);
    const archive = Buffer.from(await exported.arrayBuffer());

    const up = await fetch(`${daemon.url}/v1/checkpoints/import?fileName=base.tar.zst&name=uploaded`, {
      method: 'POST',
      headers: { authorization: `Bearer ${tenant}`, 'content-type': 'application/octet-stream' },
      body: archive,
    });
    const upText = await up.text();
    assert.equal(up.status, 201, upText);
    const imported = JSON.parse(upText) as { id: string; state: string; name: string };
    assert.equal(imported.state, 'hibernated');
    assert.equal(imported.name, 'uploaded');
    const resumed = await api(tenant, 'POST', `/v1/sandboxes/${imported.id}/resume`);
    assert.equal(resumed.status, 200, resumed.text);
    const out = await api(tenant, 'POST', `/v1/sandboxes/${imported.id}/exec`, {
      command: ['echo', 'alive'],
    });
    assert.equal(out.status, 200, out.text);
    assert.match((out.body as { stdout: string }).stdout, /alive/);
    const staged = await readdir(stagingDirFor(join(dir, 'data')));
    assert.ok(
      !staged.some((n) => n.endsWith('-upload')),
      `the upload is wiped from staging: ${staged.join(' ')}`,
    );
  });
});
