/**
 * dormant's own definitions of the CRIU image messages it reads. Field numbers are facts
 * taken from CRIU's images/*.proto (CRIU 4.2); only the fields dormant uses are decoded,
 * everything else is skipped. Unknown enum values are kept as numbers.
 */
import { Msg } from './proto.js';

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

export interface CoreEntry {
  arch: string;
  comm: string;
  /** CRIU's task state: 1 alive, 2 dead (zombie), 3 stopped, 6 alive but with seized threads. */
  taskState: number;
  exitCode: number;
  cgSet?: number;
  ids?: TaskKobjIds;
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
  parentMntId: number;
  root: string;
  mountpoint: string;
  source: string;
  options: string;
  fsname?: string;
  extMount: boolean;
  extKey?: string;
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

function decodeIds(m: Msg): TaskKobjIds {
  return {
    vmId: m.num(1) ?? 0,
    filesId: m.num(2) ?? 0,
    fsId: m.num(3) ?? 0,
    pidNs: m.num(5),
    netNs: m.num(6),
    ipcNs: m.num(7),
    utsNs: m.num(8),
    mntNs: m.num(9),
    userNs: m.num(10),
    cgroupNs: m.num(11),
    timeNs: m.num(12),
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
    pid: m.req(1, m.num(1), 'pstree.pid'),
    ppid: m.num(2) ?? 0,
    pgid: m.num(3) ?? 0,
    sid: m.num(4) ?? 0,
    threads: m.nums(5),
  };
}

export function decodeIdsEntry(b: Uint8Array): TaskKobjIds {
  return decodeIds(new Msg(b));
}

export function decodeCore(b: Uint8Array): CoreEntry {
  const m = new Msg(b);
  const mtype = m.num(1) ?? 0;
  const tc = m.msg(3);
  const ids = m.msg(4);
  return {
    arch: Arch[mtype] ?? `arch-${mtype}`,
    comm: tc?.str(6) ?? m.msg(5)?.str(13) ?? '',
    taskState: tc?.num(1) ?? 0,
    exitCode: tc?.num(2) ?? 0,
    cgSet: tc?.num(9) ?? m.msg(5)?.num(16),
    ids: ids ? decodeIds(ids) : undefined,
  };
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
    parentMntId: m.num(4) ?? 0,
    root: m.str(6) ?? '',
    mountpoint: m.str(7) ?? '',
    source: m.str(8) ?? '',
    options: m.str(9) ?? '',
    extMount: m.bool(13) ?? false,
    fsname: m.str(14),
    extKey: m.str(18),
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
