/**
 * Reads a folder of CRIU images into a model of the dumped tree: processes (pstree, core,
 * ids, mm, pagemap, fdinfo, fs), the files they hold (files.img), mounts, cgroups and the
 * dump's statistics. Memory is not loaded: `pages()` streams a process's pages from its
 * pages-N.img in bounded chunks, addressed by its pagemap.
 *
 * Every image is treated as hostile: sizes are capped before reading, framing and protobuf
 * are bounds-checked (CRIU_IMAGE_MALFORMED), and pagemap entries that point past the end of
 * the pages file are refused rather than read short.
 */
import { open, readdir, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { errnoCode } from '../../domain/errors.js';
import { Magic, parseImage } from './image-file.js';
import {
  decodeCgroup,
  decodeCore,
  decodeFdinfo,
  decodeFileEntry,
  decodeFs,
  decodeIdsEntry,
  decodeInventory,
  decodeMm,
  decodeMount,
  decodePagemapEntry,
  decodePagemapHead,
  decodePstree,
  decodeStats,
  pagemapInPagesFile,
  type CgroupSet,
  type CoreEntry,
  type DumpStats,
  type FdinfoEntry,
  type FileEntry,
  type FsEntry,
  type Inventory,
  type MmEntry,
  type MountEntry,
  type PagemapEntry,
  type TaskKobjIds,
} from './messages.js';
import { malformed } from './proto.js';

export const PAGE_SIZE = 4096;
/**
 * Images come from imported archives too, so what reading them may cost is bounded: no
 * metadata image (anything but pages) of a real dump comes near these. Decoded entries cost
 * ~150 bytes each in memory, so the entry cap bounds the model at about 150 MiB.
 */
const MAX_META_IMAGE_BYTES = 64 * 1024 * 1024;
const MAX_META_TOTAL_BYTES = 512 * 1024 * 1024;
const MAX_TOTAL_ENTRIES = 1_000_000;
/** What readMemory may return in one call (its callers read a command line or environment). */
const MAX_READ_MEMORY_BYTES = 16 * 1024 * 1024;

/** What one reading of a dump has read so far, against the caps above. */
export interface ImageBudget {
  bytes: number;
  entries: number;
}
type Budget = ImageBudget;

/** A fresh budget: one per reading of a dump, shared by every image it reads. */
export function imageBudget(): ImageBudget {
  return { bytes: 0, entries: 0 };
}

export interface ProcessImage {
  pid: number;
  ppid: number;
  pgid: number;
  sid: number;
  threads: number[];
  comm: string;
  /** CRIU task state: 1 alive, 2 dead (zombie), 3 stopped. */
  taskState: number;
  ids?: TaskKobjIds;
  core?: CoreEntry;
  mm?: MmEntry;
  pagemap?: { pagesId: number; entries: PagemapEntry[] };
  fds: FdinfoEntry[];
  fs?: FsEntry;
}

export interface CriuImages {
  dir: string;
  inventory?: Inventory;
  processes: ProcessImage[];
  /** files.img, by file id. */
  files: Map<number, FileEntry>;
  /** mountpoints-N.img, by mount namespace id. */
  mounts: Map<number, MountEntry[]>;
  cgroups: CgroupSet[];
  stats?: DumpStats;
  /** Every file in the folder with its size, for sizes and for scanning what is not parsed. */
  imageFiles: Map<string, number>;
  /** Total size of pages-*.img: the memory the dump holds. */
  pagesBytes: number;
  arch?: string;
}

async function readCapped(path: string, name: string, budget: Budget): Promise<Uint8Array | undefined> {
  let fh;
  try {
    fh = await open(path, 'r');
  } catch (e) {
    if (errnoCode(e) === 'ENOENT') return undefined;
    throw e;
  }
  try {
    // The size that is checked is the size that is read: one open file, not a stat and a path.
    const st = await fh.stat();
    if (!st.isFile()) throw malformed(`${name} is not a regular file`);
    if (st.size > MAX_META_IMAGE_BYTES)
      throw malformed(`${name} is ${st.size} bytes, over the ${MAX_META_IMAGE_BYTES} cap`);
    budget.bytes += st.size;
    if (budget.bytes > MAX_META_TOTAL_BYTES)
      throw malformed(`${name} takes the dump's metadata images past the ${MAX_META_TOTAL_BYTES}-byte cap`);
    const buf = Buffer.allocUnsafe(st.size);
    let got = 0;
    while (got < st.size) {
      const { bytesRead } = await fh.read(buf, got, st.size - got, got);
      if (bytesRead === 0) break;
      got += bytesRead;
    }
    return buf.subarray(0, got);
  } finally {
    await fh.close();
  }
}

async function entriesOf(
  dir: string,
  name: string,
  magic: number,
  budget: Budget,
): Promise<Uint8Array[] | undefined> {
  const b = await readCapped(join(dir, name), name, budget);
  if (b === undefined) return undefined;
  const { entries } = parseImage(b, name, magic, MAX_TOTAL_ENTRIES - budget.entries);
  budget.entries += entries.length;
  return entries;
}

/**
 * The entries of image `name` in `dir` (size-capped, framing checked against `magic`), or
 * undefined when there is no such file.
 */
export function readImageEntries(
  dir: string,
  name: string,
  magic: number,
  budget: ImageBudget = imageBudget(),
): Promise<Uint8Array[] | undefined> {
  return entriesOf(dir, name, magic, budget);
}

/** Reads every image of the dump in `dir` except page contents. */
export async function readCriuImages(dir: string): Promise<CriuImages> {
  const imageFiles = new Map<string, number>();
  const budget = imageBudget();
  let pagesBytes = 0;
  for (const d of await readdir(dir, { withFileTypes: true })) {
    if (!d.isFile()) continue;
    const st = await stat(join(dir, d.name));
    imageFiles.set(d.name, st.size);
    if (/^pages-\d+\.img$/.test(d.name)) pagesBytes += st.size;
  }

  const invEntries = await entriesOf(dir, 'inventory.img', Magic.INVENTORY, budget);
  const inventory = invEntries?.[0] ? decodeInventory(invEntries[0]) : undefined;
  const pstree = await entriesOf(dir, 'pstree.img', Magic.PSTREE, budget);
  if (pstree === undefined) throw malformed(`no pstree.img in ${dir}: not a CRIU dump`);

  const processes: ProcessImage[] = [];
  const fdinfoCache = new Map<number, FdinfoEntry[]>();
  let arch: string | undefined;
  for (const raw of pstree) {
    const pe = decodePstree(raw);
    const p: ProcessImage = { ...pe, comm: '', taskState: 0, fds: [] };
    const core = (await entriesOf(dir, `core-${pe.pid}.img`, Magic.CORE, budget))?.[0];
    if (core) {
      p.core = decodeCore(core);
      p.comm = p.core.comm;
      p.taskState = p.core.taskState;
      arch ??= p.core.arch;
    }
    const ids = (await entriesOf(dir, `ids-${pe.pid}.img`, Magic.IDS, budget))?.[0];
    p.ids = ids ? decodeIdsEntry(ids) : p.core?.ids;
    const mm = (await entriesOf(dir, `mm-${pe.pid}.img`, Magic.MM, budget))?.[0];
    if (mm) p.mm = decodeMm(mm);
    const pm = await entriesOf(dir, `pagemap-${pe.pid}.img`, Magic.PAGEMAP, budget);
    if (pm && pm.length > 0) {
      p.pagemap = {
        pagesId: decodePagemapHead(pm[0]!).pagesId,
        entries: pm.slice(1).map(decodePagemapEntry),
      };
    }
    const fsImg = (await entriesOf(dir, `fs-${pe.pid}.img`, Magic.FS, budget))?.[0];
    if (fsImg) p.fs = decodeFs(fsImg);
    if (p.ids) {
      const fid = p.ids.filesId;
      let fds = fdinfoCache.get(fid);
      if (fds === undefined) {
        fds = ((await entriesOf(dir, `fdinfo-${fid}.img`, Magic.FDINFO, budget)) ?? []).map(decodeFdinfo);
        fdinfoCache.set(fid, fds);
      }
      p.fds = fds;
    }
    processes.push(p);
  }

  const files = new Map<number, FileEntry>();
  for (const raw of (await entriesOf(dir, 'files.img', Magic.FILES, budget)) ?? []) {
    const f = decodeFileEntry(raw);
    files.set(f.id, f);
  }

  const mounts = new Map<number, MountEntry[]>();
  for (const name of imageFiles.keys()) {
    const m = /^mountpoints-(\d+)\.img$/.exec(name);
    if (!m) continue;
    mounts.set(Number(m[1]), ((await entriesOf(dir, name, Magic.MNTS, budget)) ?? []).map(decodeMount));
  }

  const cg = (await entriesOf(dir, 'cgroup.img', Magic.CGROUP, budget))?.[0];
  const stats = (await entriesOf(dir, 'stats-dump', Magic.STATS, budget))?.[0];
  return {
    dir,
    inventory,
    processes,
    files,
    mounts,
    cgroups: cg ? decodeCgroup(cg).sets : [],
    stats: stats ? decodeStats(stats) : undefined,
    imageFiles,
    pagesBytes,
    arch,
  };
}

/** A run of a process's memory as stored in the dump. */
export interface PageChunk {
  /** Virtual address of data[0] in the process. */
  vaddr: bigint;
  data: Buffer;
  /** Byte offset of data[0] in the pages file. */
  fileOffset: number;
  pagesFile: string;
}

/** Bytes of memory stored for this process (present pagemap entries). */
export function storedMemoryBytes(p: ProcessImage): number {
  let n = 0;
  for (const e of p.pagemap?.entries ?? []) if (pagemapInPagesFile(e)) n += e.nrPages * PAGE_SIZE;
  return n;
}

/**
 * Streams the stored pages of process `p` in chunks of at most `chunkBytes` (a multiple of
 * the page size), in pagemap order. A chunk never spans two pagemap entries, so callers that
 * match across chunk edges should carry a tail only when the next chunk's vaddr continues
 * the previous one. The yielded buffer is reused (unless `take` gives each chunk its memory):
 * copy what must outlive the iteration.
 */
export async function* readPages(
  images: Pick<CriuImages, 'dir'>,
  p: ProcessImage,
  opts: {
    chunkBytes?: number;
    signal?: AbortSignal;
    /**
     * Gives the memory for each chunk (at least `bytes` long; the chunk is its first bytes):
     * the caller then owns each chunk's memory and may keep or move it. Without it, one
     * buffer is reused for every chunk.
     */
    take?: (bytes: number) => Buffer;
    /** Where a pages file lies when not in the images folder: a file and a range in it (an archive member). */
    pagesAt?: (pagesFile: string) => { path: string; offset: number; size: number } | undefined;
  } = {},
): AsyncGenerator<PageChunk> {
  const pm = p.pagemap;
  if (!pm) return;
  const chunkBytes = Math.max(
    PAGE_SIZE,
    Math.floor((opts.chunkBytes ?? 4 * 1024 * 1024) / PAGE_SIZE) * PAGE_SIZE,
  );
  const pagesFile = `pages-${pm.pagesId}.img`;
  const at = opts.pagesAt?.(pagesFile);
  let fh;
  try {
    fh = await open(at?.path ?? join(images.dir, pagesFile), 'r');
  } catch (e) {
    if (errnoCode(e) === 'ENOENT') throw malformed(`${pagesFile} (named by pagemap-${p.pid}.img) is missing`);
    throw e;
  }
  try {
    const base = at?.offset ?? 0;
    const size = at?.size ?? (await fh.stat()).size;
    const reused = opts.take === undefined ? Buffer.allocUnsafe(chunkBytes) : undefined;
    let off = 0;
    for (const e of pm.entries) {
      if (!pagemapInPagesFile(e)) continue;
      const bytes = e.nrPages * PAGE_SIZE;
      if (off + bytes > size)
        throw malformed(
          `pagemap-${p.pid}.img addresses ${off + bytes} bytes of ${pagesFile}, which has ${size}`,
        );
      let done = 0;
      while (done < bytes) {
        opts.signal?.throwIfAborted();
        const n = Math.min(chunkBytes, bytes - done);
        const buf = reused ?? opts.take!(chunkBytes);
        const { bytesRead } = await fh.read(buf, 0, n, base + off + done);
        if (bytesRead !== n) throw malformed(`${pagesFile}: short read at ${off + done}`);
        yield { vaddr: e.vaddr + BigInt(done), data: buf.subarray(0, n), fileOffset: off + done, pagesFile };
        done += n;
      }
      off += bytes;
    }
  } finally {
    await fh.close();
  }
}

/**
 * Reads up to `len` bytes of process memory at `addr` from the dump (for the command line
 * and environment). Returns what is stored, stopping at the first page that is not.
 */
export async function readMemory(
  images: Pick<CriuImages, 'dir'>,
  p: ProcessImage,
  addr: bigint,
  len: number,
): Promise<Buffer> {
  const pm = p.pagemap;
  if (!pm || len <= 0) return Buffer.alloc(0);
  if (len > MAX_READ_MEMORY_BYTES)
    throw new RangeError(`readMemory: ${len} bytes asked, over ${MAX_READ_MEMORY_BYTES}`);
  const parts: Buffer[] = [];
  let want = addr;
  const end = addr + BigInt(len);
  let off = 0;
  const fh = await open(join(images.dir, `pages-${pm.pagesId}.img`), 'r').catch((e: unknown) => {
    if (errnoCode(e) === 'ENOENT') return undefined;
    throw e;
  });
  if (!fh) return Buffer.alloc(0);
  try {
    for (const e of pm.entries) {
      if (!pagemapInPagesFile(e)) continue;
      const eEnd = e.vaddr + BigInt(e.nrPages * PAGE_SIZE);
      if (want >= e.vaddr && want < eEnd) {
        const from = Number(want - e.vaddr);
        const n = Number((end < eEnd ? end : eEnd) - want);
        const b = Buffer.alloc(n);
        const { bytesRead } = await fh.read(b, 0, n, off + from);
        parts.push(b.subarray(0, bytesRead));
        want += BigInt(n);
        if (want >= end || bytesRead < n) break;
      }
      off += e.nrPages * PAGE_SIZE;
    }
  } finally {
    await fh.close();
  }
  return Buffer.concat(parts);
}
