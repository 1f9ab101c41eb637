/**
 * The vault's locks (vault/locks.ts, `VaultLocks`) as PostgreSQL advisory locks, for nodes
 * that share one database of record and one bucket prefix: what the local lock files do on one
 * machine, across machines. Every lock is a session lock, so a process that dies (or whose
 * connection dies) drops its locks with its session: nothing to clear after a crash.
 *
 * Keys are the two-int4 form `(class, hashtext(text))`. The classes ("vaun", "vauw", "vagc")
 * differ from each other and from the state layer's node lock class `0x646f726d` ("dorm",
 * `lockStateForNode`: also a (class, hash) pair there, or the same number as one bigint, which
 * is another key space: pg_locks.objsubid 1, not 2); its schema and transitions locks are
 * one-bigint keys. So none can meet them. The text hashed is the vault's location
 * (`s3://bucket/prefix`), with the object's name for creates: two vaults in one database do
 * not wait for each other, and a hash collision only makes two unrelated callers take turns.
 *
 * - Creates (`whileCreating`, the S3 store's writeNew): an exclusive lock on
 *   `(CREATE_CLASS, hashtext(location + '\n' + name))`, taken on a pooled connection with the
 *   server's `lock_timeout` as the bound, held across the HEAD and the PUT, then unlocked.
 * - Writers and gc (`writersAndGc`): two keys per vault. gc takes GC_CLASS exclusively first
 *   (gc against gc), then WRITERS_CLASS exclusively, polling until the running writers are done;
 *   a writer takes WRITERS_CLASS shared and then checks that GC_CLASS is free, else lets go and
 *   waits. Either the writer's check comes first (gc then waits for that writer) or gc's lock
 *   does (the writer backs off): the order lock.ts follows with files. So a gc waiting for
 *   writers keeps new writers out, as on one node. A node's writers share one connection and
 *   one shared lock (counted in the process), so a node with a hundred lazy resumes holds one
 *   connection, not a hundred; each gc has a connection of its own (a session's own shared
 *   lock would not keep its exclusive request out).
 */
import pg from 'pg';
import { DormantError, ErrorCode } from '../domain/errors.js';
import { translate } from './postgres.js';
import { redactUrl } from './redact.js';

/** "vaun": creates of one object name. */
const CREATE_CLASS = 0x7661756e;
/** "vauw": a vault's writers (shared) against its gc (exclusive). */
const WRITERS_CLASS = 0x76617577;
/** "vagc": a vault's gc, taken before WRITERS_CLASS, and what writers check is free. */
const GC_CLASS = 0x76616763;

/** SQLSTATE lock_not_available: `lock_timeout` ran out. */
const LOCK_NOT_AVAILABLE = '55P03';

type Release = () => Promise<void>;

interface LockWait {
  timeoutMs: number;
  signal?: AbortSignal;
}

export interface VaultLocksOptions {
  /** Connecting (TCP, TLS, login) gives up after this long (default 5 s). */
  connectTimeoutMs?: number;
  /** How long a create waits for another node's create of the same object (default 60 s). */
  createWaitMs?: number;
  /** How often writers and gc look again while the other holds the vault (default 50 ms). */
  pollMs?: number;
  /**
   * A connection holding writers' locks ended while they ran (the server restarted, the
   * network broke): meanwhile a gc elsewhere could start. Said here; the lock is taken again.
   */
  onLost?: (why: string) => void;
}

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

function busy(
  why: string,
  hint = 'try again later; gc waits for writes and writes wait for gc',
): DormantError {
  return new DormantError(ErrorCode.VAULT_BUSY, `vault is busy: ${why}`, { hint });
}

function aborted(signal: AbortSignal): DormantError {
  return new DormantError(ErrorCode.COMMAND_ABORTED, 'vault operation aborted', { cause: signal.reason });
}

/** The vault's locks in one PostgreSQL database (see the file's comment). */
export class PgVaultLocks {
  private readonly holders = new Map<string, WritersHolder>();
  private closed = false;

  /** @internal use {@link openVaultLocks}. */
  constructor(
    private readonly url: string,
    private readonly where: string,
    private readonly pool: pg.Pool,
    private readonly opts: Required<Omit<VaultLocksOptions, 'onLost'>> & Pick<VaultLocksOptions, 'onLost'>,
  ) {}

  /** @internal a connection of its own: a gc's, or the writers' holder. */
  client(purpose: string): pg.Client {
    const c = new pg.Client({
      connectionString: this.url,
      connectionTimeoutMillis: this.opts.connectTimeoutMs,
      // Every statement on these is a try (it never waits on a lock): 15 s is a dead server.
      query_timeout: 15_000,
      keepAlive: true,
      application_name: `dormant vault ${purpose}`.slice(0, 63),
    });
    // A connection that breaks emits 'error' and then 'end'; the end is what counts.
    c.on('error', () => undefined);
    return c;
  }

