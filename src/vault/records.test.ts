/**
 * Records that hold several chunks (consecutive new chunks of one ingest, sealed together up to
 * RECORD_MAX_RAW_BYTES): tampering with one chunk inside such a record, gc of a record whose
 * chunks are partly dead, and a fork that needs only a chunk from the middle of a record. Each
 * test first reads the pack indexes (with keys derived the way the vault derives them) to show
 * that the case really involves a record of several chunks.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { access, mkdir, open as openFile, readdir, readFile, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { DormantError } from '../domain/errors.js';
import {
  NONCE_BYTES,
  chunkId,
  deriveKey,
  deriveTenantKeys,
  open as openSealed,
  wipeTenantKeys,
  type TenantKeys,
} from './crypto.js';
import {
  CODEC_RAW,
  REF_BYTES,
  REF_HOLE,
  decodeIndex,
  decodeManifestBody,
  decodeManifestHeader,
  type IndexEntry,
} from './format.js';
import {
  loadWrappedKey,
  sandboxKeyName,
  sandboxTombstoneName,
  tenantKeyName,
  tenantTombstoneName,
} from './keys.js';
import { LocalDirStore, openVault, type Vault, type VaultOptions } from './index.js';
import { diffTrees, flipByte, removeDir, shmDir } from './testing/fixtures.js';

const MiB = 1024 * 1024;
const TENANT = 'acme';
const key = randomBytes(32);
let root: string;

before(async () => {
  root = await shmDir('records');
});
after(async () => {
  await removeDir(root);
});

async function withVault<T>(
  dir: string,
  fn: (v: Vault) => Promise<T>,
  opts: Partial<VaultOptions> = {},
): Promise<T> {
  const v = await openVault({ dir, masterKey: { key }, ...opts });
  try {
    return await fn(v);
  } finally {
    await v.close();
  }
}

/** The tenant's keys, unwrapped from the store the way the vault does it. */
interface Tenant {
  dir: string;
  store: LocalDirStore;
  keys: TenantKeys;
}

async function tenantOf(dir: string): Promise<Tenant> {
  const store = new LocalDirStore(dir);
  const wrap = deriveKey(key, 'tenant-key-wrap');
  const tk = await loadWrappedKey(store, {
    name: tenantKeyName(TENANT),
    tombstone: tenantTombstoneName(TENANT),
    wrapKey: wrap,
    label: `tenant ${TENANT}`,
    create: false,
    destroyedCode: 'TENANT_KEY_DESTROYED',
  });
  wrap.fill(0);
  assert.ok(tk, 'the tenant key exists');
  const keys = deriveTenantKeys(tk);
  tk.fill(0);
  return { dir, store, keys };
}

/** One sealed record of a pack, with the index entries of its chunks in order. */
interface Rec {
  pack: string;
  offset: number;
  storedBytes: number;
  chunks: IndexEntry[];
}

const hex = (b: Uint8Array): string => Buffer.from(b).toString('hex');

/** Every record of every pack, read from the (decrypted) pack indexes. */
async function readRecords(t: Tenant): Promise<Rec[]> {
  const out: Rec[] = [];
  for (const e of await t.store.list(`data/${TENANT}/index`)) {
    const base = e.name.slice(e.name.lastIndexOf('/') + 1);
    if (!base.endsWith('.idx') || base.includes('.tmp-')) continue;
    const pack = base.slice(0, -'.idx'.length);
    const entries = decodeIndex(t.keys.indexKey, TENANT, pack, await t.store.read(e.name));
    assert.ok(entries, `index ${pack} decodes`);
    for (const x of entries) {
      const last = out[out.length - 1];
      if (last?.pack === pack && last.offset === x.offset) last.chunks.push(x);
      else out.push({ pack, offset: x.offset, storedBytes: x.storedBytes, chunks: [x] });
    }
  }
  return out;
}

function packPath(t: Tenant, pack: string): string {
  return join(t.dir, 'data', TENANT, 'packs', `${pack}.pack`);
}

