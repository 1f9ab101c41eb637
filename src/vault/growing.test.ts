/**
 * putCheckpoint({ growing }): the vault reads CRIU's page images while they are written (a
 * hibernate stores while it dumps). The stored checkpoint must be exactly what the folder
 * holds once the writer is done, whatever the timing; a writer that fails leaves nothing.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { mkdir, open, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { isDormantError } from '../domain/errors.js';
import { openVault, type Vault } from './index.js';
import { diffTrees, removeDir, shmDir } from './testing/fixtures.js';

const PAGE = 4096;
const MiB = 1024 * 1024;
let root: string;
let vault: Vault;

before(async () => {
  root = await shmDir('growing');
  vault = await openVault({ dir: join(root, 'data', 'vault'), masterKey: { key: randomBytes(32) } });
});
after(async () => {
  await vault.close();
  await removeDir(root);
});

const pause = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

/** Memory-like pages: random, zero runs, sparse pages, a page repeated (dedup within). */
function pagesContent(pages: number): Buffer {
  const out = Buffer.alloc(pages * PAGE);
  const repeated = randomBytes(PAGE);
  for (let p = 0; p < pages; p++) {
    const at = p * PAGE;
    switch (p % 7) {
      case 0:
      case 1:
        randomBytes(PAGE).copy(out, at);
        break;
      case 2:
        break; // zero
      case 3:
        randomBytes(64).copy(out, at + ((p * 64) % PAGE));
        break;
      default:
        repeated.copy(out, at);
    }
  }
  return out;
}

/**
 * Writes `dir` the way CRIU does: the folder appears after a while, the page image grows in
 * writes of odd sizes (cut mid-page) with pauses, small images come around and after it.
 */
async function writeLikeCriu(dir: string, images: Buffer[], failAfterBytes?: number): Promise<void> {
  await pause(15);
  await mkdir(dir, { recursive: true });
  await writeFile(join(dir, 'inventory.img'), randomBytes(300));
  // One process after another, as CRIU dumps them: pages-1.img is complete before pages-2.img.
  for (const [k, pages] of images.entries()) {
    const h = await open(join(dir, `pages-${String(k + 1)}.img`), 'w');
    try {
      let at = 0;
      let i = 0;
      while (at < pages.length) {
        const n = Math.min(pages.length - at, [PAGE * 3 + 17, 1000, MiB + 5, PAGE][i++ % 4]!);
        if (failAfterBytes !== undefined && at >= failAfterBytes) throw new Error('criu dump failed: Killed');
        await h.write(pages, at, n);
        at += n;
        if (i % 3 === 0) await pause(3);
      }
    } finally {
      await h.close();
    }
    await writeFile(join(dir, `pagemap-${String(k + 1)}.img`), randomBytes(2000));
    await pause(5);
  }
  await writeFile(join(dir, 'core-1.img'), randomBytes(900));
}

describe('putCheckpoint while the folder is written', () => {
  test('stores exactly what the writer wrote, with the same chunks as a put afterwards', async () => {
    const src = join(root, 'src-1');
    // A small first process (an init) and a big second one: the big one is followed too.
    const images = [pagesContent(150), pagesContent(3000)]; // ~0.6 and ~12 MiB
    const pagesBytes = images[0]!.length + images[1]!.length;
    let finished = false;
    const writing = writeLikeCriu(src, images).then(() => {
      finished = true;
    });
    let readEarly = 0;
    const put = await vault.putCheckpoint({
      tenant: 'acme',
      sandboxId: 'sb-1',
      checkpointId: 'ck-growing',
      srcDir: src,
      growing: writing,
      onProgress: (c) => {
        if (!finished) readEarly = c.logicalBytes;
      },
    });
    await writing;
    // The point of it: the page image was being stored before the writer was done. (How much
    // of it is a matter of speed, which the benchmarks measure: under a loaded CI machine it
    // went from most to under half, so only the overlap itself is asserted.)
    assert.ok(readEarly > 0, `read while written: ${String(readEarly)} of ${String(pagesBytes)} bytes`);
    assert.equal(put.logicalBytes, pagesBytes + 300 + 2 * 2000 + 900);
    const out = join(root, 'out-1');
    await vault.restoreCheckpoint({ tenant: 'acme', checkpointId: 'ck-growing', destDir: out });
    assert.equal(await diffTrees(src, out), undefined);

    // The same folder stored again at rest: every chunk is already there, so the cuts made
    // while it grew are the cuts content alone decides.
    const again = await vault.putCheckpoint({
      tenant: 'acme',
      sandboxId: 'sb-1',
      checkpointId: 'ck-at-rest',
      srcDir: src,
    });
    assert.equal(again.newBytes, 0);
    assert.equal(again.chunks, put.chunks);
    assert.equal(again.holeBytes, put.holeBytes);
    assert.ok(put.holeBytes >= 400 * PAGE, `zero pages became holes (${String(put.holeBytes)})`);
  });

  test('a writer that fails fails the put: nothing is committed, verify is clean, gc reclaims', async () => {
    const src = join(root, 'src-2');
    const writing = writeLikeCriu(src, [pagesContent(4000)], 6 * MiB);
    writing.catch(() => undefined);
    await assert.rejects(
      vault.putCheckpoint({
        tenant: 'acme',
        sandboxId: 'sb-2',
        checkpointId: 'ck-failed',
        srcDir: src,
        growing: writing,
      }),
      (e: unknown) => e instanceof Error && /criu dump failed: Killed/.test(e.message),
    );
    const listed = await vault.listCheckpoints({ tenant: 'acme' });
    assert.ok(!listed.some((c) => c.checkpointId === 'ck-failed'), 'no checkpoint from a failed dump');
    const report = await vault.verify();
    assert.equal(report.ok, true, JSON.stringify(report.problems));
    await vault.gc();
    assert.equal((await vault.verify()).ok, true);
    // The checkpoint id was never taken: a later put under it works.
    await vault.putCheckpoint({ tenant: 'acme', sandboxId: 'sb-2', checkpointId: 'ck-failed', srcDir: src });
  });

  test("a folder that never appears: the writer's error, not a missing-folder error", async () => {
    const writing = (async () => {
      await pause(20);
      throw new Error('runc checkpoint failed: container not running');
    })();
    writing.catch(() => undefined);
    await assert.rejects(
      vault.putCheckpoint({
        tenant: 'acme',
        sandboxId: 'sb-3',
        checkpointId: 'ck-none',
        srcDir: join(root, 'never'),
        growing: writing,
      }),
      (e: unknown) => !isDormantError(e) && /container not running/.test((e as Error).message),
    );
  });
});
