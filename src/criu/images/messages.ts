/**
 * dormant's own definitions of the CRIU image messages it reads. Field numbers are facts
 * taken from CRIU's images/*.proto (CRIU 4.2); only the fields dormant uses are decoded,
 * everything else is skipped. Unknown enum values are kept as numbers.
 */
import { Msg, malformed } from './proto.js';

export interface TaskKobjIds {
  vmId: number;
  filesId: number;
  fsId: number;
  pidNs?: number;
  netNs?: number;
  ipcNs?: number;
  utsNs?: number;
  mntNs?: number;
  userNs?: number;
  cgroupNs?: number;
  timeNs?: number;
}

export interface Inventory {
  imgVersion: number;
  fdinfoPerId: boolean;
  nsPerId: boolean;
  rootIds?: TaskKobjIds;
  rootCgSet?: number;
  lsm?: number;
  dumpUptimeUs?: bigint;
  tcpClose: boolean;
  plugins: string[];
  criuRunId?: string;
}

export interface PstreeEntry {
  pid: number;
  ppid: number;
  pgid: number;
  sid: number;
  threads: number[];
}

export const Arch = [
  'unknown',
  'x86_64',
  'arm',
  'aarch64',
  'ppc64',
  's390',
  'mips',
  'loongarch64',
  'riscv64',
];

/**
 * creds_entry (creds.proto): a thread's credentials as CRIU restores them. Capability sets are
 * 32-bit words, low word first (CRIU writes two).
 */
export interface CredsEntry {
  uid: number;
  gid: number;
  euid: number;
  egid: number;
  suid: number;
  sgid: number;
  fsuid: number;
  fsgid: number;
  capInh: number[];
  capPrm: number[];
  capEff: number[];
  capBnd: number[];
  capAmb: number[];
  secbits: number;
  groups: number[];
  /** Absent when the thread had it clear: CRIU writes the field only when it is set. */
  noNewPrivs?: number;
  lsmProfile?: string;
}

/** thread_core_entry (core.proto): what is per thread, credentials and seccomp included. */
export interface ThreadCoreEntry {
  creds?: CredsEntry;
  /** SECCOMP_MODE_*: 0 disabled, 1 strict, 2 filter. Absent: disabled. */
  seccompMode?: number;
  /** Index of the thread's newest filter in seccomp.img. */
  seccompFilter?: number;
  comm?: string;
}

export interface CoreEntry {
  arch: string;
  comm: string;
  /** CRIU's task state: 1 alive, 2 dead (zombie), 3 stopped, 6 alive but with seized threads. */
  taskState: number;
  exitCode: number;
  cgSet?: number;
  ids?: TaskKobjIds;
  /** Present in every image CRIU 2+ writes; without it CRIU restores no credentials at all. */
  threadCore?: ThreadCoreEntry;
  /** task_core_entry's deprecated per-task seccomp fields: CRIU moves them onto the leader's thread. */
  oldSeccompMode?: number;
  oldSeccompFilter?: number;
}

/** One line of a uid_map or gid_map (userns.proto uid_gid_extent). */
export interface IdExtent {
  /** First id inside the namespace. */
  first: number;
  /** First id outside (in the parent namespace). */
  lowerFirst: number;
  count: number;
}

/** userns-N.img: the mappings CRIU writes into the user namespace it creates. */
export interface UsernsEntry {
  uidMap: IdExtent[];
  gidMap: IdExtent[];
}

/** seccomp.img: the filters of every thread, each naming the one installed before it. */
export interface SeccompFilter {
  /** The classic BPF program (struct sock_filter[]). */
  filter: Uint8Array;
  /** Index of the previous filter in the chain, if any. */
  prev?: number;
  flags?: number;
}

export interface Vma {
  start: bigint;
  end: bigint;
  pgoff: bigint;
  shmid: bigint;
  prot: number;
  flags: number;
  status: number;
}

export interface MmEntry {
  exeFileId: number;
  vmas: Vma[];
  argStart: bigint;
  argEnd: bigint;
  envStart: bigint;
  envEnd: bigint;
  brkStart: bigint;
  brk: bigint;
  stackStart: bigint;
}

