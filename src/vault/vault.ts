/**
 * The vault: where hibernated sandboxes live. See index.ts for the port and docs/VAULT.md for
 * the on-disk format and key design.
 */
import { availableParallelism } from 'node:os';
import { join } from 'node:path';
import { DormantError, ErrorCode } from '../domain/errors.js';
import { makeChunker, type Chunker } from './chunker.js';
import {
  CHUNK_ID_BYTES,
  chunkId,
  deriveKey,
  deriveTenantKeys,
  wipeTenantKeys,
  type TenantKeys,
} from './crypto.js';
import {
  PACK_HEADER_BYTES,
  RECORD_MAX_RAW_BYTES,
  REF_BYTES,
  REF_HOLE,
  decodeIndex,
  recordRawBytes,
  storedShare,
  decodeManifestBody,
  decodeManifestHeader,
  encodeManifest,
  packHeader,
  type ManifestBody,
  type ManifestHeader,
} from './format.js';
import { PackWriter, crashPoint, ingestFolder, type ChunkLocation, type IngestCounters } from './ingest.js';
import {
  MASTER_CHECK,
  checkMasterKey,
  isDestroyed,
  loadMasterKey,
  loadWrappedKey,
  sandboxKeyName,
  sandboxTombstoneName,
  tenantKeyName,
  tenantTombstoneName,
  type MasterKeySource,
} from './keys.js';
import { LocalLock, type Release } from './lock.js';
import { SealPool } from './seal-pool.js';
import { sealOne } from './seal-worker.js';
import { ChunkDecoder, PackReaders, restoreInto, type RestoreContext } from './restore.js';
import { CheckpointReader } from './reader.js';
import { LocalDirStore, TMP_MARK, type StoreEntry, type VaultStore } from './store.js';

const ID_RE = /^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/;

function checkId(kind: string, id: string): void {
  if (typeof id !== 'string' || !ID_RE.test(id) || id.includes('..')) {
    throw new DormantError(
      ErrorCode.INVALID_ARGUMENT,
      `invalid ${kind} "${id}": use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit`,
      { status: 400 },
    );
  }
}

/** CRIU's page images: whole memory pages back to back, chunked on page boundaries. */
export function isPageImage(path: string): boolean {
  return /(^|\/)pages-\d+\.img$/.test(path);
}

export interface VaultOptions {
  /** The vault directory (local store and locks). */
  dir: string;
  masterKey: MasterKeySource;
  /** Warnings for people (a generated master key, loose file modes). Default: stderr. */
  onWarning?: (message: string) => void;
  /** Another store behind the same format (S3 later). Default: a LocalDirStore on `dir`. */
  store?: VaultStore;
  /**
   * Create the vault when `dir` holds none (default true). With false, opening a missing vault
   * throws VAULT_NOT_FOUND: read-only tools should not create one by accident.
   */
  create?: boolean;
  /** How long writers wait for a running gc (and gc for running writers). Default 10 min. */
  lockTimeoutMs?: number;
  /**
   * Worker threads that compress and seal chunks during ingest. Default: one per CPU but one,
   * at least 1 and at most 4; 0 runs everything on the calling thread.
   */
  sealWorkers?: number;
  /**
   * Worker threads that open and decompress chunks during restore. Default: one per CPU but
   * one, at least 1 and at most 4 (the calling thread reads, dispatches and writes, and on 2
   * cores a second worker only competes with it); 0 decodes on the calling thread, as does
   * `sealWorkers: 0` when this is not set.
   */
  restoreWorkers?: number;
  /** Pack size before rolling to a new pack. Default 32 MiB. */
  packTargetBytes?: number;
  signal?: AbortSignal;
}

export interface PutCheckpointOptions {
  tenant: string;
  sandboxId: string;
  checkpointId: string;
  /** A folder of CRIU images (and anything else: files, folders, symlinks). */
  srcDir: string;
  /** Facts stored (sealed) with the checkpoint: architecture, CRIU version, ... */
  meta?: Record<string, string>;
  /**
   * `srcDir` is still being written (a CRIU dump in progress) until this settles: the put
   * starts at once and reads CRIU's page images while they grow, so storing overlaps the
   * dump; the manifest is committed only after this resolves. When it rejects, the put fails
   * with its error and commits nothing.
   */
  growing?: Promise<unknown>;
  signal?: AbortSignal;
  onProgress?: (p: Readonly<IngestCounters>) => void;
}

export interface PutCheckpointResult extends IngestCounters {
  checkpointId: string;
  durationMs: number;
  packsWritten: number;
}

