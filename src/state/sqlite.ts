/**
 * SQLite implementation of the state store (better-sqlite3, WAL, synchronous=FULL so a
 * committed transition survives a crash of the daemon or the machine).
 */
import Database from 'better-sqlite3';
import { chmodSync, closeSync, existsSync, mkdirSync, openSync } from 'node:fs';
import { dirname } from 'node:path';
import type { Sandbox, SandboxState, Transition } from '../domain/sandbox.js';
import type { MeterSample } from '../domain/cost.js';
import { DEFAULT_GPU_POLICY } from '../domain/gpu.js';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';
import { AsyncLocalStorage } from 'node:async_hooks';
import type {
  CheckpointRecord,
  RegistryCredentialRow,
  SandboxQuery,
  StateStore,
  StoredSample,
  TokenRow,
} from './store.js';
import {
  checkpointFromRow,
  patchAssignments,
  sandboxFromRow,
  type CheckpointRow,
  type SandboxRow,
} from './rows.js';
import { SqliteTemplateStore, TEMPLATES_MIGRATION, type TemplateStore } from './templates.js';

export const MIGRATIONS: string[] = [
  `CREATE TABLE sandboxes (
     id TEXT PRIMARY KEY,
     tenant TEXT NOT NULL,
     name TEXT NOT NULL,
     state TEXT NOT NULL,
     spec TEXT NOT NULL,
     created_at INTEGER NOT NULL,
     state_since INTEGER NOT NULL,
     last_active_at INTEGER NOT NULL,
     checkpoint_id TEXT,
     last_error TEXT,
     memory_bytes INTEGER NOT NULL DEFAULT 0,
     address TEXT,
     UNIQUE (tenant, name)
   );
   CREATE TABLE transitions (
     id INTEGER PRIMARY KEY AUTOINCREMENT,
     sandbox_id TEXT NOT NULL,
     tenant TEXT NOT NULL,
     from_state TEXT,
     to_state TEXT NOT NULL,
     at INTEGER NOT NULL,
     reason TEXT NOT NULL
   );
   CREATE INDEX transitions_sandbox ON transitions (sandbox_id, id);
   CREATE TABLE checkpoints (
     id TEXT PRIMARY KEY,
     sandbox_id TEXT NOT NULL,
     tenant TEXT NOT NULL,
     created_at INTEGER NOT NULL,
     kind TEXT NOT NULL,
     logical_bytes INTEGER NOT NULL,
     stored_bytes INTEGER NOT NULL,
     meta TEXT NOT NULL
   );
   CREATE INDEX checkpoints_sandbox ON checkpoints (sandbox_id, created_at);`,
  `CREATE TABLE tokens (
     hash TEXT PRIMARY KEY,
     tenant TEXT NOT NULL,
     admin INTEGER NOT NULL,
     created_at INTEGER NOT NULL,
     revoked_at INTEGER
   );`,
  `CREATE TABLE samples (
     sandbox_id TEXT NOT NULL,
     at INTEGER NOT NULL,
     memory_bytes INTEGER NOT NULL,
     cpu_usage_usec INTEGER NOT NULL
   );
   CREATE INDEX samples_at ON samples (at);
   ALTER TABLE checkpoints ADD COLUMN deleted_at INTEGER;`,
  // GPU sandboxes: rows from before have no GPUs and the default policy.
  `ALTER TABLE sandboxes ADD COLUMN gpus TEXT;
   ALTER TABLE sandboxes ADD COLUMN gpu_policy TEXT NOT NULL DEFAULT 'keep-running';`,
  // The checkpoint a lazy restore is still copying pages in from (NULL: none in flight).
  `ALTER TABLE sandboxes ADD COLUMN lazy_restore_of TEXT;`,
  // The writable layer's use per sample (NULL: not known, a sandbox without a disk quota), and
  // one sandbox's samples found without a scan of everyone's (GET /v1/sandboxes/{id}/metrics).
  `ALTER TABLE samples ADD COLUMN disk_bytes INTEGER;
   CREATE INDEX samples_sandbox ON samples (sandbox_id, at);`,
  // A tenant's registry credentials; the password only sealed with the tenant's key.
  `CREATE TABLE registry_credentials (
     tenant TEXT NOT NULL,
     host TEXT NOT NULL,
     username TEXT NOT NULL,
     sealed TEXT NOT NULL,
     created_at INTEGER NOT NULL,
     PRIMARY KEY (tenant, host)
   );`,
  // Templates: named warmed checkpoints new sandboxes start from (state/templates.ts).
  TEMPLATES_MIGRATION,
  // Egress per sample: the running total and the raw counter it came from (NULL: no egress).
  `ALTER TABLE samples ADD COLUMN egress_bytes INTEGER;
   ALTER TABLE samples ADD COLUMN egress_counter INTEGER;`,
  // The node a sandbox lives on: only a fleet (PostgreSQL) fills it in; kept in step here.
  `ALTER TABLE sandboxes ADD COLUMN node TEXT;`,
];

