/**
 * `dormant checkpoint export --format oci`: a real CRIU dump becomes an OCI image layout whose
 * blobs verify, whose manifest carries CRI-O's checkpoint annotation, and whose one layer
 * unpacks to the podman archive layout (config.dump, spec.dump, checkpoint/ with the images).
 * The scan guard applies as for a podman export.
 */
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { mkdtemp, readFile, readdir, rm, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { unpackImage } from '../runtime/image.js';
import { CRIO_CHECKPOINT_NAME } from './oci.js';
import { dump, kill, shm, startPython } from './testing/fixtures.js';

const BIN = fileURLToPath(new URL('../../bin/dormant', import.meta.url));
const HOLDER = `
import sys, time
data = bytearray(b'x' * 100000)
open(sys.argv[1], 'w').write('ok')
time.sleep(3600)
`;

let dir: string;
let images: string;
let work: string;

function dormant(args: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    execFile(
      process.execPath,
      [BIN, ...args],
      { timeout: 120_000, env: { ...process.env, NO_COLOR: '1' } },
      (err, stdout, stderr) => {
        resolve({ code: err ? (typeof err.code === 'number' ? err.code : -1) : 0, stdout, stderr });
      },
    );
  });
}

before(async () => {
  dir = await shm('dormant-oci-test-');
  work = await mkdtemp('/tmp/dormant-oci-test-');
  const clean = await startPython(HOLDER, dir);
  const dirty = await startPython(HOLDER, dir, {
    STRIPE_SECRET_KEY: ['sk', 'live', '4eC39HqLyjWDarjtT1zdp7dc'].join('_'),
  });
  try {
    images = join(dir, 'images');
    await dump(clean, images);
    await dump(dirty, join(dir, 'dirty'));
  } finally {
    kill(clean);
    kill(dirty);
  }
});

after(async () => {
  await rm(dir, { recursive: true, force: true });
  await rm(work, { recursive: true, force: true });
});

test('export --format oci writes a verified OCI layout with the checkpoint annotation and the archive as its layer', async () => {
  const out = join(work, 'image');
  const r = await dormant([
    'checkpoint',
    'export',
    images,
    '--format',
    'oci',
    '--out',
    out,
    '--name',
    'counter',
    '--json',
  ]);
  assert.equal(r.code, 0, r.stderr);
  assert.equal((JSON.parse(r.stdout) as { format: string }).format, 'oci');
  const index = JSON.parse(await readFile(join(out, 'index.json'), 'utf8')) as {
    manifests: { digest: string; annotations: Record<string, string> }[];
  };
  assert.equal(index.manifests.length, 1);
  const manifest = JSON.parse(
    await readFile(join(out, 'blobs', 'sha256', index.manifests[0]!.digest.slice(7)), 'utf8'),
  ) as { annotations: Record<string, string>; layers: { mediaType: string }[] };
  assert.equal(manifest.annotations[CRIO_CHECKPOINT_NAME], 'counter');
  assert.equal(manifest.layers[0]!.mediaType, 'application/vnd.oci.image.layer.v1.tar');
  // dormant's own image reader verifies every digest and unpacks the layer.
  const img = await unpackImage(`${out}:latest`, join(work, 'cache'));
  const root = await readdir(img.rootfs);
  assert.ok(
    root.includes('config.dump') && root.includes('spec.dump') && root.includes('checkpoint'),
    root.join(' '),
  );
  assert.ok((await readdir(join(img.rootfs, 'checkpoint'))).includes('pstree.img'));
  // No plaintext archive is left beside it.
  assert.deepEqual(
    (await readdir(work)).filter((f) => f.endsWith('.tar')),
    [],
  );
});

test('export --format oci of a checkpoint holding secrets is refused, and writes nothing', async () => {
  const out = join(work, 'dirty-image');
  const r = await dormant(['checkpoint', 'export', join(dir, 'dirty'), '--format', 'oci', '--out', out]);
  assert.equal(r.code, 1, r.stdout);
  assert.match(r.stderr, /CHECKPOINT_HAS_SECRETS/);
  assert.match(r.stderr, /stripe_key/);
  await assert.rejects(stat(out), { code: 'ENOENT' });
  assert.deepEqual(
    (await readdir(work)).filter((f) => f.endsWith('.tar') || f.endsWith('.tmp')),
    [],
  );
});