export interface RestoreCheckpointOptions {
  tenant: string;
  checkpointId: string;
  /** Created if missing; must be empty. On failure it is left empty (or removed if created). */
  destDir: string;
  signal?: AbortSignal;
  onProgress?: (restoredBytes: number) => void;
  /**
   * Files (by path in the checkpoint) left out of the restore: not created at all. Lazy
   * resume leaves out the page images and reads them with {@link Vault.openCheckpoint}.
   */
  skip?: (path: string) => boolean;
}

export interface RestoreCheckpointResult {
  checkpointId: string;
  sandboxId: string;
  files: number;
  logicalBytes: number;
  meta: Record<string, string>;
  durationMs: number;
}

export interface CheckpointInfo {
  tenant: string;
  sandboxId: string;
  checkpointId: string;
  createdAt: string;
  logicalBytes: number;
  fileCount: number;
}

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

interface TenantState {
  keys: TenantKeys;
  chunker: Chunker;
  index: Map<string, ChunkLocation>;
  loaded: Set<string>;
  /** Indexes that failed authentication: pack id -> message. */
  badIndexes: Map<string, string>;
}

function packIdOf(name: string, ext: string): string | undefined {
  const base = name.slice(name.lastIndexOf('/') + 1);
  if (base.includes(TMP_MARK) || !base.endsWith(ext)) return undefined;
  const id = base.slice(0, -ext.length);
  return /^[0-9a-f]{32}$/.test(id) ? id : undefined;
}

function ckptIdOf(name: string): string | undefined {
  const base = name.slice(name.lastIndexOf('/') + 1);
  if (base.includes(TMP_MARK) || !base.endsWith('.mf')) return undefined;
  return base.slice(0, -3);
}

function ratio(a: number, b: number): number {
  return b === 0 ? 1 : a / b;
}

/**
 * The vault. Create with {@link openVault}; every method is safe to call concurrently with
 * other methods and with other processes using the same directory.
 */
export class Vault {
  private readonly tenants = new Map<string, Promise<TenantState>>();
  private readonly sandboxKeys = new Map<string, Buffer>();
  private closed = false;
  private pool: SealPool | undefined;
  private decodePool: SealPool | undefined;

  private constructor(
    readonly store: VaultStore,
    private readonly lock: LocalLock,
    private master: Buffer,
    private readonly opts: VaultOptions,
  ) {}

  /** @internal use {@link openVault}. */
  static async open(opts: VaultOptions): Promise<Vault> {
    const store = opts.store ?? new LocalDirStore(opts.dir);
    const warn = opts.onWarning ?? ((m: string) => process.stderr.write(`warning: ${m}\n`));
    let vaultIsNew: boolean;
    try {
      await store.read(MASTER_CHECK);
      vaultIsNew = false;
    } catch (e) {
      if (!(e instanceof DormantError && e.code === ErrorCode.VAULT_NOT_FOUND)) throw e;
      vaultIsNew = true;
    }
    if (vaultIsNew && opts.create === false) {
      throw new DormantError(ErrorCode.VAULT_NOT_FOUND, `no vault at ${store.location}`, {
        status: 404,
        hint: 'check --data-dir (or DORMANT_DATA_DIR); a vault is created by the first stored checkpoint',
      });
    }
    const master = await loadMasterKey(opts.masterKey, {
      vaultIsNew,
      warn,
      ...(opts.signal ? { signal: opts.signal } : {}),
    });
    const wrap = deriveKey(master, 'tenant-key-wrap');
    master.fill(0);
    await checkMasterKey(store, wrap, vaultIsNew);
    return new Vault(store, new LocalLock(join(opts.dir, 'locks')), wrap, opts);
  }

  private check(): void {
    if (this.closed) throw new DormantError(ErrorCode.INTERNAL, 'vault is closed');
  }

  private sealPool(): SealPool | undefined {
    // The calling thread reads, chunks and hashes (about half the work); the workers take the rest.
    const n = this.opts.sealWorkers ?? Math.max(1, Math.min(4, availableParallelism() - 1));
    if (n <= 0) return undefined;
    this.pool ??= new SealPool(n);
    return this.pool;
  }

  private lockOpts(signal?: AbortSignal): { timeoutMs: number; signal?: AbortSignal } {
    return { timeoutMs: this.opts.lockTimeoutMs ?? 600_000, ...(signal ? { signal } : {}) };
  }

  private tenantState(tenant: string, create: boolean): Promise<TenantState> {
    let p = this.tenants.get(tenant);
    if (p === undefined) {
      p = (async () => {
        const key = await loadWrappedKey(this.store, {
          name: tenantKeyName(tenant),
          tombstone: tenantTombstoneName(tenant),
          wrapKey: this.master,
          label: `tenant ${tenant}`,
          create,
          destroyedCode: ErrorCode.TENANT_KEY_DESTROYED,
        });
        if (key === undefined) {
          throw new DormantError(
            ErrorCode.CHECKPOINT_NOT_FOUND,
            `tenant ${tenant} has no checkpoints in this vault`,
            {
              status: 404,
            },
          );
        }
        const keys = deriveTenantKeys(key);
        key.fill(0);
        return {
          keys,
          chunker: makeChunker(keys.gear),
          index: new Map(),
          loaded: new Set(),
          badIndexes: new Map(),
        };
      })();
      this.tenants.set(tenant, p);
      p.catch(() => this.tenants.delete(tenant));
    }
    return p;
  }

