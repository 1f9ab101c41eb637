/**
 * `dormant checkpoint inspect`: what a checkpoint holds, from its CRIU images and the
 * archive's metadata: the process tree with commands, open files, sockets (listening, and
 * established ones flagged as needing a reconnect), memory sizes, mounts, namespaces,
 * cgroups, and where it came from (engine, runtime, architecture, kernel, CRIU version,
 * created). Everything is computed from the images; no process is started.
 */
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { errnoCode } from '../domain/errors.js';
import {
  FD_TYPE_NAMES,
  FS_TYPE_NAMES,
  FdType,
  type FileEntry,
  type InetSk,
  type UnixSk,
} from '../criu/images/messages.js';
import {
  PAGE_SIZE,
  readCriuImages,
  readMemory,
  storedMemoryBytes,
  type CriuImages,
  type ProcessImage,
} from '../criu/images/reader.js';
import { readJsonFile, type OpenedCheckpoint } from './source.js';

export interface InspectFile {
  fd: string;
  type: string;
  path: string;
}

export interface InspectSocket {
  fd: number;
  /** unix, inet or inet6. */
  family: string;
  /** tcp, udp or unix. */
  protocol: string;
  type: string;
  state: string;
  local: string;
  remote: string;
  listening: boolean;
  /** An established TCP connection: the peer is not restored with it, so the program must reconnect. */
  needsReconnect: boolean;
  sendBufferBytes?: number;
  receiveBufferBytes?: number;
}

export interface InspectProcess {
  pid: number;
  ppid: number;
  pgid: number;
  sid: number;
  comm: string;
  /** argv from the dumped memory, when it is stored. */
  cmdline?: string[];
  /** running, zombie or stopped. */
  state: string;
  threads: number[];
  cwd?: string;
  root?: string;
  memory: { mappedBytes: number; storedBytes: number; vmas: number };
  files: InspectFile[];
  sockets: InspectSocket[];
}

export interface InspectMount {
  mountpoint: string;
  fstype: string;
  source: string;
  options: string;
  external: boolean;
}

export interface InspectReport {
  ref: string;
  kind: OpenedCheckpoint['kind'];
  metadata: {
    engine: string;
    runtime?: string;
    name?: string;
    containerId?: string;
    image?: string;
    arch?: string;
    kernel?: string;
    criuVersion?: string;
    createdAt?: string;
    checkpointedAt?: string;
    imageVersion?: number;
    criuRunId?: string;
    tenant?: string;
    sandboxId?: string;
  };
  sizes: { archiveBytes?: number; imagesBytes: number; memoryPagesBytes: number };
  processTree: InspectTreeNode[];
  processes: InspectProcess[];
  mounts: InspectMount[];
  namespaces: Record<string, number>;
  cgroups: { controller: string; path: string }[];
  dumpStats?: { frozenTimeUs: number; memdumpTimeUs: number; pagesWritten: number };
}

export interface InspectTreeNode {
  pid: number;
  comm: string;
  children: InspectTreeNode[];
}

const TCP_STATES: Record<number, string> = {
  1: 'ESTABLISHED',
  2: 'SYN_SENT',
  3: 'SYN_RECV',
  4: 'FIN_WAIT1',
  5: 'FIN_WAIT2',
  6: 'TIME_WAIT',
  7: 'CLOSE',
  8: 'CLOSE_WAIT',
  9: 'LAST_ACK',
  10: 'LISTEN',
  11: 'CLOSING',
};
const SOCK_TYPES: Record<number, string> = { 1: 'STREAM', 2: 'DGRAM', 3: 'RAW', 5: 'SEQPACKET' };
const TASK_STATES: Record<number, string> = { 1: 'running', 2: 'zombie', 3: 'stopped', 6: 'running' };