interface TransitionRow {
  id: number;
  sandbox_id: string;
  tenant: string;
  from_state: string | null;
  to_state: string;
  at: number;
  reason: string;
}

const toSandbox = (r: SandboxRow<string>): Sandbox => sandboxFromRow(r, JSON.parse);
const toCheckpoint = (r: CheckpointRow<string>): CheckpointRecord => checkpointFromRow(r, JSON.parse);

function patchColumns(patch: Partial<Sandbox>): { sql: string; values: unknown[] } {
  const set = patchAssignments(patch);
  return { sql: set.map(([col]) => `${col} = ?`).join(', '), values: set.map(([, v]) => v) };
}

/**
 * The database and its WAL and shared-memory files are private (0600): they hold tenant names,
 * commands and sealed environments. SQLite gives the -wal and -shm files the database file's
 * mode when it creates them, so the database file is made 0600 before SQLite opens it; files
 * left by an older version with another mode are changed too.
 */
function makePrivate(file: string): void {
  closeSync(openSync(file, 'a', 0o600));
  for (const f of [file, `${file}-wal`, `${file}-shm`]) {
    try {
      chmodSync(f, 0o600);
    } catch (e) {
      if (errnoCode(e) !== 'ENOENT') throw e;
    }
  }
}

/**
 * The rows, read and written synchronously (better-sqlite3 answers at once). The port's
 * promises, and the gate that keeps other callers out of an open transaction, are
 * SqliteStateStore's below.
 */
class SqliteRows {
  readonly db: Database.Database;
  /** StateStore.sandboxVersion. */
  sandboxVersion = 0;

  constructor(file: string) {
    if (file !== ':memory:') {
      mkdirSync(dirname(file), { recursive: true, mode: 0o700 });
      makePrivate(file);
    }
    this.db = new Database(file);
    this.db.pragma('journal_mode = WAL');
    // Deleted and overwritten content is zeroed, not left in free pages; VACUUM's scratch copy
    // (compact) stays in memory, never in a temp file on disk.
    this.db.pragma('secure_delete = ON');
    this.db.pragma('temp_store = MEMORY');
    this.db.pragma('synchronous = FULL');
    this.db.pragma('foreign_keys = ON');
    this.db.pragma('busy_timeout = 5000');
    this.migrate(file);
  }