  /** Brings the in-memory index in line with the store: new indexes in, removed packs out. */
  private async refreshIndex(tenant: string, t: TenantState): Promise<void> {
    // Only packs known before the listing can be "gone": a writer may add its pack (index file
    // written, then t.loaded updated) while the listing is in flight.
    const loadedBefore = new Set(t.loaded);
    const listed = await this.store.list(`data/${tenant}/index`);
    const present = new Set<string>();
    for (const e of listed) {
      const pack = packIdOf(e.name, '.idx');
      if (pack === undefined) continue;
      present.add(pack);
      if (t.loaded.has(pack) || t.badIndexes.has(pack)) continue;
      const blob = await this.store.read(e.name).catch((err: unknown) => {
        if (err instanceof DormantError && err.code === ErrorCode.VAULT_NOT_FOUND) return undefined;
        throw err;
      });
      if (blob === undefined) continue;
      const entries = decodeIndex(t.keys.indexKey, tenant, pack, blob);
      if (entries === undefined) {
        t.badIndexes.set(pack, `index ${pack} fails authentication`);
        continue;
      }
      for (const x of entries) {
        const k = x.id.toString('hex');
        if (!t.index.has(k)) t.index.set(k, x.loc);
      }
      t.loaded.add(pack);
    }
    const gone = [...loadedBefore].filter((p) => !present.has(p) && t.loaded.has(p));
    for (const p of [...t.badIndexes.keys()]) if (!present.has(p)) t.badIndexes.delete(p);
    if (gone.length > 0) {
      // A chunk of a removed (repacked) pack may live in another pack: rebuild the index aside,
      // then swap it in at once, so that readers never see a half-empty index, and keep what
      // writers added meanwhile.
      const g = new Set(gone);
      const fresh: TenantState = { ...t, index: new Map(), loaded: new Set(), badIndexes: new Map() };
      await this.refreshIndex(tenant, fresh);
      for (const [k, loc] of t.index) if (!g.has(loc.pack) && !fresh.index.has(k)) fresh.index.set(k, loc);
      for (const p of t.loaded) if (!g.has(p)) fresh.loaded.add(p);
      t.index.clear();
      for (const [k, loc] of fresh.index) t.index.set(k, loc);
      t.loaded.clear();
      for (const p of fresh.loaded) t.loaded.add(p);
      t.badIndexes.clear();
      for (const [p, why] of fresh.badIndexes) t.badIndexes.set(p, why);
    }
  }

  private async sandboxKey(tenant: string, sandboxId: string, create: boolean): Promise<Buffer> {
    const ck = `${tenant}/${sandboxId}`;
    const cached = this.sandboxKeys.get(ck);
    if (cached) return cached;
    const t = await this.tenantState(tenant, create);
    const key = await loadWrappedKey(this.store, {
      name: sandboxKeyName(tenant, sandboxId),
      tombstone: sandboxTombstoneName(tenant, sandboxId),
      wrapKey: t.keys.wrapKey,
      label: `sandbox ${sandboxId} of tenant ${tenant}`,
      create,
      destroyedCode: ErrorCode.SANDBOX_KEY_DESTROYED,
    });
    if (key === undefined) {
      throw new DormantError(
        ErrorCode.VAULT_KEY_MISSING,
        `the key of sandbox ${sandboxId} (tenant ${tenant}) is missing`,
        {
          details: { object: sandboxKeyName(tenant, sandboxId) },
        },
      );
    }
    const mk = deriveKey(key, 'manifest');
    key.fill(0);
    this.sandboxKeys.set(ck, mk);
    return mk;
  }

  private manifestName(tenant: string, checkpointId: string): string {
    return `data/${tenant}/manifests/${checkpointId}.mf`;
  }

