// Put and restore throughput of one checkpoint folder, local vault vs S3 vault on a private
// radosgw (src/vault/testing/rgw.ts). Build first (npx tsc), then, as root:
//   node scripts/s3-vault-throughput.mjs [MiB]      (default 256)
// Prints one JSON line per store. The S3 store runs without its pack cache (every read goes to
// the server) and with it (a resume on the node that hibernated).
import { randomBytes } from 'node:crypto';
import { mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { openVault } from '../dist/vault/index.js';
import { S3Store } from '../dist/vault/s3-store.js';
import { startRgw } from '../dist/vault/testing/rgw.js';

const MiB = 1024 * 1024;
const total = Number(process.argv[2] ?? 256) * MiB;
const root = await mkdtemp('/dev/shm/dormant-s3-figure-');
const src = join(root, 'src');
await mkdir(src);
// Half random (incompressible memory), half repetitive text (compressible), as CRIU page images.
const text = Buffer.from('the quick brown fox jumps over the lazy dog 0123456789\n'.repeat(80_000));
await writeFile(join(src, 'pages-1.img'), randomBytes(total / 2));
await writeFile(join(src, 'pages-2.img'), Buffer.concat([text, text, text]).subarray(0, total / 2));
const rgw = await startRgw();
const key = randomBytes(32);
const rows = [];
try {
  const s3 = (cache) => {
    const s = new S3Store({
      bucket: rgw.bucket,
      prefix: cache ? 'cached' : 'plain',
      endpoint: rgw.endpoint,
      credentials: { accessKeyId: rgw.accessKeyId, secretAccessKey: rgw.secretAccessKey },
      lockDir: join(root, 'locks'),
      ...(cache ? { cache: { dir: join(root, 'cache'), maxBytes: 2048 * MiB } } : {}),
    });
    return s;
  };
  for (const [name, make] of [
    ['local', async () => undefined],
    [
      's3',
      async () => {
        const s = s3(false);
        rows.push({ serverCheck: (await s.checkServer()).warnings });
        return s;
      },
    ],
    [
      's3+cache',
      async () => {
        const s = s3(true);
        await s.checkServer();
        return s;
      },
    ],
  ]) {
    const store = await make();
    const dir = join(root, `vault-${name}`);
    const v = await openVault({ dir, masterKey: { key }, ...(store ? { store } : {}) });
    let t = performance.now();
    await v.putCheckpoint({ tenant: 't', sandboxId: 'sb', checkpointId: 'ck', srcDir: src });
    const putMs = performance.now() - t;
    t = performance.now();
    await v.restoreCheckpoint({ tenant: 't', checkpointId: 'ck', destDir: join(root, `out-${name}`) });
    const restoreMs = performance.now() - t;
    await v.close();
    store?.destroy();
    await rm(join(root, `out-${name}`), { recursive: true, force: true });
    const mbs = (ms) => Math.round(total / 1e6 / (ms / 1000));
    rows.push({
      store: name,
      MiB: total / MiB,
      putMs: Math.round(putMs),
      putMBs: mbs(putMs),
      restoreMs: Math.round(restoreMs),
      restoreMBs: mbs(restoreMs),
    });
  }
} finally {
  await rgw.stop();
  await rm(root, { recursive: true, force: true });
}
for (const r of rows) process.stdout.write(`${JSON.stringify(r)}\n`);
