/**
 * PostgreSQL implementation of the state store: the database of record a fleet of nodes
 * shares. It answers the same as the SQLite store (state/sqlite.ts) for the same calls; what
 * differs is that other processes write the same rows, so every compare-and-set is one
 * statement the server decides, and nothing read may be kept (`sandboxVersion` undefined).
 */
import pg from 'pg';
import type { MeterSample } from '../domain/cost.js';
import { DEFAULT_GPU_POLICY } from '../domain/gpu.js';
import { DormantError, ErrorCode } from '../domain/errors.js';
import type { Sandbox, SandboxSpec, SandboxState, Transition } from '../domain/sandbox.js';
import type {
  CheckpointRecord,
  FleetStore,
  RegistryCredentialRow,
  SandboxQuery,
  StateStore,
  StoredSample,
  TokenRow,
} from './store.js';
import type { TemplateRecord, TemplateStore } from './templates.js';
import { redactUrl } from './redact.js';
import { AWAKE_STATES, type NodeCapacity, type NodeInfo, type NodeState } from '../domain/node.js';
import {
  checkpointFromRow,
  patchAssignments,
  sandboxFromRow,
  type CheckpointRow,
  type SandboxRow,
} from './rows.js';

/**
 * The schema, one entry per version (version N is the first N entries applied), the end state
 * of SQLite's MIGRATIONS in PostgreSQL's types: BIGINT for times in ms and byte counts (read
 * back as numbers). Specs and checkpoint facts are JSON, not JSONB: JSON keeps the text as
 * written, so an object reads back with its keys in their order, as from SQLite (JSONB sorts
 * them, and code that compares JSON.stringify of a spec, such as the runtime's record check,
 * would see a change where there is none). Text that is ordered or paged on is COLLATE "C":
 * byte order, as SQLite orders, whatever the database's locale.
 *
 * Transition ids: readers page by them (`sinceId`: GET /v1/events, the metrics fold), so a
 * reader must never see an id while a smaller one can still appear. A sequence alone gives
 * ids at insert, not at commit: two overlapping transactions can commit 11 before 10, and a
 * reader that saw 11 passes 10 for good. So the trigger takes each id while holding a shared
 * lock that the writer keeps until it ends, and a reader first waits for a moment no writer
 * holds it (dormant_transitions_settled: a try, never a queued request, so writers never
 * wait behind a reader): every id up to the sequence's value then belongs to a finished
 * transaction, and the reader reads only up to it.
 * Append to change it; never edit an entry that has shipped.
 */