  private async readManifest(
    tenant: string,
    checkpointId: string,
  ): Promise<{ header: ManifestHeader; body: ManifestBody; blob: Buffer }> {
    const name = this.manifestName(tenant, checkpointId);
    let blob: Buffer;
    try {
      blob = await this.store.read(name);
    } catch (e) {
      if (e instanceof DormantError && e.code === ErrorCode.VAULT_NOT_FOUND) {
        throw new DormantError(
          ErrorCode.CHECKPOINT_NOT_FOUND,
          `checkpoint ${checkpointId} of tenant ${tenant} is not in the vault`,
          {
            status: 404,
            cause: e,
          },
        );
      }
      throw e;
    }
    let header: ManifestHeader;
    let headerBytes: number;
    try {
      ({ header, headerBytes } = decodeManifestHeader(name, blob));
    } catch (e) {
      throw new DormantError(
        ErrorCode.VAULT_CORRUPT,
        `checkpoint ${checkpointId}: manifest is damaged (${(e as Error).message})`,
        {
          cause: e,
          details: { object: `manifest ${checkpointId}` },
        },
      );
    }
    const corrupt = (): DormantError =>
      new DormantError(ErrorCode.VAULT_CORRUPT, `checkpoint ${checkpointId}: manifest fails authentication`, {
        details: { object: `manifest ${checkpointId}` },
        hint: 'run `dormant vault verify` to list every damaged object',
      });
    if (header.tenant !== tenant || header.checkpointId !== checkpointId || !ID_RE.test(header.sandboxId))
      throw corrupt();
    const key = await this.sandboxKey(tenant, header.sandboxId, false).catch((e: unknown) => {
      // A flipped byte in the sandbox id would send us to a missing key: call that corruption.
      if (e instanceof DormantError && e.code === ErrorCode.VAULT_KEY_MISSING) throw corrupt();
      throw e;
    });
    const body = decodeManifestBody(key, blob, headerBytes);
    if (body === undefined) throw corrupt();
    return { header, body, blob };
  }

  /**
   * Stores the folder `srcDir` as checkpoint `checkpointId` of `sandboxId` (tenant `tenant`).
   * Streams: memory stays bounded whatever the folder's size. Commits atomically: packs, then
   * their indexes, then the manifest, each synced; until the manifest is in place the
   * checkpoint does not exist, and a crash leaves only orphans for gc. Throws CHECKPOINT_EXISTS
   * when the id is taken (the call is then a no-op).
   */
  async putCheckpoint(o: PutCheckpointOptions): Promise<PutCheckpointResult> {
    this.check();
    checkId('tenant', o.tenant);
    checkId('sandbox id', o.sandboxId);
    checkId('checkpoint id', o.checkpointId);
    const started = performance.now();
    const mname = this.manifestName(o.tenant, o.checkpointId);
    const exists = async (): Promise<boolean> =>
      this.store.read(mname).then(
        () => true,
        (e: unknown) => {
          if (e instanceof DormantError && e.code === ErrorCode.VAULT_NOT_FOUND) return false;
          throw e;
        },
      );
    const taken = (): DormantError =>
      new DormantError(
        ErrorCode.CHECKPOINT_EXISTS,
        `checkpoint ${o.checkpointId} already exists for tenant ${o.tenant}`,
        {
          status: 409,
          hint: 'checkpoint ids are never reused; pick a new one',
        },
      );
    if (await exists()) throw taken();
    if (await isDestroyed(this.store, tenantTombstoneName(o.tenant))) {
      // Checked on every put: another process may have shredded the tenant since we cached its key.
      this.tenants.delete(o.tenant);
      throw new DormantError(ErrorCode.TENANT_KEY_DESTROYED, `the key of tenant ${o.tenant} was destroyed`, {
        status: 410,
        hint: 'crypto-shredding cannot be undone; new checkpoints need a new tenant id',
      });
    }
    const release: Release = await this.lock.shared(this.lockOpts(o.signal));
    const t = await this.tenantState(o.tenant, true).catch(async (e: unknown) => {
      await release();
      throw e;
    });
    let packs: PackWriter | undefined;
    try {
      const mkey = await this.sandboxKey(o.tenant, o.sandboxId, true);
      await this.refreshIndex(o.tenant, t);
      packs = new PackWriter(
        this.store,
        o.tenant,
        t.keys,
        (_pack, entries) => {
          for (const [k, loc] of entries) t.index.set(k, loc);
          t.loaded.add(_pack);
        },
        this.opts.packTargetBytes,
      );
      const res = await ingestFolder(o.srcDir, {
        chunker: t.chunker,
        keys: t.keys,
        known: (k) => t.index.has(k),
        packs,
        pageAligned: isPageImage,
        ...(o.growing ? { growing: o.growing } : {}),
        ...(this.sealPool() ? { pool: this.sealPool()! } : {}),
        ...(o.signal ? { signal: o.signal } : {}),
        ...(o.onProgress ? { onProgress: o.onProgress } : {}),
      });
      await packs.finish();
      crashPoint('before-manifest');
      const header: ManifestHeader = {
        v: 1,
        tenant: o.tenant,
        sandboxId: o.sandboxId,
        checkpointId: o.checkpointId,
        createdAt: new Date().toISOString(),
        logicalBytes: res.counters.logicalBytes,
        fileCount: res.entries.filter((e) => e.type === 'file').length,
      };
      const blob = encodeManifest(mkey, header, { entries: res.entries, meta: o.meta ?? {}, refs: res.refs });
      if (!(await this.store.writeNew(mname, blob))) throw taken();
      crashPoint('manifest-committed');
      return {
        ...res.counters,
        checkpointId: o.checkpointId,
        durationMs: Math.round(performance.now() - started),
        packsWritten: packs.packsWritten,
      };
    } catch (e) {
      await packs?.abort();
      throw e;
    } finally {
      await release();
    }
  }

