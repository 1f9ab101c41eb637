/**
 * Whether a checkpoint's CRIU images stay inside the sandbox profile: the credentials,
 * capabilities, no_new_privs, seccomp mode, namespaces and mounts CRIU would give the restored
 * processes. CRIU restores what the images say, as root, without asking: an image edited to
 * hold every capability comes back with every capability. So an imported checkpoint is judged
 * here before anything of it is restored, and refused with every reason found.
 *
 * Pure: it reads decoded images (profile-check-io.ts reads them from a folder) and returns the
 * problems. Each rule follows what CRIU does with the field (criu/cr-restore.c, pstree.c,
 * namespaces.c, mount.c), so that what is judged is what would be restored.
 */
import { DormantError, ErrorCode } from '../domain/errors.js';
import {
  FS_TYPE_NAMES,
  type CoreEntry,
  type CredsEntry,
  type IdExtent,
  type Inventory,
  type MountEntry,
  type TaskKobjIds,
  type UsernsEntry,
} from '../criu/images/messages.js';

/** Capability numbers as the kernel (linux/capability.h) numbers them. */
export const CAPABILITY_NAMES: readonly string[] = Object.freeze([
  'CAP_CHOWN',
  'CAP_DAC_OVERRIDE',
  'CAP_DAC_READ_SEARCH',
  'CAP_FOWNER',
  'CAP_FSETID',
  'CAP_KILL',
  'CAP_SETGID',
  'CAP_SETUID',
  'CAP_SETPCAP',
  'CAP_LINUX_IMMUTABLE',
  'CAP_NET_BIND_SERVICE',
  'CAP_NET_BROADCAST',
  'CAP_NET_ADMIN',
  'CAP_NET_RAW',
  'CAP_IPC_LOCK',
  'CAP_IPC_OWNER',
  'CAP_SYS_MODULE',
  'CAP_SYS_RAWIO',
  'CAP_SYS_CHROOT',
  'CAP_SYS_PTRACE',
  'CAP_SYS_PACCT',
  'CAP_SYS_ADMIN',
  'CAP_SYS_BOOT',
  'CAP_SYS_NICE',
  'CAP_SYS_RESOURCE',
  'CAP_SYS_TIME',
  'CAP_SYS_TTY_CONFIG',
  'CAP_MKNOD',
  'CAP_LEASE',
  'CAP_AUDIT_WRITE',
  'CAP_AUDIT_CONTROL',
  'CAP_SETFCAP',
  'CAP_MAC_OVERRIDE',
  'CAP_MAC_ADMIN',
  'CAP_SYSLOG',
  'CAP_WAKE_ALARM',
  'CAP_BLOCK_SUSPEND',
  'CAP_AUDIT_READ',
  'CAP_PERFMON',
  'CAP_BPF',
  'CAP_CHECKPOINT_RESTORE',
]);

export type NamespaceKind = 'pid' | 'net' | 'ipc' | 'uts' | 'mnt' | 'user' | 'cgroup' | 'time';

const NS_FIELD: Record<NamespaceKind, keyof TaskKobjIds> = {
  pid: 'pidNs',
  net: 'netNs',
  ipc: 'ipcNs',
  uts: 'utsNs',
  mnt: 'mntNs',
  user: 'userNs',
  cgroup: 'cgroupNs',
  time: 'timeNs',
};
const NS_KINDS = Object.keys(NS_FIELD) as NamespaceKind[];

/**
 * Bind mounts podman and CRI-O record as external (the restoring runtime supplies their
 * source): the container's identity files, its /dev/shm and its secrets.
 */
export const ENGINE_EXTERNAL_MOUNTS: readonly string[] = Object.freeze([
  '/etc/hostname',
  '/etc/hosts',
  '/etc/resolv.conf',
  '/run/.containerenv',
  '/dev/shm',
  '/run/secrets',
]);

/**
 * The device nodes of a sandbox in a user namespace: it cannot make device nodes, so runc binds
 * these from the host's /dev (OCI's default devices), and CRIU records them as external
 * mounts. The restoring runtime binds the same host devices there, whatever the image says.
 */
