/**
 * Sandboxes from OCI registries through the real daemon: a real registry (Debian's
 * docker-registry on loopback, one open and one with htpasswd logins), images pushed to it
 * with skopeo, tenants creating from `HOST/NAME:TAG` and `@sha256:` references. A second
 * create downloads no layer again; every bad input is refused with its code and leaves no
 * sandbox and no cache entry; a login is per tenant and never stored in clear; the collector
 * removes what no sandbox uses and keeps what a hibernated one needs.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdir, readFile, readdir, writeFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { run } from '../sys/exec.js';
import { stagingDirFor, type Daemon } from '../daemon/daemon.js';
import { DormantClient } from '../sdk/client.js';
import { apiError, startTestDaemon, tearDown, testFolder } from './testing/daemon.js';
import { writeOciLayout } from '../runtime/testing/oci-layout.js';
import { pushLayout, startRegistry, type TestRegistry } from '../runtime/testing/registry.js';

const USER = { user: 'robot', password: 'pa55-Word-for-the-registry' };
const BIN = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'bin', 'dormant');

/** How often the registry's log shows a GET of this blob (a download). */
function blobGets(log: string, digest: string): number {
  return log.split('\n').filter((l) => l.includes(`"GET /v2/`) && l.includes(`/blobs/${digest} `)).length;
}