  /**
   * Brings an older database up to this version's schema, after a copy of it is kept beside
   * it (`<file>.v<N>.bak`, made with VACUUM INTO: consistent, and a way back to the version
   * that wrote it). A database from a newer version is refused: this version would misread
   * what it does not know, and its writes could corrupt what the newer one relies on.
   */
  private migrate(file: string): void {
    const version = this.db.pragma('user_version', { simple: true }) as number;
    if (version > MIGRATIONS.length) {
      this.db.close();
      throw new DormantError(
        ErrorCode.INVALID_ARGUMENT,
        `${file} has schema version ${version}, newer than this dormant's ${MIGRATIONS.length}: it was written by a newer dormant`,
        { hint: 'run the dormant version that wrote it (or a newer one); nothing was changed' },
      );
    }
    if (version > 0 && version < MIGRATIONS.length && file !== ':memory:') {
      const backup = `${file}.v${version}.bak`;
      if (!existsSync(backup)) {
        this.db.prepare('VACUUM INTO ?').run(backup);
        chmodSync(backup, 0o600);
      }
    }
    for (let v = version; v < MIGRATIONS.length; v++) {
      this.db.transaction(() => {
        this.db.exec(MIGRATIONS[v]!);
        this.db.pragma(`user_version = ${v + 1}`);
      })();
    }
  }

  private recordTransition(
    id: string,
    tenant: string,
    from: SandboxState | null,
    to: SandboxState,
    reason: string,
    at: number,
  ): void {
    this.db
      .prepare(
        'INSERT INTO transitions (sandbox_id, tenant, from_state, to_state, at, reason) VALUES (?, ?, ?, ?, ?, ?)',
      )
      .run(id, tenant, from, to, at, reason);
  }

  insertSandbox(s: Sandbox, reason: string): void {
    this.sandboxVersion++;
    this.db.transaction(() => {
      this.db
        .prepare(
          `INSERT INTO sandboxes (id, tenant, name, state, spec, created_at, state_since, last_active_at, checkpoint_id, last_error, memory_bytes, address, gpus, gpu_policy, node)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`,
        )
        .run(
          s.id,
          s.tenant,
          s.name,
          s.state,
          JSON.stringify(s.spec),
          s.createdAt,
          s.stateSince,
          s.lastActiveAt,
          s.checkpointId ?? null,
          s.lastError ?? null,
          s.memoryBytes,
          s.address ?? null,
          s.gpus ?? null,
          s.gpuPolicy ?? DEFAULT_GPU_POLICY,
          s.node ?? null,
        );
      this.recordTransition(s.id, s.tenant, null, s.state, reason, s.stateSince);
    })();
  }

  getSandbox(id: string): Sandbox | undefined {
    const r = this.db.prepare('SELECT * FROM sandboxes WHERE id = ?').get(id) as
      SandboxRow<string> | undefined;
    return r && toSandbox(r);
  }

  listSandboxes(tenant?: string): Sandbox[] {
    const rows = (
      tenant === undefined
        ? this.db.prepare('SELECT * FROM sandboxes ORDER BY created_at, id').all()
        : this.db.prepare('SELECT * FROM sandboxes WHERE tenant = ? ORDER BY created_at, id').all(tenant)
    ) as SandboxRow<string>[];
    return rows.map(toSandbox);
  }

  querySandboxes(q: SandboxQuery): Sandbox[] {
    const where: string[] = [];
    const args: unknown[] = [];
    if (q.tenant !== undefined) {
      where.push('tenant = ?');
      args.push(q.tenant);
    }
    if (q.states !== undefined) {
      where.push(`state IN (${q.states.map(() => '?').join(', ') || 'NULL'})`);
      args.push(...q.states);
    }
    if (q.name !== undefined) {
      where.push('name = ?');
      args.push(q.name);
    }
    if (q.node !== undefined) {
      where.push('node = ?');
      args.push(q.node);
    }
    // Labels live in the spec's JSON (spec.labels): matched there, so a filter never needs
    // the rows in memory and the page boundary is the database's.
    for (const [key, value] of q.labels ?? []) {
      where.push(
        `EXISTS (SELECT 1 FROM json_each(spec, '$.labels') WHERE key = ?${value !== undefined ? ' AND value = ?' : ''})`,
      );
      args.push(key, ...(value !== undefined ? [value] : []));
    }
    if (q.after !== undefined) {
      where.push('(created_at > ? OR (created_at = ? AND id > ?))');
      args.push(q.after.createdAt, q.after.createdAt, q.after.id);
    }
    const rows = this.db
      .prepare(
        `SELECT * FROM sandboxes ${where.length ? `WHERE ${where.join(' AND ')}` : ''} ORDER BY created_at, id LIMIT ?`,
      )
      .all(...args, q.limit) as SandboxRow<string>[];
    return rows.map(toSandbox);
  }

