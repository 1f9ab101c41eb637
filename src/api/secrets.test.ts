/**
 * `--env` secrets at rest, through the real daemon, runc and CRIU: a value planted with
 * `create --env` reaches the sandbox (also after hibernate, resume, fork and a daemon restart)
 * and is nowhere in plaintext on disk: not in state.db or its WAL (sealed with the tenant's
 * key), not in sandbox.json, not in an OCI config on the data disk (the bundle is on tmpfs),
 * not left in /dev/shm once the sandbox sleeps. Rows written by a version before sealing are
 * sealed at start and the database rewritten. Private files are 0600. A daemon killed
 * mid-hibernate leaves plaintext images in staging: the next start wipes them before anything
 * else, even when it then fails to open its database.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { existsSync, lstatSync, readdirSync, statSync } from 'node:fs';
import { mkdir, readFile, readdir, rename, rm, writeFile } from 'node:fs/promises';
import { randomBytes } from 'node:crypto';
import { createRequire } from 'node:module';
import { createInterface } from 'node:readline';
import { basename, dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import Database from 'better-sqlite3';
import { bundleDirFor, startDaemon, stagingDirFor, type Daemon } from '../daemon/daemon.js';
import { DormantClient, type SandboxInfo } from '../sdk/client.js';
import { filesHolding } from './testing/host.js';
import { TEST_DAEMON, startTestDaemon, stopTestDaemon, tearDown, testFolder } from './testing/daemon.js';
import { SEALED_VALUE_PREFIX } from '../vault/index.js';

const CRASH_DAEMON = fileURLToPath(new URL('./testing/crash-daemon.js', import.meta.url));
const SQLITE_MODULE = createRequire(import.meta.url).resolve('better-sqlite3');

/** A 32-character random marker: a value that can only be on disk if dormant put it there. */
const marker = (): string => randomBytes(16).toString('hex');

/**
 * Everywhere dormant may write: the test's folder (data dir, with the runc state root and the
 * vault), every /dev/shm/dormant* (staging, bundles) and /tmp/dormant* made since `since`.
 * `running` names the OCI configs allowed to hold it: those of containers that run now, on
 * tmpfs (memory, like the process's own environment; runc exec reads them).
 */
function plaintextOnDisk(dir: string, needle: string, since: number, running: string[] = []): string[] {
  return plaintextAnywhere(dir, needle, since).filter((p) => !running.includes(p));
}

function plaintextAnywhere(dir: string, needle: string, since: number): string[] {
  const hits = filesHolding(dir, needle);
  for (const n of readdirSync('/dev/shm'))
    if (n.startsWith('dormant')) hits.push(...filesHolding(join('/dev/shm', n), needle, 64 << 20));
  for (const n of readdirSync('/tmp')) {
    const p = join('/tmp', n);
    if (!n.startsWith('dormant') || p === dir) continue;
    try {
      if (lstatSync(p).mtimeMs < since) continue;
    } catch {
      continue;
    }
    hits.push(...(lstatSync(p).isDirectory() ? filesHolding(p, needle, 64 << 20) : []));
  }
  return hits;
}

const mode = (p: string): string => (statSync(p).mode & 0o777).toString(8);

