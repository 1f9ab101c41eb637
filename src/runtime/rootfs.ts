/**
 * A sandbox's root filesystem: an overlay of the read-only rootfs folder (lower) and the
 * sandbox's own writable layer (upper), mounted at the bundle's rootfs. The upper folder is
 * the sandbox's filesystem diff: it alone goes into a checkpoint or an archive.
 */
import { readFile } from 'node:fs/promises';
import { DormantError, ErrorCode } from '../domain/errors.js';
import { run } from '../sys/exec.js';

const MOUNT_TIMEOUT_MS = 15_000;

/** Decodes the octal escapes (`\040` for a space) of /proc/self/mountinfo. */
function unescapeMountPath(p: string): string {
  return p.replace(/\\([0-7]{3})/g, (_, o: string) => String.fromCharCode(parseInt(o, 8)));
}

export async function isMountPoint(path: string): Promise<boolean> {
  const info = await readFile('/proc/self/mountinfo', 'utf8');
  return info.split('\n').some((line) => {
    const f = line.split(' ');
    return f[4] !== undefined && unescapeMountPath(f[4]) === path;
  });
}

export interface OverlayDirs {
  lower: string;
  upper: string;
  work: string;
  target: string;
}

/** Mounts the overlay unless it is already mounted there. */
export async function mountOverlay(dirs: OverlayDirs, signal?: AbortSignal): Promise<void> {
  if (await isMountPoint(dirs.target)) return;
  for (const p of [dirs.lower, dirs.upper, dirs.work])
    if (/[,:\\]/.test(p))
      throw new DormantError(
        ErrorCode.INVALID_ARGUMENT,
        `overlay path ${p} must not contain ',', ':' or '\\'`,
        {
          status: 400,
        },
      );
  try {
    await run(
      'mount',
      [
        '-t',
        'overlay',
        'overlay',
        '-o',
        `lowerdir=${dirs.lower},upperdir=${dirs.upper},workdir=${dirs.work}`,
        dirs.target,
      ],
      { timeoutMs: MOUNT_TIMEOUT_MS, signal },
    );
  } catch (e) {
    throw new DormantError(
      ErrorCode.RUNTIME_ROOTFS_FAILED,
      `could not mount the root filesystem at ${dirs.target}: ${(e as Error).message}`,
      { cause: e, hint: 'the rootfs folder must exist, and dormant needs root and overlayfs' },
    );
  }
}

/** Unmounts `target` if it is mounted; lazily when something still holds it. */
export async function unmount(target: string, signal?: AbortSignal): Promise<void> {
  if (!(await isMountPoint(target))) return;
  const r = await run('umount', [target], { timeoutMs: MOUNT_TIMEOUT_MS, signal, okExitCodes: [0, 32] });
  if (r.exitCode !== 0) await run('umount', ['-l', target], { timeoutMs: MOUNT_TIMEOUT_MS, signal });
}

/**
 * Mount points at `dir` or below it, deepest (most recently mounted) first: what a failed
 * restore may leave there (runc's mounts in the rootfs, CRIU's cgroup yard in its work dir).
 */
export async function mountsUnder(dir: string): Promise<string[]> {
  const info = await readFile('/proc/self/mountinfo', 'utf8');
  const prefix = dir.endsWith('/') ? dir : `${dir}/`;
  const found: string[] = [];
  for (const line of info.split('\n')) {
    const f = line.split(' ');
    if (f[4] === undefined) continue;
    const p = unescapeMountPath(f[4]);
    if (p === dir || p.startsWith(prefix)) found.push(p);
  }
  // mountinfo lists a mount after its parent: reversed, children come before their parents.
  return found.reverse();
}

/**
 * Unmounts everything at `dir` and below it, children first; a mount still busy is detached
 * lazily (it goes once its last user does). Returns the mount points that are still there.
 */
export async function unmountAll(dir: string, signal?: AbortSignal): Promise<string[]> {
  // A mount point can carry a stack of mounts: a few rounds take them all off.
  for (let round = 0; round < 8; round++) {
    const mounts = await mountsUnder(dir);
    if (mounts.length === 0) return [];
    for (const m of mounts) {
      const r = await run('umount', [m], { timeoutMs: MOUNT_TIMEOUT_MS, signal, okExitCodes: [0, 1, 32] });
      if (r.exitCode !== 0)
        await run('umount', ['-l', m], { timeoutMs: MOUNT_TIMEOUT_MS, signal, okExitCodes: [0, 1, 32] });
    }
  }
  return mountsUnder(dir);
}