export const USERNS_DEVICE_BINDS: readonly string[] = Object.freeze([
  '/dev/null',
  '/dev/zero',
  '/dev/full',
  '/dev/random',
  '/dev/urandom',
  '/dev/tty',
]);

/** What a dormant sandbox's processes hold; a checkpoint holding more is refused. */
export interface SandboxProfile {
  /** Capabilities a sandbox keeps (names, CAP_*): every set of every thread must be within them. */
  capabilities: readonly string[];
  /** Every thread must have no_new_privs set (runc sets it: OCI noNewPrivileges). */
  noNewPrivsRequired: boolean;
  /** Every thread must run under a seccomp filter (or strict mode): refuse mode 0, disabled. */
  seccompRequired: boolean;
  /** Securebits a thread may hold (a sandbox can set these itself with CAP_SETPCAP). */
  securebitsMask: number;
  /** Namespaces a sandbox's root task has of its own; the others must be the host's. */
  namespaces: readonly NamespaceKind[];
  /**
   * The user namespace a sandbox runs in (root inside mapped to an unprivileged host range):
   * an image's own user namespace must map ids only as this does. Unset: sandboxes run in the
   * host's user namespace, and an image with one of its own is refused.
   */
  userNamespace?: { uidMap: readonly IdExtent[]; gidMap: readonly IdExtent[] };
  /**
   * When `userNamespace` is set: accept an image recorded in the host's user namespace (no
   * user namespace of its own; its root would be the host's root, held to the capabilities
   * above). Default false.
   */
  allowHostUserNamespace: boolean;
  /** Read-only bind mounts a sandbox gets (their destinations): may appear as external mounts. */
  readonlyBinds: readonly string[];
  /** Mounts that must be there, read-only (they keep /proc's kernel knobs out of reach). */
  requiredReadonly: readonly string[];
}

/** The profile of a dormant sandbox, with `capabilities` what the runtime gives (runtime/oci.ts). */
export function sandboxProfile(
  p: Pick<SandboxProfile, 'capabilities'> & Partial<SandboxProfile>,
): SandboxProfile {
  const userns = p.userNamespace !== undefined;
  return {
    noNewPrivsRequired: true,
    seccompRequired: true,
    // SECBIT_NOROOT .. SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED and the exec-restriction bits (6.14).
    securebitsMask: 0xfff,
    namespaces: ['pid', 'net', 'ipc', 'uts', 'mnt', ...(userns ? (['user'] as const) : [])],
    allowHostUserNamespace: false,
    readonlyBinds: [],
    requiredReadonly: ['/proc/sys'],
    ...p,
  };
}

/** The images a check reads: the tree, each thread's core, namespaces and mounts. */
export interface ProfileImages {
  inventory?: Inventory;
  tasks: {
    pid: number;
    ids?: TaskKobjIds;
    /** Every thread of the task (the leader first), with its core-TID.img when there is one. */
    threads: { tid: number; core?: CoreEntry }[];
  }[];
  /** userns-ID.img by namespace id. */
  userns: Map<number, UsernsEntry>;
  /** mountpoints-ID.img by mount namespace id. */
  mounts: Map<number, MountEntry[]>;
  /** Filters in seccomp.img (undefined: no seccomp.img). */
  seccompFilters?: number;
}

export interface ProfileProblem {
  /** Who: `pid 1 thread 1`, `mount /proc/sys`, `the checkpoint`. */
  where: string;
  /** The field and its value, and why it is outside. */
  what: string;
}

export const problemText = (p: ProfileProblem): string => `${p.where}: ${p.what}`;

const TASK_DEAD = 2;
const MS_RDONLY = 1;
const MS_NOSUID = 2;
const MS_NODEV = 4;
const INVALID_ID = 0xffffffff;

const FSTYPE = {
  UNSUPPORTED: 0,
  PROC: 1,
  SYSFS: 2,
  TMPFS: 5,
  DEVPTS: 6,
  CGROUP: 12,
  MQUEUE: 14,
  OVERLAY: 17,
  CGROUP2: 23,
} as const;

/** A capability set (32-bit words, low first) as a bitmask. */
function capMask(words: readonly number[]): bigint {
  let m = 0n;
  words.forEach((w, i) => (m |= BigInt(w >>> 0) << BigInt(32 * i)));
  return m;
}