export const PG_MIGRATIONS: readonly string[] = [
  `CREATE TABLE sandboxes (
     id TEXT COLLATE "C" PRIMARY KEY,
     tenant TEXT COLLATE "C" NOT NULL,
     name TEXT COLLATE "C" NOT NULL,
     state TEXT NOT NULL,
     spec JSON NOT NULL,
     created_at BIGINT NOT NULL,
     state_since BIGINT NOT NULL,
     last_active_at BIGINT NOT NULL,
     checkpoint_id TEXT,
     last_error TEXT,
     memory_bytes BIGINT NOT NULL DEFAULT 0,
     address TEXT,
     gpus TEXT,
     gpu_policy TEXT NOT NULL DEFAULT 'keep-running',
     lazy_restore_of TEXT,
     CONSTRAINT sandboxes_tenant_name UNIQUE (tenant, name)
   );
   CREATE INDEX sandboxes_listing ON sandboxes (created_at, id);
   CREATE SEQUENCE transitions_id AS BIGINT;
   CREATE TABLE transitions (
     id BIGINT PRIMARY KEY,
     sandbox_id TEXT COLLATE "C" NOT NULL,
     tenant TEXT COLLATE "C" NOT NULL,
     from_state TEXT,
     to_state TEXT NOT NULL,
     at BIGINT NOT NULL,
     reason TEXT NOT NULL
   );
   CREATE INDEX transitions_sandbox ON transitions (sandbox_id, id);
   CREATE FUNCTION dormant_transition_id() RETURNS trigger LANGUAGE plpgsql AS $$
   BEGIN
     PERFORM pg_advisory_xact_lock_shared(hashtext('dormant transitions'));
     NEW.id := nextval('transitions_id');
     RETURN NEW;
   END $$;
   CREATE TRIGGER transitions_id BEFORE INSERT ON transitions
     FOR EACH ROW EXECUTE FUNCTION dormant_transition_id();
   CREATE FUNCTION dormant_transitions_settled(wait_ms INTEGER) RETURNS BIGINT LANGUAGE plpgsql AS $$
   DECLARE
     deadline TIMESTAMPTZ := clock_timestamp() + wait_ms * INTERVAL '1 millisecond';
     settled BIGINT;
   BEGIN
     WHILE NOT pg_try_advisory_xact_lock(hashtext('dormant transitions')) LOOP
       IF clock_timestamp() > deadline THEN RETURN NULL; END IF;
       PERFORM pg_sleep(0.002);
     END LOOP;
     SELECT CASE WHEN is_called THEN last_value ELSE 0 END INTO settled FROM transitions_id;
     RETURN settled;
   END $$;
   CREATE TABLE checkpoints (
     id TEXT COLLATE "C" PRIMARY KEY,
     sandbox_id TEXT COLLATE "C" NOT NULL,
     tenant TEXT COLLATE "C" NOT NULL,
     created_at BIGINT NOT NULL,
     kind TEXT NOT NULL,
     logical_bytes BIGINT NOT NULL,
     stored_bytes BIGINT NOT NULL,
     meta JSON NOT NULL,
     deleted_at BIGINT
   );
   CREATE INDEX checkpoints_sandbox ON checkpoints (sandbox_id, created_at);
   CREATE TABLE tokens (
     hash TEXT COLLATE "C" PRIMARY KEY,
     tenant TEXT COLLATE "C" NOT NULL,
     admin BOOLEAN NOT NULL,
     created_at BIGINT NOT NULL,
     revoked_at BIGINT
   );
   CREATE TABLE samples (
     sandbox_id TEXT COLLATE "C" NOT NULL,
     at BIGINT NOT NULL,
     memory_bytes BIGINT NOT NULL,
     cpu_usage_usec BIGINT NOT NULL,
     disk_bytes BIGINT,
     egress_bytes BIGINT,
     egress_counter BIGINT
   );
   CREATE INDEX samples_at ON samples (at);
   CREATE INDEX samples_sandbox ON samples (sandbox_id, at);
   CREATE TABLE registry_credentials (
     tenant TEXT COLLATE "C" NOT NULL,
     host TEXT COLLATE "C" NOT NULL,
     username TEXT NOT NULL,
     sealed TEXT NOT NULL,
     created_at BIGINT NOT NULL,
     PRIMARY KEY (tenant, host)
   );
   CREATE TABLE templates (
     id TEXT COLLATE "C" PRIMARY KEY,
     tenant TEXT COLLATE "C" NOT NULL,
     name TEXT COLLATE "C" NOT NULL,
     public BOOLEAN NOT NULL DEFAULT false,
     checkpoint_id TEXT NOT NULL,
     spec JSON NOT NULL,
     origin TEXT NOT NULL,
     created_at BIGINT NOT NULL,
     CONSTRAINT templates_tenant_name UNIQUE (tenant, name)
   );`,
  // The fleet: the node each sandbox lives on, and the nodes with their leases (times in
  // milliseconds of the database's clock: dormant_now_ms).
  `ALTER TABLE sandboxes ADD COLUMN node TEXT COLLATE "C";
   -- The memory limit (spec.memoryBytes) as a column, set at insert: what placement sums.
   ALTER TABLE sandboxes ADD COLUMN reserved_bytes BIGINT NOT NULL DEFAULT 0;
   UPDATE sandboxes SET reserved_bytes = COALESCE((spec->>'memoryBytes')::BIGINT, 0);
   -- A node's own sandboxes, and placement's counts and sums by node and state from the
   -- index alone (no table page per sandbox).
   CREATE INDEX sandboxes_node_usage ON sandboxes (node, state) INCLUDE (reserved_bytes);
   CREATE FUNCTION dormant_now_ms() RETURNS BIGINT LANGUAGE sql VOLATILE AS
     $$ SELECT (extract(epoch FROM clock_timestamp()) * 1000)::BIGINT $$;
   CREATE TABLE nodes (
     name TEXT COLLATE "C" PRIMARY KEY,
     url TEXT NOT NULL,
     proxy_url TEXT,
     state TEXT NOT NULL,
     capacity JSON NOT NULL,
     started_at BIGINT NOT NULL,
     lease_until BIGINT NOT NULL,
     lost_at BIGINT,
     -- Its awake sandboxes and their memory limits, summed: kept by the trigger below at each
     -- change, so placement reads the nodes alone (its cost follows the nodes, not the
     -- sandboxes), and recounted when the node registers.
     awake_sandboxes INT NOT NULL DEFAULT 0,
     reserved_bytes BIGINT NOT NULL DEFAULT 0
   );
   CREATE FUNCTION dormant_node_usage() RETURNS trigger LANGUAGE plpgsql AS $$
   DECLARE
     awake_states CONSTANT TEXT[] := ARRAY[${AWAKE_STATES.map((st) => `'${st}'`).join(', ')}];
     old_node TEXT;
     old_bytes BIGINT := 0;
     new_node TEXT;
     new_bytes BIGINT := 0;
   BEGIN
     IF TG_OP <> 'INSERT' THEN
       IF OLD.state = ANY (awake_states) THEN
         old_node := OLD.node;
         old_bytes := OLD.reserved_bytes;
       END IF;
     END IF;
     IF TG_OP <> 'DELETE' THEN
       IF NEW.state = ANY (awake_states) THEN
         new_node := NEW.node;
         new_bytes := NEW.reserved_bytes;
       END IF;
     END IF;
     IF old_node IS NOT DISTINCT FROM new_node AND old_bytes = new_bytes THEN
       RETURN NULL;
     END IF;
     IF old_node IS NOT NULL THEN
       UPDATE nodes SET awake_sandboxes = awake_sandboxes - 1, reserved_bytes = reserved_bytes - old_bytes
        WHERE name = old_node;
     END IF;
     IF new_node IS NOT NULL THEN
       UPDATE nodes SET awake_sandboxes = awake_sandboxes + 1, reserved_bytes = reserved_bytes + new_bytes
        WHERE name = new_node;
     END IF;
     RETURN NULL;
   END $$;
   CREATE TRIGGER sandboxes_node_usage AFTER INSERT OR DELETE OR UPDATE OF node, state, reserved_bytes
     ON sandboxes FOR EACH ROW EXECUTE FUNCTION dormant_node_usage();`,
];

export interface PostgresStoreOptions {
  /**
   * This node's name in a fleet. A transition out of an awake state is then this node's to
   * make only while the sandbox is on this node (or on none), unless it names the node it
   * moves to (a takeover): work queued on a node that has since lost the sandbox to another
   * changes nothing.
   */
  node?: string;
  /** The server cancels a statement that runs longer (default 15 s). */
  statementTimeoutMs?: number;
  /** Connecting (TCP, TLS, login) gives up after this long (default 5 s). */
  connectTimeoutMs?: number;
  /** Connections this node keeps open at most (default 10). */
  maxConnections?: number;
  /**
   * The server ends a session that sits in an open transaction this long (default 60 s), so a
   * node that stalls mid-transaction cannot hold other nodes' rows locked.
   */
  idleInTransactionTimeoutMs?: number;
  /** An idle connection was lost (the server restarted): the next call connects again. */
  onIdleError?: (e: Error) => void;
}

/**
 * int8 (BIGINT, BIGSERIAL, COUNT) as a number: every value stored here (ms times, byte
 * counts, ids) is far below 2^53. Per pool, so other users of `pg` keep its defaults.
 */
type TypeArgs = Parameters<typeof pg.types.getTypeParser>;
function typeParser(oid: TypeArgs[0], format?: TypeArgs[1]): unknown {
  if (oid === pg.types.builtins.INT8 && format !== 'binary') return (v: string): number => Number(v);
  return pg.types.getTypeParser(oid, format) as unknown;
}
const TYPES = { getTypeParser: typeParser as pg.CustomTypesConfig['getTypeParser'] };

/** Node's errno codes for a server that cannot be reached. */
const UNREACHABLE = new Set([
  'ECONNREFUSED',
  'ECONNRESET',
  'ETIMEDOUT',
  'EHOSTUNREACH',
  'ENETUNREACH',
  'ENOTFOUND',
  'EAI_AGAIN',
  'EPIPE',
]);

/**
 * A failure of the connection rather than of the statement, as a DormantError naming the
 * database (never its password); other errors as they are. SQLSTATE class 08 is a lost or
 * refused connection; 57P01-57P03 a server shutting down or starting; 57014 a statement
 * cancelled by statement_timeout; pg's own errors carry no code, only their message.
 */
