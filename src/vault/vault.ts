/**
 * The vault: where hibernated sandboxes live. See index.ts for the port and docs/VAULT.md for
 * the on-disk format and key design.
 */
import { availableParallelism } from 'node:os';
import { join } from 'node:path';
import { DormantError, ErrorCode } from '../domain/errors.js';
import { makeChunker } from './chunker.js';
import { deriveKey, deriveTenantKeys, wipeTenantKeys } from './crypto.js';
import {
  decodeIndex,
  decodeManifestBody,
  decodeManifestHeader,
  encodeManifest,
  type ManifestBody,
  type ManifestHeader,
} from './format.js';
import { PackWriter, crashPoint, ingestFolder, type IngestCounters } from './ingest.js';
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
import type { Release } from './lock.js';
import { LocalVaultLocks, type VaultLocks, type WriterGcLock } from './locks.js';
import { SealPool } from './seal-pool.js';
import { restoreInto, type RestoreContext } from './restore.js';
import { CheckpointReader } from './reader.js';
import { LocalDirStore, TMP_MARK, type VaultStore } from './store.js';
import {
  ID_RE,
  checkId,
  ckptIdOf,
  isPageImage,
  packIdOf,
  type TenantState,
  type VaultInternals,
} from './internals.js';
import { verifyAll, type VerifyReport } from './verify.js';
import { collectGarbage, type GcOptions, type GcReport } from './gc.js';
import { attributionOf, tenantStats, type VaultStats } from './stats.js';

export { isPageImage } from './internals.js';
export type { VerifyProblem, VerifyReport } from './verify.js';
export type { GcOptions, GcReport } from './gc.js';
export type { TenantStats, VaultStats } from './stats.js';

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
   * Where writers and gc exclude each other. Default: lock files in `dir/locks`, exact on one
   * machine; nodes sharing a bucket prefix pass the PostgreSQL ones (state/pg-locks.ts), the
   * same object their S3 store was given. The vault does not close them.
   */
  locks?: VaultLocks;
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

/**
 * The vault. Create with {@link openVault}; every method is safe to call concurrently with
 * other methods and with other processes using the same directory.
 */
/** Where the vault says which layout version wrote it. */
export const FORMAT_OBJECT = 'FORMAT';
/**
 * The layout this dormant writes and reads (packs, indexes and manifests also carry magic
 * numbers of their own). A change that an older dormant would misread raises it.
 */
const VAULT_FORMAT = 1;

/**
 * Refuses a vault written by a newer dormant, before anything in it is read or written; marks
 * a new vault (or one from before the marker) with this dormant's format.
 */
async function checkFormat(store: VaultStore): Promise<void> {
  let text: string | undefined;
  try {
    text = (await store.read(FORMAT_OBJECT)).toString('utf8');
  } catch (e) {
    if (!(e instanceof DormantError && e.code === ErrorCode.VAULT_NOT_FOUND)) throw e;
  }
  if (text === undefined) {
    await store.writeNew(FORMAT_OBJECT, Buffer.from(JSON.stringify({ format: VAULT_FORMAT }) + '\n'));
    return;
  }
  let format: unknown;
  try {
    format = (JSON.parse(text) as { format?: unknown }).format;
  } catch {
    format = undefined;
  }
  if (typeof format !== 'number' || !Number.isInteger(format))
    throw new DormantError(
      ErrorCode.VAULT_CORRUPT,
      `${store.location}/${FORMAT_OBJECT} is not a vault format marker`,
    );
  if (format > VAULT_FORMAT)
    throw new DormantError(
      'VAULT_FORMAT_NEWER',
      `the vault at ${store.location} has format ${format}, newer than this dormant's ${VAULT_FORMAT}: it was written by a newer dormant`,
    );
}

export class Vault {
  private readonly tenants = new Map<string, Promise<TenantState>>();
  private readonly sandboxKeys = new Map<string, Buffer>();
  private closed = false;
  private pool: SealPool | undefined;
  private decodePool: SealPool | undefined;

