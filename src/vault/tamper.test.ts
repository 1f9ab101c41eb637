import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { mkdir, open, readdir, writeFile, access } from 'node:fs/promises';
import { join } from 'node:path';
import { DormantError } from '../domain/errors.js';
import { openVault } from './index.js';
import { diffTrees, flipByte, removeDir, shmDir } from './testing/fixtures.js';

const MiB = 1024 * 1024;
let root: string;
let vaultDir: string;
let src: string;
const key = randomBytes(32);
const CK = 'ck-tamper';

async function files(kind: 'packs' | 'index' | 'manifests'): Promise<string[]> {
  const dir = join(vaultDir, 'data', 'acme', kind);
  return (await readdir(dir)).filter((n) => !n.includes('.tmp-')).map((n) => join(dir, n));
}

async function sizeOf(path: string): Promise<number> {
  const h = await open(path, 'r');
  try {
    return (await h.stat()).size;
  } finally {
    await h.close();
  }
}

/** Several positions spread over an object: first byte, header, a quarter, middle, last. */
function positions(size: number): number[] {
  return [
    ...new Set([
      0,
      9,
      20,
      Math.floor(size / 4),
      Math.floor(size / 2),
      Math.floor((size * 3) / 4),
      size - 20,
      size - 1,
    ]),
  ].filter((p) => p >= 0 && p < size);
}

before(async () => {
  root = await shmDir('tamper');
  vaultDir = join(root, 'vault');
  src = join(root, 'src');
  await mkdir(src);
  // Random (stored raw), compressible text (stored zstd), and zeros (holes).
  await writeFile(
    join(src, 'pages-1.img'),
    Buffer.concat([randomBytes(2 * MiB), Buffer.alloc(MiB), randomBytes(MiB)]),
  );
  await writeFile(join(src, 'core.img'), Buffer.from('core '.repeat(400_000)));
  const v = await openVault({ dir: vaultDir, masterKey: { key }, packTargetBytes: MiB });
  await v.putCheckpoint({ tenant: 'acme', sandboxId: 'sb', checkpointId: CK, srcDir: src });
  await v.close();
});
after(async () => {
  await removeDir(root);
});

/**
 * Verify and restore, each in a fresh vault (a new process would have no cache either); restore
 * both ways: decoding on worker threads (the default) and on the calling thread.
 */
async function expectDetected(label: string): Promise<void> {
  const v = await openVault({ dir: vaultDir, masterKey: { key } });
  try {
    const report = await v.verify();
    assert.equal(report.ok, false, `${label}: verify missed it`);
    assert.ok(
      report.problems.some((p) => p.checkpoints.includes(CK) || p.message.includes(CK)),
      `${label}: no problem names ${CK}: ${JSON.stringify(report.problems)}`,
    );
  } finally {
    await v.close();
  }
  for (const restoreWorkers of [undefined, 0]) {
    const how = `${label} (${restoreWorkers === 0 ? 'calling thread' : 'workers'})`;
    const r = await openVault({
      dir: vaultDir,
      masterKey: { key },
      ...(restoreWorkers === 0 ? { restoreWorkers } : {}),
    });
    try {
      const out = join(root, 'out');
      await assert.rejects(
        r.restoreCheckpoint({ tenant: 'acme', checkpointId: CK, destDir: out }),
        (e) => {
          assert.ok(e instanceof DormantError, `${how}: ${String(e)}`);
          assert.equal(e.code, 'VAULT_CORRUPT', `${how}: ${e.message}`);
          assert.ok(e.message.includes(CK), `${how}: message does not name the checkpoint: ${e.message}`);
          return true;
        },
        `${how}: restore returned bytes`,
      );
      // Nothing half-restored is left behind.
      await assert.rejects(access(out), `${how}: restore left ${out}`);
    } finally {
      await r.close();
    }
  }
}

async function expectClean(): Promise<void> {
  const v = await openVault({ dir: vaultDir, masterKey: { key } });
  try {
    const report = await v.verify();
    assert.deepEqual(report.problems, []);
    const out = join(root, 'clean-out');
    await v.restoreCheckpoint({ tenant: 'acme', checkpointId: CK, destDir: out });
    assert.equal(await diffTrees(src, out), undefined);
    await removeDir(out);
  } finally {
    await v.close();
  }
}

describe('a single flipped byte is detected by verify and by restore', () => {
  test('the untouched vault verifies and restores', async () => {
    assert.ok((await files('packs')).length >= 2, 'several packs');
    await expectClean();
  });

  for (const kind of ['packs', 'index', 'manifests'] as const) {
    test(`in ${kind}: at several positions of each object`, async () => {
      let flips = 0;
      for (const f of await files(kind)) {
        for (const pos of positions(await sizeOf(f))) {
          await flipByte(f, pos);
          try {
            await expectDetected(`${kind} ${f.slice(f.lastIndexOf('/') + 1)} byte ${pos}`);
          } finally {
            await flipByte(f, pos);
          }
          flips++;
        }
      }
      assert.ok(flips >= 8, `${flips} flips`);
      await expectClean();
    });
  }
});