export function translate(e: unknown, where: string): unknown {
  if (e instanceof DormantError || !(e instanceof Error)) return e;
  const code = (e as { code?: string }).code ?? '';
  // Node's connect errors for a name with several addresses are an AggregateError with no
  // message of its own.
  const msg = e.message || code || e.name;
  if (code === '28P01' || code === '28000')
    return new DormantError(ErrorCode.STATE_UNAVAILABLE, `PostgreSQL at ${where} refused the login: ${msg}`, {
      hint: 'check the user and password of the state database URL (and pg_hba.conf on the server)',
      cause: e,
    });
  if (code === '3D000')
    return new DormantError(ErrorCode.STATE_UNAVAILABLE, `PostgreSQL at ${where}: ${msg}`, {
      hint: 'create the database (createdb NAME) or fix the name in the state database URL',
      cause: e,
    });
  if (code === '57014')
    return new DormantError(
      ErrorCode.STATE_UNAVAILABLE,
      `PostgreSQL at ${where} cancelled a statement: ${msg}`,
      {
        hint: 'the database is overloaded or a lock is held too long; see its log',
        cause: e,
      },
    );
  if (
    UNREACHABLE.has(code) ||
    code.startsWith('08') ||
    code.startsWith('57P0') ||
    /^(Connection terminated|timeout exceeded when trying to connect|Query read timeout|Client has encountered a connection error)/.test(
      msg,
    )
  )
    return new DormantError(ErrorCode.STATE_UNAVAILABLE, `cannot reach PostgreSQL at ${where}: ${msg}`, {
      hint: 'is PostgreSQL up and reachable from this node? check the host and port of the state database URL',
      cause: e,
    });
  return e;
}

const isUnique = (e: unknown, constraint: string): boolean =>
  (e as { code?: string }).code === '23505' && (e as { constraint?: string }).constraint === constraint;

/** One transaction's connection, shared by the stores bound to it. */
interface TxContext {
  client: pg.PoolClient;
  /**
   * The transaction's statements, one at a time in the order called: a caller may start
   * several at once (Promise.all on the tx), and one connection answers one at a time.
   */
  queue: Promise<unknown>;
  /** Savepoints open (nested atomically). */
  depth: number;
  ended: boolean;
}

/** Builds a statement's parameter list: `p(v)` adds `v` and answers its `$N`. */
function params(): { args: unknown[]; p: (v: unknown) => string } {
  const args: unknown[] = [];
  return { args, p: (v) => `$${args.push(v)}` };
}

interface SampleRow {
  sandbox_id: string;
  at: number;
  memory_bytes: number;
  cpu_usage_usec: number;
  disk_bytes: number | null;
  egress_bytes: number | null;
  egress_counter: number | null;
}

interface TemplateRow {
  id: string;
  tenant: string;
  name: string;
  public: boolean;
  checkpoint_id: string;
  spec: SandboxSpec;
  origin: string;
  created_at: number;
}

type PgSandboxRow = SandboxRow<SandboxSpec>;
type PgCheckpointRow = CheckpointRow<Record<string, unknown>> & { deleted_at: number | null };

const asIs = <T>(v: T): T => v;
const toSandbox = (r: PgSandboxRow): Sandbox => sandboxFromRow(r, asIs);
const toCheckpoint = (r: PgCheckpointRow): CheckpointRecord => checkpointFromRow(r, asIs);

const toTemplate = (r: TemplateRow): TemplateRecord => ({
  id: r.id,
  tenant: r.tenant,
  name: r.name,
  public: r.public,
  checkpointId: r.checkpoint_id,
  spec: r.spec,
  origin: r.origin,
  createdAt: r.created_at,
});

/** `col = $N, ...` for the patch's known fields (rows.ts). */
function patchColumns(patch: Partial<Sandbox>, p: (v: unknown) => string): string {
  const cols = patchAssignments(patch);
  // The limit's column follows the spec it comes from.
  if (patch.spec !== undefined) cols.push(['reserved_bytes', patch.spec.memoryBytes]);
  return cols.map(([col, v]) => `${col} = ${p(v)}`).join(', ');
}

/**
 * How long a transitions read waits for a moment without unfinished writers (at most half the
 * statement timeout, which bounds the wait too).
 */
const SETTLE_WAIT_MS = 2_000;

const ADVISORY_SCHEMA_LOCK = `SELECT pg_advisory_xact_lock(hashtext('dormant schema'))`;
/**
 * A migration (and a node's wait for another's) may take longer than a statement may: a
 * future one that rewrites a large table. Still bounded, so a stuck migration is an error.
 */
const MIGRATION_TIMEOUT_MS = 10 * 60_000;

/**
 * Brings the database up to PG_MIGRATIONS in one transaction under an advisory lock, so nodes
 * that start together against a fresh database migrate it once: the others wait for the lock,
 * then find it done. `dormant_schema` holds a row per version applied (a second application
 * of a version would fail on its key). A database from a newer dormant is refused unchanged.
 */
async function migrate(pool: pg.Pool, where: string): Promise<void> {
  const client = await pool.connect();
  let broken: Error | undefined;
  try {
    // pg reads query_timeout from a query's config too (its types leave it out).
    const long = (text: string): pg.QueryConfig =>
      ({ text, query_timeout: MIGRATION_TIMEOUT_MS + 5_000 }) as pg.QueryConfig;
    await client.query('BEGIN');
    await client.query(`SET LOCAL statement_timeout = ${MIGRATION_TIMEOUT_MS}`);
    await client.query(long(ADVISORY_SCHEMA_LOCK));
    await client.query(
      'CREATE TABLE IF NOT EXISTS dormant_schema (version INTEGER PRIMARY KEY, applied_at BIGINT NOT NULL)',
    );
    const { rows } = await client.query<{ v: number }>(
      'SELECT COALESCE(MAX(version), 0)::integer AS v FROM dormant_schema',
    );
    const version = rows[0]?.v ?? 0;
    if (version > PG_MIGRATIONS.length) {
      throw new DormantError(
        ErrorCode.INVALID_ARGUMENT,
        `${where} has schema version ${version}, newer than this dormant's ${PG_MIGRATIONS.length}: it was written by a newer dormant`,
        { hint: 'run the dormant version that wrote it (or a newer one); nothing was changed' },
      );
    }
    for (let v = version; v < PG_MIGRATIONS.length; v++) {
      await client.query(long(PG_MIGRATIONS[v]!));
      await client.query('INSERT INTO dormant_schema (version, applied_at) VALUES ($1, $2)', [
        v + 1,
        Date.now(),
      ]);
    }
    await client.query('COMMIT');
  } catch (e) {
    await client.query('ROLLBACK').catch((re: unknown) => {
      broken = re instanceof Error ? re : new Error(String(re));
    });
    throw e;
  } finally {
    client.release(broken);
  }
}