/** The record's sealed bytes as they lie in its pack. */
async function sealedBytes(t: Tenant, rec: Rec): Promise<Buffer> {
  const h = await openFile(packPath(t, rec.pack), 'r');
  try {
    const b = Buffer.alloc(rec.storedBytes);
    const { bytesRead } = await h.read(b, 0, b.length, rec.offset);
    assert.equal(bytesRead, b.length, 'the record lies inside its pack');
    return b;
  } finally {
    await h.close();
  }
}

/**
 * Whether the record is stored uncompressed (codec raw). Then its chunks' plaintext lies at
 * `1 + inner` in the record's plaintext, and (AES-GCM being a stream cipher) chunk byte `j` is
 * sealed at `NONCE_BYTES + 1 + inner + j` of the record. Asserts that the record opens with
 * its chunks' ids as associated data, and that every chunk's bytes there match its id.
 */
async function isRawRecord(t: Tenant, rec: Rec): Promise<boolean> {
  const aad = Buffer.concat(rec.chunks.map((x) => x.id));
  const plain = openSealed(t.keys.dataKey, aad, await sealedBytes(t, rec));
  assert.ok(plain, `record at ${rec.offset} of pack ${rec.pack} opens`);
  try {
    if (plain[0] !== CODEC_RAW) return false;
    for (const x of rec.chunks) {
      const bytes = plain.subarray(1 + x.inner, 1 + x.inner + x.rawBytes);
      assert.ok(chunkId(t.keys.idKeyObject, bytes).equals(x.id), 'chunk bytes sit at 1 + inner');
    }
    return true;
  } finally {
    plain.fill(0);
  }
}

/** Where chunk `x` of record `rec` starts in its pack file (raw records only). */
function cipherAt(rec: Rec, x: IndexEntry): number {
  return rec.offset + NONCE_BYTES + 1 + x.inner;
}

/** Asserts that chunk `x` of `rec` sits strictly inside a record of at least three chunks. */
function assertMiddleChunk(rec: Rec, x: IndexEntry): void {
  const g = x.loc.group;
  assert.ok(g !== undefined && g.chunks >= 3, `a record of ${g?.chunks ?? 1} chunk(s)`);
  assert.equal(g.chunks, rec.chunks.length);
  assert.ok(x.inner > 0, 'not the record first chunk');
  assert.ok(x.inner + x.rawBytes < g.rawBytes, 'not the record last chunk');
}

interface Ref {
  id: string;
  length: number;
  hole: boolean;
}

/** A checkpoint's files and their chunk references, from its (decrypted) manifest. */
async function manifestFiles(t: Tenant, checkpointId: string): Promise<Map<string, Ref[]>> {
  const name = `data/${TENANT}/manifests/${checkpointId}.mf`;
  const blob = await t.store.read(name);
  const { header, headerBytes } = decodeManifestHeader(name, blob);
  const sk = await loadWrappedKey(t.store, {
    name: sandboxKeyName(TENANT, header.sandboxId),
    tombstone: sandboxTombstoneName(TENANT, header.sandboxId),
    wrapKey: t.keys.wrapKey,
    label: `sandbox ${header.sandboxId}`,
    create: false,
    destroyedCode: 'SANDBOX_KEY_DESTROYED',
  });
  assert.ok(sk, 'the sandbox key exists');
  const mk = deriveKey(sk, 'manifest');
  sk.fill(0);
  const body = decodeManifestBody(mk, blob, headerBytes);
  mk.fill(0);
  assert.ok(body, `manifest ${checkpointId} opens`);
  const out = new Map<string, Ref[]>();
  for (const e of body.entries) {
    if (e.type !== 'file') continue;
    const refs: Ref[] = [];
    for (let i = e.firstRef; i < e.firstRef + e.refCount; i++) {
      const at = i * REF_BYTES;
      refs.push({
        id: hex(body.refs.subarray(at + 5, at + 5 + 16)),
        length: body.refs.readUInt32LE(at + 1),
        hole: body.refs[at] === REF_HOLE,
      });
    }
    out.set(e.path, refs);
  }
  return out;
}

