/** The vault's sizes: logical and stored bytes, ratios, and what each checkpoint occupies. */
import { CHUNK_ID_BYTES } from './crypto.js';
import { REF_BYTES, REF_HOLE, storedShare } from './format.js';
import { isDestroyed, tenantTombstoneName } from './keys.js';
import { ckptIdOf, tenantNames, type VaultInternals } from './internals.js';

export interface TenantStats {
  tenant: string;
  checkpoints: number;
  /** Sum of file sizes of all checkpoints. */
  logicalBytes: number;
  /** Of those, runs of zero pages stored as holes. */
  holeBytes: number;
  /** Distinct chunk bytes referenced (after deduplication, before compression). */
  uniqueBytes: number;
  /** Bytes of sealed chunk records referenced (after compression). */
  chunkStoredBytes: number;
  /** Everything on the store for this tenant: packs, indexes, manifests. */
  storedBytes: number;
  /** (logical - holes) / unique. */
  dedupRatio: number;
  /** unique / chunk stored. */
  compressionRatio: number;
  /** logical / stored. */
  overallRatio: number;
}

export interface VaultStats {
  location: string;
  tenants: TenantStats[];
  total: Omit<TenantStats, 'tenant'>;
}

function ratio(a: number, b: number): number {
  return b === 0 ? 1 : a / b;
}

export async function tenantStats(v: VaultInternals): Promise<VaultStats> {
  const tenants: TenantStats[] = [];
  for (const tenant of await tenantNames(v.store)) {
    if (await isDestroyed(v.store, tenantTombstoneName(tenant))) continue;
    const t = await v.tenantState(tenant, false);
    await v.refreshIndex(tenant, t);
    const s: TenantStats = {
      tenant,
      checkpoints: 0,
      logicalBytes: 0,
      holeBytes: 0,
      uniqueBytes: 0,
      chunkStoredBytes: 0,
      storedBytes: 0,
      dedupRatio: 1,
      compressionRatio: 1,
      overallRatio: 1,
    };
    const seen = new Set<string>();
    for (const f of await v.store.list(`data/${tenant}`)) {
      s.storedBytes += f.sizeBytes;
      const ck = f.name.split('/')[2] === 'manifests' ? ckptIdOf(f.name) : undefined;
      if (ck === undefined) continue;
      const { body } = await v.readManifest(tenant, ck).catch(() => ({ body: undefined }));
      if (body === undefined) continue;
      s.checkpoints++;
      for (const e of body.entries) s.logicalBytes += e.sizeBytes;
      for (let at = 0; at < body.refs.length; at += REF_BYTES) {
        const len = body.refs.readUInt32LE(at + 1);
        if (body.refs[at] === REF_HOLE) {
          s.holeBytes += len;
          continue;
        }
        const k = body.refs.subarray(at + 5, at + 5 + CHUNK_ID_BYTES).toString('hex');
        if (seen.has(k)) continue;
        seen.add(k);
        s.uniqueBytes += len;
        const loc = t.index.get(k);
        s.chunkStoredBytes += loc === undefined ? 0 : storedShare(loc);
      }
    }
    // Shares of records holding several chunks are fractions; the total is whole bytes.
    s.chunkStoredBytes = Math.round(s.chunkStoredBytes);
    s.dedupRatio = ratio(s.logicalBytes - s.holeBytes, s.uniqueBytes);
    s.compressionRatio = ratio(s.uniqueBytes, s.chunkStoredBytes);
    s.overallRatio = ratio(s.logicalBytes, s.storedBytes);
    tenants.push(s);
  }
  const total = tenants.reduce(
    (a, s) => ({
      checkpoints: a.checkpoints + s.checkpoints,
      logicalBytes: a.logicalBytes + s.logicalBytes,
      holeBytes: a.holeBytes + s.holeBytes,
      uniqueBytes: a.uniqueBytes + s.uniqueBytes,
      chunkStoredBytes: a.chunkStoredBytes + s.chunkStoredBytes,
      storedBytes: a.storedBytes + s.storedBytes,
      dedupRatio: 1,
      compressionRatio: 1,
      overallRatio: 1,
    }),
    {
      checkpoints: 0,
      logicalBytes: 0,
      holeBytes: 0,
      uniqueBytes: 0,
      chunkStoredBytes: 0,
      storedBytes: 0,
      dedupRatio: 1,
      compressionRatio: 1,
      overallRatio: 1,
    },
  );
  total.dedupRatio = ratio(total.logicalBytes - total.holeBytes, total.uniqueBytes);
  total.compressionRatio = ratio(total.uniqueBytes, total.chunkStoredBytes);
  total.overallRatio = ratio(total.logicalBytes, total.storedBytes);
  return { location: v.store.location, tenants, total };
}

/** Stored bytes attributed to each checkpoint after deduplication (see Vault.attribution). Call under the shared lock. */
export async function attributionOf(
  v: VaultInternals,
): Promise<{ tenant: string; sandboxId: string; checkpointId: string; storedBytes: number }[]> {
  const out: { tenant: string; sandboxId: string; checkpointId: string; storedBytes: number }[] = [];
  for (const tenant of await tenantNames(v.store)) {
    if (await isDestroyed(v.store, tenantTombstoneName(tenant))) continue;
    const t = await v.tenantState(tenant, false);
    await v.refreshIndex(tenant, t);
    const cks: { sandboxId: string; checkpointId: string; chunks: Set<string>; own: number }[] = [];
    const refcount = new Map<string, number>();
    for (const f of await v.store.list(`data/${tenant}/manifests`)) {
      const ck = ckptIdOf(f.name);
      if (ck === undefined) continue;
      const m = await v.readManifest(tenant, ck).catch(() => undefined);
      if (m === undefined) continue;
      const chunks = new Set<string>();
      for (let at = 0; at < m.body.refs.length; at += REF_BYTES) {
        if (m.body.refs[at] === REF_HOLE) continue;
        chunks.add(m.body.refs.subarray(at + 5, at + 5 + CHUNK_ID_BYTES).toString('hex'));
      }
      for (const k of chunks) refcount.set(k, (refcount.get(k) ?? 0) + 1);
      cks.push({ sandboxId: m.header.sandboxId, checkpointId: ck, chunks, own: f.sizeBytes });
    }
    for (const c of cks) {
      let bytes = c.own;
      for (const k of c.chunks) {
        const loc = t.index.get(k);
        bytes += (loc === undefined ? 0 : storedShare(loc)) / (refcount.get(k) ?? 1);
      }
      out.push({
        tenant,
        sandboxId: c.sandboxId,
        checkpointId: c.checkpointId,
        storedBytes: Math.round(bytes),
      });
    }
  }
  return out;
}
