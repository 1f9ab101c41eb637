import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import { mkdir, mkdtemp, readFile, readdir, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { createHash } from 'node:crypto';
import { DormantError } from '../domain/errors.js';
import { parseImageRef, unpackImage } from './image.js';
import { run } from '../sys/exec.js';
import { buildBusyboxRootfs } from './testing/rootfs.js';
import { writeOciLayout } from './testing/oci-layout.js';

async function imageError(p: Promise<unknown>): Promise<DormantError> {
  try {
    await p;
  } catch (e) {
    assert.ok(e instanceof DormantError, String(e));
    return e;
  }
  assert.fail('expected IMAGE_INVALID');
}

describe('OCI image layouts', () => {
  let dir: string;
  let layout: string;
  let layerDigests: string[];

  before(async () => {
    dir = await mkdtemp(join(tmpdir(), 'dormant-image-'));
    const base = join(dir, 'base');
    await buildBusyboxRootfs(base);
    await writeFile(join(base, 'etc', 'removeme'), 'gone in layer 2\n');
    await mkdir(join(base, 'opt', 'dir'), { recursive: true });
    await writeFile(join(base, 'opt', 'dir', 'a'), 'a\n');
    await writeFile(join(base, 'opt', 'dir', 'b'), 'b\n');
    const top = join(dir, 'top');
    await mkdir(join(top, 'etc'), { recursive: true });
    await mkdir(join(top, 'opt', 'dir'), { recursive: true });
    await mkdir(join(top, 'srv'), { recursive: true });
    await writeFile(join(top, 'etc', '.wh.removeme'), '');
    await writeFile(join(top, 'opt', 'dir', '.wh..wh..opq'), '');
    await writeFile(join(top, 'opt', 'dir', 'c'), 'c\n');
    await writeFile(join(top, 'srv', 'hello.txt'), 'hello from layer 2\n');
    layout = join(dir, 'layout');
    ({ layerDigests } = await writeOciLayout(layout, {
      layers: [base, top],
      tag: 'v1',
      config: {
        config: {
          Env: ['GREETING=hi from image', 'PATH=/bin'],
          Cmd: ['sh', '-c', 'echo "$GREETING"; sleep 100000'],
          WorkingDir: '/srv',
        },
      },
    }));
  });

  after(async () => {
    await rm(dir, { recursive: true, force: true });
  });

  test('DIR:TAG references', () => {
    assert.deepEqual(parseImageRef('/srv/img:v1'), { layout: '/srv/img', tag: 'v1' });
    assert.deepEqual(parseImageRef('/srv/img'), { layout: '/srv/img' });
  });

  test('layers are applied in order, whiteouts and opaque folders included; the config gives the defaults', async () => {
    const img = await unpackImage(`${layout}:v1`, join(dir, 'cache'));
    assert.match(img.digest, /^sha256:[0-9a-f]{64}$/);
    assert.deepEqual(img.config, {
      command: ['sh', '-c', 'echo "$GREETING"; sleep 100000'],
      env: { GREETING: 'hi from image', PATH: '/bin' },
      workingDir: '/srv',
    });
    assert.equal(existsSync(join(img.rootfs, 'bin', 'busybox')), true);
    assert.equal(existsSync(join(img.rootfs, 'etc', 'removeme')), false, 'a whiteout removes the lower file');
    assert.deepEqual(
      (await readdir(join(img.rootfs, 'opt', 'dir'))).sort(),
      ['c'],
      'an opaque folder hides the lower contents',
    );
    assert.equal(await readFile(join(img.rootfs, 'srv', 'hello.txt'), 'utf8'), 'hello from layer 2\n');
    assert.equal(
      (await readdir(img.rootfs, { recursive: true })).some((p) => p.includes('.wh.')),
      false,
    );
    // A second call reuses the cache.
    const again = await unpackImage(layout, join(dir, 'cache'));
    assert.equal(again.rootfs, img.rootfs);
  });

  test('a layer with a member outside the root is refused and writes nothing outside', async () => {
    const tarPath = join(dir, 'evil.tar');
    // A hand-made tar whose member climbs out of the target folder.
    await run('python3', [
      '-c',
      `import tarfile, io
t = tarfile.open(${JSON.stringify(tarPath)}, "w")
data = b"pwned"
info = tarfile.TarInfo("../escaped-file")
info.size = len(data)
t.addfile(info, io.BytesIO(data))
t.close()`,
    ]);
    const layout2 = join(dir, 'layout-evil');
    await mkdir(join(layout2, 'blobs', 'sha256'), { recursive: true });
    const put = async (b: Buffer) => {
      const hex = createHash('sha256').update(b).digest('hex');
      await writeFile(join(layout2, 'blobs', 'sha256', hex), b);
      return { digest: `sha256:${hex}`, size: b.length };
    };
    const layer = await put(await readFile(tarPath));
    const config = await put(Buffer.from('{"config":{}}'));
    const manifest = await put(
      Buffer.from(
        JSON.stringify({
          schemaVersion: 2,
          config,
          layers: [{ mediaType: 'application/vnd.oci.image.layer.v1.tar', ...layer }],
        }),
      ),
    );
    await writeFile(join(layout2, 'index.json'), JSON.stringify({ schemaVersion: 2, manifests: [manifest] }));
    const e = await imageError(unpackImage(layout2, join(dir, 'cache3')));
    assert.match(e.message, /outside the root/);
    assert.equal(existsSync(join(dir, 'cache3', 'escaped-file')), false);
    assert.equal(existsSync(join(dir, 'escaped-file')), false);
  });

  test('a missing tag, a missing layout and a tampered layer are refused by name', async () => {
    let e = await imageError(unpackImage(`${layout}:v2`, join(dir, 'cache2')));
    assert.equal(e.code, 'IMAGE_INVALID');
    assert.match(e.message, /no image tagged "v2" \(tags: v1\)/);
    e = await imageError(unpackImage(join(dir, 'nope'), join(dir, 'cache2')));
    assert.match(e.message, /does not exist/);
    const blob = join(layout, 'blobs', 'sha256', layerDigests[1]!.slice(7));
    const data = await readFile(blob);
    data[100] = data[100]! ^ 0xff;
    await writeFile(blob, data);
    e = await imageError(unpackImage(layout, join(dir, 'cache2')));
    assert.match(e.message, new RegExp(`layer ${layerDigests[1]!} does not match`));
    assert.deepEqual(await readdir(join(dir, 'cache2')), [], 'nothing half-unpacked is left');
  });
});