function capNames(mask: bigint): string[] {
  const out: string[] = [];
  for (let bit = 0; mask >> BigInt(bit) !== 0n; bit++)
    if ((mask >> BigInt(bit)) & 1n) out.push(CAPABILITY_NAMES[bit] ?? `capability ${bit}`);
  return out;
}

function allowedMask(names: readonly string[]): bigint {
  let m = 0n;
  for (const n of names) {
    const i = CAPABILITY_NAMES.indexOf(n);
    if (i >= 0) m |= 1n << BigInt(i);
  }
  return m;
}

/** Whether every id of `e` maps, through `map`, to the same host id as `e` says. */
function extentWithin(e: IdExtent, map: readonly IdExtent[]): boolean {
  if (e.count === 0) return false;
  return map.some(
    (m) =>
      e.first >= m.first &&
      e.first + e.count <= m.first + m.count &&
      e.lowerFirst - e.first === m.lowerFirst - m.first,
  );
}

function mapped(id: number, map: readonly IdExtent[]): boolean {
  return map.some((m) => id >= m.first && id < m.first + m.count);
}

const showMap = (map: readonly IdExtent[]): string =>
  map.map((m) => `${m.first} ${m.lowerFirst} ${m.count}`).join(', ') || 'empty';

function checkCreds(
  where: string,
  c: CredsEntry,
  profile: SandboxProfile,
  idMaps: { uid: readonly IdExtent[]; gid: readonly IdExtent[] } | undefined,
  out: ProfileProblem[],
): void {
  const allowed = allowedMask(profile.capabilities);
  const sets: [string, number[]][] = [
    ['effective', c.capEff],
    ['permitted', c.capPrm],
    ['inheritable', c.capInh],
    ['bounding', c.capBnd],
    ['ambient', c.capAmb],
  ];
  // Sets with the same extra capabilities are said once (an edited image often has all three).
  const bySet = new Map<string, string[]>();
  for (const [set, words] of sets) {
    const extra = capNames(capMask(words) & ~allowed);
    if (extra.length === 0) continue;
    const key = extra.join(', ');
    bySet.set(key, [...(bySet.get(key) ?? []), set]);
  }
  for (const [caps, names] of bySet) {
    const one = !caps.includes(',');
    const setText =
      names.length === 1
        ? `the ${names[0]!} set`
        : `the ${names.slice(0, -1).join(', ')} and ${names.at(-1)!} sets`;
    out.push({
      where,
      what: `${one ? 'capability' : 'capabilities'} ${caps} in ${setText} ${one ? 'is' : 'are'} not in the sandbox profile`,
    });
  }
  if (profile.noNewPrivsRequired && !c.noNewPrivs)
    out.push({ where, what: 'no_new_privs is 0: a sandbox runs with no_new_privs set' });
  const badBits = c.secbits & ~profile.securebitsMask;
  if (badBits !== 0)
    out.push({ where, what: `securebits 0x${c.secbits.toString(16)} has bits the kernel does not define` });
  const ids: [string, number, 'uid' | 'gid'][] = [
    ['uid', c.uid, 'uid'],
    ['euid', c.euid, 'uid'],
    ['suid', c.suid, 'uid'],
    ['fsuid', c.fsuid, 'uid'],
    ['gid', c.gid, 'gid'],
    ['egid', c.egid, 'gid'],
    ['sgid', c.sgid, 'gid'],
    ['fsgid', c.fsgid, 'gid'],
    ...c.groups.map((g, i): [string, number, 'gid'] => [`groups[${i}]`, g, 'gid']),
  ];
  for (const [name, v, kind] of ids) {
    if (v === INVALID_ID) out.push({ where, what: `${name} is ${v}, which is no id` });
    else if (idMaps !== undefined && !mapped(v, idMaps[kind]))
      out.push({ where, what: `${name} ${v} is not mapped by the checkpoint's user namespace` });
  }
}