describe('--env values are sealed at rest and reach the sandbox', () => {
  const since = Date.now();
  let dir: string;
  let data: string;
  let rootfs: string;
  let daemon: Daemon | undefined;
  let client: DormantClient;
  let sb: SandboxInfo;
  const secret = marker();
  const children: ChildProcess[] = [];
  /** The crash test's data dir until it has cleaned up after itself. */
  let crashData: string | undefined;

  const start = async (): Promise<void> => {
    ({ daemon, client } = await startTestDaemon({ dataDir: data, proxy: false, policy: false }));
  };
  const stop = async (): Promise<void> => {
    await daemon?.close();
    daemon = undefined;
  };
  const printenv = async (id: string, name = 'PLANTED'): Promise<string> => {
    const r = await client.exec(id, ['printenv', name]);
    assert.equal(r.exitCode, 0, r.stderr);
    return r.stdout.trim();
  };
  const sandboxDir = (id: string): string => join(data, 'runtime', 'sandboxes', id);
  /** The OCI config of a running sandbox: on tmpfs, 0600. */
  const config = (id: string, dataDir = data): string => join(bundleDirFor(dataDir), id, 'config.json');

  before(async () => {
    ({ dir, rootfs } = await testFolder('secrets'));
    data = join(dir, 'data');
    await start();
  });

  after(async () => {
    for (const c of children) if (c.exitCode === null && c.signalCode === null) c.kill('SIGKILL');
    if (daemon === undefined) await start().catch(() => undefined);
    await stopTestDaemon(daemon).catch(() => undefined);
    daemon = undefined;
    const crashed =
      crashData === undefined
        ? undefined
        : (await startTestDaemon({ dataDir: crashData, readonlyBinds: [], proxy: false, policy: false }))
            .daemon;
    await tearDown(dir, crashed);
  });

  test('create --env: the sandbox sees the value; the database holds it sealed; GET does not show it', async () => {
    sb = await client.createSandbox({
      name: 'agent',
      rootfs,
      command: ['sleep', '1000000'],
      env: { PLANTED: secret, OTHER: 'plain-enough' },
      memory: '64M',
    });
    assert.equal(sb.state, 'running');
    assert.equal(await printenv(sb.id), secret);
    assert.equal(await printenv(sb.id, 'OTHER'), 'plain-enough');
    // pid 1's own environment (memory, not disk) has it too.
    const environ = await client.exec(sb.id, ['cat', '/proc/1/environ']);
    assert.ok(environ.stdout.split('\0').includes(`PLANTED=${secret}`));

    const db = new Database(join(data, 'state.db'), { readonly: true });
    const row = db.prepare('SELECT spec FROM sandboxes WHERE id = ?').get(sb.id) as { spec: string };
    db.close();
    const env = (JSON.parse(row.spec) as { env: Record<string, string> }).env;
    assert.deepEqual(Object.keys(env).sort(), ['OTHER', 'PLANTED'], 'names stay readable');
    for (const v of Object.values(env)) assert.ok(v.startsWith(SEALED_VALUE_PREFIX), `sealed: ${v}`);

    assert.ok(!JSON.stringify(await client.getSandbox(sb.id)).includes(secret), 'GET shows no value');
    assert.ok(!JSON.stringify(await client.listSandboxes()).includes(secret), 'ls shows no value');
    assert.deepEqual(
      plaintextOnDisk(dir, secret, since, [config(sb.id)]),
      [],
      'nowhere on disk while it runs',
    );
    assert.ok(plaintextAnywhere(dir, secret, since).includes(config(sb.id)), 'in its config on tmpfs');
    assert.equal(mode(config(sb.id)), '600');
  });

  test('private files: the data dir 0700 (0701 with user namespaces); state.db, -wal, -shm, output.log, sandbox.json 0600', async () => {
    // With user namespaces others may search the data folder (not list or read it): the
    // sandboxes' mapped roots walk through it to their root filesystems.
    assert.equal(mode(data), TEST_DAEMON.userNamespace ? '701' : '700');
    for (const f of ['state.db', 'state.db-wal', 'state.db-shm']) assert.equal(mode(join(data, f)), '600', f);
    assert.equal(mode(join(sandboxDir(sb.id), 'log', 'output.log')), '600', 'output.log');
    assert.equal(mode(join(sandboxDir(sb.id), 'sandbox.json')), '600', 'sandbox.json');
    assert.equal(mode(join(sandboxDir(sb.id), 'runc.log')), '600', 'runc.log');
    const bundles = bundleDirFor(data);
    assert.equal(mode(bundles), '700', 'the bundles folder on tmpfs');
    // Nothing dormant writes is readable by others (the sandbox's own files keep their modes).
    const open = spawnSync(
      'find',
      [
        data,
        '(',
        '-path',
        '*/fs/upper',
        '-o',
        '-path',
        '*/fs/work',
        '-o',
        '-path',
        '*/bundle/rootfs',
        '-o',
        '-path',
        '*/idmapped',
        '-o',
        '-path',
        `${data}/images`,
        ')',
        '-prune',
        '-o',
        '(',
        '-type',
        'f',
        '-o',
        '-type',
        'd',
        ')',
        '-perm',
        '/077',
        '-print',
      ],
      { encoding: 'utf8' },
    );
    assert.equal(open.status, 0, open.stderr);
    const allowed = (p: string): boolean =>
      // The log collector's pid files (numbers, no tenant data), and runc's own container
      // folders, which runc makes 0711 (search only; runc's files in them are 0600).
      (p.includes('/log/') && p.endsWith('.pid')) ||
      // The sandbox's resolv.conf (resolvers, no tenant data), bound read-only into the
      // sandbox: 0644 so its non-root users can resolve names; its folder stays 0700.
      (p === join(data, 'runtime', 'sandboxes', basename(dirname(p)), 'resolv.conf') && mode(p) === '644') ||
      (p.startsWith(join(data, 'runtime', 'runc') + '/') && statSync(p).isDirectory() && mode(p) === '711') ||
      // With user namespaces, the folders down to each sandbox's root filesystem are
      // searchable by others (the mapped root walks through them), never listable.
      (TEST_DAEMON.userNamespace && statSync(p).isDirectory() && (statSync(p).mode & 0o066) === 0);
    const exposed = open.stdout.split('\n').filter((p) => p !== '' && !allowed(p));
    assert.deepEqual(exposed, [], 'files or folders readable by group or others');
  });

  test('hibernate: nothing in plaintext anywhere (staging, bundles, runc state, WAL); resume: the sandbox has it', async () => {
    const h = await client.hibernate(sb.id);
    assert.equal(h.state, 'hibernated');
    assert.deepEqual(await readdir(stagingDirFor(data)), [], 'staging wiped');
    assert.ok(!existsSync(join(bundleDirFor(data), sb.id, 'config.json')), 'no config while it sleeps');
    assert.deepEqual(plaintextOnDisk(dir, secret, since), [], 'nowhere while hibernated');
    assert.equal((await client.resume(sb.id)).state, 'running');
    assert.equal(await printenv(sb.id), secret);
    assert.deepEqual(
      plaintextOnDisk(dir, secret, since, [config(sb.id)]),
      [],
      'nowhere else after the resume',
    );
  });

  test('fork: the fork has the value, sealed for itself', async () => {
    const f = await client.fork(sb.id, { name: 'agent-fork' });
    try {
      assert.equal(await printenv(f.id), secret);
      const db = new Database(join(data, 'state.db'), { readonly: true });
      const rows = db.prepare('SELECT id, spec FROM sandboxes').all() as { id: string; spec: string }[];
      db.close();
      const planted = new Map(
        rows.map((r) => [r.id, (JSON.parse(r.spec) as { env: Record<string, string> }).env.PLANTED]),
      );
      assert.ok(planted.get(f.id)?.startsWith(SEALED_VALUE_PREFIX));
      assert.notEqual(planted.get(f.id), planted.get(sb.id), 'sealed again under the fork id');
      assert.deepEqual(plaintextOnDisk(dir, secret, since, [config(sb.id), config(f.id)]), []);
    } finally {
      await client.remove(f.id);
    }
    assert.ok(!existsSync(config(f.id)), 'rm removes its config');
  });

  test('a restarted daemon: the running sandbox keeps its env for exec, hibernates and resumes with it', async () => {
    await stop();
    await start();
    assert.equal((await client.getSandbox(sb.id)).state, 'running');
    assert.equal(await printenv(sb.id), secret, 'exec after the restart');
    assert.equal((await client.hibernate(sb.id)).state, 'hibernated');
    await stop();
    await start();
    assert.equal((await client.resume(sb.id)).state, 'running');
    assert.equal(await printenv(sb.id), secret, 'resumed by a new daemon');
    assert.deepEqual(plaintextOnDisk(dir, secret, since, [config(sb.id)]), []);
  });

  test('rows from before sealing are sealed at start; their old pages and WAL frames are gone', async () => {
    assert.equal((await client.hibernate(sb.id)).state, 'hibernated');
    await stop();
    const legacy = marker();
    // What an older dormant left: the value in clear in the row (here in WAL frames never
    // checkpointed: the writer is killed), in sandbox.json, and in bundle/config.json on disk.
    const writer = spawnSync(
      process.execPath,
      [
        '-e',
        `const D = require(${JSON.stringify(SQLITE_MODULE)});
         const db = new D(${JSON.stringify(join(data, 'state.db'))});
         db.pragma('wal_autocheckpoint = 0');
         const r = db.prepare('SELECT spec FROM sandboxes WHERE id = ?').get(${JSON.stringify(sb.id)});
         const spec = JSON.parse(r.spec);
         spec.env = { PLANTED: ${JSON.stringify(legacy)}, OTHER: 'plain-enough' };
         db.prepare('UPDATE sandboxes SET spec = ? WHERE id = ?').run(JSON.stringify(spec), ${JSON.stringify(sb.id)});
         process.kill(process.pid, 'SIGKILL');`,
      ],
      { encoding: 'utf8' },
    );
    assert.equal(writer.signal, 'SIGKILL', writer.stderr);
    const recordPath = join(sandboxDir(sb.id), 'sandbox.json');
    const rec = JSON.parse(await readFile(recordPath, 'utf8')) as { spec: { env: Record<string, string> } };
    rec.spec.env = { PLANTED: legacy };
    await writeFile(recordPath, JSON.stringify(rec, null, 2), { mode: 0o600 });
    await writeFile(
      join(sandboxDir(sb.id), 'bundle', 'config.json'),
      `{"process":{"env":["PLANTED=${legacy}"]}}`,
    );
    assert.ok(
      plaintextOnDisk(dir, legacy, since).some((p) => p.endsWith('state.db-wal')),
      'the planted row is in the WAL',
    );

    await start();
    assert.deepEqual(
      plaintextOnDisk(dir, legacy, since).filter(
        (p) => !p.endsWith('sandbox.json') && !p.endsWith('config.json'),
      ),
      [],
      'the database (file and WAL) holds the old value nowhere after the start',
    );
    assert.equal((await client.resume(sb.id)).state, 'running');
    // runc exec takes its environment from the config written from the (unsealed) row.
    assert.equal(await printenv(sb.id), legacy);
    assert.deepEqual(
      plaintextOnDisk(dir, legacy, since, [config(sb.id)]),
      [],
      'sandbox.json and the old config scrubbed',
    );
    assert.deepEqual(plaintextOnDisk(dir, secret, since), []);
    assert.ok(!existsSync(join(sandboxDir(sb.id), 'bundle', 'config.json')));
  });

  test('a daemon killed mid-hibernate leaves plaintext images; the next start wipes staging first', async () => {
    await client.remove(sb.id);
    await stop();
    crashData = join(dir, 'crash-data');
    const crashSecret = marker();
    // The child names the data dir with a trailing slash: the same folder, the same staging.
    const child = spawn(process.execPath, [CRASH_DAEMON, `${crashData}/`], {
      env: { ...process.env, DORMANT_TEST_CRASH_AT: 'hibernate:dumped' },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    children.push(child);
    let err = '';
    child.stderr.setEncoding('utf8').on('data', (c: string) => (err += c));
    const exited = new Promise<NodeJS.Signals | null>((res) => child.once('exit', (_c, s) => res(s)));
    const line = await new Promise<string>((res, rej) => {
      createInterface({ input: child.stdout }).once('line', res);
      void exited.then(() => rej(new Error(`crash daemon exited: ${err}`)));
    });
    const { url, token } = JSON.parse(line) as { url: string; token: string };
    const cc = new DormantClient({ url, token });
    const victim = await cc.createSandbox({
      rootfs,
      command: ['sleep', '1000000'],
      env: { PLANTED: crashSecret },
      memory: '64M',
    });
    await cc.hibernate(victim.id).catch(() => undefined);
    assert.equal(await exited, 'SIGKILL', err);
    const staging = stagingDirFor(crashData);
    assert.ok(
      filesHolding(staging, crashSecret).length > 0,
      'the crash left the value in clear in staging (the dumped memory)',
    );

    // A start that fails at once, on its database, still wipes staging: it is the first step.
    const db = join(crashData, 'state.db');
    const aside = join(dir, 'db-aside');
    await mkdir(aside);
    for (const f of ['state.db', 'state.db-wal', 'state.db-shm'])
      if (existsSync(join(crashData, f))) await rename(join(crashData, f), join(aside, f));
    await mkdir(db);
    try {
      await assert.rejects(
        startDaemon({
          dataDir: crashData,
          listen: '127.0.0.1:0',
          proxy: false,
          policy: false,
          warn: () => undefined,
        }),
      );
      // Wiped before the database was opened, then released with the rest of the refused start.
      assert.ok(!existsSync(staging), 'the refused start released staging');
      assert.deepEqual(
        filesHolding('/dev/shm', crashSecret, 64 << 20).filter((p) => p !== config(victim.id, crashData)),
        [],
        'nothing in /dev/shm but the config of the container that still runs',
      );
    } finally {
      await rm(db, { recursive: true });
      for (const f of await readdir(aside)) await rename(join(aside, f), join(crashData, f));
    }

    const { daemon: d2, client: c2 } = await startTestDaemon({
      dataDir: crashData,
      proxy: false,
      policy: false,
    });
    try {
      assert.deepEqual(await readdir(staging), []);
      assert.equal((await c2.getSandbox(victim.id)).state, 'running', 'the hibernate never committed');
      const r = await c2.exec(victim.id, ['printenv', 'PLANTED']);
      assert.equal(r.stdout.trim(), crashSecret);
      await c2.remove(victim.id);
    } finally {
      await d2.close();
    }
    assert.deepEqual(plaintextOnDisk(dir, crashSecret, since), []);
    crashData = undefined;
  });
});