/** An address stored as CRIU does: 32-bit words holding network-order bytes. */
export function formatAddr(family: number, words: number[]): string {
  const bytes = Buffer.alloc(words.length * 4);
  words.forEach((w, i) => bytes.writeUInt32LE(w >>> 0, i * 4));
  if (family === 2) return words.length === 0 ? '0.0.0.0' : `${bytes[0]}.${bytes[1]}.${bytes[2]}.${bytes[3]}`;
  const groups: string[] = [];
  for (let i = 0; i + 1 < bytes.length; i += 2) groups.push(bytes.readUInt16BE(i).toString(16));
  if (groups.length !== 8) return '::';
  // Shorten the longest run of zero groups.
  let best = -1;
  let bestLen = 0;
  for (let i = 0; i < 8;) {
    if (groups[i] !== '0') {
      i++;
      continue;
    }
    let j = i;
    while (j < 8 && groups[j] === '0') j++;
    if (j - i > bestLen) {
      best = i;
      bestLen = j - i;
    }
    i = j;
  }
  if (bestLen < 2) return groups.join(':');
  return `${groups.slice(0, best).join(':')}::${groups.slice(best + bestLen).join(':')}`;
}

function hostPort(family: number, words: number[], port: number): string {
  const a = formatAddr(family, words);
  return family === 10 ? `[${a}]:${port}` : `${a}:${port}`;
}

export function unixName(name: Uint8Array): string {
  if (name.length === 0) return '';
  const b = Buffer.from(name);
  return b[0] === 0 ? `@${b.subarray(1).toString('utf8')}` : b.toString('utf8');
}

function inetSocket(fd: number, s: InetSk): InspectSocket {
  const protocol = s.proto === 6 ? 'tcp' : s.proto === 17 ? 'udp' : `proto-${s.proto}`;
  const state =
    protocol === 'tcp'
      ? (TCP_STATES[s.state] ?? `state-${s.state}`)
      : s.state === 7
        ? 'UNCONNECTED'
        : (TCP_STATES[s.state] ?? `state-${s.state}`);
  return {
    fd,
    family: s.family === 2 ? 'inet' : s.family === 10 ? 'inet6' : `family-${s.family}`,
    protocol,
    type: SOCK_TYPES[s.type] ?? `type-${s.type}`,
    state,
    local: hostPort(s.family, s.srcAddr, s.srcPort),
    remote: hostPort(s.family, s.dstAddr, s.dstPort),
    listening: protocol === 'tcp' && s.state === 10,
    needsReconnect: protocol === 'tcp' && s.state !== 10 && s.state !== 7,
    sendBufferBytes: s.sndbuf,
    receiveBufferBytes: s.rcvbuf,
  };
}

function unixSocket(fd: number, s: UnixSk, byIno: Map<number, UnixSk>): InspectSocket {
  const peer = s.peer !== 0 ? byIno.get(s.peer) : undefined;
  return {
    fd,
    family: 'unix',
    protocol: 'unix',
    type: SOCK_TYPES[s.type] ?? `type-${s.type}`,
    state: TCP_STATES[s.state] ?? `state-${s.state}`,
    local: unixName(s.name),
    remote: peer ? unixName(peer.name) || `ino:${s.peer}` : s.peer !== 0 ? `ino:${s.peer}` : '',
    listening: s.state === 10,
    needsReconnect: false,
    sendBufferBytes: s.sndbuf,
    receiveBufferBytes: s.rcvbuf,
  };
}

function describeFile(f: FileEntry | undefined, type: number): string {
  if (!f) return `${FD_TYPE_NAMES[type] ?? type}?`;
  if (f.reg) return f.reg.name;
  if (f.pipe) return `pipe[${f.pipe.pipeId}]`;
  if (f.fifo) return `fifo[${f.fifo.pipeId}]`;
  if (f.unix) return `unix[${f.unix.ino} (${f.unix.peer}) ${unixName(f.unix.name)}]`;
  if (f.inet) {
    const s = inetSocket(0, f.inet);
    return `${s.protocol}[${f.inet.ino}] ${s.local} -> ${s.remote} ${s.state}`;
  }
  if (f.nsf) return `ns[${f.nsf.nsId}]`;
  if (f.memfd) return `memfd[${f.memfd.inodeId}]`;
  return `${FD_TYPE_NAMES[type] ?? `type-${type}`}.${f.id}`;
}

async function cmdlineOf(images: CriuImages, p: ProcessImage): Promise<string[] | undefined> {
  const mm = p.mm;
  if (!mm || mm.argEnd <= mm.argStart) return undefined;
  const len = Number(mm.argEnd - mm.argStart);
  if (len > 256 * 1024) return undefined;
  const b = await readMemory(images, p, mm.argStart, len);
  if (b.length === 0) return undefined;
  const parts = b.toString('utf8').split('\0');
  if (parts[parts.length - 1] === '') parts.pop();
  return parts;
}