function checkSeccomp(
  where: string,
  core: CoreEntry,
  leader: boolean,
  images: ProfileImages,
  profile: SandboxProfile,
  out: ProfileProblem[],
): void {
  const t = core.threadCore;
  // CRIU moves the deprecated per-task fields onto the leader's thread when they are there.
  const mode = (leader ? core.oldSeccompMode : undefined) ?? t?.seccompMode ?? 0;
  const filter = (leader ? core.oldSeccompFilter : undefined) ?? t?.seccompFilter;
  if (mode === 0) {
    if (profile.seccompRequired)
      out.push({ where, what: 'seccomp mode 0 (disabled): a sandbox runs under a seccomp filter' });
  } else if (mode === 2) {
    if (filter === undefined || filter >= (images.seccompFilters ?? 0))
      out.push({ where, what: `seccomp filter ${String(filter)} is not in seccomp.img` });
  } else if (mode !== 1) out.push({ where, what: `seccomp mode ${mode} is not one the kernel has` });
}

function checkNamespaces(images: ProfileImages, profile: SandboxProfile, out: ProfileProblem[]): void {
  const hostIds = images.inventory?.rootIds;
  const root = images.tasks[0];
  if (hostIds === undefined) {
    out.push({
      where: 'the checkpoint',
      what: "inventory.img records no root namespace ids: its namespaces can't be checked",
    });
    return;
  }
  if (!root?.ids) {
    out.push({ where: `pid ${root?.pid ?? '?'}`, what: 'no namespace ids (ids-N.img) recorded' });
    return;
  }
  for (const kind of NS_KINDS) {
    const f = NS_FIELD[kind];
    const own = root.ids[f] !== undefined && root.ids[f] !== hostIds[f];
    const wanted = profile.namespaces.includes(kind);
    // A cgroup namespace only changes which cgroup paths the sandbox sees (dormant's sandboxes
    // have one; podman's have one on cgroup v2 and not on v1): either is accepted.
    if (kind === 'cgroup') continue;
    if (kind === 'user') {
      if (own && profile.userNamespace === undefined)
        out.push({
          where: `pid ${root.pid}`,
          what: 'runs in a user namespace of its own, which sandboxes on this node do not have',
        });
      else if (!own && profile.userNamespace !== undefined && !profile.allowHostUserNamespace)
        out.push({
          where: `pid ${root.pid}`,
          what: "runs in the host's user namespace (the checkpoint has no user namespace, so its root would be the host's root); sandboxes here run in one mapping root to an unprivileged host range (podman's and CRI-O's checkpoints have none: import them on a daemon run with --no-user-namespace)",
        });
      continue;
    }
    if (wanted && !own)
      out.push({
        where: `pid ${root.pid}`,
        what: `runs in the host's ${kind} namespace: a sandbox has its own`,
      });
    else if (!wanted && own)
      out.push({
        where: `pid ${root.pid}`,
        what: `has a ${kind} namespace of its own, which a sandbox does not have`,
      });
  }
  for (const t of images.tasks.slice(1)) {
    if (!t.ids) {
      out.push({ where: `pid ${t.pid}`, what: 'no namespace ids (ids-N.img) recorded' });
      continue;
    }
    for (const kind of NS_KINDS) {
      const f = NS_FIELD[kind];
      if (t.ids[f] !== root.ids[f])
        out.push({
          where: `pid ${t.pid}`,
          what: `is in another ${kind} namespace than pid ${root.pid} (nested namespaces are not restored into a sandbox)`,
        });
    }
  }
}

function checkUserns(
  images: ProfileImages,
  profile: SandboxProfile,
  out: ProfileProblem[],
): { uid: readonly IdExtent[]; gid: readonly IdExtent[] } | undefined {
  const root = images.tasks[0];
  const hostIds = images.inventory?.rootIds;
  const id = root?.ids?.userNs;
  if (id === undefined || hostIds === undefined || id === hostIds.userNs) return undefined;
  const ns = images.userns.get(id);
  if (ns === undefined) {
    out.push({ where: `user namespace ${id}`, what: `userns-${id}.img is missing` });
    return { uid: [], gid: [] };
  }
  const want = profile.userNamespace;
  if (want !== undefined) {
    for (const [kind, map, allowed] of [
      ['uid_map', ns.uidMap, want.uidMap],
      ['gid_map', ns.gidMap, want.gidMap],
    ] as const) {
      if (map.length === 0) out.push({ where: `user namespace ${id}`, what: `${kind} is empty` });
      for (const e of map)
        if (!extentWithin(e, allowed))
          out.push({
            where: `user namespace ${id}`,
            what: `${kind} line "${e.first} ${e.lowerFirst} ${e.count}" is outside the sandbox's mapping (${showMap(allowed)})`,
          });
    }
  }
  return { uid: ns.uidMap, gid: ns.gidMap };
}