describe('images from OCI registries', () => {
  let dir: string;
  let daemon: Daemon;
  let admin: DormantClient;
  let acme: DormantClient;
  let acmeToken: string;
  let other: DormantClient;
  let open: TestRegistry;
  let locked: TestRegistry;
  let v1: { manifestDigest: string; layerDigests: string[] };
  let cacheDir: string;

  before(async () => {
    let rootfs: string;
    ({ dir, rootfs } = await testFolder('registry'));
    await mkdir(join(rootfs, 'srv'), { recursive: true });
    await writeFile(join(rootfs, 'srv', 'hello.txt'), 'pulled from a registry\n');
    const cmd = { config: { Cmd: ['sleep', '100000'], Env: ['FROM_IMAGE=yes'] } };
    v1 = await writeOciLayout(join(dir, 'v1'), { layers: [rootfs], tag: 'v1', config: cmd });
    await writeOciLayout(join(dir, 'arm'), {
      layers: [rootfs],
      tag: 'arm',
      config: { ...cmd, architecture: 'arm64' },
    });
    // An image with a layer of its own, which the test damages in the registry's storage (the
    // first, gzip-compressed, layer: skopeo pushes it as it is, where it would compress a plain one).
    await mkdir(join(dir, 'extra'));
    await writeFile(join(dir, 'extra', 'only-here.txt'), `unique ${Date.now()}\n`);
    await writeOciLayout(join(dir, 'two'), { layers: [join(dir, 'extra'), rootfs], tag: 'two', config: cmd });
    open = await startRegistry(join(dir, 'open-registry'));
    locked = await startRegistry(join(dir, 'locked-registry'), { auth: USER });
    await pushLayout(join(dir, 'v1'), 'v1', `${open.host}/tools/busybox:v1`);
    await pushLayout(join(dir, 'arm'), 'arm', `${open.host}/tools/busybox:arm`);
    await pushLayout(join(dir, 'two'), 'two', `${open.host}/tools/damaged:two`);
    await pushLayout(join(dir, 'v1'), 'v1', `${locked.host}/private/busybox:v1`, USER);
    const dataDir = join(dir, 'data');
    cacheDir = join(dataDir, 'images');
    ({ daemon, client: admin } = await startTestDaemon({
      dataDir,
      readonlyBinds: [],
      proxy: false,
      policy: false,
      images: { pullTimeoutMs: 60_000, gcIntervalMs: 0 },
    }));
    acmeToken = (await admin.createToken({ tenant: 'acme' })).token;
    acme = new DormantClient({ url: daemon.url, token: acmeToken });
    other = new DormantClient({
      url: daemon.url,
      token: (await admin.createToken({ tenant: 'other' })).token,
    });
  });

  after(async () => {
    await tearDown(undefined, daemon);
    await open?.stop();
    await locked?.stop();
    await tearDown(dir);
  });

  test('a tenant creates from HOST/NAME:TAG and runs it; the second create downloads no layer', async () => {
    const ref = `${open.host}/tools/busybox:v1`;
    const a = await acme.createSandbox({ image: ref });
    assert.equal(a.state, 'running');
    assert.deepEqual(a.command, ['sleep', '100000'], "the image's Cmd");
    assert.equal(a.source.kind, 'image');
    assert.equal(a.source.kind === 'image' && a.source.path, ref);
    assert.equal(a.source.kind === 'image' && a.source.digest, v1.manifestDigest);
    const r = await acme.exec(a.id, ['sh', '-c', 'cat /srv/hello.txt; echo "$FROM_IMAGE"']);
    assert.equal(r.stdout, 'pulled from a registry\nyes\n');
    const layer = v1.layerDigests[0]!;
    assert.equal(blobGets(await open.log(), layer), 1, 'the layer was downloaded once');
    const [first] = await admin.listImages();
    const b = await acme.createSandbox({ image: ref });
    assert.equal((await acme.exec(b.id, ['cat', '/srv/hello.txt'])).stdout, 'pulled from a registry\n');
    assert.equal(blobGets(await open.log(), layer), 1, 'a second create fetches no layer');
    const [again] = await admin.listImages();
    assert.equal(again?.unpackedAt, first?.unpackedAt, 'nor unpacks it again');
    assert.equal(again?.sandboxes, 2);
    // Pinned by digest: the same image, no download either.
    const c = await acme.createSandbox({ image: `${open.host}/tools/busybox@${v1.manifestDigest}` });
    assert.equal(c.source.kind === 'image' && c.source.digest, v1.manifestDigest);
    assert.equal((await acme.exec(c.id, ['cat', '/srv/hello.txt'])).stdout, 'pulled from a registry\n');
    assert.equal(blobGets(await open.log(), layer), 1);
    for (const s of [a, b, c]) await acme.remove(s.id);
  });

  test('bad references and registries are refused with their codes, leaving nothing behind', async () => {
    const before = await readdir(cacheDir);
    const cases: [string, string, RegExp][] = [
      [`${open.host}/tools/busybox:nope`, 'IMAGE_NOT_FOUND', /no such image/],
      [`${open.host}/tools/busybox@sha256:${'0'.repeat(64)}`, 'IMAGE_NOT_FOUND', /no such image/],
      [`${open.host}/tools/busybox:arm`, 'IMAGE_ARCH_MISMATCH', /linux\/arm64.*linux\/amd64/],
      [`${open.host}/tools/damaged:two`, 'IMAGE_DIGEST_MISMATCH', /does not match its digest/],
      // A port nothing listens on: the registry is down.
      [`${open.host.replace(/:\d+$/, ':1')}/tools/busybox:v1`, 'REGISTRY_UNAVAILABLE', /could not be read/],
      ['busybox', 'IMAGE_REF_INVALID', /no registry host/],
      [`${open.host}/Tools/BusyBox:v1`, 'IMAGE_REF_INVALID', /lowercase/],
      [`${open.host}/tools/busybox@sha256:abc`, 'IMAGE_REF_INVALID', /digest/],
    ];
    // Damage the unique layer of damaged:two where the registry keeps it.
    const two = JSON.parse(await readFile(join(dir, 'two', 'index.json'), 'utf8')) as {
      manifests: { digest: string }[];
    };
    const manifest = JSON.parse(
      await readFile(join(dir, 'two', 'blobs', 'sha256', two.manifests[0]!.digest.slice(7)), 'utf8'),
    ) as { layers: { digest: string }[] };
    const hex = manifest.layers[0]!.digest.slice(7);
    const data = join(open.storage, 'docker/registry/v2/blobs/sha256', hex.slice(0, 2), hex, 'data');
    const bytes = await readFile(data);
    bytes.writeUInt8(bytes.readUInt8(bytes.length - 5) ^ 0xff, bytes.length - 5);
    await writeFile(data, bytes);
    for (const [image, code, message] of cases) {
      const e = await apiError(acme.createSandbox({ image }));
      assert.equal(e.code, code, `${image}: ${e.message}`);
      assert.match(e.message, message);
    }
    assert.deepEqual(await acme.listSandboxes(), [], 'no sandbox record');
    assert.deepEqual(await readdir(cacheDir), before, 'no cache entry, no half-made folder');
    assert.deepEqual(await readdir(join(cacheDir, 'registry', 'acme', 'pulls')), [], 'no pull layout');
    const blobs = await readdir(join(cacheDir, 'registry', 'acme', 'blobs', 'sha256'));
    assert.ok(!blobs.includes(hex), 'the damaged layer was not kept');
    assert.deepEqual(
      (await readdir(stagingDirFor(join(dir, 'data')))).filter((n) => n.startsWith('registry-')),
      [],
      'no private pull folder left in staging',
    );
  });

  test('registry logins: checked, per tenant, sealed; wrong ones refused', async () => {
    const ref = `${locked.host}/private/busybox:v1`;
    const anonymous = await apiError(acme.createSandbox({ image: ref }));
    assert.equal(anonymous.code, 'REGISTRY_UNAUTHORIZED');
    const wrong = await apiError(
      acme.registryLogin(locked.host, { username: USER.user, password: 'not-it' }),
    );
    assert.equal(wrong.code, 'REGISTRY_UNAUTHORIZED');
    assert.deepEqual(await acme.listRegistryLogins(), [], 'a refused login is not stored');
    // The CLI, as a user logs in: the password on stdin, never on the command line.
    const cli = await run(
      process.execPath,
      [BIN, 'registry', 'login', locked.host, '--username', USER.user, '--password-stdin'],
      {
        input: `${USER.password}\n`,
        env: { DORMANT_URL: daemon.url, DORMANT_TOKEN: acmeToken, NO_COLOR: '1' },
        timeoutMs: 60_000,
      },
    );
    assert.equal(cli.stdout, `logged in to ${locked.host} as ${USER.user}\n`);
    assert.deepEqual(
      (await acme.listRegistryLogins()).map((l) => [l.host, l.username, l.tenant]),
      [[locked.host, USER.user, 'acme']],
    );
    assert.ok(!JSON.stringify(await acme.listRegistryLogins()).includes(USER.password));
    const s = await acme.createSandbox({ image: ref });
    assert.equal((await acme.exec(s.id, ['cat', '/srv/hello.txt'])).stdout, 'pulled from a registry\n');
    // The image is in the cache now, yet another tenant without the login is refused: the
    // registry decides on every create, with the tenant's own credentials.
    const stranger = await apiError(other.createSandbox({ image: ref }));
    assert.equal(stranger.code, 'REGISTRY_UNAUTHORIZED');
    assert.deepEqual(await other.listRegistryLogins(), []);
    // Never in clear on disk: not in the database (nor its WAL), not in the data folder.
    for (const f of ['state.db', 'state.db-wal']) {
      const text = await readFile(join(dir, 'data', f)).catch(() => Buffer.alloc(0));
      assert.ok(!text.includes(USER.password), `${f} holds the password in clear`);
    }
    await acme.remove(s.id);
    await acme.registryLogout(locked.host);
    assert.equal((await apiError(acme.createSandbox({ image: ref }))).code, 'REGISTRY_UNAUTHORIZED');
    assert.equal((await apiError(acme.registryLogout(locked.host))).code, 'REGISTRY_CREDENTIALS_NOT_FOUND');
  });

  test('prune removes images and blobs no sandbox uses, and keeps what a hibernated sandbox needs', async () => {
    const ref = `${open.host}/tools/busybox:v1`;
    const s = await acme.createSandbox({ image: ref });
    await acme.hibernate(s.id);
    const blobDir = join(cacheDir, 'registry', 'acme', 'blobs', 'sha256');
    const kept = await admin.pruneImages();
    assert.deepEqual(kept.images, [], 'the hibernated sandbox still uses its image');
    assert.ok((await readdir(blobDir)).includes(v1.layerDigests[0]!.slice(7)));
    const resumed = await acme.resume(s.id);
    assert.equal(resumed.state, 'running');
    assert.equal((await acme.exec(s.id, ['cat', '/srv/hello.txt'])).stdout, 'pulled from a registry\n');
    await acme.remove(s.id);
    const pruned = await admin.pruneImages();
    assert.deepEqual(pruned.images, [v1.manifestDigest]);
    assert.ok(pruned.blobs >= 3, 'its manifest, config and layer');
    assert.deepEqual(await admin.listImages(), []);
    assert.deepEqual(
      (await readdir(cacheDir)).filter((n) => n.startsWith('sha256-')),
      [],
      'the unpacked folder is gone',
    );
    assert.deepEqual(await readdir(blobDir), []);
    // A tenant cannot prune, nor list the node's images.
    assert.equal((await apiError(acme.pruneImages())).code, 'FORBIDDEN');
  });
});
