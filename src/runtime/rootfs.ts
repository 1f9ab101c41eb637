/**
 * A sandbox's root filesystem: an overlay of the read-only rootfs folder (lower) and the
 * sandbox's own writable layer (upper), mounted at the bundle's rootfs. The upper folder is
 * the sandbox's filesystem diff: it alone goes into a checkpoint or an archive.
 */
import { readFile, readlink, rename, rm, symlink } from 'node:fs/promises';
import { basename, dirname, isAbsolute, join, relative } from 'node:path';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';
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

/**
 * The overlay's mount options with every folder named relative to the folder holding the
 * upper and work folders, and that folder, for mount to run in. The kernel keeps the option
 * strings as given and shows them in every /proc/<pid>/mountinfo, the sandbox's own too:
 * absolute ones would tell the sandbox the host's data folder, its sandbox folder and the
 * rootfs path. A lower folder outside it is reached through a symlink there (`lower`), which
 * the kernel follows when it mounts and does not show.
 */
export async function overlayOptions(dirs: OverlayDirs): Promise<{ cwd: string; options: string }> {
  const cwd = dirname(dirs.upper);
  if (dirname(dirs.work) !== cwd)
    throw new DormantError(
      ErrorCode.INVALID_ARGUMENT,
      `overlay upper ${dirs.upper} and work ${dirs.work} must be in one folder`,
      { status: 400 },
    );
  let lower = relative(cwd, dirs.lower);
  if (lower === '' || lower.startsWith('..') || isAbsolute(lower)) {
    lower = 'lower';
    const link = join(cwd, lower);
    const now = await readlink(link).catch((e: unknown) => {
      if (errnoCode(e) === 'ENOENT') return undefined;
      throw e;
    });
    if (now !== dirs.lower) {
      // Replaced in one rename: a crash leaves the old link or the new one.
      await rm(`${link}.tmp`, { force: true });
      await symlink(dirs.lower, `${link}.tmp`);
      await rename(`${link}.tmp`, link);
    }
  }
  return {
    cwd,
    options: `lowerdir=${lower},upperdir=${basename(dirs.upper)},workdir=${basename(dirs.work)}`,
  };
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
  const form = await overlayOptions(dirs);
  try {
    await run('mount', ['-t', 'overlay', 'overlay', '-o', form.options, dirs.target], {
      timeoutMs: MOUNT_TIMEOUT_MS,
      signal,
      cwd: form.cwd,
    });
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