  transition(
    id: string,
    from: SandboxState,
    to: SandboxState,
    reason: string,
    at: number,
    patch: Partial<Sandbox> = {},
  ): boolean {
    this.sandboxVersion++;
    return this.db.transaction(() => {
      const cur = this.db.prepare('SELECT tenant, state FROM sandboxes WHERE id = ?').get(id) as
        { tenant: string; state: string } | undefined;
      if (cur?.state !== from) return false;
      const { sql, values } = patchColumns(patch);
      this.db
        .prepare(`UPDATE sandboxes SET state = ?, state_since = ?${sql ? `, ${sql}` : ''} WHERE id = ?`)
        .run(to, at, ...values, id);
      this.recordTransition(id, cur.tenant, from, to, reason, at);
      return true;
    })();
  }

  updateSandbox(id: string, patch: Partial<Omit<Sandbox, 'id' | 'state'>>): void {
    const { sql, values } = patchColumns(patch);
    if (sql === '') return;
    this.sandboxVersion++;
    this.db.prepare(`UPDATE sandboxes SET ${sql} WHERE id = ?`).run(...values, id);
  }

  deleteSandbox(id: string, reason: string, at: number): void {
    this.sandboxVersion++;
    this.db.transaction(() => {
      const cur = this.db.prepare('SELECT tenant, state FROM sandboxes WHERE id = ?').get(id) as
        { tenant: string; state: SandboxState } | undefined;
      if (!cur) return;
      this.db.prepare('DELETE FROM sandboxes WHERE id = ?').run(id);
      this.db
        .prepare('UPDATE checkpoints SET deleted_at = ? WHERE sandbox_id = ? AND deleted_at IS NULL')
        .run(at, id);
      // 'deleted' is not a state a sandbox rests in; the transition records the end.
      this.recordTransition(id, cur.tenant, cur.state, 'deleting', reason, at);
    })();
  }

  note(id: string, reason: string, at: number): void {
    const cur = this.db.prepare('SELECT tenant, state FROM sandboxes WHERE id = ?').get(id) as
      { tenant: string; state: SandboxState } | undefined;
    if (cur) this.recordTransition(id, cur.tenant, cur.state, cur.state, reason, at);
  }

  transitions(opts: { sinceId?: number; sandboxId?: string; limit?: number } = {}): Transition[] {
    const where: string[] = ['id > ?'];
    const args: unknown[] = [opts.sinceId ?? 0];
    if (opts.sandboxId !== undefined) {
      where.push('sandbox_id = ?');
      args.push(opts.sandboxId);
    }
    const rows = this.db
      .prepare(`SELECT * FROM transitions WHERE ${where.join(' AND ')} ORDER BY id LIMIT ?`)
      .all(...args, opts.limit ?? 10_000) as TransitionRow[];
    return rows.map((r) => ({
      id: r.id,
      sandboxId: r.sandbox_id,
      tenant: r.tenant,
      from: r.from_state as SandboxState | null,
      to: r.to_state as SandboxState,
      at: r.at,
      reason: r.reason,
    }));
  }

  insertCheckpoint(c: CheckpointRecord): void {
    this.db
      .prepare(
        'INSERT INTO checkpoints (id, sandbox_id, tenant, created_at, kind, logical_bytes, stored_bytes, meta) VALUES (?, ?, ?, ?, ?, ?, ?, ?)',
      )
      .run(
        c.id,
        c.sandboxId,
        c.tenant,
        c.createdAt,
        c.kind,
        c.logicalBytes,
        c.storedBytes,
        JSON.stringify(c.meta),
      );
  }