  writersAndGc(location: string): {
    shared(o: LockWait): Promise<Release>;
    exclusive(o: LockWait): Promise<Release>;
  } {
    this.check();
    let h = this.holders.get(location);
    if (h === undefined) {
      h = new WritersHolder(this, location, this.where, this.opts.pollMs, this.opts.onLost);
      this.holders.set(location, h);
    }
    const holder = h;
    return {
      shared: (o) => holder.shared(o),
      exclusive: (o) => this.gc(location, o),
    };
  }

  /**
   * gc's lock on a connection of its own: GC_CLASS (no other gc), then WRITERS_CLASS (no
   * writer), each polled until `timeoutMs` from the start. Ending the connection releases both.
   */
  private async gc(location: string, o: LockWait): Promise<Release> {
    this.check();
    const deadline = Date.now() + o.timeoutMs;
    const c = this.client('gc');
    try {
      await c.connect();
      const take = async (cls: number, why: string): Promise<void> => {
        for (;;) {
          const r = await c.query<{ ok: boolean }>('SELECT pg_try_advisory_lock($1, hashtext($2)) AS ok', [
            cls,
            location,
          ]);
          if (r.rows[0]?.ok === true) return;
          if (o.signal?.aborted) throw aborted(o.signal);
          if (Date.now() > deadline) throw busy(why);
          await sleep(this.opts.pollMs);
        }
      };
      await take(GC_CLASS, 'another garbage collection is running');
      await take(WRITERS_CLASS, 'checkpoints are being written');
    } catch (e) {
      await c.end().catch(() => undefined);
      throw translate(e, this.where);
    }
    let released = false;
    return async () => {
      if (released) return;
      released = true;
      await c.end().catch(() => undefined);
    };
  }

  /**
   * Runs `fn` holding the create lock of `name` in the vault at `location`: a session lock on a
   * pooled connection, waited for up to `createWaitMs` (the server's lock_timeout). When the
   * connection breaks while `fn` runs, the lock went with it and another node may have created
   * the same object meanwhile: the call fails (STATE_UNAVAILABLE) even if `fn` succeeded, so
   * the caller does not use what it wrote; a retry reads what the bucket holds.
   */
  async whileCreating<T>(location: string, name: string, fn: () => Promise<T>): Promise<T> {
    this.check();
    const key = `${location}\n${name}`;
    let c: pg.PoolClient;
    try {
      c = await this.pool.connect();
    } catch (e) {
      throw translate(e, this.where);
    }
    let broken: Error | undefined;
    try {
      try {
        await c.query('SELECT pg_advisory_lock($1, hashtext($2))', [CREATE_CLASS, key]);
      } catch (e) {
        if ((e as { code?: string }).code === LOCK_NOT_AVAILABLE)
          throw busy(
            `waited ${Math.round(this.opts.createWaitMs / 1000)} s for another node's create of ${location}/${name}`,
            'another dormant node is creating the same vault object and has not finished; retry',
          );
        broken = e as Error;
        throw translate(e, this.where);
      }
      let result: T;
      try {
        result = await fn();
      } finally {
        try {
          const r = await c.query<{ ok: boolean }>('SELECT pg_advisory_unlock($1, hashtext($2)) AS ok', [
            CREATE_CLASS,
            key,
          ]);
          if (r.rows[0]?.ok !== true) broken = new Error('the lock was gone at its release');
        } catch (e) {
          broken = e as Error;
        }
      }
      if (broken !== undefined)
        throw new DormantError(
          ErrorCode.STATE_UNAVAILABLE,
          `lost the lock on creating ${location}/${name} in ${this.where} while creating it: ${broken.message}`,
          {
            cause: broken,
            hint: 'another node may have created the same object at that moment; retry (the retry uses what the bucket holds)',
          },
        );
      return result;
    } finally {
      // A connection whose lock state is unknown is ended, not pooled: the server then drops
      // whatever it still holds.
      c.release(broken);
    }
  }

  private check(): void {
    if (this.closed) throw new DormantError(ErrorCode.INTERNAL, 'the vault locks are closed');
  }

  /** Ends every connection, and with them every lock this process holds. */
  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    for (const h of this.holders.values()) await h.close();
    await this.pool.end();
  }
}

/**
 * One vault's writers in this process: one connection holding WRITERS_CLASS shared while any
 * of them runs. Statements on it run one at a time (`serial`).
 */
class WritersHolder {
  private client: pg.Client | undefined;
  /** Writers of this process running now. */
  private count = 0;
  /** Whether `client`'s session holds WRITERS_CLASS shared (false after it was lost). */
  private held = false;
  private tail: Promise<unknown> = Promise.resolve();
  private closed = false;

  constructor(
    private readonly locks: PgVaultLocks,
    private readonly location: string,
    private readonly where: string,
    private readonly pollMs: number,
    private readonly onLost: ((why: string) => void) | undefined,
  ) {}

  private serial<T>(fn: () => Promise<T>): Promise<T> {
    const mine = this.tail.then(fn);
    this.tail = mine.catch(() => undefined);
    return mine;
  }

  private async ok(c: pg.Client, sql: string, cls: number): Promise<boolean> {
    const r = await c.query<{ ok: boolean }>(sql, [cls, this.location]);
    return r.rows[0]?.ok === true;
  }

