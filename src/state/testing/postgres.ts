/**
 * Test fixture: a private PostgreSQL server for one test file, from the distribution's own
 * binaries (Debian: /usr/lib/postgresql/VERSION/bin; setup.sh installs them and leaves the
 * system's cluster stopped). Its data folder is a temp folder under /dev/shm owned by the
 * `postgres` user when the tests run as root (PostgreSQL refuses to run as root); it listens
 * on 127.0.0.1 only, on a free port, with a random password (scram-sha-256) for its one role,
 * and its unix socket stays in the temp folder. fsync is off (the data is thrown away) but
 * commits still wait for the WAL write: a killed server (`halt`) keeps what it committed.
 * `stop` ends the server by its PID and removes the folder; `halt` and `start` kill it (as a
 * crash would) and start it again on the same port and data (fault tests).
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { existsSync, readdirSync, rmSync } from 'node:fs';
import { chown, mkdtemp, open, readFile, rm, writeFile } from 'node:fs/promises';
import { createServer } from 'node:net';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import pg from 'pg';
import { run } from '../../sys/exec.js';

export interface TestPostgres {
  /** The server's port on 127.0.0.1. */
  port: number;
  /** The test role, a superuser. */
  user: string;
  password: string;
  /** Makes a database and answers its URL (`postgres://USER:PASSWORD@127.0.0.1:PORT/NAME`). */
  createDatabase(name: string): Promise<string>;
  /** The URL of a database (made or not). */
  url(database: string): string;
  /** Ends the server and its backends (SIGKILL: as a crash would) and keeps its data. */
  halt(): Promise<void>;
  /** Stops the server and its backends (SIGSTOP): it accepts connections and never answers. */
  freeze(): Promise<void>;
  /** Lets a frozen server go on (SIGCONT). */
  thaw(): Promise<void>;
  /** Starts it again after `halt`, same port and data. */
  start(): Promise<void>;
  /** The server's log so far. */
  log(): Promise<string>;
  /** The server's process id while it runs. */
  pid(): number | undefined;
  /** Ends the server and removes its folder. */
  stop(): Promise<void>;
  /**
   * For a server shared by a whole test process (DORMANT_TEST_STATE=postgres): it no longer
   * keeps the process alive, and goes (killed, its folder removed) when the process exits.
   */
  endWithProcess(): void;
}

/** The newest PostgreSQL server installed from the distribution's packages, if any. */
function pgBinDir(): string | undefined {
  const root = '/usr/lib/postgresql';
  if (!existsSync(root)) return undefined;
  const versions = readdirSync(root)
    .filter((v) => /^\d+$/.test(v) && existsSync(join(root, v, 'bin', 'postgres')))
    .sort((a, b) => Number(b) - Number(a));
  return versions[0] === undefined ? undefined : join(root, versions[0], 'bin');
}

/** Why the PostgreSQL tests cannot run here, or undefined when they can. */
export async function pgMissing(): Promise<string | undefined> {
  const bin = pgBinDir();
  if (bin === undefined || !existsSync(join(bin, 'initdb')))
    return 'PostgreSQL is not installed (/usr/lib/postgresql/*/bin): run scripts/setup.sh (it installs postgresql)';
  if (process.getuid?.() === 0) {
    try {
      await run('id', ['-u', 'postgres'], { timeoutMs: 5_000 });
    } catch {
      return 'there is no postgres user to run PostgreSQL as (it refuses root): install the postgresql package';
    }
  }
  return undefined;
}

async function freePort(): Promise<number> {
  const srv = createServer();
  srv.listen(0, '127.0.0.1');
  await once(srv, 'listening');
  const port = (srv.address() as { port: number }).port;
  await new Promise((r) => srv.close(r));
  return port;
}

/** The user PostgreSQL runs as: `postgres` when we are root, else ourselves. */
async function serverUser(): Promise<{ uid: number; gid: number; asRoot: boolean }> {
  if (process.getuid?.() !== 0)
    return { uid: process.getuid?.() ?? 0, gid: process.getgid?.() ?? 0, asRoot: false };
  const uid = Number((await run('id', ['-u', 'postgres'], { timeoutMs: 5_000 })).stdout.trim());
  const gid = Number((await run('id', ['-g', 'postgres'], { timeoutMs: 5_000 })).stdout.trim());
  return { uid, gid, asRoot: true };
}

/** The direct children of a process (the postmaster's backends), read before it is killed. */
async function childrenOf(pid: number): Promise<number[]> {
  const text = await readFile(`/proc/${pid}/task/${pid}/children`, 'utf8').catch(() => '');
  return text.split(/\s+/).filter(Boolean).map(Number);
}