export interface PagemapEntry {
  vaddr: bigint;
  nrPages: number;
  inParent: boolean;
  flags?: number;
}

export interface FdinfoEntry {
  id: number;
  flags: number;
  type: number;
  fd: number;
}

export interface RegFile {
  id: number;
  flags: number;
  pos: bigint;
  name: string;
  size?: bigint;
  mode?: number;
  mntId?: number;
}

export interface InetSk {
  id: number;
  ino: number;
  family: number;
  type: number;
  proto: number;
  state: number;
  srcPort: number;
  dstPort: number;
  backlog: number;
  srcAddr: number[];
  dstAddr: number[];
  sndbuf?: number;
  rcvbuf?: number;
}

export interface UnixSk {
  id: number;
  ino: number;
  type: number;
  state: number;
  peer: number;
  /** The bound name; an abstract name starts with a NUL byte. */
  name: Uint8Array;
  sndbuf?: number;
  rcvbuf?: number;
}

export interface PipeFile {
  id: number;
  pipeId: number;
}

export interface FileEntry {
  type: number;
  id: number;
  reg?: RegFile;
  inet?: InetSk;
  unix?: UnixSk;
  pipe?: PipeFile;
  fifo?: PipeFile;
  nsf?: { nsId: number; nsCflag: number };
  memfd?: { inodeId: number };
}

export interface MountEntry {
  fstype: number;
  mntId: number;
  rootDev: number;
  parentMntId: number;
  /** The mount's MS_* flags (MS_RDONLY 1, MS_NOSUID 2, MS_NODEV 4, MS_NOEXEC 8). */
  flags: number;
  /** The superblock's flags (MS_RDONLY when the filesystem itself is read-only). */
  sbFlags?: number;
  root: string;
  mountpoint: string;
  source: string;
  options: string;
  fsname?: string;
  extMount: boolean;
  extKey?: string;
  withPlugin: boolean;
  sharedId?: number;
  masterId?: number;
}

export interface CgroupSet {
  id: number;
  controllers: { name: string; path: string }[];
}

export interface FsEntry {
  cwdId: number;
  rootId: number;
  umask?: number;
}

export interface DumpStats {
  freezingTimeUs: number;
  frozenTimeUs: number;
  memdumpTimeUs: number;
  memwriteTimeUs: number;
  pagesScanned: bigint;
  pagesWritten: bigint;
}

/** fd_types from fdinfo.proto. */
export const FdType = {
  UND: 0,
  REG: 1,
  PIPE: 2,
  FIFO: 3,
  INETSK: 4,
  UNIXSK: 5,
  EVENTFD: 6,
  EVENTPOLL: 7,
  INOTIFY: 8,
  SIGNALFD: 9,
  PACKETSK: 10,
  TTY: 11,
  FANOTIFY: 12,
  NETLINKSK: 13,
  NS: 14,
  TUNF: 15,
  EXT: 16,
  TIMERFD: 17,
  MEMFD: 18,
  BPFMAP: 19,
  PIDFD: 20,
} as const;

export const FD_TYPE_NAMES: Record<number, string> = Object.fromEntries(
  Object.entries(FdType).map(([k, v]) => [v, k]),
);

/** fstype from mnt.proto. */
export const FS_TYPE_NAMES: Record<number, string> = {
  0: 'unsupported',
  1: 'proc',
  2: 'sysfs',
  3: 'devtmpfs',
  4: 'binfmt_misc',
  5: 'tmpfs',
  6: 'devpts',
  7: 'simfs',
  8: 'pstore',
  9: 'securityfs',
  10: 'fusectl',
  11: 'debugfs',
  12: 'cgroup',
  13: 'aufs',
  14: 'mqueue',
  15: 'fuse',
  16: 'auto',
  17: 'overlay',
  18: 'autofs',
  19: 'tracefs',
  23: 'cgroup2',
};

