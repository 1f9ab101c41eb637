/**
 * What an engine's checkpoint needs of the restoring side beyond its processes: the bind
 * mounts podman and CRI-O give every container (recorded by CRIU as external mounts the
 * restore must supply: /etc/hostname, /etc/hosts, /etc/resolv.conf, /run/.containerenv, the
 * container's /dev/shm, CRI-O's /run/secrets), their contents, and the root folder's mode
 * (CRIU checks the restored root against the one it dumped: podman's is the image's, 0555
 * for most, where a dormant sandbox's writable layer is 0700).
 *
 * Which external mounts a sandbox may have at all is the profile check's (profile-check.ts):
 * any other, a bind of a host folder, is refused there before this runs.
 */
import { chmod, readdir, stat, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { Magic } from '../criu/images/image-file.js';
import { decodeFileEntry, decodeMount, type MountEntry } from '../criu/images/messages.js';
import { imageBudget, readImageEntries } from '../criu/images/reader.js';
import { ENGINE_EXTERNAL_MOUNTS } from './profile-check.js';
import { applyRootfsDiff } from './rootfs-diff.js';

/** A bind the sandbox gets for an archive's external mount (runtime.ts EngineBind). */
export interface EngineMount {
  destination: string;
  dir: boolean;
}

/** CRIU's fstype number of cgroup v1 (images/mnt.proto). */
const FSTYPE_CGROUP = 12;

/** Engine binds that are folders (the rest are files). */
const DIR_MOUNTS = ['/dev/shm', '/run/secrets'];
const under = (p: string, d: string): boolean => p === d || p.startsWith(`${d}/`);

export interface ArchiveMounts {
  /** The engine binds the restore must supply, in the images' order. */
  binds: EngineMount[];
  /** The mode bits of the root folder as dumped (from the task's root in files.img). */
  rootMode?: number;
  /**
   * The cgroup v1 hierarchies are external binds (a container with no cgroup namespace): the
   * sandbox must then have none either, or runc does not map them on restore.
   */
  cgroupBinds: boolean;
}

/** Reads the archive's external mounts (the engines' own) and its root's mode from its images. */
export async function readArchiveMounts(imagesDir: string): Promise<ArchiveMounts> {
  const budget = imageBudget();
  const mounts: MountEntry[] = [];
  for (const name of await readdir(imagesDir))
    if (/^mountpoints-\d+\.img$/.test(name))
      for (const raw of (await readImageEntries(imagesDir, name, Magic.MNTS, budget)) ?? [])
        mounts.push(decodeMount(raw));
  const binds: EngineMount[] = [];
  let cgroupBinds = false;
  for (const m of mounts) {
    if (m.extKey !== undefined && m.fstype === FSTYPE_CGROUP && under(m.extKey, '/sys/fs/cgroup'))
      cgroupBinds = true;
    const key = m.extKey;
    if (key === undefined || key === '/dev/null' || key !== m.mountpoint) continue;
    if (!ENGINE_EXTERNAL_MOUNTS.some((p) => under(key, p))) continue;
    if (binds.some((b) => b.destination === key)) continue;
    binds.push({ destination: key, dir: DIR_MOUNTS.some((d) => under(key, d)) });
  }
  // The root mount's id; the root folder is the files.img entry named "/" on it.
  const rootIds = new Set(mounts.filter((m) => m.mountpoint === '/').map((m) => m.mntId));
  let rootMode: number | undefined;
  for (const raw of (await readImageEntries(imagesDir, 'files.img', Magic.FILES, budget)) ?? []) {
    const reg = decodeFileEntry(raw).reg;
    if (reg?.name !== '/' || reg.mode === undefined || (reg.mode & 0o170000) !== 0o040000) continue;
    if (reg.mntId !== undefined && rootIds.size > 0 && !rootIds.has(reg.mntId)) continue;
    rootMode = reg.mode & 0o7777;
    break;
  }
  return { binds, cgroupBinds, ...(rootMode !== undefined ? { rootMode } : {}) };
}

/** What dormant knows to write into the identity files it provides. */
export interface EngineIdentity {
  hostname: string;
  /** The sandbox's address on its link. */
  address: string;
}

/**
 * Fills the sources of an imported sandbox's engine binds: /dev/shm from the archive's
 * devshm-checkpoint.tar (through the same guards as its rootfs diff), the identity files with
 * what the container had (its hostname, written as podman writes it, with no newline; an
 * empty .containerenv, as podman gives an unprivileged container) and what dormant
 * provides for the rest (its own address in /etc/hosts; no resolver: a sandbox reaches no
 * outside name server). A folder bind with no saved contents stays empty.
 */
export async function fillEngineBinds(
  archiveRoot: string | undefined,
  sources: readonly { destination: string; source: string }[],
  id: EngineIdentity,
): Promise<void> {
  for (const { destination, source } of sources) {
    switch (destination) {
      case '/dev/shm': {
        const tar = archiveRoot !== undefined ? join(archiveRoot, 'devshm-checkpoint.tar') : undefined;
        if (tar !== undefined && (await readable(tar))) {
          await applyRootfsDiff(tar, source);
          // The tar's "./" entry may narrow it: /dev/shm is everyone's.
          await chmod(source, 0o1777);
        }
        break;
      }
      case '/etc/hostname':
        await writeFile(source, id.hostname);
        break;
      case '/etc/hosts':
        await writeFile(source, `127.0.0.1\tlocalhost\n::1\tlocalhost\n${id.address}\t${id.hostname}\n`);
        break;
      case '/etc/resolv.conf':
        await writeFile(source, '# dormant: sandboxes are given no name server\n');
        break;
      case '/run/.containerenv':
        await writeFile(source, '');
        break;
      default:
      // CRI-O's secrets: their contents are not in the archive; the runtime's source stays empty.
    }
  }
}

async function readable(path: string): Promise<boolean> {
  return stat(path).then(
    (s) => s.isFile(),
    () => false,
  );
}
