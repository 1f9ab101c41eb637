/**
 * Test fixtures: a real process tree (python3 with TCP, unix sockets, a pipe, a file and a
 * child) dumped with the real CRIU, and podman-layout archives built from the dump.
 */
import { spawn } from 'node:child_process';
import { mkdir, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { run } from '../../sys/exec.js';
import { writeArchive, podmanMembers, type PodmanMetadata } from '../export.js';
import type { Compression } from '../archive.js';
import { TAR_END, tarHeader, tarPadding } from '../tar.js';

export async function shm(prefix: string): Promise<string> {
  return mkdtemp(join('/dev/shm', prefix));
}

export function kill(pid: number): void {
  try {
    process.kill(pid, 'SIGKILL');
  } catch {
    // already gone: criu dump ends what it dumped
  }
}

async function waitFile(path: string, timeoutMs: number): Promise<string> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    try {
      const s = await readFile(path, 'utf8');
      if (s !== '') return s;
    } catch {
      // not there yet
    }
    if (Date.now() > deadline) throw new Error(`${path} did not appear in ${timeoutMs} ms`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

/**
 * Starts python3 running `code` (argv[1] is the ready file; write to it when set up) with
 * `env` added to its environment. Returns the pid.
 */
export async function startPython(
  code: string,
  dir: string,
  env: Record<string, string> = {},
): Promise<number> {
  const ready = join(dir, 'ready');
  const child = spawn('/usr/bin/python3', ['-c', code, ready], {
    detached: true,
    stdio: 'ignore',
    env: { PATH: '/usr/bin:/bin', ...env },
    cwd: dir,
  });
  child.unref();
  if (child.pid === undefined) throw new Error('python3 did not start');
  try {
    await waitFile(ready, 30_000);
  } catch (e) {
    kill(child.pid);
    throw e;
  }
  await rm(ready, { force: true });
  return child.pid;
}

/** A tree with a listening TCP socket, an established connection, a unix socket, a pipe, a file and a child. */
export const TREE_PY = `
import os, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', 0)); s.listen()
c = socket.create_connection(s.getsockname()); a, _ = s.accept()
f = open(os.path.join(os.path.dirname(sys.argv[1]), 'data.txt'), 'w'); f.write('hello')
r, w = os.pipe()
u = socket.socket(socket.AF_UNIX); u.bind('\\0dormant-test-%d' % os.getpid()); u.listen()
if os.fork() == 0:
    time.sleep(3600); os._exit(0)
open(sys.argv[1], 'w').write(str(os.getpid()))
time.sleep(3600)
`;

/** Dumps `pid`'s tree with criu (TCP connections included) into `dir`; the tree is gone afterwards. */
export async function dump(pid: number, dir: string): Promise<void> {
  await mkdir(dir, { recursive: true });
  try {
    await run(
      'criu',
      ['dump', '-t', String(pid), '-D', dir, '--shell-job', '--tcp-established', '-o', 'dump.log', '-v4'],
      { timeoutMs: 120_000 },
    );
  } finally {
    kill(pid);
  }
}

/** A tar (uncompressed) of files, for a rootfs diff. */
export function tarOf(files: Record<string, string | Buffer>): Buffer {
  const parts: Buffer[] = [];
  for (const [name, content] of Object.entries(files)) {
    const b = Buffer.isBuffer(content) ? content : Buffer.from(content);
    parts.push(tarHeader({ name, size: b.length, type: 'file' }), b, tarPadding(b.length));
  }
  parts.push(TAR_END);
  return Buffer.concat(parts);
}

export const DEMO_META: PodmanMetadata = {
  id: '0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef',
  name: 'demo',
  image: 'localhost/busybox:latest',
  runtime: 'runc',
  createdAt: '2026-12-02T13:00:00Z',
  checkpointedAt: '2026-12-02T13:59:00Z',
};

/** Builds a podman-layout archive from a dump folder. */
export async function podmanArchive(
  imagesDir: string,
  out: string,
  compression: Compression,
  o: { env?: string[]; rootfs?: Record<string, string | Buffer> } = {},
): Promise<string> {
  const extra = [];
  if (o.rootfs) extra.push({ name: 'rootfs-diff.tar', data: tarOf(o.rootfs) });
  extra.push({ name: 'network.status', data: Buffer.from('[]') });
  const members = await podmanMembers(imagesDir, { ...DEMO_META, env: o.env ?? ['PATH=/bin'] }, extra);
  await writeArchive(out, members, { compression, dirs: ['checkpoint'] });
  return out;
}

export async function writeText(path: string, s: string): Promise<void> {
  await writeFile(path, s);
}