// uint32 fields read as protobuf-c reads them (low 32 bits): the namespace checks compare
// these ids, and must see the ids CRIU will.
function decodeIds(m: Msg): TaskKobjIds {
  return {
    vmId: m.u32(1) ?? 0,
    filesId: m.u32(2) ?? 0,
    fsId: m.u32(3) ?? 0,
    pidNs: m.u32(5),
    netNs: m.u32(6),
    ipcNs: m.u32(7),
    utsNs: m.u32(8),
    mntNs: m.u32(9),
    userNs: m.u32(10),
    cgroupNs: m.u32(11),
    timeNs: m.u32(12),
  };
}

export function decodeInventory(b: Uint8Array): Inventory {
  const m = new Msg(b);
  const ids = m.msg(3);
  return {
    imgVersion: m.req(1, m.num(1), 'inventory.img_version'),
    fdinfoPerId: m.bool(2) ?? false,
    nsPerId: m.bool(4) ?? false,
    rootIds: ids ? decodeIds(ids) : undefined,
    rootCgSet: m.num(5),
    lsm: m.num(6),
    dumpUptimeUs: m.big(8),
    tcpClose: m.bool(10) ?? false,
    plugins: m.msg(12)?.strs(12) ?? [],
    criuRunId: m.str(13),
  };
}

export function decodePstree(b: Uint8Array): PstreeEntry {
  const m = new Msg(b);
  return {
    pid: m.req(1, m.u32(1), 'pstree.pid'),
    ppid: m.num(2) ?? 0,
    pgid: m.num(3) ?? 0,
    sid: m.num(4) ?? 0,
    threads: m.u32s(5),
  };
}

export function decodeIdsEntry(b: Uint8Array): TaskKobjIds {
  return decodeIds(new Msg(b));
}

/** At most this many supplementary groups (the kernel's NGROUPS_MAX). */
const MAX_GROUPS = 65536;
/** Capability words: the kernel has two (64 bits); more is a damaged or hostile image. */
const MAX_CAP_WORDS = 8;

function capWords(m: Msg, no: number, what: string): number[] {
  const w = m.u32s(no);
  if (w.length > MAX_CAP_WORDS) throw malformed(`creds.${what}: ${w.length} capability words`);
  return w;
}

export function decodeCreds(m: Msg): CredsEntry {
  const id = (no: number, what: string): number => m.req(no, m.u32(no), `creds.${what}`);
  const groups = m.u32s(14);
  if (groups.length > MAX_GROUPS) throw malformed(`creds.groups: ${groups.length} groups`);
  return {
    uid: id(1, 'uid'),
    gid: id(2, 'gid'),
    euid: id(3, 'euid'),
    egid: id(4, 'egid'),
    suid: id(5, 'suid'),
    sgid: id(6, 'sgid'),
    fsuid: id(7, 'fsuid'),
    fsgid: id(8, 'fsgid'),
    capInh: capWords(m, 9, 'cap_inh'),
    capPrm: capWords(m, 10, 'cap_prm'),
    capEff: capWords(m, 11, 'cap_eff'),
    capBnd: capWords(m, 12, 'cap_bnd'),
    capAmb: capWords(m, 19, 'cap_amb'),
    secbits: id(13, 'secbits'),
    groups,
    noNewPrivs: m.u32(18),
    lsmProfile: m.str(15),
  };
}

function decodeThreadCore(m: Msg): ThreadCoreEntry {
  const creds = m.msg(10);
  return {
    creds: creds ? decodeCreds(creds) : undefined,
    // An enum: protobuf-c keeps the int32 value (an unknown one fails CRIU's restore).
    seccompMode: m.u32(11),
    seccompFilter: m.u32(12),
    comm: m.str(13),
  };
}

export function decodeCore(b: Uint8Array): CoreEntry {
  const m = new Msg(b);
  const mtype = m.num(1) ?? 0;
  const tc = m.msg(3);
  const ids = m.msg(4);
  const thread = m.msg(5);
  return {
    arch: Arch[mtype] ?? `arch-${mtype}`,
    comm: tc?.str(6) ?? thread?.str(13) ?? '',
    taskState: tc?.num(1) ?? 0,
    exitCode: tc?.num(2) ?? 0,
    cgSet: tc?.num(9) ?? thread?.num(16),
    ids: ids ? decodeIds(ids) : undefined,
    threadCore: thread ? decodeThreadCore(thread) : undefined,
    oldSeccompMode: tc?.u32(11),
    oldSeccompFilter: tc?.u32(12),
  };
}