function processReport(
  images: CriuImages,
  p: ProcessImage,
  unixByIno: Map<number, UnixSk>,
  cmdline?: string[],
): InspectProcess {
  const files: InspectFile[] = [];
  const sockets: InspectSocket[] = [];
  for (const fd of [...p.fds].sort((a, b) => a.fd - b.fd)) {
    const f = images.files.get(fd.id);
    const tn = FD_TYPE_NAMES[fd.type] ?? `type-${fd.type}`;
    files.push({ fd: String(fd.fd), type: tn, path: describeFile(f, fd.type) });
    if (fd.type === FdType.INETSK && f?.inet) sockets.push(inetSocket(fd.fd, f.inet));
    if (fd.type === FdType.UNIXSK && f?.unix) sockets.push(unixSocket(fd.fd, f.unix, unixByIno));
  }
  const cwd = p.fs ? images.files.get(p.fs.cwdId)?.reg?.name : undefined;
  const root = p.fs ? images.files.get(p.fs.rootId)?.reg?.name : undefined;
  if (cwd !== undefined) files.push({ fd: 'cwd', type: 'DIR', path: cwd });
  if (root !== undefined) files.push({ fd: 'root', type: 'DIR', path: root });
  let mapped = 0;
  for (const v of p.mm?.vmas ?? []) mapped += Number(v.end - v.start);
  return {
    pid: p.pid,
    ppid: p.ppid,
    pgid: p.pgid,
    sid: p.sid,
    comm: p.comm,
    cmdline,
    state: TASK_STATES[p.taskState] ?? `state-${p.taskState}`,
    threads: p.threads,
    cwd,
    root,
    memory: { mappedBytes: mapped, storedBytes: storedMemoryBytes(p), vmas: p.mm?.vmas.length ?? 0 },
    files,
    sockets,
  };
}

function tree(processes: ProcessImage[]): InspectTreeNode[] {
  const nodes = new Map<number, InspectTreeNode>();
  for (const p of processes) nodes.set(p.pid, { pid: p.pid, comm: p.comm, children: [] });
  const roots: InspectTreeNode[] = [];
  for (const p of processes) {
    const n = nodes.get(p.pid)!;
    const parent = p.ppid !== p.pid ? nodes.get(p.ppid) : undefined;
    if (parent) parent.children.push(n);
    else roots.push(n);
  }
  return roots;
}

function str(o: unknown, key: string): string | undefined {
  if (typeof o !== 'object' || o === null) return undefined;
  const v = (o as Record<string, unknown>)[key];
  return typeof v === 'string' && v !== '' ? v : undefined;
}

function annotations(spec: unknown): Record<string, string> {
  if (typeof spec !== 'object' || spec === null) return {};
  const a = (spec as Record<string, unknown>).annotations;
  if (typeof a !== 'object' || a === null) return {};
  const out: Record<string, string> = {};
  for (const [k, v] of Object.entries(a)) if (typeof v === 'string') out[k] = v;
  return out;
}

/** Which engine wrote an archive, from its spec.dump annotations (podman, CRI-O) or its shape. */
export function engineOf(kind: OpenedCheckpoint['kind'], config: unknown, spec: unknown): string {
  if (kind === 'dormant') return 'dormant';
  const a = annotations(spec);
  if (a['io.container.manager'] === 'libpod') return 'podman';
  if (Object.keys(a).some((k) => k.startsWith('io.kubernetes.cri-o.'))) return 'cri-o';
  if (config !== undefined) return 'containerd';
  return 'criu';
}

async function logFacts(dirs: string[]): Promise<{ criuVersion?: string; kernel?: string; arch?: string }> {
  for (const d of dirs) {
    for (const name of ['dump.log', 'criu-dump.log']) {
      let text: string;
      try {
        const fh = await readFile(join(d, name));
        text = fh.subarray(0, 64 * 1024).toString('utf8');
      } catch (e) {
        if (errnoCode(e) === 'ENOENT') continue;
        throw e;
      }
      const v = /Version:\s*(\S+)/.exec(text);
      const r = /Running on \S+ (\S+) (\S+) .* (\S+)\s*$/m.exec(text);
      if (v || r) return { criuVersion: v?.[1], kernel: r?.[2], arch: r?.[3] };
    }
  }
  return {};
}

