/**
 * Test helpers for the tests that drive the real runc and CRIU: whether this machine can run
 * them at all, and what a sandbox's disk layer leaves on the host (mounts, loop devices).
 */
import { existsSync, readFileSync, readdirSync, readlinkSync } from 'node:fs';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { run, which } from '../../sys/exec.js';
import type { RuncRuntime } from '../runc.js';
import { buildBusyboxRootfs } from './rootfs.js';

/** Where the tests look for the CRIU that scripts/setup.sh installs. */
export const CRIU = '/usr/local/bin/criu';

/**
 * Why these tests cannot run here (for node:test's `skip`), or false: they need root and runc,
 * and each of `needs`: `criu` ({@link CRIU}), `python3` (/usr/bin/python3, for the test
 * servers) or any other tool on the PATH (`mkfs.ext4` for the disk quota, say).
 */
export async function cannotRun(...needs: string[]): Promise<string | false> {
  if (process.getuid?.() !== 0) return 'needs root';
  if ((await which('runc')) === undefined) return 'runc not installed';
  for (const n of needs) {
    if (n === 'criu') {
      if ((await which(CRIU)) === undefined) return 'criu not installed (scripts/setup.sh)';
    } else if (n === 'python3') {
      if (!existsSync('/usr/bin/python3')) return 'python3 not installed';
    } else if ((await which(n)) === undefined) {
      return n === 'mkfs.ext4' ? 'mkfs.ext4 not installed (e2fsprogs)' : `${n} not installed`;
    }
  }
  return false;
}

/** The loop devices whose backing file is under `dir` (`losetup -a` on the host). */
export async function loopsUnder(dir: string): Promise<string[]> {
  const { stdout } = await run('losetup', ['-a'], { timeoutMs: 10_000 });
  return stdout.split('\n').filter((l) => l.includes(dir));
}

/**
 * The loop devices under `dir` once they are gone, or those left after `timeoutMs`, each with
 * the processes whose mount table still shows a mount under `dir` (the diagnosis when one
 * stays): a mount namespace another container is being made in holds a copy of the mount (and
 * so the loop device) for a moment, until that runc detaches the host's mounts.
 */
export async function loopsLeft(dir: string, timeoutMs: number): Promise<string[]> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const left = await loopsUnder(dir);
    if (left.length === 0) return left;
    if (Date.now() > deadline) return [...left, ...mountHolders(dir)];
    await new Promise((r) => setTimeout(r, 100));
  }
}

/** The processes whose mount table shows a mount under `dir`, with those mounts. */
function mountHolders(dir: string): string[] {
  const out: string[] = [];
  for (const pid of readdirSync('/proc').filter((p) => /^\d+$/.test(p))) {
    try {
      const lines = readFileSync(`/proc/${pid}/mountinfo`, 'utf8')
        .split('\n')
        .filter((l) => l.includes(dir));
      if (lines.length === 0) continue;
      const cmd = readFileSync(`/proc/${pid}/cmdline`, 'utf8').replaceAll('\0', ' ').slice(0, 120);
      out.push(`held by pid ${pid} (${readlinkSync(`/proc/${pid}/ns/mnt`)}: ${cmd}): ${lines.join(' | ')}`);
    } catch {
      // The process ended meanwhile.
    }
  }
  return out;
}

/** The lines of this process's mount table that name `dir`. */
export async function mountsUnder(dir: string): Promise<string[]> {
  return (await readFile('/proc/self/mountinfo', 'utf8')).split('\n').filter((l) => l.includes(dir));
}

/** The folders of a runtime test. */
export interface RuntimeFolders {
  /** /tmp/dormant-NAME-XXXXXX: the rootfs and the runtimes' state. */
  tmp: string;
  /** /dev/shm/dormant-NAME-XXXXXX: memory-backed, for checkpoint images. */
  shm: string;
  /** A busybox rootfs in `tmp`. */
  rootfs: string;
}

/** Makes the folders of a runtime test, with a busybox rootfs named `rootfsName` holding `files`. */
export async function runtimeFolders(
  name: string,
  files?: Record<string, string>,
  rootfsName = 'rootfs',
): Promise<RuntimeFolders> {
  const tmp = await mkdtemp(`/tmp/dormant-${name}-`);
  const shm = await mkdtemp(`/dev/shm/dormant-${name}-`);
  const rootfs = join(tmp, rootfsName);
  await buildBusyboxRootfs(rootfs, files);
  return { tmp, shm, rootfs };
}

/** Destroys every container of `runtimes`, then removes the test's folders. */
export async function removeRuntimeFolders(f: RuntimeFolders, runtimes: RuncRuntime[]): Promise<void> {
  for (const rt of runtimes) for (const id of await rt.list()) await rt.destroy(id);
  await rm(f.tmp, { recursive: true, force: true });
  await rm(f.shm, { recursive: true, force: true });
}

/** Calls `fn` every 50 ms until it gives a value (a throw counts as none); fails after `timeoutMs`. */
export async function waitFor<T>(
  what: string,
  fn: () => Promise<T | undefined>,
  timeoutMs = 10_000,
): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const v = await fn().catch(() => undefined);
    if (v !== undefined) return v;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}
