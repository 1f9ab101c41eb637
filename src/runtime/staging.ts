/**
 * The staging folder where CRIU images are in flight (a dump before it is in the vault, a
 * checkpoint fetched for a restore): memory only, never a disk. It is a tmpfs of its own with
 * transparent huge pages for files of 2 MiB and more (`huge=within_size`): on these VMs every
 * fresh 4 KiB page costs a fault, and a 256 MiB image written into a plain tmpfs took 0.16-0.19 s
 * against 0.05-0.06 s with huge pages (small images still get small pages). Where that mount is
 * not possible (no root, a kernel without shmem THP) it is a plain folder on /dev/shm.
 */
import { mkdir, readdir, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { run } from '../sys/exec.js';
import { isMountPoint, unmount, unmountAll } from './rootfs.js';

export type StagingKind = 'tmpfs-huge' | 'folder';

/**
 * Makes `dir` an empty, private (0700) staging folder. A leftover from a crash (images of a
 * hibernate that never committed) is emptied, its mount kept.
 */
export async function prepareStaging(dir: string): Promise<StagingKind> {
  if (await isMountPoint(dir)) {
    await Promise.all((await readdir(dir)).map((n) => rm(join(dir, n), { recursive: true, force: true })));
    return 'tmpfs-huge';
  }
  await rm(dir, { recursive: true, force: true });
  await mkdir(dir, { recursive: true, mode: 0o700 });
  try {
    await run(
      'mount',
      [
        '-t',
        'tmpfs',
        '-o',
        'huge=within_size,mode=0700,nosuid,nodev,noexec,size=50%',
        'dormant-staging',
        dir,
      ],
      { timeoutMs: 15_000 },
    );
    return 'tmpfs-huge';
  } catch {
    // Not root, or shmem huge pages not built into this kernel: the folder on /dev/shm serves.
    return 'folder';
  }
}

/** Unmounts (when mounted) and removes the staging folder and everything in it. */
export async function releaseStaging(dir: string): Promise<void> {
  await unmount(dir);
  await rm(dir, { recursive: true, force: true });
}

/**
 * Removes `dir` (a folder inside the staging folder) and everything in it, unmounting first
 * whatever is mounted below it: a restore whose CRIU was ended mid-way leaves CRIU's cgroup
 * yard (a tmpfs with every hierarchy mounted in it) in its work dir, which rm cannot remove.
 */
export async function wipeStaged(dir: string): Promise<void> {
  const still = await unmountAll(dir);
  if (still.length > 0) throw new Error(`cannot wipe ${dir}: still mounted: ${still.join(' ')}`);
  await rm(dir, { recursive: true, force: true });
}