/** Reads the images of an opened checkpoint and describes them. */
export async function inspectCheckpoint(ck: OpenedCheckpoint, images?: CriuImages): Promise<InspectReport> {
  const im = images ?? (await readCriuImages(ck.imagesDir));
  const config = ck.rootDir ? await readJsonFile(join(ck.rootDir, 'config.dump')) : undefined;
  const spec = ck.rootDir ? await readJsonFile(join(ck.rootDir, 'spec.dump')) : undefined;
  const facts = await logFacts([ck.imagesDir, ...(ck.rootDir ? [ck.rootDir] : [])]);
  const unixByIno = new Map<number, UnixSk>();
  for (const f of im.files.values()) if (f.unix) unixByIno.set(f.unix.ino, f.unix);
  const processes: InspectProcess[] = [];
  for (const p of im.processes) processes.push(processReport(im, p, unixByIno, await cmdlineOf(im, p)));

  const rootMntNs = im.inventory?.rootIds?.mntNs ?? im.processes[0]?.ids?.mntNs;
  const mountList =
    (rootMntNs !== undefined ? im.mounts.get(rootMntNs) : undefined) ?? [...im.mounts.values()].flat();
  const mounts = mountList.map((m) => ({
    mountpoint: m.mountpoint,
    fstype: m.fsname ?? FS_TYPE_NAMES[m.fstype] ?? `fstype-${m.fstype}`,
    source: m.source,
    options: m.options,
    external: m.extMount || m.extKey !== undefined,
  }));
  const ns: Record<string, number> = {};
  const ids = im.inventory?.rootIds ?? im.processes[0]?.ids;
  if (ids) {
    for (const k of ['pidNs', 'netNs', 'ipcNs', 'utsNs', 'mntNs', 'userNs', 'cgroupNs', 'timeNs'] as const) {
      const v = ids[k];
      if (v !== undefined) ns[k.replace(/Ns$/, '')] = v;
    }
  }
  const rootSet = im.inventory?.rootCgSet ?? im.processes[0]?.core?.cgSet;
  const cgset = im.cgroups.find((s) => s.id === rootSet) ?? im.cgroups[0];
  let imagesBytes = 0;
  for (const n of im.imageFiles.values()) imagesBytes += n;
  const meta = ck.dormantMeta ?? {};
  const a = annotations(spec);
  return {
    ref: ck.ref,
    kind: ck.kind,
    metadata: {
      engine: engineOf(ck.kind, config, spec),
      runtime: str(config, 'runtime') ?? (ck.kind === 'dormant' ? 'runc' : undefined),
      name: str(config, 'name') ?? a['io.kubernetes.cri-o.Name'],
      containerId: str(config, 'id'),
      image: str(config, 'rootfsImageName') ?? str(config, 'rootfsImage'),
      arch: meta.arch ?? facts.arch ?? im.arch,
      kernel: meta.kernel ?? facts.kernel,
      criuVersion: meta.criuVersion ?? facts.criuVersion,
      createdAt: str(config, 'createdTime') ?? ck.dormant?.createdAt,
      checkpointedAt: str(config, 'checkpointedTime') ?? ck.dormant?.createdAt,
      imageVersion: im.inventory?.imgVersion,
      criuRunId: im.inventory?.criuRunId,
      tenant: ck.dormant?.tenant,
      sandboxId: ck.dormant?.sandboxId,
    },
    sizes: {
      archiveBytes: ck.kind === 'archive' ? ck.sizeBytes : undefined,
      imagesBytes,
      memoryPagesBytes: im.pagesBytes,
    },
    processTree: tree(im.processes),
    processes,
    mounts,
    namespaces: ns,
    cgroups: cgset ? cgset.controllers.map((c) => ({ controller: c.name, path: c.path })) : [],
    dumpStats: im.stats
      ? {
          frozenTimeUs: im.stats.frozenTimeUs,
          memdumpTimeUs: im.stats.memdumpTimeUs,
          pagesWritten: Number(im.stats.pagesWritten),
        }
      : undefined,
  };
}

/** Pages of memory stored, as a size for people. */
export function pagesToBytes(n: number): number {
  return n * PAGE_SIZE;
}