/** Each chunk's offset in the file `refs` describe (the first, if it appears twice). */
function fileOffsets(refs: readonly Ref[]): Map<string, number> {
  const out = new Map<string, number>();
  let at = 0;
  for (const r of refs) {
    if (!r.hole && !out.has(r.id)) out.set(r.id, at);
    at += r.length;
  }
  return out;
}

/** The records holding the chunks of `refs`, in file order. */
function recordsInFileOrder(recs: readonly Rec[], refs: readonly Ref[]): Rec[] {
  const of = new Map<string, Rec>();
  for (const r of recs) for (const x of r.chunks) of.set(hex(x.id), r);
  const out: Rec[] = [];
  for (const r of refs) {
    if (r.hole) continue;
    const rec = of.get(r.id);
    assert.ok(rec, `chunk ${r.id} is indexed`);
    if (!out.includes(rec)) out.push(rec);
  }
  return out;
}

/** The raw bytes of every file under `dir`. */
async function rawFiles(dir: string): Promise<{ path: string; bytes: Buffer }[]> {
  const out: { path: string; bytes: Buffer }[] = [];
  for (const e of await readdir(dir, { recursive: true, withFileTypes: true })) {
    if (!e.isFile()) continue;
    const p = join(e.parentPath, e.name);
    out.push({ path: p, bytes: await readFile(p) });
  }
  return out;
}