/**
 * Connects to the database at `url`, brings its schema up to this version and returns the
 * store. Fails with a DormantError naming the URL (without its password) when the server
 * cannot be reached, refuses the login, or holds a newer schema.
 */
export async function openPostgresStore(
  url: string,
  opts: PostgresStoreOptions = {},
): Promise<PostgresStateStore> {
  const where = redactUrl(url);
  const statementTimeoutMs = opts.statementTimeoutMs ?? 15_000;
  const pool = new pg.Pool({
    connectionString: url,
    types: TYPES,
    max: opts.maxConnections ?? 10,
    connectionTimeoutMillis: opts.connectTimeoutMs ?? 5_000,
    statement_timeout: statementTimeoutMs,
    // statement_timeout is the server's: a server that does not answer at all (hung, or the
    // network between gone quiet) is caught by the client's own bound, a little later.
    query_timeout: statementTimeoutMs + 2_000,
    idle_in_transaction_session_timeout: opts.idleInTransactionTimeoutMs ?? 60_000,
    keepAlive: true,
    application_name: 'dormant',
  });
  // An idle connection lost (server restart) is reported here; without a listener the pool's
  // 'error' event would end the process. The next call opens a new connection.
  pool.on('error', (e) => opts.onIdleError?.(e));
  try {
    await migrate(pool, where);
  } catch (e) {
    await pool.end().catch(() => undefined);
    throw translate(e, where);
  }
  return new PostgresStateStore(pool, where, Math.min(SETTLE_WAIT_MS, statementTimeoutMs / 2), opts.node);
}

export class PostgresStateStore implements StateStore {
  /** Other nodes write the same rows: nothing read may be kept. */
  readonly sandboxVersion = undefined;

  /** Made by openPostgresStore (root) or by atomically (bound to a transaction). */
  constructor(
    private readonly pool: pg.Pool,
    /** The URL without its password, for errors. */
    private readonly where: string,
    private readonly settleWaitMs: number,
    private readonly me: string | undefined,
    private readonly tx?: TxContext,
  ) {}

  /**
   * Runs `fn` on the pool, or, bound to a transaction, on its connection after the
   * transaction's earlier statements.
   */
  private async use<T>(fn: (c: pg.Pool | pg.PoolClient) => Promise<T>): Promise<T> {
    const tx = this.tx;
    try {
      if (!tx) return await fn(this.pool);
      const turn = tx.queue.then(() => {
        if (tx.ended) throw new Error('this store is bound to a transaction that has ended');
        return fn(tx.client);
      });
      tx.queue = turn.catch(() => undefined);
      return await turn;
    } catch (e) {
      throw translate(e, this.where);
    }
  }

  private async q<R extends pg.QueryResultRow = Record<string, never>>(
    sql: string,
    args: readonly unknown[] = [],
  ): Promise<pg.QueryResult<R>> {
    return this.use((c) => c.query<R>(sql, args as unknown[]));
  }

  /**
   * A statement that may fail in a way the caller handles (a name taken): inside a transaction
   * it runs under a savepoint of its own, so the transaction can go on after the failure, as
   * SQLite's does (PostgreSQL aborts the whole transaction on a failed statement).
   */
  private async guarded(sql: string, args: readonly unknown[]): Promise<pg.QueryResult> {
    if (!this.tx) return this.q(sql, args);
    return this.use(async (c) => {
      await c.query('SAVEPOINT dormant_statement');
      let r: pg.QueryResult;
      try {
        r = await c.query(sql, args as unknown[]);
      } catch (e) {
        await c.query('ROLLBACK TO SAVEPOINT dormant_statement').catch(() => undefined);
        throw e;
      }
      await c.query('RELEASE SAVEPOINT dormant_statement');
      return r;
    });
  }

  private async savepoint<T>(fn: () => Promise<T>): Promise<T> {
    const tx = this.tx!;
    const name = `dormant_${++tx.depth}`;
    try {
      await this.q(`SAVEPOINT ${name}`);
      let out: T;
      try {
        out = await fn();
      } catch (e) {
        // A failure to roll back means the connection is gone: the outer transaction fails
        // on its next statement with that, so the first error is the one worth answering.
        await this.q(`ROLLBACK TO SAVEPOINT ${name}`).catch(() => undefined);
        throw e;
      }
      await this.q(`RELEASE SAVEPOINT ${name}`);
      return out;
    } finally {
      tx.depth--;
    }
  }

  async atomically<T>(fn: (tx: StateStore) => Promise<T>): Promise<T> {
    return this.inTransaction(fn);
  }

  /** `atomically`, handing the callback this class (its raw queries) rather than the port. */
  private async inTransaction<T>(fn: (tx: PostgresStateStore) => Promise<T>): Promise<T> {
    if (this.tx) return this.savepoint(() => fn(this));
    let client: pg.PoolClient;
    try {
      client = await this.pool.connect();
    } catch (e) {
      throw translate(e, this.where);
    }
    const ctx: TxContext = { client, queue: Promise.resolve(), depth: 0, ended: false };
    const tx = new PostgresStateStore(this.pool, this.where, this.settleWaitMs, this.me, ctx);
    let broken: Error | undefined;
    try {
      await tx.q('BEGIN');
      const out = await fn(tx);
      await tx.q('COMMIT');
      return out;
    } catch (e) {
      // After the callback's statements still running (one it did not await), not among them.
      await ctx.queue;
      await client.query('ROLLBACK').catch((re: unknown) => {
        // The connection is unusable: the pool must not hand it out again.
        broken = re instanceof Error ? re : new Error(String(re));
      });
      throw e;
    } finally {
      ctx.ended = true;
      await ctx.queue;
      client.release(broken);
    }
  }

  async insertToken(t: TokenRow): Promise<void> {
    await this.guarded(
      'INSERT INTO tokens (hash, tenant, admin, created_at, revoked_at) VALUES ($1, $2, $3, $4, $5)',
      [t.hash, t.tenant, t.admin, t.createdAt, t.revokedAt ?? null],
    );
  }