  /**
   * Restores checkpoint `checkpointId` of `tenant` into `destDir`, byte for byte (holes stay
   * holes). Every chunk is authenticated before it is written; on any failure the partial
   * output is removed and a VAULT_CORRUPT error names the checkpoint and the object.
   */
  async restoreCheckpoint(o: RestoreCheckpointOptions): Promise<RestoreCheckpointResult> {
    this.check();
    checkId('tenant', o.tenant);
    checkId('checkpoint id', o.checkpointId);
    // Readers hold the shared lock too: gc may move a live chunk to a new pack.
    return this.withShared(o.signal, () => this.restoreLocked(o));
  }

  private async withShared<T>(signal: AbortSignal | undefined, fn: () => Promise<T>): Promise<T> {
    const release = await this.lock.shared(this.lockOpts(signal));
    try {
      return await fn();
    } finally {
      await release();
    }
  }

  private restorePool(): SealPool | undefined {
    const n =
      this.opts.restoreWorkers ??
      // One core stays with the calling thread, which reads the packs and writes the files.
      (this.opts.sealWorkers === 0 ? 0 : Math.max(1, Math.min(4, availableParallelism() - 1)));
    if (n <= 0) return undefined;
    this.decodePool ??= new SealPool(n);
    return this.decodePool;
  }

  /**
   * What a restore and a reader need of checkpoint `checkpointId`: its manifest, and the
   * context to find and open its chunks (the index refreshed first). Call under the shared lock.
   */
  private async readContext(
    tenant: string,
    checkpointId: string,
  ): Promise<{
    header: ManifestHeader;
    body: ManifestBody;
    ctx: Omit<RestoreContext, 'signal' | 'onProgress' | 'skip'>;
  }> {
    if (await isDestroyed(this.store, tenantTombstoneName(tenant))) {
      throw new DormantError(
        ErrorCode.TENANT_KEY_DESTROYED,
        `the key of tenant ${tenant} was destroyed; checkpoint ${checkpointId} is unrecoverable`,
        { status: 410 },
      );
    }
    // Started first: the workers boot while the manifest and the index load.
    const pool = this.restorePool();
    const t = await this.tenantState(tenant, false);
    const { header, body } = await this.readManifest(tenant, checkpointId);
    await this.refreshIndex(tenant, t);
    return {
      header,
      body,
      ctx: {
        ...(pool ? { pool } : {}),
        store: this.store,
        tenant,
        checkpointId,
        keys: t.keys,
        lookup: (k) => t.index.get(k),
        explainMissing: () =>
          t.badIndexes.size > 0
            ? ` (damaged: ${[...t.badIndexes.values()].join('; ')})`
            : ' (its pack or index is gone)',
      },
    };
  }

  private async restoreLocked(o: RestoreCheckpointOptions): Promise<RestoreCheckpointResult> {
    const started = performance.now();
    const { header, body, ctx } = await this.readContext(o.tenant, o.checkpointId);
    await restoreInto(o.destDir, body, {
      ...ctx,
      ...(o.skip ? { skip: o.skip } : {}),
      ...(o.signal ? { signal: o.signal } : {}),
      ...(o.onProgress ? { onProgress: o.onProgress } : {}),
    });
    return {
      checkpointId: o.checkpointId,
      sandboxId: header.sandboxId,
      files: header.fileCount,
      logicalBytes: header.logicalBytes,
      meta: body.meta,
      durationMs: Math.round(performance.now() - started),
    };
  }

  /**
   * Opens checkpoint `checkpointId` of `tenant` for random reads of its files (see
   * {@link CheckpointReader}). The reader holds the vault's shared lock, as a restore does,
   * until it is closed: gc waits for it.
   */
  async openCheckpoint(o: {
    tenant: string;
    checkpointId: string;
    signal?: AbortSignal;
  }): Promise<CheckpointReader> {
    this.check();
    checkId('tenant', o.tenant);
    checkId('checkpoint id', o.checkpointId);
    const release = await this.lock.shared(this.lockOpts(o.signal));
    try {
      const { body, ctx } = await this.readContext(o.tenant, o.checkpointId);
      return new CheckpointReader(body, ctx, release);
    } catch (e) {
      await release();
      throw e;
    }
  }

