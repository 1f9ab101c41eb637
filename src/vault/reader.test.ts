/**
 * openCheckpoint: random reads of a stored checkpoint's files, as lazy resume makes them
 * (a page here, 4 MiB there, out of order). Every read equals the stored bytes, across chunk,
 * record and hole edges; a damaged record throws VAULT_CORRUPT naming the checkpoint and
 * returns nothing; an open reader keeps gc waiting (it may move chunks) and close lets it go.
 */
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes, randomInt } from 'node:crypto';
import { mkdir, readdir, stat, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { DormantError, ErrorCode } from '../domain/errors.js';
import { openVault, type Vault } from './index.js';
import { flipByte, removeDir, shmDir } from './testing/fixtures.js';

let root: string;
let vault: Vault;
const MiB = 1024 * 1024;
/** A pages image: random pages, runs of zero pages (holes in the vault), text that compresses. */
const pages = Buffer.concat([
  randomBytes(3 * MiB + 4096 * 7),
  Buffer.alloc(2 * MiB),
  Buffer.from('heap object '.repeat(200_000)),
  randomBytes(MiB),
  Buffer.alloc(4096 * 3),
]);
const small = Buffer.from('core image\n');
const masterKey = randomBytes(32);

before(async () => {
  root = await shmDir('reader');
  vault = await openVault({
    dir: join(root, 'vault'),
    masterKey: { key: masterKey },
    lockTimeoutMs: 2000,
  });
  const src = join(root, 'src');
  await mkdir(join(src, 'sub'), { recursive: true });
  await writeFile(join(src, 'pages-1.img'), pages);
  await writeFile(join(src, 'sub', 'core-1.img'), small);
  await writeFile(join(src, 'empty.img'), '');
  await vault.putCheckpoint({ tenant: 't', sandboxId: 'sb', checkpointId: 'ck', srcDir: src });
});

after(async () => {
  await vault.close();
  await removeDir(root);
});

for (const workers of [true, false])
  test(`random reads equal the stored bytes across chunk, record and hole edges (read-ahead ${workers ? 'on a decode worker' : 'on the calling thread'})`, async () => {
    const v = workers
      ? vault
      : await openVault({ dir: join(root, 'vault'), masterKey: { key: masterKey }, restoreWorkers: 0 });
    const r = await v.openCheckpoint({ tenant: 't', checkpointId: 'ck' });
    try {
      assert.equal(r.size('pages-1.img'), pages.length);
      assert.deepEqual(
        r.list().map((f) => [f.path, f.type, f.sizeBytes]),
        [
          ['empty.img', 'file', 0],
          ['pages-1.img', 'file', pages.length],
          ['sub', 'dir', 0],
          ['sub/core-1.img', 'file', small.length],
        ].sort(),
      );
      assert.ok((await r.read('sub/core-1.img', 0, small.length)).equals(small));
      assert.equal((await r.read('empty.img', 0, 0)).length, 0);
      // Whole, in 4 MiB steps (the daemon's background reads), then 500 random ranges, pipelined.
      const whole = Buffer.alloc(pages.length);
      for (let at = 0; at < pages.length; at += 4 * MiB)
        await r.read('pages-1.img', at, Math.min(4 * MiB, pages.length - at), whole, at);
      assert.ok(whole.equals(pages), 'read through in order');
      const ranges = Array.from({ length: 500 }, () => {
        const off = randomInt(pages.length);
        return [off, randomInt(Math.min(pages.length - off, 300_000) + 1)] as const;
      });
      // Every other one without read-ahead (as the eager pages of a lazy resume are read): the
      // records then decode on this thread, into spare buffers reused as the cache turns over.
      const got = await Promise.all(
        ranges.map(([off, len], i) =>
          r.read('pages-1.img', off, len, undefined, 0, { readAhead: i % 2 === 0 }),
        ),
      );
      for (const [i, [off, len]] of ranges.entries())
        assert.ok(got[i]!.equals(pages.subarray(off, off + len)), `range ${String(off)}+${String(len)}`);
      // The last byte, one page across the zero run's start.
      const z = 3 * MiB + 4096 * 7;
      assert.ok((await r.read('pages-1.img', pages.length - 1, 1)).equals(pages.subarray(-1)));
      assert.ok((await r.read('pages-1.img', z - 2048, 4096)).equals(pages.subarray(z - 2048, z + 2048)));
    } finally {
      await r.close();
      if (v !== vault) await v.close();
    }
  });

test('reads outside a file, of a missing file, or after close are refused by name', async () => {
  const r = await vault.openCheckpoint({ tenant: 't', checkpointId: 'ck' });
  await assert.rejects(r.read('pages-1.img', pages.length - 10, 11), /outside pages-1\.img of checkpoint ck/);
  await assert.rejects(r.read('pages-1.img', -1, 1), /outside/);
  await assert.rejects(r.read('pages-2.img', 0, 1), /checkpoint ck has no file pages-2\.img/);
  await assert.rejects(r.read('sub', 0, 0), /has no file sub/);
  await r.close();
  await assert.rejects(r.read('sub/core-1.img', 0, 1), /closed/);
  await assert.rejects(vault.openCheckpoint({ tenant: 't', checkpointId: 'nope' }), (e: unknown) => {
    return e instanceof DormantError && e.code === ErrorCode.CHECKPOINT_NOT_FOUND;
  });
});

test('an open reader keeps gc waiting; once closed gc runs', async () => {
  const r = await vault.openCheckpoint({ tenant: 't', checkpointId: 'ck' });
  let gcDone = false;
  const gc = vault.gc().then(() => (gcDone = true));
  await new Promise((res) => setTimeout(res, 300));
  assert.equal(gcDone, false, 'gc waits for the reader');
  assert.ok((await r.read('pages-1.img', MiB, 4096)).equals(pages.subarray(MiB, MiB + 4096)));
  await r.close();
  await gc;
  assert.equal(gcDone, true);
});

test('a flipped byte in a pack: the read that needs it throws VAULT_CORRUPT naming the checkpoint, others still read', async () => {
  const packs = join(root, 'vault', 'data', 't', 'packs');
  let pack = '';
  let size = 0;
  for (const f of await readdir(packs)) {
    const n = (await stat(join(packs, f))).size;
    if (n > size) [pack, size] = [join(packs, f), n];
  }
  const at = 1024;
  await flipByte(pack, at, 1);
  const r = await vault.openCheckpoint({ tenant: 't', checkpointId: 'ck' });
  try {
    // Page by page: the pages of the damaged record fail, every other page reads right.
    let bad = 0;
    for (let off = 0; off < pages.length; off += 64 * 1024) {
      const len = Math.min(64 * 1024, pages.length - off);
      const out = Buffer.alloc(len, 0xee);
      const ok = await r.read('pages-1.img', off, len, out).then(
        () => true,
        (e: unknown) => {
          assert.ok(e instanceof DormantError && e.code === ErrorCode.VAULT_CORRUPT, String(e));
          assert.match(e.message, /checkpoint ck: chunk [0-9a-f]+ in pack [0-9a-f]+ fails authentication/);
          return false;
        },
      );
      if (ok) assert.ok(out.equals(pages.subarray(off, off + len)), `range at ${String(off)}`);
      else {
        bad++;
        assert.ok(out.equals(Buffer.alloc(len, 0xee)), 'not a byte of a damaged read returned');
      }
    }
    assert.ok(bad > 0, 'the damage was found');
    // A record holds at most 256 KiB of plaintext.
    assert.ok(bad <= 5, `only the damaged record's pages fail (${String(bad)} of 64 KiB)`);
  } finally {
    await r.close();
    await flipByte(pack, at, 1);
  }
});