  async listTokens(): Promise<TokenRow[]> {
    const { rows } = await this.q<{
      hash: string;
      tenant: string;
      admin: boolean;
      created_at: number;
      revoked_at: number | null;
    }>('SELECT * FROM tokens ORDER BY created_at, hash');
    return rows.map((r) => ({
      hash: r.hash,
      tenant: r.tenant,
      admin: r.admin,
      createdAt: r.created_at,
      ...(r.revoked_at === null ? {} : { revokedAt: r.revoked_at }),
    }));
  }

  async revokeToken(hash: string, at: number): Promise<boolean> {
    const r = await this.q('UPDATE tokens SET revoked_at = $1 WHERE hash = $2 AND revoked_at IS NULL', [
      at,
      hash,
    ]);
    return (r.rowCount ?? 0) > 0;
  }

  async insertSandbox(s: Sandbox, reason: string): Promise<void> {
    // One statement: the row and its first transition land together without a transaction
    // of our own (a round trip each for BEGIN and COMMIT saved).
    try {
      await this.guarded(
        `WITH s AS (
           INSERT INTO sandboxes (id, tenant, name, state, spec, created_at, state_since, last_active_at,
                                  checkpoint_id, last_error, memory_bytes, address, gpus, gpu_policy, node,
                                  reserved_bytes)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $16, $17)
           RETURNING id, tenant, state, state_since)
         INSERT INTO transitions (sandbox_id, tenant, from_state, to_state, at, reason)
         SELECT id, tenant, NULL, state, state_since, $15 FROM s`,
        [
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
          reason,
          s.node ?? null,
          s.spec.memoryBytes,
        ],
      );
    } catch (e) {
      // Callers check the name first; two nodes creating the same name at once meet here.
      if (isUnique(e, 'sandboxes_tenant_name'))
        throw new DormantError(ErrorCode.SANDBOX_NAME_TAKEN, `a sandbox named ${s.name} already exists`, {
          cause: e,
        });
      throw e;
    }
  }

  /**
   * Inside a transaction the row is locked until it ends (FOR UPDATE): a read-then-write
   * there (markActive, keepalive) cannot be undone by another node writing between the two,
   * which SQLite's one writer at a time gives by itself. Another transaction reading the same
   * sandbox waits for this one, then reads what it wrote.
   */
  async getSandbox(id: string): Promise<Sandbox | undefined> {
    const { rows } = await this.q<PgSandboxRow>(
      `SELECT * FROM sandboxes WHERE id = $1${this.tx ? ' FOR UPDATE' : ''}`,
      [id],
    );
    return rows[0] && toSandbox(rows[0]);
  }

  async listSandboxes(tenant?: string): Promise<Sandbox[]> {
    const { rows } =
      tenant === undefined
        ? await this.q<PgSandboxRow>('SELECT * FROM sandboxes ORDER BY created_at, id')
        : await this.q<PgSandboxRow>('SELECT * FROM sandboxes WHERE tenant = $1 ORDER BY created_at, id', [
            tenant,
          ]);
    return rows.map(toSandbox);
  }

  async querySandboxes(q: SandboxQuery): Promise<Sandbox[]> {
    const { args, p } = params();
    const where: string[] = [];
    if (q.tenant !== undefined) where.push(`tenant = ${p(q.tenant)}`);
    if (q.states !== undefined) where.push(`state = ANY(${p([...q.states])}::text[])`);
    if (q.name !== undefined) where.push(`name = ${p(q.name)}`);
    if (q.node !== undefined) where.push(`node = ${p(q.node)}`);
    // Labels live in the spec (spec.labels): matched in the database, so the page boundary
    // is the database's.
    for (const [key, value] of q.labels ?? []) {
      where.push(
        value === undefined
          ? `spec->'labels'->${p(key)} IS NOT NULL`
          : `spec->'labels'->>${p(key)} = ${p(value)}`,
      );
    }
    if (q.after !== undefined) {
      const at = p(q.after.createdAt);
      where.push(`(created_at > ${at} OR (created_at = ${at} AND id > ${p(q.after.id)}))`);
    }
    const { rows } = await this.q<PgSandboxRow>(
      `SELECT * FROM sandboxes ${where.length ? `WHERE ${where.join(' AND ')}` : ''} ORDER BY created_at, id LIMIT ${p(q.limit)}`,
      args,
    );
    return rows.map(toSandbox);
  }

  async transition(
    id: string,
    from: SandboxState,
    to: SandboxState,
    reason: string,
    at: number,
    patch: Partial<Sandbox> = {},
  ): Promise<boolean> {
    const { args, p } = params();
    const [pid, pfrom, pto, pat, preason] = [p(id), p(from), p(to), p(at), p(reason)];
    const sets = patchColumns(patch, p);
    // An awake sandbox's own transitions are its node's (PostgresStoreOptions.node).
    const mine =
      this.me !== undefined && AWAKE_STATES.includes(from) && patch.node === undefined
        ? ` AND (node IS NULL OR node = ${p(this.me)})`
        : '';
    // The compare-and-set is the UPDATE's WHERE, decided by the server on the row under its
    // lock: of two racing callers (on any node) the second re-reads the row once the first
    // commits, finds it no longer in `from`, and updates nothing. The transitions row comes
    // from the UPDATE's RETURNING in the same statement, so it exists exactly when the
    // update happened.
    const r = await this.q(
      `WITH s AS (
         UPDATE sandboxes SET state = ${pto}, state_since = ${pat}${sets ? `, ${sets}` : ''}
         WHERE id = ${pid} AND state = ${pfrom}${mine}
         RETURNING tenant)
       INSERT INTO transitions (sandbox_id, tenant, from_state, to_state, at, reason)
       SELECT ${pid}, tenant, ${pfrom}, ${pto}, ${pat}, ${preason} FROM s`,
      args,
    );
    return r.rowCount === 1;
  }

  async updateSandbox(id: string, patch: Partial<Omit<Sandbox, 'id' | 'state'>>): Promise<void> {
    const { args, p } = params();
    const sets = patchColumns(patch, p);
    if (sets === '') return;
    await this.q(`UPDATE sandboxes SET ${sets} WHERE id = ${p(id)}`, args);
  }

  async deleteSandbox(id: string, reason: string, at: number): Promise<void> {
    // One statement, as transition: the row goes, its checkpoints are marked deleted (kept
    // for metering) and the end is recorded, or, when another caller deleted it first, none.
    await this.q(
      `WITH d AS (DELETE FROM sandboxes WHERE id = $1 RETURNING tenant, state),
            c AS (UPDATE checkpoints SET deleted_at = $2
                  WHERE sandbox_id = $1 AND deleted_at IS NULL AND EXISTS (SELECT 1 FROM d))
       INSERT INTO transitions (sandbox_id, tenant, from_state, to_state, at, reason)
       SELECT $1, tenant, state, 'deleting', $2, $3 FROM d`,
      [id, at, reason],
    );
  }