export async function startPostgres(): Promise<TestPostgres> {
  const bin = pgBinDir();
  if (bin === undefined) throw new Error((await pgMissing()) ?? 'PostgreSQL is not installed');
  const dir = await mkdtemp('/dev/shm/dormant-pg-');
  const data = join(dir, 'data');
  const logFile = join(dir, 'server.log');
  const port = await freePort();
  const user = 'dormant_test';
  const password = randomBytes(18).toString('base64url');
  const who = await serverUser();
  // setpriv execs the server in place (runuser would fork and stay its parent): the PID we
  // hold is the postmaster's own. Should the test process die without stopping it, the
  // parent-death signal ends it (its backends follow their postmaster).
  const as = (cmd: string, args: string[]): [string, string[]] =>
    who.asRoot
      ? [
          'setpriv',
          [
            `--reuid=${who.uid}`,
            `--regid=${who.gid}`,
            '--init-groups',
            '--pdeathsig=KILL',
            '--',
            cmd,
            ...args,
          ],
        ]
      : [cmd, args];

  let child: ChildProcess | undefined;
  let exited: Promise<unknown> = Promise.resolve();

  const url = (database: string): string =>
    `postgres://${user}:${encodeURIComponent(password)}@127.0.0.1:${port}/${encodeURIComponent(database)}`;

  const halt = async (): Promise<void> => {
    const c = child;
    child = undefined;
    if (c?.pid !== undefined && c.exitCode === null && c.signalCode === null) {
      // The whole server goes at once, as with a crash of its machine: backends left behind
      // would hold the shared memory and keep a restart from starting.
      const backends = await childrenOf(c.pid);
      c.kill('SIGKILL');
      for (const b of backends) {
        try {
          process.kill(b, 'SIGKILL');
        } catch (e) {
          if ((e as { code?: string }).code !== 'ESRCH') throw e;
        }
      }
      await exited;
      for (const b of backends) {
        for (let i = 0; i < 100 && existsSync(`/proc/${b}`); i++) await new Promise((r) => setTimeout(r, 20));
      }
    }
  };

  const signalAll = async (signal: NodeJS.Signals): Promise<void> => {
    const pid = child?.pid;
    if (pid === undefined) return;
    for (const p of [pid, ...(await childrenOf(pid))]) {
      try {
        process.kill(p, signal);
      } catch (e) {
        if ((e as { code?: string }).code !== 'ESRCH') throw e;
      }
    }
  };

  const start = async (): Promise<void> => {
    const out = await open(logFile, 'a');
    const [cmd, args] = as(join(bin, 'postgres'), [
      '-D',
      data,
      '-p',
      String(port),
      '-c',
      'listen_addresses=127.0.0.1',
      '-c',
      `unix_socket_directories=${dir}`,
      '-c',
      'fsync=off',
      '-c',
      'full_page_writes=off',
      '-c',
      'max_connections=60',
      '-c',
      'shared_buffers=32MB',
      // Its dynamic shared memory in the data folder, not /dev/shm/PostgreSQL.*: a server
      // killed outright (halt, or the test process dying) would leave those behind.
      '-c',
      'dynamic_shared_memory_type=mmap',
    ]);
    const c = spawn(cmd, args, { stdio: ['ignore', out.fd, out.fd] });
    await out.close();
    child = c;
    exited = once(c, 'exit');
    for (let i = 0; ; i++) {
      const client = new pg.Client({ connectionString: url('postgres'), connectionTimeoutMillis: 1_000 });
      const ok = await client.connect().then(
        () => true,
        () => false,
      );
      await client.end().catch(() => undefined);
      if (ok) return;
      if (i > 150 || c.exitCode !== null) {
        const log = await readFile(logFile, 'utf8').catch(() => '');
        await halt();
        throw new Error(`PostgreSQL did not start on 127.0.0.1:${port}:\n${log.slice(-3000)}`);
      }
      await new Promise((r) => setTimeout(r, 100));
    }
  };

  const stop = async (): Promise<void> => {
    await signalAll('SIGCONT');
    const c = child;
    if (c && c.exitCode === null && c.signalCode === null) {
      // Fast shutdown: clients are disconnected, no checkpoint wait worth having.
      child = undefined;
      c.kill('SIGINT');
      const done = await Promise.race([
        exited.then(() => true),
        new Promise((r) => setTimeout(() => r(false), 10_000)),
      ]);
      if (!done) {
        child = c;
        await halt();
      }
    }
    await rm(dir, { recursive: true, force: true });
  };

  try {
    await chown(dir, who.uid, who.gid);
    const pwfile = join(dir, 'pw');
    await writeFile(pwfile, `${password}\n`, { mode: 0o600 });
    await chown(pwfile, who.uid, who.gid);
    const [cmd, args] = as(join(bin, 'initdb'), [
      '-D',
      data,
      '-U',
      user,
      `--pwfile=${pwfile}`,
      '--auth=scram-sha-256',
      '--encoding=UTF8',
      '--no-sync',
    ]);
    await run(cmd, args, { timeoutMs: 60_000 });
    await rm(pwfile);
    await start();
    const createDatabase = async (name: string): Promise<string> => {
      const admin = new pg.Client({ connectionString: url('postgres') });
      await admin.connect();
      try {
        await admin.query(`CREATE DATABASE ${pg.escapeIdentifier(name)}`);
      } finally {
        await admin.end();
      }
      return url(name);
    };
    return {
      port,
      user,
      password,
      createDatabase,
      url,
      halt,
      freeze: () => signalAll('SIGSTOP'),
      thaw: () => signalAll('SIGCONT'),
      start,
      log: () => readFile(logFile, 'utf8'),
      pid: () => child?.pid,
      stop,
      endWithProcess: () => {
        child?.unref();
        process.once('exit', () => {
          try {
            child?.kill('SIGKILL');
          } catch {
            // gone already
          }
          rmSync(dir, { recursive: true, force: true });
        });
      },
    };
  } catch (e) {
    await stop();
    throw e;
  }
}
