/** Garbage collection: mark the chunks live manifests reference, sweep or repack the rest. */
import { DormantError, ErrorCode } from '../domain/errors.js';
import { CHUNK_ID_BYTES } from './crypto.js';
import { REF_BYTES, REF_HOLE, decodeIndex, recordRawBytes, storedShare } from './format.js';
import { PackWriter } from './ingest.js';
import { isDestroyed, tenantTombstoneName } from './keys.js';
import { sealOne } from './seal-worker.js';
import { ChunkDecoder, PackReaders } from './restore.js';
import { TMP_MARK, type StoreEntry } from './store.js';
import { ckptIdOf, packIdOf, tenantNames, type TenantState, type VaultInternals } from './internals.js';

export interface GcOptions {
  /** Repack a pack when at least this fraction of its bytes is dead. Default 0: any dead chunk. */
  minDeadFraction?: number;
  signal?: AbortSignal;
}

export interface GcReport {
  packsDeleted: number;
  packsRepacked: number;
  indexesDeleted: number;
  temporariesDeleted: number;
  manifestsDeleted: number;
  tenantsShredded: number;
  bytesBefore: number;
  bytesAfter: number;
  reclaimedBytes: number;
  /** Tenants gc left alone because something could not be read (verify says what). */
  skippedTenants: { tenant: string; reason: string }[];
  durationMs: number;
}

/**
 * Mark and sweep: chunks referenced by a readable manifest are live; packs with no live
 * chunk are deleted, packs with dead chunks are rewritten without them (so deleted data
 * leaves the disk), and leftovers of interrupted writes are removed. Takes the vault's
 * exclusive lock: it waits for running writes and holds new ones back until it is done.
 */
export async function collectGarbage(v: VaultInternals, o: GcOptions): Promise<GcReport> {
  const started = performance.now();
  const release = await v.lock.exclusive(v.lockOpts(o.signal));
  const report: GcReport = {
    packsDeleted: 0,
    packsRepacked: 0,
    indexesDeleted: 0,
    temporariesDeleted: 0,
    manifestsDeleted: 0,
    tenantsShredded: 0,
    bytesBefore: 0,
    bytesAfter: 0,
    reclaimedBytes: 0,
    skippedTenants: [],
    durationMs: 0,
  };
  try {
    report.bytesBefore = (await v.store.list('')).reduce((s, e) => s + e.sizeBytes, 0);
    for (const e of await v.store.list('keys')) {
      if (e.name.includes(TMP_MARK)) {
        await v.store.shred(e.name);
        report.temporariesDeleted++;
      }
    }
    for (const tenant of await tenantNames(v.store)) {
      if (await isDestroyed(v.store, tenantTombstoneName(tenant))) {
        const objs = await v.store.list(`data/${tenant}`);
        if (objs.length > 0) report.tenantsShredded++;
        await v.store.removeAll(`data/${tenant}`);
        await v.store.removeAll(`keys/sandboxes/${tenant}`);
        continue;
      }
      await gcTenant(v, tenant, o, report);
    }
    report.bytesAfter = (await v.store.list('')).reduce((s, e) => s + e.sizeBytes, 0);
    report.reclaimedBytes = Math.max(0, report.bytesBefore - report.bytesAfter);
  } finally {
    await release();
  }
  report.durationMs = Math.round(performance.now() - started);
  return report;
}

