/**
 * A daemon for a test, the way most tests run one: on a free loopback port, the host's /usr
 * bound read-only into every sandbox (the python the test servers run on; see
 * runtime/testing/rootfs.ts), warnings kept quiet; an admin client for it; and its teardown.
 */
import assert from 'node:assert/strict';
import { chmod, mkdtemp, rm, stat } from 'node:fs/promises';
import { createHash } from 'node:crypto';
import { dirname, join, resolve } from 'node:path';
import pg from 'pg';
import { startDaemon, type Daemon, type DaemonOptions } from '../../daemon/daemon.js';
import type { S3VaultConfig } from '../../daemon/config.js';
import { DEFAULTS } from '../../daemon/defaults.js';
import type { TestRgw } from '../../vault/testing/rgw.js';
import { DormantApiError, DormantClient } from '../../sdk/client.js';
import { buildBusyboxRootfs } from '../../runtime/testing/rootfs.js';
import { startPostgres, type TestPostgres } from '../../state/testing/postgres.js';

/**
 * The suites' daemons give every sandbox a user namespace, as a daemon does by default;
 * DORMANT_TEST_USER_NAMESPACE=0 runs them without. (Test folders are searchable by others
 * either way: the mapped root must walk through them to its root filesystem.)
 */
const USER_NAMESPACE = process.env.DORMANT_TEST_USER_NAMESPACE !== '0';

/**
 * DORMANT_TEST_STATE=postgres runs the suites' daemons on PostgreSQL instead of SQLite: one
 * private server per test process, one database per data folder (a daemon restarted on the
 * same folder finds its state again). Processes the test starts (the crash suites' daemons)
 * inherit the server through DORMANT_TEST_PG_URL instead of starting their own. The suites
 * then check the PostgreSQL store in the whole product, as they check SQLite by default.
 */
const TEST_STATE = process.env.DORMANT_TEST_STATE;
let pgServer: Promise<TestPostgres> | undefined;

async function testStateUrl(dataDir: string): Promise<string> {
  let admin = process.env.DORMANT_TEST_PG_URL;
  if (admin === undefined) {
    pgServer ??= startPostgres().then((s) => {
      s.endWithProcess();
      return s;
    });
    admin = (await pgServer).url('postgres');
    process.env.DORMANT_TEST_PG_URL = admin;
  }
  const name = `d_${createHash('sha256').update(resolve(dataDir)).digest('hex').slice(0, 16)}`;
  const c = new pg.Client({ connectionString: admin });
  await c.connect();
  try {
    await c.query(`CREATE DATABASE ${name}`).catch((e: unknown) => {
      // Made already: this folder's daemon ran before (a restart).
      if ((e as { code?: string }).code !== '42P04') throw e;
    });
  } finally {
    await c.end();
  }
  const u = new URL(admin);
  u.pathname = `/${name}`;
  return u.toString();
}

/**
 * What a process the test starts (a daemon of its own) needs in its environment to use this
 * process's PostgreSQL server under DORMANT_TEST_STATE=postgres (nothing otherwise).
 */
export async function testStateEnv(): Promise<Record<string, string>> {
  if (TEST_STATE !== 'postgres') return {};
  await testStateUrl('/'); // the server, and DORMANT_TEST_PG_URL naming it
  return { DORMANT_TEST_PG_URL: process.env.DORMANT_TEST_PG_URL! };
}

/** The options every test daemon starts with, unless the test says otherwise. */
export const TEST_DAEMON = {
  listen: '127.0.0.1:0',
  readonlyBinds: [{ source: '/usr', destination: '/usr' }],
  warn: () => undefined,
  userNamespace: USER_NAMESPACE,
} satisfies Partial<DaemonOptions>;

export interface TestDaemon {
  daemon: Daemon;
  client: DormantClient;
}

/**
 * A daemon on `opts.dataDir` with {@link TEST_DAEMON} under `opts`, and an admin client. The
 * test's folders above the data folder (below /tmp) become searchable by others, as an
 * operator makes the folders above a data folder when sandboxes have user namespaces.
 */
export async function startTestDaemon(opts: DaemonOptions): Promise<TestDaemon> {
  for (let p = dirname(resolve(opts.dataDir)); p.startsWith('/tmp/'); p = dirname(p))
    await chmod(p, ((await stat(p)).mode & 0o7777) | 0o001);
  const state =
    opts.state ?? (TEST_STATE === 'postgres' ? { url: await testStateUrl(opts.dataDir) } : undefined);
  const daemon = await startDaemon({ ...TEST_DAEMON, ...opts, ...(state ? { state } : {}) });
  return { daemon, client: new DormantClient({ url: daemon.url, token: daemon.adminToken }) };
}

/** Removes every sandbox `daemon` still has (as cleanup: errors are ignored), then closes it. */
export async function stopTestDaemon(daemon: Daemon | undefined): Promise<void> {
  if (daemon === undefined) return;
  // Its own: in a fleet, the other nodes' sandboxes are theirs to remove (and what it still
  // held of those is released).
  for (const s of await daemon.controller.listOwn())
    await daemon.controller.remove(s.id).catch(() => undefined);
  await daemon.controller.releaseForeign().catch(() => undefined);
  await daemon.close();
}

/** A test's own folder: /tmp/dormant-NAME-XXXXXX, with a busybox rootfs at `rootfs` holding `files`. */
export async function testFolder(
  name: string,
  files?: Record<string, string>,
): Promise<{ dir: string; rootfs: string }> {
  const dir = await mkdtemp(`/tmp/dormant-${name}-`);
  await chmod(dir, 0o711);
  const rootfs = join(dir, 'rootfs');
  await buildBusyboxRootfs(rootfs, files);
  return { dir, rootfs };
}

/** {@link stopTestDaemon} for each of `daemons`, then the test's folder `dir` removed. */
export async function tearDown(dir: string | undefined, ...daemons: (Daemon | undefined)[]): Promise<void> {
  for (const d of daemons) await stopTestDaemon(d);
  if (dir !== undefined) await rm(dir, { recursive: true, force: true });
}

/** The API error that `p` fails with; fails the test when `p` succeeds or fails otherwise. */
export async function apiError(p: Promise<unknown>): Promise<DormantApiError> {
  try {
    await p;
  } catch (e) {
    assert.ok(e instanceof DormantApiError, String(e));
    return e;
  }
  assert.fail('expected an API error');
}

/** A daemon's vault in the test S3 server's bucket under `prefix`, with the default cache and part size. */
export function rgwVault(rgw: TestRgw, prefix: string): S3VaultConfig {
  return {
    url: `s3://${rgw.bucket}/${prefix}`,
    endpoint: rgw.endpoint,
    accessKeyId: rgw.accessKeyId,
    secretAccessKey: { value: rgw.secretAccessKey },
    cacheBytes: DEFAULTS.vault.cacheBytes,
    partSizeBytes: DEFAULTS.vault.partSizeBytes,
  };
}
