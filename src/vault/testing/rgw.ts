/**
 * Test fixture: a real S3 server, Ceph's RADOS gateway with its SQLite dbstore backend (no
 * Ceph cluster), on a free loopback port, its database in a private temp folder. setup.sh
 * installs it into a private prefix with `dormant-radosgw` and `dormant-radosgw-admin`
 * wrappers on PATH (scripts/setup-radosgw.sh). One S3 user with a random key pair and one
 * bucket are made per server. `stop` ends the process by its PID and removes the folder;
 * `halt` and `start` stop and start it again on the same port and data (fault tests).
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { mkdtemp, open, readFile, rm, writeFile } from 'node:fs/promises';
import { createServer } from 'node:net';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import { CreateBucketCommand, S3Client } from '@aws-sdk/client-s3';
import { run } from '../../sys/exec.js';

export const RADOSGW = 'dormant-radosgw';
export const RADOSGW_ADMIN = 'dormant-radosgw-admin';

export interface TestRgw {
  /** `http://127.0.0.1:PORT` */
  endpoint: string;
  accessKeyId: string;
  secretAccessKey: string;
  /** A bucket made for the test. */
  bucket: string;
  /** Makes one more bucket. */
  makeBucket(name: string): Promise<void>;
  /** Ends the server (SIGKILL: as a crash would) and keeps its data. */
  halt(): Promise<void>;
  /** Starts it again after `halt`, same port and data. */
  start(): Promise<void>;
  /** The server's log so far. */
  log(): Promise<string>;
  /** The server's process id while it runs (a benchmark reads its CPU time). */
  pid(): number | undefined;
  /** Ends the server and removes its folder. */
  stop(): Promise<void>;
}

/** Why the S3 tests cannot run here, or undefined when radosgw is installed. */
export async function rgwMissing(): Promise<string | undefined> {
  try {
    await run(RADOSGW, ['--version'], { timeoutMs: 20_000 });
    return undefined;
  } catch {
    return `${RADOSGW} is not installed: run scripts/setup.sh (it unpacks trixie's radosgw into /opt/dormant/radosgw)`;
  }
}

async function freePort(): Promise<number> {
  const srv = createServer();
  srv.listen(0, '127.0.0.1');
  await once(srv, 'listening');
  const port = (srv.address() as { port: number }).port;
  await new Promise((r) => srv.close(r));
  return port;
}

export async function startRgw(opts: { bucket?: string } = {}): Promise<TestRgw> {
  const dir = await mkdtemp('/dev/shm/dormant-rgw-');
  const port = await freePort();
  const endpoint = `http://127.0.0.1:${port}`;
  const conf = join(dir, 'ceph.conf');
  const name = 'client.rgw.dormant';
  await writeFile(
    conf,
    [
      '[global]',
      'auth_cluster_required = none',
      'auth_service_required = none',
      'auth_client_required = none',
      'rgw_backend_store = dbstore',
      'rgw_config_store = dbstore',
      `dbstore_db_dir = ${dir}`,
      `dbstore_config_uri = file:${dir}/config.db`,
      `run_dir = ${dir}`,
      `log_file = ${dir}/rgw.log`,
      // No admin socket: radosgw-admin, run while the server is up, would collide with it.
      'admin_socket =',
      // Parts of 5 MiB as S3 requires; the tests' small parts are fine with it.
      'rgw_multipart_min_part_size = 5242880',
      `[${name}]`,
      `rgw_frontends = beast endpoint=127.0.0.1:${port}`,
      '',
    ].join('\n'),
  );
  const base = ['-c', conf, '-n', name, '--rgw-backend-store', 'dbstore'];
  let child: ChildProcess | undefined;
  let exited: Promise<unknown> = Promise.resolve();
  const logFile = join(dir, 'out.log');

  const halt = async (): Promise<void> => {
    const c = child;
    child = undefined;
    if (c && c.exitCode === null && c.signalCode === null) {
      c.kill('SIGKILL');
      await exited;
    }
  };
  const start = async (): Promise<void> => {
    const out = await open(logFile, 'a');
    const c = spawn(RADOSGW, [...base, '-d'], { stdio: ['ignore', out.fd, out.fd] });
    await out.close();
    child = c;
    exited = once(c, 'exit');
    for (let i = 0; ; i++) {
      const ok = await fetch(`${endpoint}/`).then(
        (r) => r.status < 500,
        () => false,
      );
      if (ok) return;
      if (i > 300 || c.exitCode !== null) {
        const log = await readFile(logFile, 'utf8').catch(() => '');
        await halt();
        throw new Error(`radosgw did not start on ${endpoint}:\n${log.slice(-3000)}`);
      }
      await new Promise((r) => setTimeout(r, 100));
    }
  };
  const stop = async (): Promise<void> => {
    await halt();
    await rm(dir, { recursive: true, force: true });
  };

  try {
    await start();
    const accessKeyId = `DMT${randomBytes(8).toString('hex').toUpperCase()}`;
    const secretAccessKey = randomBytes(20).toString('base64url');
    // radosgw-admin sometimes prints the new user and then does not exit: the user is made
    // once its key is printed.
    await run(
      RADOSGW_ADMIN,
      [
        ...base,
        'user',
        'create',
        '--uid=dormant',
        '--display-name=dormant',
        `--access-key=${accessKeyId}`,
        `--secret=${secretAccessKey}`,
      ],
      { timeoutMs: 20_000 },
    ).catch((e: unknown) => {
      if (!String((e as { details?: { output?: string } }).details?.output).includes(accessKeyId)) throw e;
    });
    const makeBucket = async (bucket: string): Promise<void> => {
      const c = new S3Client({
        endpoint,
        region: 'us-east-1',
        forcePathStyle: true,
        credentials: { accessKeyId, secretAccessKey },
      });
      try {
        await c.send(new CreateBucketCommand({ Bucket: bucket }));
      } finally {
        c.destroy();
      }
    };
    const bucket = opts.bucket ?? 'dormant-test';
    await makeBucket(bucket);
    return {
      endpoint,
      accessKeyId,
      secretAccessKey,
      bucket,
      makeBucket,
      halt,
      start,
      log: () => readFile(logFile, 'utf8'),
      pid: () => child?.pid,
      stop,
    };
  } catch (e) {
    await stop();
    throw e;
  }
}