async function gcTenant(v: VaultInternals, tenant: string, o: GcOptions, report: GcReport): Promise<void> {
  const skip = (reason: string): void => {
    report.skippedTenants.push({ tenant, reason });
  };
  v.forgetTenant(tenant);
  let t: TenantState;
  try {
    t = await v.tenantState(tenant, false);
  } catch (e) {
    skip(e instanceof Error ? e.message : String(e));
    return;
  }
  const files = await v.store.list(`data/${tenant}`);
  // No writer runs (we hold the exclusive lock): every temporary is a crash leftover.
  for (const f of files) {
    if (f.name.includes(TMP_MARK)) {
      await v.store.remove(f.name);
      report.temporariesDeleted++;
    }
  }
  const live = new Set<string>();
  for (const f of files) {
    const ck = f.name.split('/')[2] === 'manifests' ? ckptIdOf(f.name) : undefined;
    if (ck === undefined) continue;
    try {
      const { body } = await v.readManifest(tenant, ck);
      for (let at = 0; at < body.refs.length; at += REF_BYTES) {
        if (body.refs[at] !== REF_HOLE)
          live.add(body.refs.subarray(at + 5, at + 5 + CHUNK_ID_BYTES).toString('hex'));
      }
    } catch (e) {
      if (e instanceof DormantError && e.code === ErrorCode.SANDBOX_KEY_DESTROYED) {
        await v.store.remove(f.name);
        report.manifestsDeleted++;
        continue;
      }
      // Sweeping without knowing what this checkpoint holds could delete its data.
      skip(`checkpoint ${ck}: ${e instanceof Error ? e.message : String(e)}`);
      return;
    }
  }
  const packs = new Map<string, StoreEntry>();
  const indexes = new Map<string, StoreEntry>();
  for (const f of files) {
    if (f.name.includes(TMP_MARK)) continue;
    const kind = f.name.split('/')[2];
    const p =
      kind === 'packs' ? packIdOf(f.name, '.pack') : kind === 'index' ? packIdOf(f.name, '.idx') : undefined;
    if (p === undefined) continue;
    (kind === 'packs' ? packs : indexes).set(p, f);
  }
  const decoded = new Map<string, ReturnType<typeof decodeIndex>>();
  for (const [pack, e] of indexes) {
    const entries = decodeIndex(t.keys.indexKey, tenant, pack, await v.store.read(e.name));
    if (entries === undefined) {
      skip(`index ${pack} fails authentication`);
      return;
    }
    decoded.set(pack, entries);
  }
  // Orphans: packs without an index (crash before the index commit), indexes without a pack.
  for (const [pack, e] of packs) {
    if (!indexes.has(pack)) {
      await v.store.remove(e.name);
      report.packsDeleted++;
    }
  }
  const claimed = new Set<string>();
  const writer = new PackWriter(v.store, tenant, t.keys, () => undefined, v.packTargetBytes);
  const repackedAway: string[] = [];
  try {
    for (const [pack, entries] of [...decoded].sort(([a], [b]) => a.localeCompare(b))) {
      if (!packs.has(pack)) {
        await v.store.remove(indexes.get(pack)!.name);
        report.indexesDeleted++;
        continue;
      }
      // Records: the entries of one record are adjacent and share its offset.
      const records: NonNullable<typeof entries>[] = [];
      for (const x of entries ?? []) {
        const last = records[records.length - 1];
        if (last !== undefined && last[0]!.offset === x.offset) last.push(x);
        else records.push([x]);
      }
      let liveBytes = 0;
      let deadBytes = 0;
      const keep: { record: NonNullable<typeof entries>; live: boolean[] }[] = [];
      for (const record of records) {
        const liveAt = record.map((x) => {
          const k = x.id.toString('hex');
          const l = live.has(k) && !claimed.has(k);
          if (l) claimed.add(k);
          return l;
        });
        for (const [i, x] of record.entries()) {
          if (liveAt[i]) liveBytes += storedShare(x.loc);
          else deadBytes += storedShare(x.loc);
        }
        if (liveAt.some(Boolean)) keep.push({ record, live: liveAt });
      }
      if (liveBytes === 0) {
        repackedAway.push(pack);
        continue;
      }
      if (deadBytes === 0 || deadBytes / (liveBytes + deadBytes) < (o.minDeadFraction ?? 0)) continue;
      // A record whose chunks are all live moves as it is: sealed with the tenant key and
      // bound to its chunk ids, it needs no decryption. One with dead chunks is opened and its
      // live chunks sealed again, each on its own, so that deleted data leaves the disk.
      const readers = new PackReaders(v.store, tenant, `gc of pack ${pack}`);
      const decoder = new ChunkDecoder(t.keys);
      try {
        for (const { record, live } of keep) {
          const loc = record[0]!.loc;
          const rec = await readers.record(loc);
          if (live.every(Boolean)) {
            const chunks = record.map((x) => ({
              key: x.id.toString('hex'),
              id: x.id,
              rawBytes: x.rawBytes,
            }));
            writer.add(chunks, [Buffer.from(rec)], loc.storedBytes);
          } else {
            const plain = Buffer.allocUnsafe(recordRawBytes(loc));
            try {
              decoder.decode(record[0]!.id, loc, rec, plain, 0, `gc of pack ${pack}`);
              for (const [i, x] of record.entries()) {
                if (!live[i]) continue;
                const one = sealOne(t.keys.dataKey, x.id, plain.subarray(x.inner, x.inner + x.rawBytes));
                writer.add(
                  [{ key: x.id.toString('hex'), id: x.id, rawBytes: x.rawBytes }],
                  [one],
                  one.length,
                );
              }
            } finally {
              plain.fill(0);
            }
          }
          await writer.pump();
        }
      } finally {
        await readers.close();
      }
      repackedAway.push(pack);
      report.packsRepacked++;
    }
    // New packs and indexes are durable before the old ones go: a crash in between leaves
    // duplicates (which the next gc drops), never a missing chunk.
    await writer.finish();
  } catch (e) {
    await writer.abort();
    throw e;
  }
  for (const pack of repackedAway) {
    await v.store.remove(indexes.get(pack)!.name);
    report.indexesDeleted++;
    await v.store.remove(packs.get(pack)!.name);
    report.packsDeleted++;
  }
  v.forgetTenant(tenant);
}
