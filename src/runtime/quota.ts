/**
 * A sandbox's disk quota: its writable layer (fs/upper and fs/work) lives on a sparse ext4
 * image of the quota's size (`fs.img` in the sandbox's folder), loop-mounted over its `fs/`
 * folder. A write past the quota fails inside with ENOSPC, and the host disk holds at most
 * the image's size for the sandbox (sparse: only what is written, plus ~4 MiB of ext4
 * metadata). Mounted with `discard`, so what the sandbox deletes (and what hibernate empties)
 * goes back to the host disk.
 *
 * The image stays mounted for the sandbox's whole life on the node, asleep too: the daemon
 * packs, empties and refills the writable layer around a checkpoint through its path.
 * After a reboot it is mounted again by the first prepare() or stop(). rm unmounts it (the
 * loop device goes with the mount: `mount -o loop` sets it to clear itself) and deletes it.
 *
 * Why not project quotas: they need the data folder's filesystem mounted with prjquota (ext4
 * with the project feature, or XFS), which dormant cannot assume of a host. Why not tmpfs:
 * the layer would be held in memory.
 */
import { constants } from 'node:fs';
import { chmod, open, readdir, rename, rm, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';
import { run } from '../sys/exec.js';
import { exists } from '../sys/fs.js';
import { isMountPoint } from './rootfs.js';

const MKFS_TIMEOUT_MS = 60_000;
const MOUNT_TIMEOUT_MS = 15_000;

/** The image file of the sandbox whose folder is `dir`. */
export function layerImage(dir: string): string {
  return join(dir, 'fs.img');
}

/** Where the image is mounted: the folder holding upper/ and work/. */
export function layerMountPoint(dir: string): string {
  return join(dir, 'fs');
}

function layerError(message: string, cause?: unknown): DormantError {
  return new DormantError(ErrorCode.RUNTIME_ROOTFS_FAILED, message, {
    ...(cause !== undefined ? { cause } : {}),
    hint: 'the disk quota needs mkfs.ext4 (e2fsprogs), loop devices and root',
  });
}

/**
 * Makes the image of `sizeBytes` (sparse) under a temporary name and renames it into place:
 * a crash mid-mkfs leaves no half-made image to be mounted later.
 */
async function makeImage(image: string, sizeBytes: number, signal?: AbortSignal): Promise<void> {
  const tmp = `${image}.tmp`;
  await rm(tmp, { force: true });
  const fh = await open(tmp, constants.O_CREAT | constants.O_EXCL | constants.O_WRONLY, 0o600);
  try {
    await fh.truncate(sizeBytes);
  } finally {
    await fh.close();
  }
  try {
    // -m 0: no blocks held back for root (the sandbox's root gets the whole quota, and a
    // host-side writer none past it). A 4 MiB journal instead of the default (64 MiB at
    // 10 GiB): what a sleeping sandbox's image holds on disk. nodiscard: mkfs need not trim
    // a file that is all holes. Lazy inode tables: written by the kernel when used.
    await run(
      'mkfs.ext4',
      [
        '-F',
        '-q',
        '-m',
        '0',
        '-J',
        'size=4',
        '-E',
        'nodiscard,lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0',
        tmp,
      ],
      { timeoutMs: MKFS_TIMEOUT_MS, signal },
    );
  } catch (e) {
    await rm(tmp, { force: true });
    throw layerError(`could not make the writable layer's disk image: ${(e as Error).message}`, e);
  }
  await rename(tmp, image);
}

async function mountImage(image: string, target: string, signal?: AbortSignal): Promise<void> {
  try {
    await run('mount', ['-t', 'ext4', '-o', 'loop,discard,nosuid,nodev', image, target], {
      timeoutMs: MOUNT_TIMEOUT_MS,
      signal,
    });
    // mkfs makes the image's root folder 0755: the sandbox's files are nobody else's.
    await chmod(target, 0o700);
  } catch (e) {
    throw layerError(`could not mount the writable layer's disk image: ${(e as Error).message}`, e);
  }
}

/**
 * The sandbox's writable layer on its own image of `sizeBytes`: made at the first call,
 * mounted at `dir/fs` unless it is already. Called before upper/ and work/ are made.
 */
export async function ensureLayer(dir: string, sizeBytes: number, signal?: AbortSignal): Promise<void> {
  const image = layerImage(dir);
  const target = layerMountPoint(dir);
  if (await isMountPoint(target)) return;
  if (!(await exists(image))) {
    // A layer already filled on the host disk would be hidden under the new image: refuse
    // rather than make the sandbox's files vanish.
    const present = await readdir(join(target, 'upper')).catch((e: unknown) => {
      if (errnoCode(e) === 'ENOENT') return [];
      throw e;
    });
    if (present.length > 0)
      throw layerError(`the writable layer of ${dir} has files outside its disk image; it is left as it is`);
    await makeImage(image, sizeBytes, signal);
  }
  await mountImage(image, target, signal);
}

/** Mounts the image again where one exists and is not mounted (after a reboot). */
export async function remountLayer(dir: string, signal?: AbortSignal): Promise<void> {
  if (!(await exists(layerImage(dir)))) return;
  if (await isMountPoint(layerMountPoint(dir))) return;
  await mountImage(layerImage(dir), layerMountPoint(dir), signal);
}

/**
 * Commits the image's journal now. It is mounted with `discard`, and ext4 hands freed blocks
 * back (a hole punched in the image file) when its journal commits, every 5 s: without this, a
 * hibernate that has just emptied the layer would return while the host still held its blocks.
 * Only the image's own filesystem is synced (never the host's data folder).
 */
export async function commitLayer(dir: string, signal?: AbortSignal): Promise<void> {
  const target = layerMountPoint(dir);
  // Best effort: without it the blocks still come back at the next commit, so a failure
  // here must not fail the operation that emptied the layer (a recorded archive, say).
  try {
    if (!(await isMountPoint(target))) return;
    await run('sync', ['-f', target], { timeoutMs: MOUNT_TIMEOUT_MS, signal });
  } catch {
    return;
  }
}

/**
 * Unmounts the image (its loop device is freed with the mount; lazily, once the last user
 * lets go, when something still holds it). The caller then deletes the folder with the file.
 */
export async function releaseLayer(dir: string, signal?: AbortSignal): Promise<void> {
  const target = layerMountPoint(dir);
  if (!(await isMountPoint(target))) return;
  const r = await run('umount', [target], { timeoutMs: MOUNT_TIMEOUT_MS, signal, okExitCodes: [0, 32] });
  if (r.exitCode !== 0) await run('umount', ['-l', target], { timeoutMs: MOUNT_TIMEOUT_MS, signal });
}

/** Bytes of host disk the sandbox's image takes now (its allocated blocks); 0 without one. */
export async function layerHostBytes(dir: string): Promise<number> {
  try {
    return (await stat(layerImage(dir))).blocks * 512;
  } catch (e) {
    if (errnoCode(e) === 'ENOENT') return 0;
    throw e;
  }
}