  private constructor(
    readonly store: VaultStore,
    private readonly lock: WriterGcLock,
    private master: Buffer,
    private readonly opts: VaultOptions,
  ) {}

  /** The vault's layout version, kept in FORMAT_OBJECT; an older dormant refuses a newer one. */
  static readonly FORMAT = VAULT_FORMAT;

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
        hint: 'check --data-dir (or DORMANT_DATA_DIR); a vault is created by the first stored checkpoint',
      });
    }
    await checkFormat(store);
    const master = await loadMasterKey(opts.masterKey, {
      vaultIsNew,
      warn,
      ...(opts.signal ? { signal: opts.signal } : {}),
    });
    const wrap = deriveKey(master, 'tenant-key-wrap');
    master.fill(0);
    await checkMasterKey(store, wrap, vaultIsNew);
    const locks = opts.locks ?? new LocalVaultLocks(join(opts.dir, 'locks'));
    return new Vault(store, locks.writersAndGc(store.location), wrap, opts);
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

  /**
   * Runs `fn` while gc cannot run (the shared lock writers and readers hold): every chunk,
   * pack and manifest present when `fn` starts stays where it is until it ends. A backup
   * copies the vault's files under it, after snapshotting the state that references them.
   */
  async whileGcHeldOff<T>(fn: () => Promise<T>, signal?: AbortSignal): Promise<T> {
    this.check();
    const release = await this.lock.shared(this.lockOpts(signal));
    try {
      return await fn();
    } finally {
      await release();
    }
  }

  /** The vault as verify, gc and stats work with it. */
  private internals(): VaultInternals {
    return {
      store: this.store,
      lock: this.lock,
      lockOpts: (signal) => this.lockOpts(signal),
      packTargetBytes: this.opts.packTargetBytes,
      tenantState: (tenant, create) => this.tenantState(tenant, create),
      forgetTenant: (tenant) => this.tenants.delete(tenant),
      refreshIndex: (tenant, t) => this.refreshIndex(tenant, t),
      readManifest: (tenant, checkpointId) => this.readManifest(tenant, checkpointId),
    };
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
          { cause: e },
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
        { hint: 'checkpoint ids are never reused; pick a new one' },
      );
    if (await exists()) throw taken();
    if (await isDestroyed(this.store, tenantTombstoneName(o.tenant))) {
      // Checked on every put: another process may have shredded the tenant since we cached its key.
      this.tenants.delete(o.tenant);
      throw new DormantError(ErrorCode.TENANT_KEY_DESTROYED, `the key of tenant ${o.tenant} was destroyed`, {
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

  /**
   * Decrypts and checks everything: every key object, index, pack record (authentication,
   * decompression, chunk id) and manifest (authentication, every reference resolvable).
   * Problems name the tenant, the checkpoints affected and the object.
   */
  async verify(o: { signal?: AbortSignal } = {}): Promise<VerifyReport> {
    this.check();
    return this.withShared(o.signal, () => verifyAll(this.internals(), o));
  }

  /**
   * Mark and sweep: chunks referenced by a readable manifest are live; packs with no live
   * chunk are deleted, packs with dead chunks are rewritten without them (so deleted data
   * leaves the disk), and leftovers of interrupted writes are removed. Takes the vault's
   * exclusive lock: it waits for running writes and holds new ones back until it is done.
   */
  async gc(o: GcOptions = {}): Promise<GcReport> {
    this.check();
    return collectGarbage(this.internals(), o);
  }

  /** Logical and stored sizes, deduplication and compression ratios, per tenant and in total. */
  async stats(): Promise<VaultStats> {
    this.check();
    return this.withShared(undefined, () => tenantStats(this.internals()));
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
    return this.withShared(undefined, () => attributionOf(this.internals()));
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