describe('records of several chunks', () => {
  test('a flipped byte in the middle chunk of a record: verify names the checkpoint, restore fails and leaves nothing', async () => {
    const CK = 'ck-tamper';
    const dir = join(root, 'tamper-vault');
    const src = join(root, 'tamper-src');
    await mkdir(src);
    // Random data is stored raw, so each chunk's ciphertext is a known range of its record.
    // core.img sorts first: a restore writes it before it reaches the damaged record.
    await writeFile(join(src, 'core.img'), Buffer.from('core '.repeat(100_000)));
    await writeFile(join(src, 'pages-1.img'), randomBytes(3 * MiB));
    await withVault(
      dir,
      (v) => v.putCheckpoint({ tenant: TENANT, sandboxId: 'sb', checkpointId: CK, srcDir: src }),
      { packTargetBytes: MiB },
    );
    const t = await tenantOf(dir);
    let found: Rec | undefined;
    try {
      for (const r of await readRecords(t)) {
        if (r.chunks.length >= 3 && (await isRawRecord(t, r))) {
          found = r;
          break;
        }
      }
    } finally {
      wipeTenantKeys(t.keys);
    }
    assert.ok(found, 'a raw record of at least three chunks');
    const rec = found;
    const middle = rec.chunks[Math.floor(rec.chunks.length / 2)]!;
    assertMiddleChunk(rec, middle);
    process.stderr.write(
      `# flipping chunk ${rec.chunks.indexOf(middle) + 1} of ${rec.chunks.length} of a ${rec.storedBytes}-byte record\n`,
    );
    const path = packPath(t, rec.pack);
    const pos = cipherAt(rec, middle) + Math.floor(middle.rawBytes / 2);
    assert.ok(pos > cipherAt(rec, rec.chunks[0]!) + rec.chunks[0]!.rawBytes, 'past the first chunk');
    assert.ok(pos < rec.offset + rec.storedBytes - 16 - rec.chunks.at(-1)!.rawBytes, 'before the last chunk');

    const restoreOk = async (label: string): Promise<void> => {
      await withVault(dir, async (v) => {
        assert.deepEqual((await v.verify()).problems, [], `${label}: verify`);
        const out = join(root, `tamper-ok-${label}`);
        await v.restoreCheckpoint({ tenant: TENANT, checkpointId: CK, destDir: out });
        assert.equal(await diffTrees(src, out), undefined, `${label}: restore`);
        await removeDir(out);
      });
    };
    await restoreOk('before');

    await flipByte(path, pos);
    try {
      await withVault(dir, async (v) => {
        const report = await v.verify();
        assert.equal(report.ok, false, 'verify missed the flipped byte');
        assert.ok(
          report.problems.some((p) => p.object === `pack ${rec.pack}` && p.checkpoints.includes(CK)),
          `no problem names pack ${rec.pack} and ${CK}: ${JSON.stringify(report.problems)}`,
        );
      });
      for (const restoreWorkers of [undefined, 0]) {
        for (const precreated of [false, true]) {
          const how = `${restoreWorkers === 0 ? 'calling thread' : 'workers'}, ${precreated ? 'empty' : 'missing'} destination`;
          const out = join(root, `tamper-out-${restoreWorkers ?? 'w'}-${precreated}`);
          if (precreated) await mkdir(out);
          await withVault(
            dir,
            async (v) => {
              await assert.rejects(
                v.restoreCheckpoint({ tenant: TENANT, checkpointId: CK, destDir: out }),
                (e) => {
                  assert.ok(e instanceof DormantError, `${how}: ${String(e)}`);
                  assert.equal(e.code, 'VAULT_CORRUPT', `${how}: ${e.message}`);
                  assert.ok(e.message.includes(CK), `${how}: message does not name ${CK}: ${e.message}`);
                  return true;
                },
                `${how}: restore returned bytes`,
              );
            },
            restoreWorkers === 0 ? { restoreWorkers } : {},
          );
          // Nothing restored is left: not the damaged file, not core.img written before it.
          if (precreated) assert.deepEqual(await readdir(out), [], `${how}: restore left files`);
          else await assert.rejects(access(out), `${how}: restore left ${out}`);
          await removeDir(out);
        }
      }
    } finally {
      await flipByte(path, pos);
    }
    // The flip was the only damage: undone, everything is whole again.
    await restoreOk('after');
  });

  test('gc after a delete re-seals the live chunks of a half-dead record, and the dead chunks leave the disk', async () => {
    const dir = join(root, 'gc-vault');
    const srcA = join(root, 'gc-a');
    const srcB = join(root, 'gc-b');
    await mkdir(srcA);
    await mkdir(srcB);
    const dataA = randomBytes(4 * MiB);
    await writeFile(join(srcA, 'pages-1.img'), dataA);
    const small = { packTargetBytes: MiB };
    await withVault(
      dir,
      (v) => v.putCheckpoint({ tenant: TENANT, sandboxId: 'sb-a', checkpointId: 'A', srcDir: srcA }),
      small,
    );
    const t = await tenantOf(dir);
    try {
      const refsA = (await manifestFiles(t, 'A')).get('pages-1.img')!;
      const at = fileOffsets(refsA);
      const ordered = recordsInFileOrder(await readRecords(t), refsA);
      const packs = [...new Set(ordered.map((r) => r.pack))];
      assert.ok(packs.length >= 3, `A spans ${packs.length} packs`);
      // A record of several chunks, not the first of its pack, in a pack between A's first and
      // last: the fork keeps what comes before its second chunk.
      const firstOf = (pack: string): Rec => ordered.find((r) => r.pack === pack)!;
      const split = ordered.find(
        (r) =>
          r.chunks.length >= 3 && r.pack !== packs[0] && r.pack !== packs.at(-1) && firstOf(r.pack) !== r,
      );
      assert.ok(split, 'a record of several chunks in the middle of a middle pack');
      assert.ok(await isRawRecord(t, split), 'random data is stored raw');
      const kept = firstOf(split.pack);
      const cut = at.get(hex(split.chunks[1]!.id))! + Math.floor(split.chunks[1]!.rawBytes / 2);
      const dataB = Buffer.concat([dataA.subarray(0, cut), randomBytes(dataA.length - cut)]);
      await writeFile(join(srcB, 'pages-1.img'), dataB);
      const before = await withVault(
        dir,
        async (v) => {
          await v.putCheckpoint({ tenant: TENANT, sandboxId: 'sb-b', checkpointId: 'B', srcDir: srcB });
          return (await v.stats()).total.storedBytes;
        },
        small,
      );
      const usedByB = new Set(
        [...(await manifestFiles(t, 'B')).values()].flat().flatMap((r) => (r.hole ? [] : [r.id])),
      );
      // The situation: the split record holds a chunk B uses and chunks B does not; the record
      // before it in the same pack is all B's; A's first pack is all B's and its last is all dead.
      assert.ok(usedByB.has(hex(split.chunks[0]!.id)), "B uses the split record's first chunk");
      for (const x of split.chunks.slice(1))
        assert.ok(!usedByB.has(hex(x.id)), "B does not use the split record's later chunks");
      assert.ok(kept.chunks.length >= 2 && kept.chunks.every((x) => usedByB.has(hex(x.id))));
      for (const r of ordered.filter((q) => q.pack === packs[0]))
        assert.ok(
          r.chunks.every((x) => usedByB.has(hex(x.id))),
          "A's first pack is all live",
        );
      for (const r of ordered.filter((q) => q.pack === packs.at(-1)))
        assert.ok(
          r.chunks.every((x) => !usedByB.has(hex(x.id))),
          "A's last pack is all dead",
        );
      let deadRaw = 0;
      for (const r of ordered) for (const x of r.chunks) if (!usedByB.has(hex(x.id))) deadRaw += x.rawBytes;
      process.stderr.write(
        `# A: ${ordered.length} records in ${packs.length} packs; split record: ${split.chunks.length} chunks, ` +
          `1 live; ${deadRaw} dead bytes\n`,
      );

      // The dead chunks' ciphertext in the split record (32-byte windows at start, middle and
      // end of each), and the all-live record before it: on disk now.
      const sealedSplit = await sealedBytes(t, split);
      const windows: Buffer[] = [];
      for (const x of split.chunks.slice(1)) {
        const c = cipherAt(split, x) - split.offset;
        for (const w of [c, c + Math.floor(x.rawBytes / 2), c + x.rawBytes - 32])
          windows.push(Buffer.from(sealedSplit.subarray(w, w + 32)));
      }
      const sealedKept = await sealedBytes(t, kept);
      const onDisk = await rawFiles(dir);
      for (const w of windows)
        assert.ok(
          onDisk.some((f) => f.bytes.includes(w)),
          'dead ciphertext is on disk',
        );

      const gc = await withVault(
        dir,
        async (v) => {
          await v.deleteCheckpoint({ tenant: TENANT, checkpointId: 'A' });
          return v.gc();
        },
        small,
      );
      assert.ok(gc.packsRepacked >= 1, `gc repacked ${gc.packsRepacked} packs`);
      assert.deepEqual(gc.skippedTenants, []);

      await withVault(dir, async (v) => {
        const out = join(root, 'gc-out');
        await v.restoreCheckpoint({ tenant: TENANT, checkpointId: 'B', destDir: out });
        assert.equal(await diffTrees(srcB, out), undefined, 'B restores byte-exact after gc');
        await removeDir(out);
        const report = await v.verify();
        assert.deepEqual(report.problems, []);
        assert.deepEqual(report.orphans, { packs: 0, indexes: 0, temporaries: 0 });
        const after = (await v.stats()).total.storedBytes;
        assert.ok(
          before - after >= deadRaw,
          `stored bytes fell by ${before - after}, dead chunks held ${deadRaw}`,
        );
      });
      // The indexes hold exactly B's chunks: no dead chunk is left anywhere.
      const indexed = (await readRecords(t)).flatMap((r) => r.chunks.map((x) => hex(x.id)));
      assert.equal(indexed.length, new Set(indexed).size, 'no chunk is indexed twice');
      assert.deepEqual(new Set(indexed), usedByB);
      // Not one 32-byte window of the dead chunks' ciphertext is left on disk; the all-live
      // record of the same pack was moved as it was (still sealed, same bytes).
      const afterGc = await rawFiles(dir);
      for (const w of windows) {
        const hits = afterGc.filter((f) => f.bytes.includes(w)).map((f) => f.path);
        assert.deepEqual(hits, [], 'dead ciphertext survived gc');
      }
      assert.ok(!afterGc.some((f) => f.path.endsWith(`${split.pack}.pack`)), 'the old pack is gone');
      assert.ok(
        afterGc.some((f) => f.path.endsWith('.pack') && f.bytes.includes(sealedKept)),
        'the all-live record was copied as it was',
      );
    } finally {
      wipeTenantKeys(t.keys);
    }
  });

  test('a fork that references only middle chunks of records restores byte-exact, before and after gc', async () => {
    const dir = join(root, 'fork-vault');
    const srcA = join(root, 'fork-a');
    const srcB = join(root, 'fork-b');
    await mkdir(srcA);
    await mkdir(srcB);
    const dataA = randomBytes(2 * MiB);
    await writeFile(join(srcA, 'pages-1.img'), dataA);
    await withVault(dir, (v) =>
      v.putCheckpoint({ tenant: TENANT, sandboxId: 'sb-a', checkpointId: 'A', srcDir: srcA }),
    );
    const t = await tenantOf(dir);
    try {
      const refsA = (await manifestFiles(t, 'A')).get('pages-1.img')!;
      const at = fileOffsets(refsA);
      const big = recordsInFileOrder(await readRecords(t), refsA).filter((r) => r.chunks.length >= 3);
      assert.ok(big.length >= 2, `${big.length} records of three chunks or more`);
      const pick = (r: Rec): { x: IndexEntry; bytes: Buffer } => {
        const x = r.chunks[Math.floor(r.chunks.length / 2)]!;
        assertMiddleChunk(r, x);
        const from = at.get(hex(x.id))!;
        const bytes = dataA.subarray(from, from + x.rawBytes);
        assert.ok(chunkId(t.keys.idKeyObject, bytes).equals(x.id), 'the slice is exactly that chunk');
        return { x, bytes };
      };
      const m1 = pick(big[0]!);
      const m2 = pick(big[big.length - 1]!);
      process.stderr.write(
        `# B uses chunk ${big[0]!.chunks.indexOf(m1.x) + 1} of ${big[0]!.chunks.length} and chunk ` +
          `${big.at(-1)!.chunks.indexOf(m2.x) + 1} of ${big.at(-1)!.chunks.length} of two records of A\n`,
      );
      // One file is a middle chunk alone; the other two middle chunks of two records, the
      // first of them again.
      await writeFile(join(srcB, 'pages-1.img'), m1.bytes);
      await writeFile(join(srcB, 'pages-2.img'), Buffer.concat([m2.bytes, m1.bytes]));
      const put = await withVault(dir, (v) =>
        v.putCheckpoint({ tenant: TENANT, sandboxId: 'sb-b', checkpointId: 'B', srcDir: srcB }),
      );
      assert.equal(put.newBytes, 0, 'B stores nothing new');
      const filesB = await manifestFiles(t, 'B');
      assert.deepEqual(
        filesB.get('pages-1.img')!.map((r) => r.id),
        [hex(m1.x.id)],
      );
      assert.deepEqual(
        filesB.get('pages-2.img')!.map((r) => r.id),
        [hex(m2.x.id), hex(m1.x.id)],
      );

      const restoreB = async (label: string, opts: Partial<VaultOptions>): Promise<void> => {
        await withVault(
          dir,
          async (v) => {
            const out = join(root, `fork-out-${label}`);
            await v.restoreCheckpoint({ tenant: TENANT, checkpointId: 'B', destDir: out });
            assert.equal(await diffTrees(srcB, out), undefined, `${label}: B restores byte-exact`);
            await removeDir(out);
          },
          opts,
        );
      };
      await restoreB('workers', {});
      await restoreB('calling-thread', { restoreWorkers: 0 });

      // A deleted: gc keeps only the two middle chunks, cut out of their records.
      await withVault(dir, async (v) => {
        await v.deleteCheckpoint({ tenant: TENANT, checkpointId: 'A' });
        const gc = await v.gc();
        assert.ok(gc.packsRepacked + gc.packsDeleted >= 1);
      });
      const indexed = (await readRecords(t)).flatMap((r) => r.chunks.map((x) => hex(x.id)));
      assert.deepEqual(indexed.sort(), [hex(m1.x.id), hex(m2.x.id)].sort());
      await restoreB('after-gc', {});
      await withVault(dir, async (v) => {
        assert.deepEqual((await v.verify()).problems, []);
      });
    } finally {
      wipeTenantKeys(t.keys);
    }
  });
});
