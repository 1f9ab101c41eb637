/**
 * A sandbox's filesystem diff (its overlay's upper folder) as one tar file, so that it travels
 * into the vault with the checkpoint and is not left in plaintext on disk while the sandbox
 * sleeps (hibernated and archived sandboxes keep the diff in the vault, encrypted).
 *
 * GNU tar keeps what overlayfs needs: owners and modes (numeric), hard links, sparse files,
 * whiteouts (character devices 0/0) and opaque folders (the trusted.overlay.* xattrs).
 */
import { mkdir, open, readdir, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { run } from '../sys/exec.js';
import { DormantError } from '../domain/errors.js';

/** The diff's name in a checkpoint folder (as in podman's and CRI-O's archives). */
export const FS_DIFF = 'rootfs-diff.tar';

/** Checkpoint meta key saying the checkpoint carries the filesystem diff as FS_DIFF. */
export const FS_META = 'fs';

const TAR_FLAGS = ['--numeric-owner', '--xattrs', '--xattrs-include=*', '--acls'];
const TAR_TIMEOUT_MS = 600_000;

/** Writes the upper folder `upperDir` as the tar file `tarPath` (on private staging). */
export async function packFilesystem(upperDir: string, tarPath: string, signal?: AbortSignal): Promise<void> {
  try {
    await run(
      'tar',
      [
        '--create',
        `--file=${tarPath}`,
        `--directory=${upperDir}`,
        ...TAR_FLAGS,
        '--sparse',
        '--one-file-system',
        '.',
      ],
      { timeoutMs: TAR_TIMEOUT_MS, ...(signal ? { signal } : {}) },
    );
  } catch (e) {
    throw new DormantError('FILESYSTEM_PACK_FAILED', `could not pack the filesystem diff ${upperDir}`, {
      cause: e,
    });
  }
}

/** Empties `upperDir` (keeping the folder itself). */
export async function emptyFolder(upperDir: string): Promise<void> {
  // As the runtime makes it (and its parents): root's only.
  await mkdir(upperDir, { recursive: true, mode: 0o700 });
  for (const name of await readdir(upperDir))
    await rm(join(upperDir, name), { recursive: true, force: true });
  // On a disk-quota image (runtime/quota.ts) the freed blocks leave the image file (it is
  // mounted with discard) only when ext4's journal commits, up to 5 s later: the fsync
  // commits now (~3 ms), so the files of a sandbox that hibernates are off the host disk
  // (in the vault, encrypted) by the time the hibernate answers.
  const fh = await open(upperDir, 'r');
  try {
    await fh.sync();
  } finally {
    await fh.close();
  }
}

/** Replaces the contents of `upperDir` with the tar file `tarPath`. */
export async function unpackFilesystem(
  tarPath: string,
  upperDir: string,
  signal?: AbortSignal,
): Promise<void> {
  await emptyFolder(upperDir);
  try {
    await run(
      'tar',
      [
        '--extract',
        `--file=${tarPath}`,
        `--directory=${upperDir}`,
        ...TAR_FLAGS,
        '--same-permissions',
        '--same-owner',
      ],
      { timeoutMs: TAR_TIMEOUT_MS, ...(signal ? { signal } : {}) },
    );
  } catch (e) {
    throw new DormantError(
      'FILESYSTEM_UNPACK_FAILED',
      `could not unpack the filesystem diff into ${upperDir}`,
      { cause: e },
    );
  }
}

/** Copies the contents of `fromUpper` into `toUpper` (a fork's writable layer from its source's). */
export async function copyFolder(fromUpper: string, toUpper: string): Promise<void> {
  // cp -a keeps modes, owners, links and overlayfs whiteouts (character devices 0/0).
  await run('cp', ['-a', '--', `${fromUpper}/.`, toUpper], { timeoutMs: 600_000 });
}
