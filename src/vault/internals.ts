/**
 * What the vault's parts (verify, gc, stats) share with the Vault class: the names of its
 * objects, a tenant's in-memory state, and the view of the vault they work through.
 */
import { DormantError, ErrorCode } from '../domain/errors.js';
import type { Chunker } from './chunker.js';
import type { TenantKeys } from './crypto.js';
import type { ManifestBody, ManifestHeader } from './format.js';
import type { ChunkLocation } from './ingest.js';
import { TMP_MARK, type VaultStore } from './store.js';
import type { WriterGcLock } from './locks.js';

export const ID_RE = /^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/;

export function checkId(kind: string, id: string): void {
  if (typeof id !== 'string' || !ID_RE.test(id) || id.includes('..')) {
    throw new DormantError(
      ErrorCode.INVALID_ARGUMENT,
      `invalid ${kind} "${id}": use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit`,
    );
  }
}

/** CRIU's page images: whole memory pages back to back, chunked on page boundaries. */
export function isPageImage(path: string): boolean {
  return /(^|\/)pages-\d+\.img$/.test(path);
}

export interface TenantState {
  keys: TenantKeys;
  chunker: Chunker;
  index: Map<string, ChunkLocation>;
  loaded: Set<string>;
  /** Indexes that failed authentication: pack id -> message. */
  badIndexes: Map<string, string>;
}

export function packIdOf(name: string, ext: string): string | undefined {
  const base = name.slice(name.lastIndexOf('/') + 1);
  if (base.includes(TMP_MARK) || !base.endsWith(ext)) return undefined;
  const id = base.slice(0, -ext.length);
  return /^[0-9a-f]{32}$/.test(id) ? id : undefined;
}

export function ckptIdOf(name: string): string | undefined {
  const base = name.slice(name.lastIndexOf('/') + 1);
  if (base.includes(TMP_MARK) || !base.endsWith('.mf')) return undefined;
  return base.slice(0, -3);
}

/** Every tenant the store holds data or a key (or a key's tombstone) of. */
export async function tenantNames(store: VaultStore): Promise<string[]> {
  const names = new Set<string>();
  for (const e of await store.list('data')) {
    const t = e.name.split('/')[1];
    if (t !== undefined) names.add(t);
  }
  for (const e of await store.list('keys/tenants')) {
    const base = e.name.split('/')[2] ?? '';
    const m = /^([A-Za-z0-9._-]+)\.(key|destroyed)$/.exec(base);
    if (m) names.add(m[1]!);
  }
  return [...names].sort();
}

/** The vault as its parts (verify.ts, gc.ts, stats.ts) see it. */
export interface VaultInternals {
  readonly store: VaultStore;
  readonly lock: WriterGcLock;
  lockOpts(signal?: AbortSignal): { timeoutMs: number; signal?: AbortSignal };
  /** Pack size before rolling to a new pack (VaultOptions.packTargetBytes). */
  readonly packTargetBytes: number | undefined;
  tenantState(tenant: string, create: boolean): Promise<TenantState>;
  /** Drops the tenant's cached state (keys, index): the next tenantState reads it afresh. */
  forgetTenant(tenant: string): void;
  /** Brings the in-memory index in line with the store: new indexes in, removed packs out. */
  refreshIndex(tenant: string, t: TenantState): Promise<void>;
  readManifest(
    tenant: string,
    checkpointId: string,
  ): Promise<{ header: ManifestHeader; body: ManifestBody; blob: Buffer }>;
}