  async note(id: string, reason: string, at: number): Promise<void> {
    await this.q(
      `INSERT INTO transitions (sandbox_id, tenant, from_state, to_state, at, reason)
       SELECT id, tenant, state, state, $2, $3 FROM sandboxes WHERE id = $1`,
      [id, at, reason],
    );
  }

  async transitions(
    opts: { sinceId?: number; sandboxId?: string; limit?: number } = {},
  ): Promise<Transition[]> {
    const { args, p } = params();
    const where = [`id > ${p(opts.sinceId ?? 0)}`];
    if (opts.sandboxId !== undefined) where.push(`sandbox_id = ${p(opts.sandboxId)}`);
    if (!this.tx) {
      // Only ids no unfinished transaction can still add to (PG_MIGRATIONS); a statement of
      // its own, so the read after it sees every one of them. Inside a transaction (which may
      // hold the writers' lock itself) it reads what the transaction sees.
      const { rows } = await this.q<{ settled: number | null }>(
        'SELECT dormant_transitions_settled($1) AS settled',
        [Math.round(this.settleWaitMs)],
      );
      const settled = rows[0]?.settled ?? null;
      if (settled !== null) where.push(`id <= ${p(settled)}`);
      // Writers never let go for that long. A reader that pages on is told nothing is certain
      // yet and asks again; one reading it all (the cost report) gets what is committed now.
      else if (opts.sinceId !== undefined) return [];
    }
    const { rows } = await this.q<{
      id: number;
      sandbox_id: string;
      tenant: string;
      from_state: string | null;
      to_state: string;
      at: number;
      reason: string;
    }>(
      `SELECT * FROM transitions WHERE ${where.join(' AND ')} ORDER BY id LIMIT ${p(opts.limit ?? 10_000)}`,
      args,
    );
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

  async insertCheckpoint(c: CheckpointRecord): Promise<void> {
    await this.guarded(
      `INSERT INTO checkpoints (id, sandbox_id, tenant, created_at, kind, logical_bytes, stored_bytes, meta)
       VALUES ($1, $2, $3, $4, $5, $6, $7, $8)`,
      [
        c.id,
        c.sandboxId,
        c.tenant,
        c.createdAt,
        c.kind,
        c.logicalBytes,
        c.storedBytes,
        JSON.stringify(c.meta),
      ],
    );
  }

  async getCheckpoint(id: string): Promise<CheckpointRecord | undefined> {
    const { rows } = await this.q<PgCheckpointRow>(
      'SELECT * FROM checkpoints WHERE id = $1 AND deleted_at IS NULL',
      [id],
    );
    return rows[0] && toCheckpoint(rows[0]);
  }

  async listCheckpoints(opts: { sandboxId?: string; tenant?: string } = {}): Promise<CheckpointRecord[]> {
    const { args, p } = params();
    const where = ['deleted_at IS NULL'];
    if (opts.sandboxId !== undefined) where.push(`sandbox_id = ${p(opts.sandboxId)}`);
    if (opts.tenant !== undefined) where.push(`tenant = ${p(opts.tenant)}`);
    const { rows } = await this.q<PgCheckpointRow>(
      `SELECT * FROM checkpoints WHERE ${where.join(' AND ')} ORDER BY created_at DESC, id DESC`,
      args,
    );
    return rows.map(toCheckpoint);
  }

  async deleteCheckpoint(id: string, at: number = Date.now()): Promise<void> {
    // Kept with its deletion time: metering charges storage for as long as it existed.
    await this.q('UPDATE checkpoints SET deleted_at = $1 WHERE id = $2 AND deleted_at IS NULL', [at, id]);
  }

  async checkpointHistory(): Promise<(CheckpointRecord & { deletedAt?: number })[]> {
    const { rows } = await this.q<PgCheckpointRow>('SELECT * FROM checkpoints ORDER BY created_at, id');
    return rows.map((r) => ({
      ...toCheckpoint(r),
      ...(r.deleted_at !== null ? { deletedAt: r.deleted_at } : {}),
    }));
  }

  async insertSamples(samples: readonly StoredSample[]): Promise<void> {
    if (samples.length === 0) return;
    // One statement for the batch (arrays unnested on the server): all land or none, in one
    // round trip however many sandboxes the meter sampled.
    await this.q(
      `INSERT INTO samples (sandbox_id, at, memory_bytes, cpu_usage_usec, disk_bytes, egress_bytes, egress_counter)
       SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::bigint[], $5::bigint[], $6::bigint[], $7::bigint[])`,
      [
        samples.map((x) => x.sandboxId),
        samples.map((x) => x.at),
        samples.map((x) => Math.round(x.memoryBytes)),
        samples.map((x) => Math.round(x.cpuUsageUsec)),
        samples.map((x) => (x.diskBytes !== undefined ? Math.round(x.diskBytes) : null)),
        samples.map((x) => x.egressBytes ?? null),
        samples.map((x) => x.egressCounter ?? null),
      ],
    );
  }

  async sandboxSamples(sandboxId: string, opts: { since: number; limit: number }): Promise<StoredSample[]> {
    const { rows } = await this.q<SampleRow>(
      `SELECT * FROM samples WHERE sandbox_id = $1
         AND at >= COALESCE((SELECT MAX(at) FROM samples WHERE sandbox_id = $1 AND at < $2), $2)
       ORDER BY at LIMIT $3`,
      [sandboxId, opts.since, opts.limit + 1],
    );
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

  async samples(opts: { since?: number; until?: number } = {}): Promise<MeterSample[]> {
    const { rows } = await this.q<SampleRow>(
      'SELECT * FROM samples WHERE at >= $1 AND at <= $2 ORDER BY at, sandbox_id',
      [opts.since ?? 0, opts.until ?? Number.MAX_SAFE_INTEGER],
    );
    return rows.map((r) => ({
      sandboxId: r.sandbox_id,
      at: r.at,
      memoryBytes: r.memory_bytes,
      cpuUsageUsec: r.cpu_usage_usec,
    }));
  }

  async putRegistryCredential(r: RegistryCredentialRow): Promise<void> {
    await this.q(
      `INSERT INTO registry_credentials (tenant, host, username, sealed, created_at) VALUES ($1, $2, $3, $4, $5)
       ON CONFLICT (tenant, host) DO UPDATE
         SET username = EXCLUDED.username, sealed = EXCLUDED.sealed, created_at = EXCLUDED.created_at`,
      [r.tenant, r.host, r.username, r.sealed, r.createdAt],
    );
  }

  async listRegistryCredentials(tenant?: string): Promise<RegistryCredentialRow[]> {
    type Row = { tenant: string; host: string; username: string; sealed: string; created_at: number };
    const { rows } =
      tenant === undefined
        ? await this.q<Row>('SELECT * FROM registry_credentials ORDER BY tenant, host')
        : await this.q<Row>('SELECT * FROM registry_credentials WHERE tenant = $1 ORDER BY host', [tenant]);
    return rows.map((r) => ({
      tenant: r.tenant,
      host: r.host,
      username: r.username,
      sealed: r.sealed,
      createdAt: r.created_at,
    }));
  }

  async deleteRegistryCredential(tenant: string, host: string): Promise<boolean> {
    const r = await this.q('DELETE FROM registry_credentials WHERE tenant = $1 AND host = $2', [
      tenant,
      host,
    ]);
    return (r.rowCount ?? 0) > 0;
  }

  /** The templates, in the same database; bound to the transaction when this store is. */
  get fleet(): FleetStore {
    const now = 'dormant_now_ms()';
    return {
      registerNode: (n, leaseMs) =>
        this.inTransaction(async (tx) => {
          const { rows } = await tx.q<{ state: NodeState }>(
            `INSERT INTO nodes (name, url, proxy_url, state, capacity, started_at, lease_until)
             VALUES ($1, $2, $3, 'active', $4, $5, ${now} + $6)
             ON CONFLICT (name) DO UPDATE SET url = $2, proxy_url = $3, capacity = $4, started_at = $5,
               lease_until = ${now} + $6, lost_at = NULL,
               state = CASE WHEN nodes.state = 'draining' THEN 'draining' ELSE 'active' END
             RETURNING state`,
            [n.name, n.url, n.proxyUrl ?? null, JSON.stringify(n.capacity), n.startedAt, leaseMs],
          );
          // Its usage counted afresh (sandboxes placed on it before its row existed, or while it
          // was lost): the row is locked by the statement above, so a change that commits later
          // adds itself after this count, and one committed before is in it.
          await tx.q(
            `UPDATE nodes SET (awake_sandboxes, reserved_bytes) =
               (SELECT count(*), COALESCE(sum(reserved_bytes), 0) FROM sandboxes
                 WHERE node = $1 AND state = ANY($2::text[]))
              WHERE name = $1`,
            [n.name, [...AWAKE_STATES]],
          );
          return rows[0]!.state;
        }),
      renewNode: async (name, leaseMs) => {
        const { rows } = await this.q<{ state: NodeState }>(
          `UPDATE nodes SET lease_until = ${now} + $2 WHERE name = $1 AND state <> 'lost' RETURNING state`,
          [name, leaseMs],
        );
        return rows[0]?.state;
      },
      listNodes: (o) => this.nodes(undefined, o?.counts ?? true),
      getNode: async (name, o) => (await this.nodes(name, o?.counts ?? true))[0],
      setNodeState: async (name, state) => {
        const r = await this.q(`UPDATE nodes SET state = $2 WHERE name = $1 AND state <> 'lost'`, [
          name,
          state,
        ]);
        return (r.rowCount ?? 0) > 0;
      },
      expiredNodes: async () => {
        const { rows } = await this.q<{ name: string }>(
          `SELECT name FROM nodes WHERE state <> 'lost' AND lease_until < ${now} ORDER BY name`,
        );
        return rows.map((r) => r.name);
      },
      markNodeLost: async (name, by, at) => {
        // Its awake sandboxes' rows first, then its own: the order the usage trigger takes
        // them in (a sandbox's row, then its node's), so a write the lost node still makes to
        // one of them waits here instead of deadlocking with the takeover.
        await this.q(
          `SELECT 1 FROM sandboxes WHERE node = $1 AND state = ANY($2::text[]) ORDER BY id FOR UPDATE`,
          [name, [...AWAKE_STATES]],
        );
        const r = await this.q(
          `UPDATE nodes SET state = 'lost', lost_at = $2
            WHERE name = $1 AND state <> 'lost' AND lease_until < ${now}`,
          [name, at],
        );
        if ((r.rowCount ?? 0) === 0) return false;
        // A row another node claims meanwhile (a resume) is re-read after its commit and
        // skipped: it is no longer the lost node's.
        await this.q(`UPDATE sandboxes SET node = $2 WHERE node = $1 AND state = ANY($3::text[])`, [
          name,
          by,
          ['hibernated', 'archived', 'failed'],
        ]);
        return true;
      },
      adoptUnplaced: async (name) => {
        const r = await this.q(
          `UPDATE sandboxes SET node = $1 WHERE node IS NULL AND state = ANY($2::text[])`,
          [name, [...AWAKE_STATES, 'failed']],
        );
        return r.rowCount ?? 0;
      },
    };
  }

  /** The nodes (or the one named), with their sandboxes counted by state. */
  private async nodes(name?: string, counts = true): Promise<NodeInfo[]> {
    const { rows } = await this.q<{
      name: string;
      url: string;
      proxy_url: string | null;
      state: NodeState;
      capacity: NodeCapacity;
      started_at: number;
      lease_until: number;
      lost_at: number | null;
      expired: boolean;
      awake_sandboxes: number;
      reserved_bytes: number;
      counts: Record<string, number> | null;
    }>(
      counts
        ? // Its sandboxes by state for `node ls`: one pass over the sandboxes grouped by node
          // and state, read from the index alone (sandboxes_node_usage).
          `SELECT n.*, n.lease_until < dormant_now_ms() AS expired, c.counts
             FROM nodes n LEFT JOIN (
               SELECT node, json_object_agg(state, k) AS counts
                 FROM (SELECT node, state, count(*) AS k FROM sandboxes
                        WHERE ${name === undefined ? 'node IS NOT NULL' : 'node = $1'} GROUP BY node, state) g
                GROUP BY node) c ON c.node = n.name
             ${name === undefined ? '' : 'WHERE n.name = $1'} ORDER BY n.name`
        : // Placement: the nodes alone, with the usage the trigger keeps.
          `SELECT n.*, n.lease_until < dormant_now_ms() AS expired, NULL AS counts FROM nodes n
             ${name === undefined ? '' : 'WHERE n.name = $1'} ORDER BY n.name`,
      name === undefined ? [] : [name],
    );
    return rows.map((r) => ({
      name: r.name,
      url: r.url,
      ...(r.proxy_url !== null ? { proxyUrl: r.proxy_url } : {}),
      state: r.state,
      capacity: r.capacity,
      startedAt: r.started_at,
      leaseUntil: r.lease_until,
      expired: r.expired,
      ...(r.lost_at !== null ? { lostAt: r.lost_at } : {}),
      sandboxes: r.counts ?? {},
      awakeSandboxes: r.awake_sandboxes,
      memoryUsedBytes: r.reserved_bytes,
    }));
  }

  templates(): TemplateStore {
    return {
      insertTemplate: async (t) => {
        try {
          await this.guarded(
            `INSERT INTO templates (id, tenant, name, public, checkpoint_id, spec, origin, created_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)`,
            [t.id, t.tenant, t.name, t.public, t.checkpointId, JSON.stringify(t.spec), t.origin, t.createdAt],
          );
        } catch (e) {
          if (isUnique(e, 'templates_tenant_name'))
            throw new DormantError(
              ErrorCode.TEMPLATE_NAME_TAKEN,
              `a template named ${t.name} already exists`,
              {
                cause: e,
              },
            );
          throw e;
        }
      },
      getTemplate: async (id) => {
        const { rows } = await this.q<TemplateRow>('SELECT * FROM templates WHERE id = $1', [id]);
        return rows[0] && toTemplate(rows[0]);
      },
      listTemplates: async (tenant) => {
        const { rows } =
          tenant === undefined
            ? await this.q<TemplateRow>('SELECT * FROM templates ORDER BY created_at, id')
            : await this.q<TemplateRow>(
                'SELECT * FROM templates WHERE tenant = $1 OR public ORDER BY created_at, id',
                [tenant],
              );
        return rows.map(toTemplate);
      },
      setTemplatePublic: async (id, isPublic) => {
        await this.q('UPDATE templates SET public = $1 WHERE id = $2', [isPublic, id]);
      },
      deleteTemplate: async (id) => {
        const r = await this.q('DELETE FROM templates WHERE id = $1', [id]);
        return (r.rowCount ?? 0) > 0;
      },
    };
  }

  /**
   * Ends the pool (waits for checked-out connections to come back). No `compact`: PostgreSQL
   * reclaims dead rows itself (autovacuum), and a database made by this store never held the
   * unsealed environments SQLite's compact exists to wipe.
   */
  async close(): Promise<void> {
    if (this.tx) throw new Error('close the store, not a transaction bound to it');
    await this.pool.end();
  }
}

/**
 * The advisory lock a node holds on the state database while it runs: (this key, the hash of
 * the node's name), `classid` and `objid` in pg_locks, which is how its holder is found.
 */
const NODE_LOCK_KEY = 0x646f726d; // "dorm"

/** The state database held for one node (lockStateForNode). */
export interface NodeLock {
  /** Ends the lock's connection, and with it the lock. */
  release(): Promise<void>;
}

/**
 * Holds the node's name in the state database for as long as it runs: a session-level
 * advisory lock on a connection of its own, so the server drops it the moment the node's
 * process or connection dies (a crash leaves nothing to clean up). A second process started
 * as the same node is refused with STATE_IN_USE naming the holder: the two would each take
 * the other's sandboxes for their own. A lost connection (the server restarted) is reported
 * through `onLost` and the lock taken again, every `retryMs`, until released; `onLost` hears
 * again if another process got it meanwhile.
 */
export async function lockStateForNode(
  url: string,
  node: string,
  holder: string,
  opts: { connectTimeoutMs?: number; retryMs?: number; onLost?: (why: string) => void } = {},
): Promise<NodeLock> {
  const where = redactUrl(url);
  let released = false;
  let client: pg.Client | undefined;
  let retry: NodeJS.Timeout | undefined;
  const take = async (): Promise<void> => {
    const c = new pg.Client({
      connectionString: url,
      connectionTimeoutMillis: opts.connectTimeoutMs ?? 5_000,
      query_timeout: 15_000,
      keepAlive: true,
      // Seen by the next node refused (pg_stat_activity), and by the operator.
      application_name: `dormant node ${holder}`.slice(0, 63),
    });
    c.on('error', () => undefined); // the end that follows is what counts
    try {
      await c.connect();
      // And the key alone, shared: a daemon from before the fleet held it, exclusively, for
      // the whole database; while one still runs, a node of this version keeps out.
      const got = await c.query<{ ok: boolean }>(
        `SELECT pg_try_advisory_lock_shared($3::BIGINT) AND pg_try_advisory_lock($1::INTEGER, hashtext($2)) AS ok`,
        [NODE_LOCK_KEY, node, NODE_LOCK_KEY],
      );
      if (got.rows[0]?.ok !== true) {
        // objid is the hash's bits read as unsigned (oid).
        const by = await c.query<{ who: string; addr: string | null }>(
          `SELECT a.application_name AS who, a.client_addr::text AS addr
             FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
            WHERE l.locktype = 'advisory' AND l.granted AND l.classid = $1
              AND l.objid = (hashtext($2)::BIGINT & 4294967295)::TEXT::oid
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())`,
          [NODE_LOCK_KEY, node],
        );
        const h = by.rows[0];
        throw new DormantError(
          ErrorCode.STATE_IN_USE,
          `node ${node} is already running on the state database ${where}${
            h ? ` (${h.who || 'unnamed'}${h.addr ? ` from ${h.addr}` : ''})` : ''
          }`,
          {
            hint: 'give each node its own name (--node NAME): nodes share a database, each under its own name',
          },
        );
      }
    } catch (e) {
      await c.end().catch(() => undefined);
      throw translate(e, where);
    }
    c.once('end', () => {
      if (released) return;
      client = undefined;
      opts.onLost?.(`the connection holding this node's lock on ${where} ended; taking it again`);
      schedule();
    });
    client = c;
  };
  const schedule = (): void => {
    retry = setTimeout(() => {
      retry = undefined;
      if (released) return;
      take().catch((e: unknown) => {
        if (released) return;
        if (e instanceof DormantError && e.code === ErrorCode.STATE_IN_USE) opts.onLost?.(e.message);
        schedule();
      });
    }, opts.retryMs ?? 5_000);
    retry.unref();
  };
  await take();
  return {
    release: async () => {
      released = true;
      if (retry) clearTimeout(retry);
      await client?.end().catch(() => undefined);
    },
  };
}