function isExternal(m: MountEntry): boolean {
  return m.extKey !== undefined || m.extMount;
}

function underOrAt(path: string, dir: string): boolean {
  return path === dir || path.startsWith(`${dir}/`);
}

/** One mount: refused when a sandbox could not have it. */
function checkMount(m: MountEntry, isRoot: boolean, profile: SandboxProfile, out: ProfileProblem[]): void {
  const where = `mount ${m.mountpoint.slice(0, 200) || '?'}`;
  const type = FS_TYPE_NAMES[m.fstype] ?? `fstype ${m.fstype}`;
  const ro = (m.flags & MS_RDONLY) !== 0 || ((m.sbFlags ?? 0) & MS_RDONLY) !== 0;
  if (m.withPlugin) {
    out.push({ where, what: 'is restored by a CRIU plugin, which a sandbox has none of' });
    return;
  }
  if (isRoot) {
    // The root is not mounted from the image: CRIU binds the sandbox's own rootfs there.
    if (m.mountpoint !== '/') out.push({ where, what: 'the root mount is not at /' });
    return;
  }
  if (m.mountpoint.split('/').includes('..') || !m.mountpoint.startsWith('/'))
    out.push({ where, what: 'the mountpoint is not a plain absolute path' });
  if (isExternal(m)) {
    // The restoring runtime maps the key to a host path (its own bind mounts): what is
    // checked is that the key is one a sandbox has, where it has it, and read-only when its
    // bind is read-only (CRIU remounts with the image's flags).
    const key = m.extKey ?? m.mountpoint;
    if (key === '/dev/null') return; // a masked file
    if (key !== m.mountpoint) {
      out.push({
        where,
        what: `external mount "${key.slice(0, 200)}" is bound at another path than its own`,
      });
      return;
    }
    if (ENGINE_EXTERNAL_MOUNTS.some((p) => underOrAt(key, p))) return;
    if (profile.userNamespace !== undefined && USERNS_DEVICE_BINDS.includes(key)) return;
    const roBind = profile.readonlyBinds.includes(key);
    const cgroupBind =
      (m.fstype === FSTYPE.CGROUP || m.fstype === FSTYPE.CGROUP2) && underOrAt(key, '/sys/fs/cgroup');
    if (!roBind && !cgroupBind) {
      out.push({
        where,
        what: `external ${m.fsname?.slice(0, 40) ?? type} mount ${key.slice(0, 200)} is not one a sandbox has`,
      });
      return;
    }
    const need = roBind ? MS_RDONLY | MS_NOSUID | MS_NODEV : MS_RDONLY;
    if ((m.flags & need) !== need)
      out.push({
        where,
        what: `${type} bind mount flags 0x${m.flags.toString(16)}: a sandbox has it ${roBind ? 'read-only, nosuid, nodev' : 'read-only'}`,
      });
    return;
  }
  switch (m.fstype) {
    case FSTYPE.TMPFS:
    case FSTYPE.DEVPTS:
    case FSTYPE.MQUEUE:
      // The sandbox's own instances, made fresh by CRIU (tmpfs contents from the images).
      return;
    case FSTYPE.PROC:
      // /proc itself may be read-write (its kernel knobs are covered read-only); any other
      // view of proc must be read-only, or it would uncover /proc/sys.
      if (m.mountpoint === '/proc' && m.root === '/') return;
      if (!ro) out.push({ where, what: 'proc mounted read-write: a sandbox has only /proc read-write' });
      return;
    case FSTYPE.SYSFS:
      if (!ro) out.push({ where, what: 'sysfs mounted read-write: a sandbox has it read-only' });
      return;
    case FSTYPE.CGROUP:
    case FSTYPE.CGROUP2:
      if (!ro) out.push({ where, what: `${type} mounted read-write: a sandbox has it read-only` });
      return;
    default:
      out.push({
        where,
        what: `a ${type}${m.fsname ? ` (${m.fsname.slice(0, 40)})` : ''} mount is not one a sandbox has (a sandbox mounts proc, sysfs, tmpfs, devpts, mqueue and cgroup; host filesystems only as its read-only binds)`,
      });
  }
}

