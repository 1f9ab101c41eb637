/**
 * `dormant checkpoint export --format oci`: a real CRIU dump becomes an OCI image layout whose
 * blobs verify, whose manifest carries CRI-O's and podman's checkpoint annotations, and whose one layer
 * unpacks to the podman archive layout (config.dump, spec.dump, checkpoint/ with the images).
 * The scan guard applies as for a podman export.
 */
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { generateKeyPairSync } from 'node:crypto';
import { mkdtemp, readFile, readdir, rm, stat, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { unpackImage } from '../runtime/image.js';
import { CRIO_CHECKPOINT_NAME, PODMAN_CHECKPOINT } from './oci.js';
import { decryptLayer } from './testing/decrypt.js';
import { dump, kill, shm, startPython } from './testing/fixtures.js';

const BIN = fileURLToPath(new URL('../../bin/dormant', import.meta.url));
const HOLDER = `
import sys, time
data = bytearray(b'x' * 100000)
open(sys.argv[1], 'w').write('ok')
time.sleep(3600)
`;

const SECRET = ['sk', 'live', '4eC39HqLyjWDarjtT1zdp7dc'].join('_');
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
  const dirty = await startPython(HOLDER, dir, { STRIPE_SECRET_KEY: SECRET });
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
  // podman restores from an image only when it names the runtime (config.dump's, runc).
  assert.equal(manifest.annotations[`${PODMAN_CHECKPOINT}.runtime.name`], 'runc');
  assert.equal(manifest.annotations[`${PODMAN_CHECKPOINT}.name`], 'counter');
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

async function filesUnder(d: string): Promise<string[]> {
  const out: string[] = [];
  for (const e of await readdir(d, { withFileTypes: true })) {
    const p = join(d, e.name);
    if (e.isDirectory()) out.push(...(await filesUnder(p)));
    else out.push(p);
  }
  return out;
}

test('export --format oci --encrypt of a checkpoint holding secrets writes an ocicrypt layer that only the recipients open', async () => {
  const keys = [
    generateKeyPairSync('rsa', { modulusLength: 2048 }),
    generateKeyPairSync('rsa', { modulusLength: 3072 }),
  ];
  const pubs = await Promise.all(
    keys.map(async (k, i) => {
      const p = join(work, `pub${i}.pem`);
      await writeFile(p, k.publicKey.export({ type: 'spki', format: 'pem' }));
      return p;
    }),
  );
  const out = join(work, 'enc-image');
  const args = [
    'checkpoint',
    'export',
    join(dir, 'dirty'),
    '--format',
    'oci',
    '--out',
    out,
    '--name',
    'dirty',
  ];
  // Without --encrypt: refused, as before.
  const plain = await dormant(args);
  assert.equal(plain.code, 1, plain.stdout);
  assert.match(plain.stderr, /CHECKPOINT_HAS_SECRETS/);
  const r = await dormant([
    ...args,
    '--encrypt',
    '--recipient',
    `jwe:${pubs[0]!}`,
    '--recipient',
    pubs[1]!,
    '--json',
  ]);
  assert.equal(r.code, 0, r.stderr);
  const res = JSON.parse(r.stdout) as { findings: number; encrypted: boolean };
  assert.ok(res.findings > 0, 'the findings are still reported');
  assert.equal(res.encrypted, true);
  // The secret's bytes are in no file of the layout, and no plaintext staging is left anywhere.
  const secret = Buffer.from(SECRET);
  for (const f of await filesUnder(out)) assert.equal((await readFile(f)).indexOf(secret), -1, f);
  assert.deepEqual(
    (await readdir(work)).filter((f) => f.endsWith('.tar') || f.endsWith('.tmp')),
    [],
  );
  assert.deepEqual(
    (await readdir('/dev/shm')).filter((f) => f.startsWith(`.dormant-export-`)),
    [],
  );

  const index = JSON.parse(await readFile(join(out, 'index.json'), 'utf8')) as {
    manifests: { digest: string }[];
  };
  const blob = (d: string): Promise<Buffer> => readFile(join(out, 'blobs', 'sha256', d.slice(7)));
  const manifest = JSON.parse((await blob(index.manifests[0]!.digest)).toString()) as {
    config: { digest: string };
    layers: { mediaType: string; digest: string; size: number; annotations: Record<string, string> }[];
  };
  const layer = manifest.layers[0]!;
  assert.equal(layer.mediaType, 'application/vnd.oci.image.layer.v1.tar+encrypted');
  const enc = await blob(layer.digest);
  assert.equal(enc.length, layer.size);
  const config = JSON.parse((await blob(manifest.config.digest)).toString()) as {
    rootfs: { diff_ids: string[] };
  };
  // Each recipient's private key gives back the plain layer: the podman archive with the secret in it.
  for (const k of keys) {
    const d = decryptLayer(enc, layer.annotations, k.privateKey);
    assert.equal(d.priv.digest, config.rootfs.diff_ids[0]);
    assert.ok(d.plain.indexOf(secret) >= 0, 'the decrypted layer is the checkpoint memory');
    assert.ok(d.plain.indexOf(Buffer.from('checkpoint/pstree.img')) >= 0);
  }
  // A stranger's key opens nothing; one flipped byte fails the HMAC.
  assert.throws(
    () =>
      decryptLayer(enc, layer.annotations, generateKeyPairSync('rsa', { modulusLength: 2048 }).privateKey),
    /no JWE recipient/,
  );
  const flipped = Buffer.from(enc);
  flipped[flipped.length >> 1]! ^= 1;
  assert.throws(() => decryptLayer(flipped, layer.annotations, keys[0]!.privateKey), /HMAC mismatch/);
});

test('export --encrypt refuses bad recipients and the podman format, clearly and before writing', async () => {
  const out = join(work, 'bad-enc');
  const base = ['checkpoint', 'export', images, '--format', 'oci', '--out', out];
  const notKey = join(work, 'not-a-key.pem');
  await writeFile(notKey, 'hello\n');
  const ec = join(work, 'ec.pem');
  await writeFile(
    ec,
    generateKeyPairSync('ec', { namedCurve: 'P-256' }).publicKey.export({ type: 'spki', format: 'pem' }),
  );
  const cases: [string[], RegExp][] = [
    [[...base, '--encrypt'], /--encrypt needs at least one --recipient/],
    [[...base, '--encrypt', '--recipient', `jwe:${join(work, 'missing.pem')}`], /cannot read .*missing\.pem/],
    [[...base, '--encrypt', '--recipient', `jwe:${notKey}`], /not-a-key\.pem is not a PEM public key/],
    [[...base, '--encrypt', '--recipient', `pgp:${notKey}`], /only jwe:PUBKEY\.pem is supported/],
    [[...base, '--encrypt', '--recipient', ec], /ec key; an RSA public key/],
    [
      ['checkpoint', 'export', images, '--out', join(work, 'x.tar'), '--encrypt', '--recipient', notKey],
      /--encrypt needs --format oci/,
    ],
  ];
  for (const [args, re] of cases) {
    const r = await dormant(args);
    assert.equal(r.code, 2, `${args.join(' ')}: ${r.stderr}`);
    assert.match(r.stderr, re);
  }
  await assert.rejects(stat(out), { code: 'ENOENT' });
});