  /** Lists checkpoints (all tenants, or one), oldest first. Reads headers only. */
  async listCheckpoints(o: { tenant?: string; sandboxId?: string } = {}): Promise<CheckpointInfo[]> {
    this.check();
    if (o.tenant !== undefined) checkId('tenant', o.tenant);
    const out: CheckpointInfo[] = [];
    for (const e of await this.store.list(o.tenant === undefined ? 'data' : `data/${o.tenant}/manifests`)) {
      const parts = e.name.split('/');
      if (parts.length !== 4 || parts[2] !== 'manifests') continue;
      const ck = ckptIdOf(e.name);
      if (ck === undefined) continue;
      let header: ManifestHeader;
      try {
        ({ header } = decodeManifestHeader(e.name, await this.store.read(e.name)));
      } catch (err) {
        if (
          err instanceof DormantError &&
          (err.code === ErrorCode.VAULT_NOT_FOUND || err.code === ErrorCode.VAULT_CORRUPT)
        )
          continue;
        throw err;
      }
      if (o.sandboxId !== undefined && header.sandboxId !== o.sandboxId) continue;
      out.push({
        tenant: header.tenant,
        sandboxId: header.sandboxId,
        checkpointId: header.checkpointId,
        createdAt: header.createdAt,
        logicalBytes: header.logicalBytes,
        fileCount: header.fileCount,
      });
    }
    return out.sort((a, b) => a.createdAt.localeCompare(b.createdAt));
  }

  /** Deletes a checkpoint's manifest; its chunks go at the next gc unless others use them. */
  async deleteCheckpoint(o: { tenant: string; checkpointId: string }): Promise<{ deleted: boolean }> {
    this.check();
    checkId('tenant', o.tenant);
    checkId('checkpoint id', o.checkpointId);
    const name = this.manifestName(o.tenant, o.checkpointId);
    const had = await this.store.read(name).then(
      () => true,
      () => false,
    );
    await this.store.remove(name);
    return { deleted: had };
  }

  /**
   * Crypto-shreds a tenant: writes a tombstone (so nothing re-creates the key), then
   * overwrites and deletes the wrapped tenant key and its sandbox keys. From then on its
   * checkpoints are unrecoverable (TENANT_KEY_DESTROYED); gc deletes the ciphertext.
   */
  async destroyTenantKey(o: { tenant: string }): Promise<void> {
    this.check();
    checkId('tenant', o.tenant);
    await this.store.writeNew(tenantTombstoneName(o.tenant), Buffer.from(new Date().toISOString()));
    const st = this.tenants.get(o.tenant);
    this.tenants.delete(o.tenant);
    if (st) {
      await st.then(
        (s) => wipeTenantKeys(s.keys),
        () => undefined,
      );
    }
    for (const [k, v] of this.sandboxKeys) {
      if (k.startsWith(`${o.tenant}/`)) {
        v.fill(0);
        this.sandboxKeys.delete(k);
      }
    }
    await this.store.shred(tenantKeyName(o.tenant));
    for (const e of await this.store.list(`keys/sandboxes/${o.tenant}`)) {
      if (e.name.endsWith('.key') || e.name.includes(TMP_MARK)) await this.store.shred(e.name);
    }
  }

  /**
   * Crypto-shreds one sandbox: its manifests become unreadable at once (they are sealed with
   * the sandbox key) and are deleted; the chunks only it used go at the next gc (which repacks,
   * so their ciphertext leaves the disk). Chunks shared with other sandboxes of the tenant stay.
   */
  async destroySandboxKey(o: { tenant: string; sandboxId: string }): Promise<{ checkpointsDeleted: number }> {
    this.check();
    checkId('tenant', o.tenant);
    checkId('sandbox id', o.sandboxId);
    const mine = await this.listCheckpoints({ tenant: o.tenant, sandboxId: o.sandboxId });
    await this.store.writeNew(
      sandboxTombstoneName(o.tenant, o.sandboxId),
      Buffer.from(new Date().toISOString()),
    );
    const ck = `${o.tenant}/${o.sandboxId}`;
    this.sandboxKeys.get(ck)?.fill(0);
    this.sandboxKeys.delete(ck);
    await this.store.shred(sandboxKeyName(o.tenant, o.sandboxId));
    for (const c of mine) await this.store.remove(this.manifestName(o.tenant, c.checkpointId));
    return { checkpointsDeleted: mine.length };
  }

  private async tenantNames(): Promise<string[]> {
    const names = new Set<string>();
    for (const e of await this.store.list('data')) {
      const t = e.name.split('/')[1];
      if (t !== undefined) names.add(t);
    }
    for (const e of await this.store.list('keys/tenants')) {
      const base = e.name.split('/')[2] ?? '';
      const m = /^([A-Za-z0-9._-]+)\.(key|destroyed)$/.exec(base);
      if (m) names.add(m[1]!);
    }
    return [...names].sort();
  }

