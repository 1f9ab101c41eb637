/**
 * Test fixture: a real OCI registry (Debian's `docker-registry`, the CNCF distribution) on a
 * free loopback port, with filesystem storage in the test's folder and, when asked, htpasswd
 * (bcrypt) authentication; and `skopeo copy` to push OCI layouts into it. The registry's
 * access log is kept, so a test can count what was downloaded. `stop` ends the process (by
 * its PID) and removes its folder.
 */
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { mkdir, open, readFile, rm, writeFile } from 'node:fs/promises';
import { createServer } from 'node:net';
import { join } from 'node:path';
import { run } from '../../sys/exec.js';

export interface TestRegistry {
  /** `127.0.0.1:PORT` */
  host: string;
  /** Where the registry keeps blobs: `docker/registry/v2/blobs/sha256/XX/HEX/data`. */
  storage: string;
  /** The access log and the registry's own messages so far. */
  log(): Promise<string>;
  /** Stops the process and removes the registry's folder. */
  stop(): Promise<void>;
}

async function freePort(): Promise<number> {
  const srv = createServer();
  srv.listen(0, '127.0.0.1');
  await once(srv, 'listening');
  const port = (srv.address() as { port: number }).port;
  await new Promise((r) => srv.close(r));
  return port;
}

/** A bcrypt htpasswd line, made with python3's crypt (Debian 12's python has it), else htpasswd -B. */
async function htpasswdLine(user: string, password: string): Promise<string> {
  try {
    const r = await run(
      'python3',
      [
        '-W',
        'ignore',
        '-c',
        'import crypt,sys; print(crypt.crypt(sys.stdin.read(), crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16)))',
      ],
      { input: password, timeoutMs: 10_000 },
    );
    if (r.stdout.startsWith('$2')) return `${user}:${r.stdout.trim()}`;
  } catch {
    // No python3 crypt module (Python 3.13 dropped it): apache2-utils' htpasswd instead.
  }
  const r = await run('htpasswd', ['-niB', '-C', '4', user], { input: password, timeoutMs: 10_000 });
  return r.stdout.trim();
}

/** Starts a registry in `dir` (made here); with `auth`, every request needs that user. */
export async function startRegistry(
  dir: string,
  opts: { auth?: { user: string; password: string } } = {},
): Promise<TestRegistry> {
  await mkdir(dir, { recursive: true });
  const port = await freePort();
  const storage = join(dir, 'storage');
  let auth = '';
  if (opts.auth) {
    await writeFile(join(dir, 'htpasswd'), `${await htpasswdLine(opts.auth.user, opts.auth.password)}\n`);
    auth = `auth:\n  htpasswd:\n    realm: dormant-test\n    path: ${join(dir, 'htpasswd')}\n`;
  }
  const config = join(dir, 'config.yml');
  await writeFile(
    config,
    `version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: false\nstorage:\n  filesystem:\n    rootdirectory: ${storage}\nhttp:\n  addr: 127.0.0.1:${port}\n  secret: dormant-test\n${auth}`,
  );
  const logFile = join(dir, 'registry.log');
  const out = await open(logFile, 'w');
  const child = spawn('/usr/bin/docker-registry', ['serve', config], { stdio: ['ignore', out.fd, out.fd] });
  await out.close();
  const exited = once(child, 'exit');
  const stop = async (): Promise<void> => {
    if (child.exitCode === null && child.signalCode === null) {
      child.kill('SIGTERM');
      await exited;
    }
    await rm(dir, { recursive: true, force: true });
  };
  const host = `127.0.0.1:${port}`;
  for (let i = 0; ; i++) {
    const ok = await fetch(`http://${host}/v2/`).then(
      (r) => r.status === 200 || r.status === 401,
      () => false,
    );
    if (ok) break;
    if (i > 100 || child.exitCode !== null) {
      const log = await readFile(logFile, 'utf8').catch(() => '');
      await stop();
      throw new Error(`docker-registry did not start on ${host}:\n${log.slice(-2000)}`);
    }
    await new Promise((r) => setTimeout(r, 100));
  }
  return { host, storage, log: () => readFile(logFile, 'utf8'), stop };
}

/** Pushes the OCI layout `layout:tag` to `dest` (`HOST/NAME:TAG`) with skopeo. */
export async function pushLayout(
  layout: string,
  tag: string,
  dest: string,
  auth?: { user: string; password: string },
): Promise<void> {
  const policy = `${layout}.policy.json`;
  await writeFile(policy, '{"default":[{"type":"insecureAcceptAnything"}]}');
  await run(
    'skopeo',
    [
      '--policy',
      policy,
      'copy',
      '--quiet',
      '--dest-tls-verify=false',
      ...(auth ? ['--dest-creds', `${auth.user}:${auth.password}`] : ['--dest-no-creds']),
      `oci:${layout}:${tag}`,
      `docker://${dest}`,
    ],
    { timeoutMs: 120_000 },
  );
  await rm(policy, { force: true });
}
