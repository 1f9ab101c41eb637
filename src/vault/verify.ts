/** Verify: every key, index, pack record and manifest of the vault decrypted and checked. */
import { DormantError, ErrorCode } from '../domain/errors.js';
import { CHUNK_ID_BYTES, chunkId } from './crypto.js';
import {
  PACK_HEADER_BYTES,
  RECORD_MAX_RAW_BYTES,
  REF_BYTES,
  REF_HOLE,
  decodeIndex,
  recordRawBytes,
  packHeader,
} from './format.js';
import { isDestroyed, tenantKeyName, tenantTombstoneName } from './keys.js';
import { ChunkDecoder, PackReaders } from './restore.js';
import { TMP_MARK, type StoreEntry } from './store.js';
import { ckptIdOf, packIdOf, tenantNames, type TenantState, type VaultInternals } from './internals.js';

export interface VerifyProblem {
  tenant: string;
  /** The checkpoints this problem breaks (empty when none reference the object). */
  checkpoints: string[];
  /** The damaged object: `pack <id>`, `index <id>`, `manifest <checkpoint>`, `chunk <id>`, `key <name>`. */
  object: string;
  message: string;
}

export interface VerifyReport {
  ok: boolean;
  tenants: number;
  checkpoints: number;
  chunksChecked: number;
  bytesChecked: number;
  problems: VerifyProblem[];
  /** Leftovers of interrupted writes (harmless; gc removes them). */
  orphans: { packs: number; indexes: number; temporaries: number };
  /** Tenants whose key was destroyed and whose data awaits gc. */
  shreddedTenants: string[];
}

export async function verifyAll(v: VaultInternals, o: { signal?: AbortSignal }): Promise<VerifyReport> {
  const report: VerifyReport = {
    ok: true,
    tenants: 0,
    checkpoints: 0,
    chunksChecked: 0,
    bytesChecked: 0,
    problems: [],
    orphans: { packs: 0, indexes: 0, temporaries: 0 },
    shreddedTenants: [],
  };
  for (const tenant of await tenantNames(v.store)) {
    if (o.signal?.aborted) throw new DormantError(ErrorCode.COMMAND_ABORTED, 'verify aborted');
    if (await isDestroyed(v.store, tenantTombstoneName(tenant))) {
      report.shreddedTenants.push(tenant);
      continue;
    }
    report.tenants++;
    await verifyTenant(v, tenant, report);
  }
  report.ok = report.problems.length === 0;
  return report;
}

