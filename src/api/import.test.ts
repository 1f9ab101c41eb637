/**
 * `dormant checkpoint import` and export by checkpoint id, end to end on the real daemon
 * (runc, CRIU, the vault): a sandbox exported as a podman archive imports as a new hibernated
 * sandbox that resumes with the same memory and filesystem; a kubelet-named CRI-O archive built
 * from a real runc checkpoint imports too; a missing or different base image and hostile
 * archives are refused with clear errors and leave nothing behind.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import { mkdir, mkdtemp, readFile, readdir, rm, stat, truncate, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { createWriteStream } from 'node:fs';
import { stagingDirFor, type Daemon } from '../daemon/daemon.js';
import { DormantClient } from '../sdk/client.js';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';
import { apiError, startTestDaemon, tearDown } from './testing/daemon.js';
import { writeOciLayout } from '../runtime/testing/oci-layout.js';
import { eventually, leftovers } from './testing/host.js';
import { writeArchive, type ArchiveMember } from '../checkpoint/export.js';
import { TAR_END, tarHeader, tarPadding } from '../checkpoint/tar.js';
import { run } from '../sys/exec.js';
import { DormantApiError } from '../sdk/errors.js';
import { isDormantError } from '../domain/errors.js';
import { COUNTER_SERVER_PY, serveCounter } from './testing/servers.js';
import { allCapsNoNewPrivs } from '../criu/images/testing/tamper.js';

describe('checkpoint import and export', () => {
  let dir: string;
  let daemon: Daemon;
  let client: DormantClient;
  let layout: string;
  let other: string;

  before(async () => {
    dir = await mkdtemp('/tmp/dormant-import-');
    const base = join(dir, 'base');
    await buildBusyboxRootfs(base, {
      'srv/server.py': COUNTER_SERVER_PY,
      'srv/data.txt': 'from the image\n',
    });
    layout = join(dir, 'layout');
    await writeOciLayout(layout, { layers: [base], tag: 'latest', config: { config: { WorkingDir: '/' } } });
    const base2 = join(dir, 'base2');
    await buildBusyboxRootfs(base2, {
      'srv/server.py': COUNTER_SERVER_PY,
      'srv/data.txt': 'another image\n',
    });
    other = join(dir, 'other');
    await writeOciLayout(other, { layers: [base2], tag: 'latest', config: {} });
    ({ daemon, client } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      proxy: false,
      policy: false,
    }));
  });

  after(() => tearDown(dir, daemon));

  const create = (name: string) =>
    client.createSandbox({
      name,
      image: `${layout}:latest`,
      command: ['/usr/bin/python3', '-u', '/srv/server.py'],
      ports: [8080],
      memory: '128M',
    });

  /** What an import that failed must not leave: a sandbox row, runtime side, staging, vault data. */
  async function nothingLeft(before: {
    sandboxes: string[];
    vault: number;
    runtime: string[];
  }): Promise<void> {
    assert.deepEqual(
      (await client.listSandboxes()).map((s) => s.id).sort(),
      before.sandboxes,
      'no sandbox row is left',
    );
    assert.deepEqual(await daemon.runtime.list(), before.runtime, 'no runtime folder is left');
    assert.deepEqual(await readdir(stagingDirFor(join(dir, 'data'))), [], 'staging is empty');
    assert.equal(
      (await daemon.vault.listCheckpoints({})).length,
      before.vault,
      'no vault checkpoint is left',
    );
    const v = await daemon.vault.verify();
    assert.deepEqual(v.problems, []);
  }
  async function snapshot() {
    return {
      sandboxes: (await client.listSandboxes()).map((s) => s.id).sort(),
      vault: (await daemon.vault.listCheckpoints({})).length,
      runtime: await daemon.runtime.list(),
    };
  }

  async function exportTo(ckId: string, out: string): Promise<number> {
    const r = await client.exportCheckpoint(ckId, { allowPlaintext: true });
    await pipeline(
      Readable.fromWeb(r.body as Parameters<typeof Readable.fromWeb>[0]),
      createWriteStream(out, { flags: 'wx' }),
    );
    return r.secretsFound;
  }

  let exported: string;

  test('a podman export of a sandbox imports as a hibernated sandbox that resumes with its memory and files', async () => {
    const a = await create('source');
    const [n, token] = await serveCounter(a);
    await client.exec(a.id, ['sh', '-c', 'echo changed > /srv/note.txt && rm /srv/data.txt']);
    const ha = await client.hibernate(a.id);
    assert.ok(ha.checkpointId);
    exported = join(dir, 'a.tar.zst');
    await exportTo(ha.checkpointId, exported);
    // checkpointctl, the reference reader, reads what dormant wrote.
    const show = await run('checkpointctl', ['show', exported], { timeoutMs: 60_000 });
    assert.match(show.stdout, /source/);

    const b = await client.importCheckpoint({
      archive: exported,
      image: `${layout}:latest`,
      name: 'imported',
    });
    assert.equal(b.state, 'hibernated');
    assert.notEqual(b.id, a.id);
    assert.deepEqual(
      b.ports.map((p) => p.port),
      [8080],
      'the ports dormant recorded in the archive',
    );
    assert.deepEqual(await readdir(stagingDirFor(join(dir, 'data'))), [], 'no plaintext left in staging');
    const rb = await client.resume(b.id);
    assert.equal(rb.state, 'running');
    assert.equal(
      (await serveCounter(rb)).join(' '),
      `${n + 1} ${token}`,
      'same process memory: the counter continues',
    );
    const files = await client.exec(b.id, [
      'sh',
      '-c',
      'cat /srv/note.txt; test -e /srv/data.txt || echo gone',
    ]);
    assert.equal(files.stdout, 'changed\ngone\n', 'the filesystem diff and the deletion came along');
    // And it is an ordinary sandbox now: it hibernates and resumes again.
    await client.hibernate(b.id);
    const again = await client.resume(b.id);
    assert.equal((await serveCounter(again)).join(' '), `${n + 2} ${token}`);
    await client.remove(b.id);
    assert.deepEqual(leftovers(b.id), []);
  });

  test('without --image the base comes from an image dormant holds; a different image is refused', async () => {
    const before = await snapshot();
    const wrong = await apiError(client.importCheckpoint({ archive: exported, image: `${other}:latest` }));
    assert.equal(wrong.code, 'IMAGE_MISMATCH');
    assert.match(wrong.message, /sha256:[0-9a-f]{64}/, 'the message names the digests');
    await nothingLeft(before);
    const c = await client.importCheckpoint({ archive: exported, name: 'from-held-image' });
    assert.equal(c.state, 'hibernated');
    const src = (await daemon.controller.get(c.id)).spec.source;
    assert.equal(src.kind === 'image' ? src.path : '', layout, 'the image the source sandbox was made from');
    await client.remove(c.id);
  });

  test('a kubelet checkpoint archive built from a real runc checkpoint imports and resumes', async () => {
    const k = await create('kubelet-source');
    const [n, token] = await serveCounter(k);
    await client.exec(k.id, ['sh', '-c', 'echo from-the-pod > /srv/pod.txt']);
    const images = join(dir, 'k-images');
    // A real runc checkpoint of the running container (it keeps running).
    await daemon.runtime.checkpoint(k.id, {
      imagesDir: images,
      workDir: join(dir, 'k-work'),
      leaveRunning: true,
    });
    const upper = (await daemon.runtime.state(k.id)).upperDir;
    const diff = join(dir, 'k-rootfs-diff.tar');
    await run('tar', ['--numeric-owner', '-cf', diff, '-C', upper, '.'], { timeoutMs: 60_000 });
    const cfgDigest = JSON.parse(await readFile(join(layout, 'index.json'), 'utf8')) as {
      manifests: { digest: string }[];
    };
    const manifest = JSON.parse(
      await readFile(join(layout, 'blobs', 'sha256', cfgDigest.manifests[0]!.digest.slice(7)), 'utf8'),
    ) as { config: { digest: string } };
    const imageId = manifest.config.digest.slice(7);
    const config = {
      id: 'a'.repeat(64),
      name: 'k8s_server_web_default_0',
      rootfsImage: 'localhost/busybox-py:latest',
      rootfsImageRef: imageId,
      rootfsImageName: 'localhost/busybox-py:latest',
      runtime: 'runc',
      createdTime: new Date().toISOString(),
      checkpointedTime: new Date().toISOString(),
    };
    const spec = {
      ociVersion: '1.0.2',
      process: { args: ['/usr/bin/python3', '-u', '/srv/server.py'], env: ['PATH=/usr/bin:/bin'], cwd: '/' },
      annotations: {
        'io.kubernetes.cri-o.ContainerName': 'server',
        'io.kubernetes.pod.name': 'web',
        'io.kubernetes.pod.namespace': 'default',
      },
    };
    const members: ArchiveMember[] = [
      { name: 'config.dump', data: Buffer.from(JSON.stringify(config)) },
      { name: 'spec.dump', data: Buffer.from(JSON.stringify(spec)) },
      { name: 'rootfs-diff.tar', file: diff },
      { name: 'deleted.files', data: Buffer.from('["/srv/data.txt"]') },
      ...(await readdir(images)).sort().map((f) => ({ name: `checkpoint/${f}`, file: join(images, f) })),
    ];
    const archive = join(dir, 'checkpoint-web_default-server-2026-12-02T16:40:00Z.tar');
    await writeArchive(archive, members, { compression: 'none', dirs: ['checkpoint'] });
    await rm(images, { recursive: true, force: true });

    const m = await client.importCheckpoint({ archive, ports: [8080] });
    assert.equal(m.state, 'hibernated');
    assert.equal(m.name, 'server', "the kubelet container's name");
    const r = await client.resume(m.id);
    assert.equal((await serveCounter(r)).join(' '), `${n + 1} ${token}`, 'the checkpointed memory');
    const files = await client.exec(m.id, [
      'sh',
      '-c',
      'cat /srv/pod.txt; test -e /srv/data.txt || echo gone',
    ]);
    assert.equal(files.stdout, 'from-the-pod\ngone\n');
    await client.remove(m.id);
    await client.remove(k.id);

    // The same archive naming an image dormant does not hold, without --image: a clear error.
    const before = await snapshot();
    const unknown = { ...config, rootfsImageRef: 'b'.repeat(64), rootfsImage: 'localhost/unknown:1' };
    members[0] = { name: 'config.dump', data: Buffer.from(JSON.stringify(unknown)) };
    const missing = join(dir, 'checkpoint-web_default-other-2026-12-02T16:41:00Z.tar');
    // The base image is looked for before the images are read: a stand-in pstree.img will do.
    members.splice(4, members.length - 4, { name: 'checkpoint/pstree.img', data: Buffer.alloc(0) });
    await writeArchive(missing, members, { compression: 'none', dirs: ['checkpoint'] });
    const e = await apiError(client.importCheckpoint({ archive: missing }));
    assert.equal(e.code, 'IMAGE_REQUIRED', e.message);
    assert.match(e.message, /localhost\/busybox-py:latest/, 'the message names the image');
    await nothingLeft(before);
  });

  test('hostile archives are refused with a clear error and leave nothing behind', async () => {
    const before = await snapshot();
    const outside = join(dir, 'escaped');
    const raw = async (name: string, entries: Buffer[]): Promise<string> => {
      const p = join(dir, name);
      await writeFile(p, Buffer.concat([...entries, TAR_END]));
      return p;
    };
    const file = (name: string, data: string): Buffer[] => {
      const b = Buffer.from(data);
      return [tarHeader({ name, size: b.length, type: 'file' }), b, tarPadding(b.length)];
    };
    const cases: [string, string][] = [
      [await raw('traversal.tar', file('../escaped', 'x')), 'climbs out'],
      [await raw('absolute.tar', file(outside, 'x')), 'absolute path'],
      [
        await raw('link.tar', [tarHeader({ name: 'checkpoint', size: 0, type: 'symlink', linkName: dir })]),
        'link',
      ],
    ];
    // A device node (typeflag 3), written by hand.
    const dev = tarHeader({ name: 'null', size: 0, type: 'file' });
    dev.write('3', 156, 'latin1');
    let sum = 0;
    dev.write('        ', 148, 'latin1');
    for (const x of dev) sum += x;
    dev.write(`${sum.toString(8).padStart(6, '0')}\0 `, 148, 'latin1');
    cases.push([await raw('device.tar', [dev]), 'chardev']);
    // Truncated: a real export cut in half.
    const cut = join(dir, 'truncated.tar.zst');
    await writeFile(cut, await readFile(exported));
    await truncate(cut, Math.floor((await readFile(exported)).length / 2));
    cases.push([cut, '']);
    // A rootfs-diff.tar that writes through a link it made itself.
    const diffDir = join(dir, 'evil-diff');
    await mkdir(diffDir);
    const evilDiff = await raw('evil-diff/rootfs-diff.tar', [
      tarHeader({ name: 'etc', size: 0, type: 'symlink', linkName: '/' }),
      ...file('etc/escaped', 'x'),
    ]);
    const ok = await readdir(join(dir, 'k-images')).catch(() => []);
    assert.deepEqual(ok, []);
    const members: ArchiveMember[] = [
      { name: 'config.dump', data: Buffer.from('{}') },
      {
        name: 'spec.dump',
        data: Buffer.from(JSON.stringify({ process: { args: ['/bin/sh'] }, annotations: {} })),
      },
      { name: 'rootfs-diff.tar', file: evilDiff },
    ];
    // Real images, so the import gets as far as the filesystem diff.
    const cks = await client.listCheckpoints();
    const real = join(dir, 'real-images');
    await daemon.vault.restoreCheckpoint({ tenant: cks[0]!.tenant, checkpointId: cks[0]!.id, destDir: real });
    for (const f of (await readdir(real)).sort())
      members.push({ name: `checkpoint/${f}`, file: join(real, f) });
    const evil = join(dir, 'evil-diff.tar');
    await writeArchive(evil, members, { compression: 'none', dirs: ['checkpoint'] });
    await rm(real, { recursive: true, force: true });
    cases.push([evil, 'through the link']);

    for (const [archive, why] of cases) {
      const e = await apiError(client.importCheckpoint({ archive, image: `${layout}:latest` }));
      assert.equal(e.code, 'CHECKPOINT_ARCHIVE_INVALID', `${archive}: ${e.code} ${e.message}`);
      assert.match(e.message, new RegExp(why), archive);
      assert.equal(existsSync(outside), false, 'nothing was written outside');
      assert.equal(existsSync('/escaped'), false);
      await nothingLeft(before);
    }
  });
  /** Every file under `root` as archive members (their paths relative to it), and its folders. */
  async function membersOf(root: string): Promise<{ members: ArchiveMember[]; dirs: string[] }> {
    const members: ArchiveMember[] = [];
    const dirs: string[] = [];
    const walk = async (rel: string): Promise<void> => {
      for (const n of (await readdir(join(root, rel))).sort()) {
        const r = rel === '' ? n : `${rel}/${n}`;
        if ((await stat(join(root, r))).isDirectory()) {
          dirs.push(r);
          await walk(r);
        } else members.push({ name: r, file: join(root, r) });
      }
    };
    await walk('');
    return { members, dirs };
  }

  test('a podman export edited to hold every capability and no no_new_privs is refused for a tenant; the untouched one imports and resumes', async () => {
    const minted = await client.createToken({ tenant: 'default' });
    const tenant = new DormantClient({ url: daemon.url, token: minted.token });
    const s = await create('tamper-source');
    const [n, token] = await serveCounter(s);
    const h = await client.hibernate(s.id);
    assert.ok(h.checkpointId);
    const plain = join(dir, 'plain.tar');
    const r = await client.exportCheckpoint(h.checkpointId, { allowPlaintext: true, compression: 'none' });
    await pipeline(
      Readable.fromWeb(r.body as Parameters<typeof Readable.fromWeb>[0]),
      createWriteStream(plain, { flags: 'wx' }),
    );
    // Unpacked, core-1.img edited as the attacker did, packed again.
    const tree = join(dir, 'tamper-tree');
    await mkdir(tree);
    await run('tar', ['-xf', plain, '-C', tree], { timeoutMs: 60_000 });
    const core = join(tree, 'checkpoint', 'core-1.img');
    await writeFile(core, allCapsNoNewPrivs(await readFile(core)));
    const tampered = join(dir, 'tampered.tar');
    const { members, dirs } = await membersOf(tree);
    await writeArchive(tampered, members, { compression: 'none', dirs });
    await rm(tree, { recursive: true, force: true });

    const before = await snapshot();
    const e = await apiError(tenant.uploadCheckpoint(await readFile(tampered), { fileName: 'tampered.tar' }));
    assert.equal(e.code, 'CHECKPOINT_OUTSIDE_PROFILE', e.message);
    assert.equal(e.status, 422);
    assert.match(e.message, /pid 1 thread 1: capabilities [A-Z_, ]*CAP_SYS_ADMIN[A-Z_, ]* in the effective/);
    // no_new_privs clear is podman's default: the import sets it (checkpoint/narrow.ts), and
    // refuses for what it cannot take away, the capabilities.
    assert.doesNotMatch(e.message, /no_new_privs/);
    assert.doesNotMatch(e.message, /\/tmp\//, 'no host path in what a tenant sees');
    await nothingLeft(before);

    // The same export, untouched, imports for the tenant.
    const ok = await tenant.uploadCheckpoint(await readFile(plain), { fileName: 'plain.tar' });
    assert.equal(ok.state, 'hibernated');

    // An imported checkpoint is checked again before it is restored (one imported before the
    // check existed): the same edit made to a copy of it in the vault is refused at resume,
    // the sandbox stays hibernated, nothing of the attempt is left running.
    const good = (await daemon.store.getCheckpoint((await daemon.controller.get(ok.id)).checkpointId!))!;
    const copy = join(dir, 'vault-copy');
    await daemon.vault.restoreCheckpoint({ tenant: good.tenant, checkpointId: good.id, destDir: copy });
    await writeFile(join(copy, 'core-1.img'), allCapsNoNewPrivs(await readFile(join(copy, 'core-1.img'))));
    const badId = `${good.id}-edited`;
    const put = await daemon.vault.putCheckpoint({
      tenant: good.tenant,
      sandboxId: ok.id,
      checkpointId: badId,
      srcDir: copy,
      meta: Object.fromEntries(Object.entries(good.meta).map(([k, v]) => [k, String(v)])),
    });
    await rm(copy, { recursive: true, force: true });
    await daemon.store.insertCheckpoint({ ...good, id: badId, ...put });
    // What a hibernated sandbox keeps on the host (its network, its log collector).
    const kept = leftovers(ok.id)
      .map((l) => l.replace(/^process \d+: /, 'process: '))
      .sort();
    const atResume = await daemon.controller.resume(ok.id, 'default', 'test', { from: badId }).then(
      () => undefined,
      (x: unknown) => x,
    );
    assert.ok(isDormantError(atResume, 'CHECKPOINT_OUTSIDE_PROFILE'), String(atResume));
    assert.match(atResume.message, /CAP_SYS_ADMIN/);
    assert.equal((await daemon.controller.get(ok.id)).state, 'hibernated');
    assert.deepEqual(
      leftovers(ok.id)
        .map((l) => l.replace(/^process \d+: /, 'process: '))
        .sort(),
      kept,
      'nothing more of it runs or is mounted than before',
    );

    // And it resumes from its own checkpoint, with its memory.
    const resumed = await tenant.resume(ok.id);
    assert.equal((await serveCounter(resumed)).join(' '), `${n + 1} ${token}`, 'the checkpointed memory');
    await client.remove(ok.id);
    await client.remove(s.id);
  });

  test('the export of a checkpoint holding a secret is refused, and allowed with encrypted (the client encrypts it)', async () => {
    const s = await client.createSandbox({
      name: 'secretive',
      image: `${layout}:latest`,
      command: ['/usr/bin/python3', '-u', '/srv/server.py'],
      env: { STRIPE_SECRET_KEY: ['sk', 'live', '4eC39HqLyjWDarjtT1zdp7dc'].join('_') },
      memory: '128M',
    });
    const h = await client.hibernate(s.id);
    assert.ok(h.checkpointId);
    await assert.rejects(client.exportCheckpoint(h.checkpointId), (e: unknown) => {
      assert.ok(e instanceof DormantApiError);
      assert.equal(e.code, 'CHECKPOINT_HAS_SECRETS');
      return true;
    });
    const r = await client.exportCheckpoint(h.checkpointId, { encrypted: true, compression: 'none' });
    assert.ok(r.secretsFound > 0, 'the findings are still reported');
    let n = 0;
    for await (const chunk of Readable.fromWeb(r.body as Parameters<typeof Readable.fromWeb>[0]))
      n += (chunk as Buffer).length;
    assert.ok(n > 0);
    await eventually('staging wiped', async () => {
      assert.deepEqual(await readdir(stagingDirFor(join(dir, 'data'))), [], 'staging wiped');
    });
    await client.remove(s.id);
  });
});