  getCheckpoint(id: string): CheckpointRecord | undefined {
    const r = this.db.prepare('SELECT * FROM checkpoints WHERE id = ? AND deleted_at IS NULL').get(id) as
      CheckpointRow<string> | undefined;
    return r && toCheckpoint(r);
  }

  listCheckpoints(opts: { sandboxId?: string; tenant?: string } = {}): CheckpointRecord[] {
    const where: string[] = ['deleted_at IS NULL'];
    const args: unknown[] = [];
    if (opts.sandboxId !== undefined) {
      where.push('sandbox_id = ?');
      args.push(opts.sandboxId);
    }
    if (opts.tenant !== undefined) {
      where.push('tenant = ?');
      args.push(opts.tenant);
    }
    const rows = this.db
      .prepare(
        `SELECT * FROM checkpoints ${where.length ? `WHERE ${where.join(' AND ')}` : ''} ORDER BY created_at DESC, id DESC`,
      )
      .all(...args) as CheckpointRow<string>[];
    return rows.map(toCheckpoint);
  }

  deleteCheckpoint(id: string, at: number = Date.now()): void {
    // Kept with its deletion time: metering charges storage for as long as it existed.
    this.db.prepare('UPDATE checkpoints SET deleted_at = ? WHERE id = ? AND deleted_at IS NULL').run(at, id);
  }

  checkpointHistory(): (CheckpointRecord & { deletedAt?: number })[] {
    const rows = this.db
      .prepare('SELECT * FROM checkpoints ORDER BY created_at')
      .all() as (CheckpointRow<string> & {
      deleted_at: number | null;
    })[];
    return rows.map((r) => ({
      ...toCheckpoint(r),
      ...(r.deleted_at !== null ? { deletedAt: r.deleted_at } : {}),
    }));
  }

  insertSamples(samples: readonly StoredSample[]): void {
    const stmt = this.db.prepare(
      'INSERT INTO samples (sandbox_id, at, memory_bytes, cpu_usage_usec, disk_bytes, egress_bytes, egress_counter) VALUES (?, ?, ?, ?, ?, ?, ?)',
    );
    this.db.transaction(() => {
      for (const x of samples)
        stmt.run(
          x.sandboxId,
          x.at,
          Math.round(x.memoryBytes),
          Math.round(x.cpuUsageUsec),
          x.diskBytes !== undefined ? Math.round(x.diskBytes) : null,
          x.egressBytes ?? null,
          x.egressCounter ?? null,
        );
    })();
  }

  sandboxSamples(sandboxId: string, opts: { since: number; limit: number }): StoredSample[] {
    const rows = this.db
      .prepare(
        `SELECT * FROM samples WHERE sandbox_id = ?
           AND at >= COALESCE((SELECT MAX(at) FROM samples WHERE sandbox_id = ? AND at < ?), ?)
         ORDER BY at LIMIT ?`,
      )
      .all(sandboxId, sandboxId, opts.since, opts.since, opts.limit + 1) as {
      sandbox_id: string;
      at: number;
      memory_bytes: number;
      cpu_usage_usec: number;
      disk_bytes: number | null;
      egress_bytes: number | null;
      egress_counter: number | null;
    }[];
    return rows.map((r) => ({
      sandboxId: r.sandbox_id,
      at: r.at,
      memoryBytes: r.memory_bytes,
      cpuUsageUsec: r.cpu_usage_usec,
      ...(r.disk_bytes !== null ? { diskBytes: r.disk_bytes } : {}),
      ...(r.egress_bytes !== null && r.egress_counter !== null
        ? { egressBytes: r.egress_bytes, egressCounter: r.egress_counter }
        : {}),
    }));
  }