  private takeShared(c: pg.Client): Promise<boolean> {
    return this.ok(c, 'SELECT pg_try_advisory_lock_shared($1, hashtext($2)) AS ok', WRITERS_CLASS);
  }

  private async dropShared(c: pg.Client): Promise<void> {
    this.held = false;
    await c.query('SELECT pg_advisory_unlock_shared($1, hashtext($2))', [WRITERS_CLASS, this.location]);
  }

  /** The holder's connection, made (and the shared lock taken back, if writers run) when gone. */
  private async connection(): Promise<pg.Client> {
    if (this.client !== undefined) return this.client;
    const c = this.locks.client('writers');
    try {
      await c.connect();
      if (this.count > 0) {
        this.held = await this.takeShared(c);
        if (!this.held)
          this.onLost?.(
            `a garbage collection took the vault ${this.location} while the connection holding its writer lock was down`,
          );
      }
    } catch (e) {
      await c.end().catch(() => undefined);
      throw e;
    }
    c.once('end', () => {
      if (this.client !== c) return;
      this.client = undefined;
      this.held = false;
      if (this.closed || this.count === 0) return;
      this.onLost?.(
        `the connection holding the writer lock of the vault ${this.location} on ${this.where} ended while ${this.count} write(s) ran; taking it again`,
      );
      // Back as soon as the server answers again, not at the next writer.
      void this.serial(() => this.connection()).catch((e: unknown) =>
        this.onLost?.(
          `could not take the writer lock of the vault ${this.location} again: ${(e as Error).message}`,
        ),
      );
    });
    this.client = c;
    return c;
  }

  /** Is no gc holding (or waiting for writers under) GC_CLASS? Asked without waiting. */
  private gcFree(c: pg.Client): Promise<boolean> {
    return this.ok(
      c,
      `SELECT CASE WHEN pg_try_advisory_lock_shared($1, hashtext($2))
              THEN pg_advisory_unlock_shared($1, hashtext($2)) ELSE false END AS ok`,
      GC_CLASS,
    );
  }

  async shared(o: LockWait): Promise<Release> {
    const deadline = Date.now() + o.timeoutMs;
    for (;;) {
      let got: boolean;
      try {
        got = await this.serial(async () => {
          if (this.closed) throw new DormantError(ErrorCode.INTERNAL, 'the vault locks are closed');
          const c = await this.connection();
          // Writers' key first, then the look at gc's: see the file's comment for why.
          if (!this.held) {
            if (!(await this.takeShared(c))) return false;
            this.held = true;
          }
          if (!(await this.gcFree(c))) {
            // Kept while writers of this process run: the gc waits for them.
            if (this.count === 0) await this.dropShared(c);
            return false;
          }
          this.count++;
          return true;
        });
      } catch (e) {
        throw translate(e, this.where);
      }
      if (got) return this.releaser();
      if (o.signal?.aborted) throw aborted(o.signal);
      if (Date.now() > deadline) throw busy('a garbage collection is running');
      await sleep(this.pollMs);
    }
  }

  private releaser(): Release {
    let released = false;
    return () => {
      if (released) return Promise.resolve();
      released = true;
      return this.serial(async () => {
        this.count--;
        const c = this.client;
        if (this.count > 0 || !this.held || c === undefined) return;
        try {
          await this.dropShared(c);
        } catch {
          // The connection is going: ending it drops the lock all the same.
          await c.end().catch(() => undefined);
        }
      });
    };
  }

  async close(): Promise<void> {
    this.closed = true;
    await this.serial(async () => {
      const c = this.client;
      this.client = undefined;
      this.held = false;
      await c?.end().catch(() => undefined);
    }).catch(() => undefined);
  }
}

/**
 * The vault's locks in the database of record at `url` (docs/VAULT.md, "What stays local"):
 * for every node that shares a bucket prefix, with the same database. Connects once to
 * check the server answers (STATE_UNAVAILABLE naming the URL without its password if not).
 * `close()` after the vault that uses them.
 */
export async function openVaultLocks(url: string, opts: VaultLocksOptions = {}): Promise<PgVaultLocks> {
  const where = redactUrl(url);
  const o = {
    connectTimeoutMs: opts.connectTimeoutMs ?? 5_000,
    createWaitMs: opts.createWaitMs ?? 60_000,
    pollMs: opts.pollMs ?? 50,
    ...(opts.onLost ? { onLost: opts.onLost } : {}),
  };
  const pool = new pg.Pool({
    connectionString: url,
    max: 8,
    connectionTimeoutMillis: o.connectTimeoutMs,
    // The server's bound on waiting for another node's create; the client's a little later,
    // for a server that does not answer at all.
    lock_timeout: o.createWaitMs,
    query_timeout: o.createWaitMs + 5_000,
    keepAlive: true,
    application_name: 'dormant vault creates',
  });
  // An idle pooled connection lost (server restart): the next create opens a new one.
  pool.on('error', () => undefined);
  try {
    const c = await pool.connect();
    c.release();
  } catch (e) {
    await pool.end().catch(() => undefined);
    throw translate(e, where);
  }
  return new PgVaultLocks(url, where, pool, o);
}