async function verifyTenant(v: VaultInternals, tenant: string, report: VerifyReport): Promise<void> {
  const problem = (object: string, message: string, checkpoints: string[] = []): void => {
    report.problems.push({ tenant, object, message, checkpoints });
  };
  let t: TenantState;
  try {
    // A fresh state: verify reads everything from the store, never from a cache.
    v.forgetTenant(tenant);
    t = await v.tenantState(tenant, false);
  } catch (e) {
    problem(`key ${tenantKeyName(tenant)}`, e instanceof Error ? e.message : String(e));
    return;
  }
  const files = await v.store.list(`data/${tenant}`);
  const packs = new Map<string, StoreEntry>();
  const indexes = new Map<string, StoreEntry>();
  const manifests: string[] = [];
  for (const f of files) {
    if (f.name.includes(TMP_MARK)) {
      report.orphans.temporaries++;
      continue;
    }
    const kind = f.name.split('/')[2];
    if (kind === 'packs') {
      const id = packIdOf(f.name, '.pack');
      if (id) packs.set(id, f);
    } else if (kind === 'index') {
      const id = packIdOf(f.name, '.idx');
      if (id) indexes.set(id, f);
    } else if (kind === 'manifests') {
      const id = ckptIdOf(f.name);
      if (id) manifests.push(id);
    }
  }
  // Manifests first, to know which checkpoints each object carries.
  const users = new Map<string, string[]>(); // chunk key -> checkpoints
  const refsOf = new Map<string, Set<string>>();
  for (const ck of manifests) {
    report.checkpoints++;
    try {
      const { body } = await v.readManifest(tenant, ck);
      const set = new Set<string>();
      for (let at = 0; at < body.refs.length; at += REF_BYTES) {
        if (body.refs[at] === REF_HOLE) continue;
        const k = body.refs.subarray(at + 5, at + 5 + CHUNK_ID_BYTES).toString('hex');
        if (set.has(k)) continue;
        set.add(k);
        const u = users.get(k);
        if (u) u.push(ck);
        else users.set(k, [ck]);
      }
      refsOf.set(ck, set);
    } catch (e) {
      if (e instanceof DormantError && e.code === ErrorCode.SANDBOX_KEY_DESTROYED) continue;
      problem(`manifest ${ck}`, e instanceof Error ? e.message : String(e), [ck]);
    }
  }
  const good = new Set<string>();
  const decoder = new ChunkDecoder(t.keys);
  const scratch = Buffer.allocUnsafe(RECORD_MAX_RAW_BYTES);
  for (const [pack, idxEntry] of indexes) {
    if (!packs.has(pack)) {
      const affected = new Set<string>();
      problem(`pack ${pack}`, `pack ${pack} is missing but its index lists chunks`, [...affected]);
      continue;
    }
    const blob = await v.store.read(idxEntry.name);
    const entries = decodeIndex(t.keys.indexKey, tenant, pack, blob);
    if (entries === undefined) {
      problem(`index ${pack}`, `index ${pack} fails authentication`, checkpointsUsingPackUnknown(refsOf));
      continue;
    }
    const readers = new PackReaders(v.store, tenant, `pack ${pack}`);
    const packEntry = packs.get(pack)!;
    try {
      const reader = await v.store.openReader(packEntry.name);
      const head = await reader.read(0, PACK_HEADER_BYTES).catch(() => Buffer.alloc(0));
      await reader.close();
      if (!head.equals(packHeader(pack))) {
        const affected = new Set<string>();
        for (const x of entries) for (const c of users.get(x.id.toString('hex')) ?? []) affected.add(c);
        problem(`pack ${pack}`, `pack ${pack} has a damaged header`, [...affected].sort());
        continue;
      }
      // Records (entries of one record share its offset) must tile the pack.
      let expect = PACK_HEADER_BYTES;
      const sorted = [...entries].sort((a, b) => a.offset - b.offset);
      for (const x of sorted) {
        if (x.offset === expect) expect += x.storedBytes;
        else if (x.offset + x.storedBytes !== expect) break;
      }
      if (expect !== packEntry.sizeBytes) {
        problem(
          `pack ${pack}`,
          `pack ${pack} is ${packEntry.sizeBytes} bytes but its index covers ${expect}`,
        );
      }
      // One record at a time: its entries are adjacent in the index.
      for (let i = 0; i < entries.length;) {
        let j = i + 1;
        while (j < entries.length && entries[j]!.offset === entries[i]!.offset) j++;
        const group = entries.slice(i, j);
        i = j;
        const loc = group[0]!.loc;
        const us = [...new Set(group.flatMap((x) => users.get(x.id.toString('hex')) ?? []))].sort();
        try {
          const rec = await readers.record(loc);
          const raw = recordRawBytes(loc);
          const out = raw <= scratch.length ? scratch : Buffer.allocUnsafe(raw);
          const what =
            us.length === 0 ? 'unreferenced' : `checkpoint${us.length > 1 ? 's' : ''} ${us.join(', ')}`;
          decoder.decode(group[0]!.id, loc, rec, out, 0, what);
          for (const x of group) {
            const k = x.id.toString('hex');
            if (!chunkId(t.keys.idKeyObject, out.subarray(x.inner, x.inner + x.rawBytes)).equals(x.id)) {
              problem(
                `pack ${pack}`,
                `chunk ${k.slice(0, 16)} in pack ${pack} does not match its id`,
                [...(users.get(k) ?? [])].sort(),
              );
              continue;
            }
            good.add(k);
            report.chunksChecked++;
            report.bytesChecked += x.rawBytes;
          }
          if (out !== scratch) out.fill(0);
        } catch (e) {
          problem(`pack ${pack}`, e instanceof Error ? e.message : String(e), us);
        }
      }
    } finally {
      await readers.close();
      scratch.fill(0);
    }
  }
  for (const pack of packs.keys()) if (!indexes.has(pack)) report.orphans.packs++;
  // Every reference of every readable manifest must resolve to a chunk that checked out.
  for (const [ck, set] of refsOf) {
    let missing = 0;
    let first = '';
    for (const k of set) {
      if (!good.has(k)) {
        missing++;
        first ||= k;
      }
    }
    if (missing > 0 && !report.problems.some((p) => p.checkpoints.includes(ck))) {
      problem(
        `chunk ${first}`,
        `checkpoint ${ck}: ${missing} chunk(s) missing or damaged, first ${first.slice(0, 16)}`,
        [ck],
      );
    }
  }
}

/** A damaged index hides which chunks its pack held: every checkpoint may be affected. */
function checkpointsUsingPackUnknown(refsOf: Map<string, Set<string>>): string[] {
  return [...refsOf.keys()].sort();
}