  samples(opts: { since?: number; until?: number } = {}): MeterSample[] {
    const rows = this.db
      .prepare('SELECT * FROM samples WHERE at >= ? AND at <= ? ORDER BY at, sandbox_id')
      .all(opts.since ?? 0, opts.until ?? Number.MAX_SAFE_INTEGER) as {
      sandbox_id: string;
      at: number;
      memory_bytes: number;
      cpu_usage_usec: number;
    }[];
    return rows.map((r) => ({
      sandboxId: r.sandbox_id,
      at: r.at,
      memoryBytes: r.memory_bytes,
      cpuUsageUsec: r.cpu_usage_usec,
    }));
  }

  insertToken(t: TokenRow): void {
    this.db
      .prepare('INSERT INTO tokens (hash, tenant, admin, created_at, revoked_at) VALUES (?, ?, ?, ?, ?)')
      .run(t.hash, t.tenant, t.admin ? 1 : 0, t.createdAt, t.revokedAt ?? null);
  }

  listTokens(): TokenRow[] {
    const rows = this.db.prepare('SELECT * FROM tokens ORDER BY created_at').all() as {
      hash: string;
      tenant: string;
      admin: number;
      created_at: number;
      revoked_at: number | null;
    }[];
    return rows.map((r) => ({
      hash: r.hash,
      tenant: r.tenant,
      admin: r.admin === 1,
      createdAt: r.created_at,
      ...(r.revoked_at === null ? {} : { revokedAt: r.revoked_at }),
    }));
  }

  revokeToken(hash: string, at: number): boolean {
    return (
      this.db.prepare('UPDATE tokens SET revoked_at = ? WHERE hash = ? AND revoked_at IS NULL').run(at, hash)
        .changes > 0
    );
  }

  putRegistryCredential(r: RegistryCredentialRow): void {
    this.db
      .prepare(
        'INSERT OR REPLACE INTO registry_credentials (tenant, host, username, sealed, created_at) VALUES (?, ?, ?, ?, ?)',
      )
      .run(r.tenant, r.host, r.username, r.sealed, r.createdAt);
  }

  /** One tenant's logins (every tenant's when undefined), by host. */
  listRegistryCredentials(tenant?: string): RegistryCredentialRow[] {
    const rows = (
      tenant === undefined
        ? this.db.prepare('SELECT * FROM registry_credentials ORDER BY tenant, host').all()
        : this.db.prepare('SELECT * FROM registry_credentials WHERE tenant = ? ORDER BY host').all(tenant)
    ) as { tenant: string; host: string; username: string; sealed: string; created_at: number }[];
    return rows.map((r) => ({
      tenant: r.tenant,
      host: r.host,
      username: r.username,
      sealed: r.sealed,
      createdAt: r.created_at,
    }));
  }

  deleteRegistryCredential(tenant: string, host: string): boolean {
    return (
      this.db.prepare('DELETE FROM registry_credentials WHERE tenant = ? AND host = ?').run(tenant, host)
        .changes > 0
    );
  }

  /**
   * Rewrites the database file from its live rows (VACUUM) and empties the WAL, so no free
   * page, old page version or WAL frame keeps what was overwritten (the clear environment
   * values of rows from before sealing). What the filesystem did with blocks it freed is out of
   * reach from here.
   */
  compact(): void {
    this.db.pragma('wal_checkpoint(TRUNCATE)');
    this.db.exec('VACUUM');
    this.db.pragma('wal_checkpoint(TRUNCATE)');
  }

  close(): void {
    this.db.close();
  }
}

/** A sync read or write of the rows as the port's promise (a throw becomes its rejection). */
async function answer<T>(f: () => T): Promise<T> {
  return f();
}

function internal(message: string): DormantError {
  return new DormantError(ErrorCode.INTERNAL, message, {
    hint: 'a bug in dormant: please report it with the daemon log',
  });
}

/** The port over the rows; how a call reaches them (at once, or after the open transaction) is the subclass's. */
abstract class SqlitePort implements StateStore {
  constructor(protected readonly rows: SqliteRows) {}

  get sandboxVersion(): number {
    return this.rows.sandboxVersion;
  }

