/**
 * Reads what the profile check judges from a folder of CRIU images (the process tree, every
 * thread's core, namespace ids, user namespaces, mounts, seccomp filters) and refuses a
 * checkpoint outside the sandbox profile. Every read goes through the bounded image reader.
 */
import { readdir } from 'node:fs/promises';
import { Magic } from '../criu/images/image-file.js';
import {
  decodeCore,
  decodeIdsEntry,
  decodeInventory,
  decodeMount,
  decodePstree,
  decodeSeccomp,
  decodeUserns,
  type UsernsEntry,
  type MountEntry,
} from '../criu/images/messages.js';
import { malformed } from '../criu/images/proto.js';
import { imageBudget, readImageEntries } from '../criu/images/reader.js';
import {
  checkAgainstProfile,
  outsideProfile,
  type ProfileImages,
  type SandboxProfile,
} from './profile-check.js';

/** Far above any sandbox (its pids limit); more means a hostile tree, read no further. */
const MAX_THREADS = 100_000;
/** Namespace images of one kind (userns-N, mountpoints-N) a checkpoint may hold. */
const MAX_NS_IMAGES = 1024;

export async function readProfileImages(dir: string): Promise<ProfileImages> {
  // One budget for the whole dump: bytes read and entries split are capped across its images.
  const budget = imageBudget();
  const one = async <T>(name: string, magic: number, dec: (b: Uint8Array) => T): Promise<T | undefined> => {
    const e = (await readImageEntries(dir, name, magic, budget))?.[0];
    return e === undefined ? undefined : dec(e);
  };
  const inventory = await one('inventory.img', Magic.INVENTORY, decodeInventory);
  const pstree = await readImageEntries(dir, 'pstree.img', Magic.PSTREE, budget);
  if (pstree === undefined) throw malformed('no pstree.img: not a CRIU dump');
  const tasks: ProfileImages['tasks'] = [];
  let threads = 0;
  for (const raw of pstree) {
    const pe = decodePstree(raw);
    // The leader first; CRIU restores every thread listed, each from its core-TID.img.
    const tids = [pe.pid, ...pe.threads.filter((t) => t !== pe.pid)];
    threads += tids.length;
    if (threads > MAX_THREADS) throw malformed(`pstree.img lists more than ${MAX_THREADS} threads`);
    const list: ProfileImages['tasks'][number]['threads'] = [];
    for (const tid of new Set(tids)) {
      const core = await one(`core-${tid}.img`, Magic.CORE, decodeCore);
      list.push(core === undefined ? { tid } : { tid, core });
    }
    const ids = (await one(`ids-${pe.pid}.img`, Magic.IDS, decodeIdsEntry)) ?? list[0]?.core?.ids;
    tasks.push({ pid: pe.pid, ...(ids ? { ids } : {}), threads: list });
  }
  const userns = new Map<number, UsernsEntry>();
  const mounts = new Map<number, MountEntry[]>();
  let nsImages = 0;
  for (const name of await readdir(dir)) {
    const u = /^userns-(\d+)\.img$/.exec(name);
    const m = /^mountpoints-(\d+)\.img$/.exec(name);
    if (!u && !m) continue;
    if (++nsImages > MAX_NS_IMAGES) throw malformed(`more than ${MAX_NS_IMAGES} namespace images`);
    if (u) {
      const e = await one(name, Magic.USERNS, decodeUserns);
      if (e) userns.set(Number(u[1]), e);
    } else if (m) {
      mounts.set(
        Number(m[1]),
        ((await readImageEntries(dir, name, Magic.MNTS, budget)) ?? []).map(decodeMount),
      );
    }
  }
  const seccomp = await one('seccomp.img', Magic.SECCOMP, decodeSeccomp);
  return {
    ...(inventory ? { inventory } : {}),
    tasks,
    userns,
    mounts,
    ...(seccomp ? { seccompFilters: seccomp.length } : {}),
  };
}

/**
 * Refuses (CHECKPOINT_OUTSIDE_PROFILE, 422) the checkpoint whose images are in `dir` when they
 * give its processes more than `profile`; malformed images fail with CRIU_IMAGE_MALFORMED.
 */
export async function assertWithinProfile(
  dir: string,
  profile: SandboxProfile,
  what?: string,
): Promise<void> {
  const problems = checkAgainstProfile(await readProfileImages(dir), profile);
  if (problems.length > 0) throw outsideProfile(problems, what);
}