function decodeExtents(m: Msg, no: number, what: string): IdExtent[] {
  const list = m.msgs(no);
  // The kernel takes at most 340 lines per map.
  if (list.length > 340) throw malformed(`userns.${what}: ${list.length} extents`);
  return list.map((e) => ({
    first: e.req(1, e.u32(1), `${what}.first`),
    lowerFirst: e.req(2, e.u32(2), `${what}.lower_first`),
    count: e.req(3, e.u32(3), `${what}.count`),
  }));
}

export function decodeUserns(b: Uint8Array): UsernsEntry {
  const m = new Msg(b);
  return { uidMap: decodeExtents(m, 1, 'uid_map'), gidMap: decodeExtents(m, 2, 'gid_map') };
}

export function decodeSeccomp(b: Uint8Array): SeccompFilter[] {
  return new Msg(b).msgs(1).map((f) => ({
    filter: f.req(1, f.bytes(1), 'seccomp_filter.filter'),
    prev: f.u32(2),
    flags: f.u32(3),
  }));
}

export function decodeMm(b: Uint8Array): MmEntry {
  const m = new Msg(b);
  return {
    exeFileId: m.num(12) ?? 0,
    vmas: m.msgs(14).map((v) => ({
      start: v.big(1) ?? 0n,
      end: v.big(2) ?? 0n,
      pgoff: v.big(3) ?? 0n,
      shmid: v.big(4) ?? 0n,
      prot: v.num(5) ?? 0,
      flags: v.num(6) ?? 0,
      status: v.num(7) ?? 0,
    })),
    argStart: m.big(8) ?? 0n,
    argEnd: m.big(9) ?? 0n,
    envStart: m.big(10) ?? 0n,
    envEnd: m.big(11) ?? 0n,
    brkStart: m.big(6) ?? 0n,
    brk: m.big(7) ?? 0n,
    stackStart: m.big(5) ?? 0n,
  };
}

export function decodePagemapHead(b: Uint8Array): { pagesId: number } {
  const m = new Msg(b);
  return { pagesId: m.req(1, m.num(1), 'pagemap_head.pages_id') };
}

/** Pages of a pagemap entry live in the pages image (not in a parent, not lazy-only). */
export const PE_PARENT = 1;
export const PE_LAZY = 2;
export const PE_PRESENT = 4;

export function decodePagemapEntry(b: Uint8Array): PagemapEntry {
  const m = new Msg(b);
  const nr = m.num(5) ?? m.num(2) ?? 0;
  return { vaddr: m.big(1) ?? 0n, nrPages: nr, inParent: m.bool(3) ?? false, flags: m.num(4) };
}

/** True when the entry's pages are stored in this image's pages file. */
export function pagemapInPagesFile(e: PagemapEntry): boolean {
  if (e.flags !== undefined) return (e.flags & PE_PRESENT) !== 0;
  return !e.inParent;
}

export function decodeFdinfo(b: Uint8Array): FdinfoEntry {
  const m = new Msg(b);
  return { id: m.num(1) ?? 0, flags: m.num(2) ?? 0, type: m.num(3) ?? 0, fd: m.num(4) ?? 0 };
}

function decodeSkOpts(m: Msg | undefined): { sndbuf?: number; rcvbuf?: number } {
  return m ? { sndbuf: m.num(1), rcvbuf: m.num(2) } : {};
}

export function decodeRegFile(m: Msg): RegFile {
  return {
    id: m.num(1) ?? 0,
    flags: m.num(2) ?? 0,
    pos: m.big(3) ?? 0n,
    name: m.str(6) ?? '',
    mntId: m.sint(7),
    size: m.big(8),
    mode: m.num(10),
  };
}