  /** Runs `f` on the rows when this store may: its result or throw as a promise. */
  protected abstract run<T>(f: () => T): Promise<T>;
  abstract atomically<T>(fn: (tx: StateStore) => Promise<T>): Promise<T>;
  abstract close(): Promise<void>;

  insertToken(t: TokenRow): Promise<void> {
    return this.run(() => this.rows.insertToken(t));
  }
  listTokens(): Promise<TokenRow[]> {
    return this.run(() => this.rows.listTokens());
  }
  revokeToken(hash: string, at: number): Promise<boolean> {
    return this.run(() => this.rows.revokeToken(hash, at));
  }
  insertSandbox(s: Sandbox, reason: string): Promise<void> {
    return this.run(() => this.rows.insertSandbox(s, reason));
  }
  getSandbox(id: string): Promise<Sandbox | undefined> {
    return this.run(() => this.rows.getSandbox(id));
  }
  listSandboxes(tenant?: string): Promise<Sandbox[]> {
    return this.run(() => this.rows.listSandboxes(tenant));
  }
  querySandboxes(q: SandboxQuery): Promise<Sandbox[]> {
    return this.run(() => this.rows.querySandboxes(q));
  }
  transition(
    id: string,
    from: SandboxState,
    to: SandboxState,
    reason: string,
    at: number,
    patch?: Partial<Sandbox>,
  ): Promise<boolean> {
    return this.run(() => this.rows.transition(id, from, to, reason, at, patch));
  }
  updateSandbox(id: string, patch: Partial<Omit<Sandbox, 'id' | 'state'>>): Promise<void> {
    return this.run(() => this.rows.updateSandbox(id, patch));
  }
  deleteSandbox(id: string, reason: string, at: number): Promise<void> {
    return this.run(() => this.rows.deleteSandbox(id, reason, at));
  }
  note(id: string, reason: string, at: number): Promise<void> {
    return this.run(() => this.rows.note(id, reason, at));
  }
  transitions(opts?: { sinceId?: number; sandboxId?: string; limit?: number }): Promise<Transition[]> {
    return this.run(() => this.rows.transitions(opts));
  }
  insertCheckpoint(c: CheckpointRecord): Promise<void> {
    return this.run(() => this.rows.insertCheckpoint(c));
  }
  getCheckpoint(id: string): Promise<CheckpointRecord | undefined> {
    return this.run(() => this.rows.getCheckpoint(id));
  }
  listCheckpoints(opts?: { sandboxId?: string; tenant?: string }): Promise<CheckpointRecord[]> {
    return this.run(() => this.rows.listCheckpoints(opts));
  }
  deleteCheckpoint(id: string, at?: number): Promise<void> {
    return this.run(() => this.rows.deleteCheckpoint(id, at));
  }
  checkpointHistory(): Promise<(CheckpointRecord & { deletedAt?: number })[]> {
    return this.run(() => this.rows.checkpointHistory());
  }
  insertSamples(samples: readonly StoredSample[]): Promise<void> {
    return this.run(() => this.rows.insertSamples(samples));
  }
  samples(opts?: { since?: number; until?: number }): Promise<MeterSample[]> {
    return this.run(() => this.rows.samples(opts));
  }
  sandboxSamples(sandboxId: string, opts: { since: number; limit: number }): Promise<StoredSample[]> {
    return this.run(() => this.rows.sandboxSamples(sandboxId, opts));
  }
  putRegistryCredential(r: RegistryCredentialRow): Promise<void> {
    return this.run(() => this.rows.putRegistryCredential(r));
  }
  listRegistryCredentials(tenant?: string): Promise<RegistryCredentialRow[]> {
    return this.run(() => this.rows.listRegistryCredentials(tenant));
  }
  deleteRegistryCredential(tenant: string, host: string): Promise<boolean> {
    return this.run(() => this.rows.deleteRegistryCredential(tenant, host));
  }
  /** The templates, in the same database (state/templates.ts), reached as this store is. */
  templates(): TemplateStore {
    return new SqliteTemplateStore(this.rows.db, (f) => this.run(f));
  }
  compact(): Promise<void> {
    return this.run(() => this.rows.compact());
  }
}

