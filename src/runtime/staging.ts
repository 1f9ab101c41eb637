/**
 * The staging folder where CRIU images are in flight (a dump before it is in the vault, a
 * checkpoint fetched for a restore): memory only, never a disk. It is a tmpfs of its own with
 * transparent huge pages for files of 2 MiB and more (`huge=within_size`): on these VMs every
 * fresh 4 KiB page costs a fault, and a 256 MiB image written into a plain tmpfs took 0.16-0.19 s
 * against 0.05-0.06 s with huge pages (small images still get small pages). Where that mount is
 * not possible (no root, a kernel without shmem THP) it is a plain folder on /dev/shm.
 */
import { chmod, lstat, mkdir, readdir, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';
import { run } from '../sys/exec.js';
import { isMountPoint, unmount, unmountAll } from './rootfs.js';

export type StagingKind = 'tmpfs-huge' | 'folder';

/**
 * Makes `dir` an empty, private (0700) staging folder. A leftover from a crash (images of a
 * hibernate that never committed) is emptied, its mount kept.
 */
export async function prepareStaging(dir: string): Promise<StagingKind> {
  if (await isMountPoint(dir)) {
    await emptyPrivateFolder(dir);
    return 'tmpfs-huge';
  }
  await preparePrivateFolder(dir);
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

/**
 * Checks that `dir` is a real folder (no link) of this process's user that nobody else may
 * write to: /dev/shm is writable by every local user, so a folder there with a name known in
 * advance could have been made by someone else, to read or swap what dormant writes into it.
 */
export async function assertOwnFolder(dir: string): Promise<void> {
  const st = await lstat(dir);
  const uid = process.getuid?.() ?? 0;
  if (!st.isDirectory() || st.uid !== uid || (st.mode & 0o022) !== 0)
    throw new DormantError(
      ErrorCode.INTERNAL,
      `${dir} is not a private folder of this user (${st.isSymbolicLink() ? 'a symbolic link' : `owner ${String(st.uid)}, mode ${(st.mode & 0o777).toString(8)}`}): refusing to keep secrets in it`,
      { hint: `someone made it before dormant did; remove it (rm -rf ${dir}) and start again` },
    );
}

/** Empties a folder of ours, keeping the folder (and a mount on it), and makes it 0700. */
async function emptyPrivateFolder(dir: string): Promise<void> {
  await assertOwnFolder(dir);
  await chmod(dir, 0o700);
  await Promise.all((await readdir(dir)).map((n) => rm(join(dir, n), { recursive: true, force: true })));
}

/**
 * Makes `dir` (in a memory-backed folder such as /dev/shm) an empty folder only this user
 * reads: what an earlier process left there (a daemon killed mid-hibernate leaves plaintext
 * images) is removed. Created without `recursive`, so a folder someone else made in the
 * meantime is an error rather than silently reused.
 */
export async function preparePrivateFolder(dir: string): Promise<void> {
  try {
    await mkdir(dir, { mode: 0o700 });
  } catch (e) {
    if (errnoCode(e) !== 'EEXIST') throw e;
    await emptyPrivateFolder(dir);
  }
  await assertOwnFolder(dir);
}

/** Makes `dir` a private folder of ours (0700), keeping what is in it; someone else's is an error. */
export async function privateFolder(dir: string): Promise<void> {
  await mkdir(dir, { mode: 0o700 }).catch((e: unknown) => {
    if (errnoCode(e) !== 'EEXIST') throw e;
  });
  await assertOwnFolder(dir);
  await chmod(dir, 0o700);
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