function checkMounts(images: ProfileImages, profile: SandboxProfile, out: ProfileProblem[]): void {
  const mntNs = images.tasks[0]?.ids?.mntNs;
  for (const [nsId, list] of images.mounts) {
    const ids = new Set(list.map((m) => m.mntId));
    const roots = list.filter((m) => !ids.has(m.parentMntId) || m.parentMntId === m.mntId);
    if (roots.length !== 1)
      out.push({
        where: `mount namespace ${nsId}`,
        what: `${roots.length} root mounts (expected one, at /)`,
      });
    for (const m of list) checkMount(m, roots.includes(m), profile, out);
    if (nsId !== mntNs) continue;
    for (const path of profile.requiredReadonly) {
      const at = list.filter((m) => m.mountpoint === path);
      const ro = at.some((m) => (m.flags & MS_RDONLY) !== 0);
      if (!ro)
        out.push({
          where: `mount ${path}`,
          what: 'is missing or read-write: a sandbox has it read-only',
        });
    }
  }
  if (mntNs !== undefined && !images.mounts.has(mntNs))
    out.push({ where: `mount namespace ${mntNs}`, what: `mountpoints-${mntNs}.img is missing` });
}

/** Every way the checkpoint's images go beyond `profile`; empty when they stay inside. */
export function checkAgainstProfile(images: ProfileImages, profile: SandboxProfile): ProfileProblem[] {
  const out: ProfileProblem[] = [];
  if (images.tasks.length === 0) {
    out.push({ where: 'the checkpoint', what: 'pstree.img lists no process' });
    return out;
  }
  checkNamespaces(images, profile, out);
  const idMaps = checkUserns(images, profile, out);
  for (const task of images.tasks) {
    for (const th of task.threads) {
      const where = `pid ${task.pid} thread ${th.tid}`;
      const core = th.core;
      if (core === undefined) {
        out.push({ where, what: `core-${th.tid}.img is missing` });
        continue;
      }
      // A zombie runs nothing of the image: CRIU makes it and lets it exit.
      if (core.taskState === TASK_DEAD) continue;
      const creds = core.threadCore?.creds;
      if (creds === undefined)
        // CRIU would restore this thread with its own credentials: root, every capability.
        out.push({ where, what: 'no credentials recorded (thread_core.creds)' });
      else checkCreds(where, creds, profile, idMaps, out);
      // CRIU (4.2, checked) records seccomp on the leader's core only: a thread's core holds
      // none though the thread runs under the same filter, and CRIU restores it so (a restored
      // multi-threaded task's threads show Seccomp: 2). A thread without a record is judged by
      // its leader's; a thread's own record, where there is one, by itself.
      const leaderCore = task.threads.find((x) => x.tid === task.pid)?.core;
      const judged =
        th.tid !== task.pid && core.threadCore?.seccompMode === undefined && leaderCore !== undefined
          ? leaderCore
          : core;
      checkSeccomp(where, judged, judged === leaderCore || th.tid === task.pid, images, profile, out);
    }
  }
  checkMounts(images, profile, out);
  return out;
}

/** At most this many reasons go into the error's message; all are in its details. */
const MAX_REASONS_SHOWN = 8;

/** The refusal of a checkpoint outside the profile: what and why, for each problem. */
export function outsideProfile(problems: readonly ProfileProblem[], what = 'the checkpoint'): DormantError {
  const shown = problems.slice(0, MAX_REASONS_SHOWN).map(problemText);
  const more = problems.length - shown.length;
  return new DormantError(
    ErrorCode.CHECKPOINT_OUTSIDE_PROFILE,
    `${what} holds more than a sandbox may: ${shown.join('; ')}${more > 0 ? `; and ${more} more` : ''}`,
    {
      hint: 'a checkpoint restores only as what a dormant sandbox is: its capabilities, no_new_privs, a seccomp filter, its namespaces and mounts; checkpoint the workload in a sandbox (or a container run with that profile) and import that',
      details: { problems: problems.map(problemText) },
    },
  );
}