/**
 * The store a transaction's callback is handed: its calls go straight to the database, inside
 * the transaction. Refuses to be used once the transaction has ended (a call the callback
 * started and did not wait for).
 */
class SqliteTransaction extends SqlitePort {
  ended = false;
  /** Savepoints of nested `atomically` calls, for their names. */
  private depth = 0;

  protected run<T>(f: () => T): Promise<T> {
    if (this.ended)
      return Promise.reject(internal('a store bound to a transaction was used after the transaction ended'));
    return answer(f);
  }

  /** The same transaction; a throw undoes the inner callback's writes (a savepoint) and goes on up. */
  async atomically<T>(fn: (tx: StateStore) => Promise<T>): Promise<T> {
    if (this.ended) throw internal('a store bound to a transaction was used after the transaction ended');
    const name = `nested_${++this.depth}`;
    this.rows.db.exec(`SAVEPOINT ${name}`);
    try {
      const out = await fn(this);
      this.rows.db.exec(`RELEASE ${name}`);
      return out;
    } catch (e) {
      this.rows.db.exec(`ROLLBACK TO ${name}`);
      this.rows.db.exec(`RELEASE ${name}`);
      throw e;
    } finally {
      this.depth--;
    }
  }

  close(): Promise<void> {
    return Promise.reject(internal("a transaction's store cannot close the database: close the store"));
  }
}

/**
 * SQLite as the state port: every call answers at once, except while a transaction is open
 * (`atomically`): better-sqlite3 has one connection, so a call made then by anyone but the
 * transaction's callback would read its uncommitted rows or land its writes inside it. Such a
 * call waits until the transaction has ended. The callback itself must use the `tx` it is
 * handed: a call on this store from inside it would wait for itself, and throws INTERNAL
 * instead (told by the async context the callback runs in).
 */
export class SqliteStateStore extends SqlitePort {
  /** The transaction open now, if any, and a promise that settles when it has ended. */
  private open: { tx: SqliteTransaction; ended: Promise<void> } | undefined;
  private readonly inside = new AsyncLocalStorage<SqliteTransaction>();

  constructor(file: string) {
    super(new SqliteRows(file));
  }

  protected run<T>(f: () => T): Promise<T> {
    // No transaction open (nearly always): straight to the rows, one promise.
    if (this.open === undefined) return answer(f);
    if (this.inside.getStore() === this.open.tx) return Promise.reject(this.misuse());
    return this.open.ended.then(() => this.run(f));
  }

  private misuse(): DormantError {
    return internal(
      "the state store was called inside its own transaction's callback, which would wait for that transaction forever: the callback must use the tx it is handed",
    );
  }

  /**
   * BEGIN IMMEDIATE (the write lock at once, so the transaction never fails half-way on a
   * lock), `fn(tx)`, COMMIT; ROLLBACK when `fn` throws.
   */
  async atomically<T>(fn: (tx: StateStore) => Promise<T>): Promise<T> {
    while (this.open !== undefined) {
      if (this.inside.getStore() === this.open.tx) throw this.misuse();
      await this.open.ended;
    }
    const db = this.rows.db;
    const tx = new SqliteTransaction(this.rows);
    let end = (): void => undefined;
    this.open = { tx, ended: new Promise<void>((resolve) => (end = resolve)) };
    try {
      db.exec('BEGIN IMMEDIATE');
      const out = await this.inside.run(tx, () => fn(tx));
      db.exec('COMMIT');
      return out;
    } catch (e) {
      if (db.inTransaction) db.exec('ROLLBACK');
      throw e;
    } finally {
      tx.ended = true;
      this.open = undefined;
      end();
    }
  }

  async close(): Promise<void> {
    while (this.open !== undefined) {
      if (this.inside.getStore() === this.open.tx) throw this.misuse();
      await this.open.ended;
    }
    this.rows.close();
  }
}