export function decodeInetSk(m: Msg): InetSk {
  return {
    id: m.num(1) ?? 0,
    ino: m.num(2) ?? 0,
    family: m.num(3) ?? 0,
    type: m.num(4) ?? 0,
    proto: m.num(5) ?? 0,
    state: m.num(6) ?? 0,
    srcPort: m.num(7) ?? 0,
    dstPort: m.num(8) ?? 0,
    backlog: m.num(10) ?? 0,
    srcAddr: m.nums(11),
    dstAddr: m.nums(12),
    ...decodeSkOpts(m.msg(14)),
  };
}

export function decodeUnixSk(m: Msg): UnixSk {
  return {
    id: m.num(1) ?? 0,
    ino: m.num(2) ?? 0,
    type: m.num(3) ?? 0,
    state: m.num(4) ?? 0,
    peer: m.num(8) ?? 0,
    name: m.bytes(11) ?? new Uint8Array(0),
    ...decodeSkOpts(m.msg(10)),
  };
}

export function decodeFileEntry(b: Uint8Array): FileEntry {
  const m = new Msg(b);
  const e: FileEntry = { type: m.num(1) ?? 0, id: m.num(2) ?? 0 };
  const reg = m.msg(3);
  if (reg) e.reg = decodeRegFile(reg);
  const isk = m.msg(4);
  if (isk) e.inet = decodeInetSk(isk);
  const nsf = m.msg(5);
  if (nsf) e.nsf = { nsId: nsf.num(2) ?? 0, nsCflag: nsf.num(3) ?? 0 };
  const usk = m.msg(16);
  if (usk) e.unix = decodeUnixSk(usk);
  const fifo = m.msg(17);
  if (fifo) e.fifo = { id: fifo.num(1) ?? 0, pipeId: fifo.num(2) ?? 0 };
  const pipe = m.msg(18);
  if (pipe) e.pipe = { id: pipe.num(1) ?? 0, pipeId: pipe.num(2) ?? 0 };
  const memfd = m.msg(20);
  if (memfd) e.memfd = { inodeId: memfd.num(5) ?? 0 };
  return e;
}

export function decodeMount(b: Uint8Array): MountEntry {
  const m = new Msg(b);
  return {
    fstype: m.num(1) ?? 0,
    mntId: m.num(2) ?? 0,
    rootDev: m.num(3) ?? 0,
    parentMntId: m.num(4) ?? 0,
    flags: m.u32(5) ?? 0,
    sbFlags: m.u32(17),
    root: m.str(6) ?? '',
    mountpoint: m.str(7) ?? '',
    source: m.str(8) ?? '',
    options: m.str(9) ?? '',
    extMount: m.bool(13) ?? false,
    fsname: m.str(14),
    extKey: m.str(18),
    withPlugin: m.bool(12) ?? false,
    sharedId: m.num(10),
    masterId: m.num(11),
  };
}

export function decodeCgroup(b: Uint8Array): { sets: CgroupSet[]; controllers: string[][] } {
  const m = new Msg(b);
  return {
    sets: m.msgs(1).map((s) => ({
      id: s.num(1) ?? 0,
      controllers: s.msgs(2).map((c) => ({ name: c.str(1) ?? '', path: c.str(2) ?? '' })),
    })),
    controllers: m.msgs(2).map((c) => c.strs(1)),
  };
}

export function decodeFs(b: Uint8Array): FsEntry {
  const m = new Msg(b);
  return { cwdId: m.num(1) ?? 0, rootId: m.num(2) ?? 0, umask: m.num(3) };
}

export function decodeStats(b: Uint8Array): DumpStats | undefined {
  const d = new Msg(b).msg(1);
  if (!d) return undefined;
  return {
    freezingTimeUs: d.num(1) ?? 0,
    frozenTimeUs: d.num(2) ?? 0,
    memdumpTimeUs: d.num(3) ?? 0,
    memwriteTimeUs: d.num(4) ?? 0,
    pagesScanned: d.big(5) ?? 0n,
    pagesWritten: d.big(7) ?? 0n,
  };
}