  /**
   * Decrypts and checks everything: every key object, index, pack record (authentication,
   * decompression, chunk id) and manifest (authentication, every reference resolvable).
   * Problems name the tenant, the checkpoints affected and the object.
   */
  async verify(o: { signal?: AbortSignal } = {}): Promise<VerifyReport> {
    this.check();
    return this.withShared(o.signal, () => this.verifyLocked(o));
  }

  private async verifyLocked(o: { signal?: AbortSignal }): Promise<VerifyReport> {
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
    for (const tenant of await this.tenantNames()) {
      if (o.signal?.aborted) throw new DormantError(ErrorCode.COMMAND_ABORTED, 'verify aborted');
      if (await isDestroyed(this.store, tenantTombstoneName(tenant))) {
        report.shreddedTenants.push(tenant);
        continue;
      }
      report.tenants++;
      await this.verifyTenant(tenant, report);
    }
    report.ok = report.problems.length === 0;
    return report;
  }

  private async verifyTenant(tenant: string, report: VerifyReport): Promise<void> {
    const problem = (object: string, message: string, checkpoints: string[] = []): void => {
      report.problems.push({ tenant, object, message, checkpoints });
    };
    let t: TenantState;
    try {
      // A fresh state: verify reads everything from the store, never from a cache.
      this.tenants.delete(tenant);
      t = await this.tenantState(tenant, false);
    } catch (e) {
      problem(`key ${tenantKeyName(tenant)}`, e instanceof Error ? e.message : String(e));
      return;
    }
    const files = await this.store.list(`data/${tenant}`);
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
        const { body } = await this.readManifest(tenant, ck);
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
      const blob = await this.store.read(idxEntry.name);
      const entries = decodeIndex(t.keys.indexKey, tenant, pack, blob);
      if (entries === undefined) {
        problem(
          `index ${pack}`,
          `index ${pack} fails authentication`,
          this.checkpointsUsingPackUnknown(refsOf),
        );
        continue;
      }
      const readers = new PackReaders(this.store, tenant, `pack ${pack}`);
      const packEntry = packs.get(pack)!;
      try {
        const reader = await this.store.openReader(packEntry.name);
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
  private checkpointsUsingPackUnknown(refsOf: Map<string, Set<string>>): string[] {
    return [...refsOf.keys()].sort();
  }

  /**
   * Mark and sweep: chunks referenced by a readable manifest are live; packs with no live
   * chunk are deleted, packs with dead chunks are rewritten without them (so deleted data
   * leaves the disk), and leftovers of interrupted writes are removed. Takes the vault's
   * exclusive lock: it waits for running writes and holds new ones back until it is done.
   */
  async gc(o: GcOptions = {}): Promise<GcReport> {
    this.check();
    const started = performance.now();
    const release = await this.lock.exclusive(this.lockOpts(o.signal));
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
      report.bytesBefore = (await this.store.list('')).reduce((s, e) => s + e.sizeBytes, 0);
      for (const e of await this.store.list('keys')) {
        if (e.name.includes(TMP_MARK)) {
          await this.store.shred(e.name);
          report.temporariesDeleted++;
        }
      }
      for (const tenant of await this.tenantNames()) {
        if (await isDestroyed(this.store, tenantTombstoneName(tenant))) {
          const objs = await this.store.list(`data/${tenant}`);
          if (objs.length > 0) report.tenantsShredded++;
          await this.store.removeAll(`data/${tenant}`);
          await this.store.removeAll(`keys/sandboxes/${tenant}`);
          continue;
        }
        await this.gcTenant(tenant, o, report);
      }
      report.bytesAfter = (await this.store.list('')).reduce((s, e) => s + e.sizeBytes, 0);
      report.reclaimedBytes = Math.max(0, report.bytesBefore - report.bytesAfter);
    } finally {
      await release();
    }
    report.durationMs = Math.round(performance.now() - started);
    return report;
  }

  private async gcTenant(tenant: string, o: GcOptions, report: GcReport): Promise<void> {
    const skip = (reason: string): void => {
      report.skippedTenants.push({ tenant, reason });
    };
    this.tenants.delete(tenant);
    let t: TenantState;
    try {
      t = await this.tenantState(tenant, false);
    } catch (e) {
      skip(e instanceof Error ? e.message : String(e));
      return;
    }
    const files = await this.store.list(`data/${tenant}`);
    // No writer runs (we hold the exclusive lock): every temporary is a crash leftover.
    for (const f of files) {
      if (f.name.includes(TMP_MARK)) {
        await this.store.remove(f.name);
        report.temporariesDeleted++;
      }
    }
    const live = new Set<string>();
    for (const f of files) {
      const ck = f.name.split('/')[2] === 'manifests' ? ckptIdOf(f.name) : undefined;
      if (ck === undefined) continue;
      try {
        const { body } = await this.readManifest(tenant, ck);
        for (let at = 0; at < body.refs.length; at += REF_BYTES) {
          if (body.refs[at] !== REF_HOLE)
            live.add(body.refs.subarray(at + 5, at + 5 + CHUNK_ID_BYTES).toString('hex'));
        }
      } catch (e) {
        if (e instanceof DormantError && e.code === ErrorCode.SANDBOX_KEY_DESTROYED) {
          await this.store.remove(f.name);
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
        kind === 'packs'
          ? packIdOf(f.name, '.pack')
          : kind === 'index'
            ? packIdOf(f.name, '.idx')
            : undefined;
      if (p === undefined) continue;
      (kind === 'packs' ? packs : indexes).set(p, f);
    }
    const decoded = new Map<string, ReturnType<typeof decodeIndex>>();
    for (const [pack, e] of indexes) {
      const entries = decodeIndex(t.keys.indexKey, tenant, pack, await this.store.read(e.name));
      if (entries === undefined) {
        skip(`index ${pack} fails authentication`);
        return;
      }
      decoded.set(pack, entries);
    }
    // Orphans: packs without an index (crash before the index commit), indexes without a pack.
    for (const [pack, e] of packs) {
      if (!indexes.has(pack)) {
        await this.store.remove(e.name);
        report.packsDeleted++;
      }
    }
    const claimed = new Set<string>();
    const writer = new PackWriter(this.store, tenant, t.keys, () => undefined, this.opts.packTargetBytes);
    const repackedAway: string[] = [];
    try {
      for (const [pack, entries] of [...decoded].sort(([a], [b]) => a.localeCompare(b))) {
        if (!packs.has(pack)) {
          await this.store.remove(indexes.get(pack)!.name);
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
        const readers = new PackReaders(this.store, tenant, `gc of pack ${pack}`);
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
      await this.store.remove(indexes.get(pack)!.name);
      report.indexesDeleted++;
      await this.store.remove(packs.get(pack)!.name);
      report.packsDeleted++;
    }
    this.tenants.delete(tenant);
  }

  /** Logical and stored sizes, deduplication and compression ratios, per tenant and in total. */
  async stats(): Promise<VaultStats> {
    this.check();
    return this.withShared(undefined, () => this.statsLocked());
  }

  /**
   * Stored bytes attributed to each checkpoint after deduplication: every chunk's sealed size
   * is split evenly among the checkpoints that reference it, and a checkpoint's own manifest is
   * its own. The sum over a tenant's checkpoints is what its chunks and manifests occupy.
   */
  async attribution(): Promise<
    { tenant: string; sandboxId: string; checkpointId: string; storedBytes: number }[]
  > {
    this.check();
    return this.withShared(undefined, async () => {
      const out: { tenant: string; sandboxId: string; checkpointId: string; storedBytes: number }[] = [];
      for (const tenant of await this.tenantNames()) {
        if (await isDestroyed(this.store, tenantTombstoneName(tenant))) continue;
        const t = await this.tenantState(tenant, false);
        await this.refreshIndex(tenant, t);
        const cks: { sandboxId: string; checkpointId: string; chunks: Set<string>; own: number }[] = [];
        const refcount = new Map<string, number>();
        for (const f of await this.store.list(`data/${tenant}/manifests`)) {
          const ck = ckptIdOf(f.name);
          if (ck === undefined) continue;
          const m = await this.readManifest(tenant, ck).catch(() => undefined);
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
    });
  }

  private async statsLocked(): Promise<VaultStats> {
    const tenants: TenantStats[] = [];
    for (const tenant of await this.tenantNames()) {
      if (await isDestroyed(this.store, tenantTombstoneName(tenant))) continue;
      const t = await this.tenantState(tenant, false);
      await this.refreshIndex(tenant, t);
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
      for (const f of await this.store.list(`data/${tenant}`)) {
        s.storedBytes += f.sizeBytes;
        const ck = f.name.split('/')[2] === 'manifests' ? ckptIdOf(f.name) : undefined;
        if (ck === undefined) continue;
        const { body } = await this.readManifest(tenant, ck).catch(() => ({ body: undefined }));
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
    return { location: this.store.location, tenants, total };
  }

  /** Forgets every key held in memory. The vault cannot be used afterwards. */
  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    for (const p of this.tenants.values()) {
      await p.then(
        (s) => wipeTenantKeys(s.keys),
        () => undefined,
      );
    }
    this.tenants.clear();
    for (const k of this.sandboxKeys.values()) k.fill(0);
    this.sandboxKeys.clear();
    this.master.fill(0);
    await this.pool?.close();
    this.pool = undefined;
    await this.decodePool?.close();
    this.decodePool = undefined;
  }
}
