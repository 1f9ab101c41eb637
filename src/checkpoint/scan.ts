/**
 * `dormant checkpoint scan`: secrets in a checkpoint's memory pages (streamed, a bounded
 * chunk at a time, never the whole dump), in its other CRIU images (socket queues, pipe
 * buffers, tty data), in the filesystem diff (rootfs-diff.tar, streamed) and in the
 * archive's metadata (config.dump, spec.dump carry the container's environment).
 *
 * Equal secrets found again in the same place are folded into one finding with an
 * occurrence count. A finding never carries the secret: a redacted preview and a keyed
 * fingerprint stand in for it.
 */
import { randomBytes } from 'node:crypto';
import { createReadStream } from 'node:fs';
import { open, readdir, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { threadId } from 'node:worker_threads';
import {
  readCriuImages,
  readPages,
  storedMemoryBytes,
  type CriuImages,
  type ProcessImage,
} from '../criu/images/reader.js';
import type { Vma } from '../criu/images/messages.js';
import { TarParser, type TarHeader } from './tar.js';
import { scanChunk, type ChunkHit, type SecretKind } from './secrets.js';
import { defaultScanWorkers, ScanPool, type ChunkResult } from './scan-pool.js';
import type { OpenedCheckpoint } from './source.js';

export interface SecretFinding {
  kind: SecretKind;
  where: 'memory' | 'image' | 'filesystem' | 'metadata';
  process?: { pid: number; comm: string };
  /** The mapping ("[heap]", "[stack]", a file path, "anon") for memory findings. */
  mapping?: string;
  /** Virtual address (hex) for memory findings. */
  address?: string;
  /** The file (image, rootfs path or metadata file) and the byte offset in it. */
  path?: string;
  offset: number;
  /** The variable name for assignments. */
  name?: string;
  preview: string;
  fingerprint: string;
  occurrences: number;
}

export interface ScanReport {
  ref: string;
  findings: SecretFinding[];
  scanned: {
    memoryBytes: number;
    imageBytes: number;
    filesystemBytes: number;
    metadataBytes: number;
    files: number;
  };
  durationMs: number;
}

export interface ScanOptions {
  /** HMAC key for fingerprints; default random per scan (fingerprints then compare only within it). */
  fingerprintKey?: Buffer;
  chunkBytes?: number;
  /** Skip files in the filesystem diff larger than this. Default 64 MiB. */
  maxFileBytes?: number;
  signal?: AbortSignal;
  /**
   * Worker threads for the detectors: 0 runs them on the calling thread. Default: one per
   * core but one (1 to 4), or none for a checkpoint too small to pay for starting them.
   */
  workers?: number;
  /** Called for each chunk once scanned, in read order: the thread that scanned it (tests). */
  onChunk?: (c: { thread: number; bytes: number }) => void;
}

/** Bytes carried from one chunk into the next so a secret across the edge is still seen. */
const OVERLAP = 4096;
/** Chunks of image, metadata and other files (the size a read stream of them gave before). */
const FILE_CHUNK_BYTES = 4 * 1024 * 1024;
/**
 * Below this many bytes a scan runs on the calling thread: starting a worker costs more than
 * it saves (measured: 67-82 ms until two new workers had each scanned a first chunk, at load
 * 4 on 2 cores; a fresh thread then also runs its first megabytes before V8 has compiled the
 * detectors), and 16 MiB take the calling thread about 25 ms, a 4 MiB chunk at a time.
 */
const MIN_WORKER_SCAN_BYTES = 16 * 1024 * 1024;
const VMA_FILE_PRIVATE = 1 << 2;
const VMA_FILE_SHARED = 1 << 1;

/** Where a match at this offset of a chunk is (negative: in the chunk before). */
type Place = (offset: number) => Omit<
  SecretFinding,
  'kind' | 'offset' | 'preview' | 'fingerprint' | 'occurrences' | 'name'
> & {
  offset: number;
};

class Collector {
  readonly findings: SecretFinding[] = [];
  private readonly index = new Map<string, SecretFinding>();

  /** Adds a chunk's secrets, in the order the chunks were read. */
  add(hits: readonly ChunkHit[], place: Place): void {
    for (const h of hits) {
      const where = place(h.offset);
      const fp = h.fingerprint;
      const k = `${h.kind}|${where.where}|${where.process?.pid ?? ''}|${where.path ?? ''}|${fp}`;
      const prev = this.index.get(k);
      if (prev) {
        prev.occurrences++;
        continue;
      }
      const f: SecretFinding = {
        kind: h.kind,
        ...where,
        name: h.name,
        preview: h.preview,
        fingerprint: fp,
        occurrences: 1,
      };
      this.index.set(k, f);
      this.findings.push(f);
    }
  }
}

/**
 * The chunks of a scan on their way through the detectors: on the worker pool when there is
 * one (at most `maxInFlight` chunks out at a time, so memory stays bounded), else on the
 * calling thread. Results are taken in the order the chunks were read, so findings (and
 * which occurrence a finding's place names) are the same either way. Chunk memory comes
 * from `take` and is reused once a chunk is done.
 */
class ChunkQueue {
  private readonly out: { result: Promise<ChunkResult>; place: Place }[] = [];
  private readonly free = new Map<number, Buffer[]>();

  constructor(
    private readonly c: Collector,
    private readonly key: Buffer,
    private readonly pool: ScanPool | undefined,
    private readonly maxInFlight: number,
    private readonly onChunk: ScanOptions['onChunk'],
  ) {}

  /** Memory of its own for a chunk of `bytes`. */
  readonly take = (bytes: number): Buffer => {
    let list = this.free.get(bytes);
    if (list === undefined) this.free.set(bytes, (list = []));
    return list.pop() ?? Buffer.allocUnsafeSlow(bytes);
  };

  /** Hands back memory from `take` that was not pushed. */
  give(b: Buffer): void {
    const whole = b.buffer.byteLength;
    const list = this.free.get(whole);
    if (list !== undefined && list.length <= this.maxInFlight)
      list.push(b.length === whole ? b : Buffer.from(b.buffer, 0, whole));
  }

  /**
   * Scans `data` (from `take`, or memory nobody else uses: it may move to a worker) and its
   * seam with `prevTail`, the last bytes of the chunk before when the two are contiguous.
   */
  async push(data: Buffer, prevTail: Buffer | undefined, place: Place): Promise<void> {
    let seam: Buffer | undefined;
    let edge = 0;
    if (data.length === 0) return;
    if (prevTail !== undefined && prevTail.length > 0) {
      seam = Buffer.concat([prevTail, data.subarray(0, OVERLAP)]);
      edge = prevTail.length;
    }
    if (this.pool === undefined) {
      this.c.add(scanChunk(this.key, data, seam, edge), place);
      this.onChunk?.({ thread: threadId, bytes: data.length });
      this.give(data);
      return;
    }
    const result = this.pool.scan(data, seam, edge);
    // Taken in order by drainOne; one that fails after the scan has given up is not waited for.
    result.catch(() => undefined);
    this.out.push({ result, place });
    while (this.out.length >= this.maxInFlight) await this.drainOne();
  }

  private async drainOne(): Promise<void> {
    const j = this.out.shift()!;
    const r = await j.result;
    this.c.add(r.hits, j.place);
    this.onChunk?.({ thread: r.thread, bytes: r.data.length });
    this.give(r.data);
  }

  /** Waits for every chunk out. */
  async finish(): Promise<void> {
    while (this.out.length > 0) await this.drainOne();
  }
}

function mappingName(im: CriuImages, p: ProcessImage, addr: bigint): { mapping: string; vma?: Vma } {
  const mm = p.mm;
  if (!mm) return { mapping: 'unknown' };
  const vma = mm.vmas.find((v) => addr >= v.start && addr < v.end);
  if (!vma) return { mapping: 'unknown' };
  if (addr >= mm.brkStart && addr < mm.brk) return { mapping: '[heap]', vma };
  if ((vma.status & (VMA_FILE_PRIVATE | VMA_FILE_SHARED)) !== 0) {
    const f = im.files.get(Number(vma.shmid));
    if (f?.reg) return { mapping: f.reg.name, vma };
  }
  if (mm.stackStart >= vma.start && mm.stackStart < vma.end) return { mapping: '[stack]', vma };
  if (mm.envStart >= vma.start && mm.envStart < vma.end) return { mapping: '[stack]', vma };
  return { mapping: 'anon', vma };
}

/** The last OVERLAP bytes of a chunk, copied (the chunk's memory may move or be reused). */
function tailOf(data: Buffer): Buffer {
  return Buffer.from(data.subarray(Math.max(0, data.length - OVERLAP)));
}

async function scanMemory(
  im: CriuImages,
  q: ChunkQueue,
  opts: ScanOptions,
  inPlace: OpenedCheckpoint['pagesInPlace'],
): Promise<number> {
  const pagesAt =
    inPlace === undefined
      ? undefined
      : (name: string) => {
          const m = inPlace.members.get(name);
          return m === undefined ? undefined : { path: inPlace.archive, ...m };
        };
  let bytes = 0;
  for (const p of im.processes) {
    let tail: Buffer | undefined;
    let tailEnd = -1n;
    for await (const chunk of readPages(im, p, {
      chunkBytes: opts.chunkBytes,
      signal: opts.signal,
      take: q.take,
      ...(pagesAt !== undefined ? { pagesAt } : {}),
    })) {
      const length = chunk.data.length;
      bytes += length;
      const contiguous = tail !== undefined && tailEnd === chunk.vaddr;
      const nextTail = tailOf(chunk.data);
      await q.push(chunk.data, contiguous ? tail : undefined, (off) => {
        const addr = chunk.vaddr + BigInt(off);
        const m = mappingName(im, p, addr);
        return {
          where: 'memory',
          process: { pid: p.pid, comm: p.comm },
          mapping: m.mapping,
          address: `0x${addr.toString(16)}`,
          path: chunk.pagesFile,
          offset: chunk.fileOffset + off,
        };
      });
      tail = nextTail;
      tailEnd = chunk.vaddr + BigInt(length);
    }
  }
  return bytes;
}

/** Scans a file in chunks, with overlap. */
async function scanFile(
  path: string,
  label: string,
  where: SecretFinding['where'],
  q: ChunkQueue,
  signal: AbortSignal | undefined,
): Promise<number> {
  let tail: Buffer | undefined;
  let pos = 0;
  const fh = await open(path, 'r');
  try {
    for (;;) {
      signal?.throwIfAborted();
      const buf = q.take(FILE_CHUNK_BYTES);
      const { bytesRead } = await fh.read(buf, 0, FILE_CHUNK_BYTES, pos);
      if (bytesRead === 0) {
        q.give(buf);
        break;
      }
      const chunk = buf.subarray(0, bytesRead);
      const base = pos;
      const nextTail = tailOf(chunk);
      await q.push(chunk, tail, (off) => ({ where, path: label, offset: base + off }));
      pos += bytesRead;
      tail = nextTail;
    }
  } finally {
    await fh.close();
  }
  return pos;
}

/** Streams a tar (the rootfs diff) and scans each regular file's bytes whole. */
async function scanRootfsDiff(
  path: string,
  q: ChunkQueue,
  opts: ScanOptions,
): Promise<{ bytes: number; files: number }> {
  const maxFile = opts.maxFileBytes ?? 64 * 1024 * 1024;
  let bytes = 0;
  let files = 0;
  let cur: { name: string; data: Buffer; at: number } | undefined;
  const done: { name: string; data: Buffer }[] = [];
  const parser = new TarParser({
    entry(h: TarHeader) {
      if (h.type !== 'file' || h.size > maxFile) return undefined;
      files++;
      // Memory of its own: it may move to a worker.
      const mine = { name: `/${h.name.replace(/^\.?\//, '')}`, data: Buffer.allocUnsafeSlow(h.size), at: 0 };
      cur = mine;
      return (chunk: Buffer) => {
        mine.at += chunk.copy(mine.data, mine.at);
      };
    },
    entryEnd() {
      if (!cur) return;
      done.push({ name: cur.name, data: cur.data.subarray(0, cur.at) });
      cur = undefined;
    },
  });
  const scanDone = async (): Promise<void> => {
    for (const f of done.splice(0)) {
      bytes += f.data.length;
      const name = f.name;
      await q.push(f.data, undefined, (offset) => ({ where: 'filesystem', path: name, offset }));
    }
  };
  for await (const chunk of createReadStream(path, { highWaterMark: 1024 * 1024 }) as AsyncIterable<Buffer>) {
    opts.signal?.throwIfAborted();
    parser.push(chunk);
    await scanDone();
  }
  parser.end();
  await scanDone();
  return { bytes, files };
}

const NOT_SCANNED_AS_IMAGE = /^(?:pages-\d+\.img|pagemap-\d+\.img|dump\.log|restore\.log)$/;

/** Scans an opened checkpoint. */
export async function scanCheckpoint(
  ck: OpenedCheckpoint,
  opts: ScanOptions = {},
  images?: CriuImages,
): Promise<ScanReport> {
  const started = performance.now();
  const im = images ?? (await readCriuImages(ck.imagesDir));
  const key = opts.fingerprintKey ?? randomBytes(32);
  const c = new Collector();
  const imageNames = [...im.imageFiles.keys()].sort().filter((n) => !NOT_SCANNED_AS_IMAGE.test(n));
  let workers = opts.workers;
  if (workers === undefined) {
    let total = 0;
    for (const p of im.processes) total += storedMemoryBytes(p);
    for (const n of imageNames) total += im.imageFiles.get(n) ?? 0;
    workers = total >= MIN_WORKER_SCAN_BYTES ? defaultScanWorkers() : 0;
  }
  const pool = workers > 0 ? new ScanPool(workers, key) : undefined;
  try {
    // Two chunks a worker, and two more read ahead while the workers start (measured: a
    // single worker's scan went from about 0.45 to 0.6 GB/s with them).
    const q = new ChunkQueue(c, key, pool, 2 * workers + 2, opts.onChunk);
    const memoryBytes = await scanMemory(im, q, opts, ck.pagesInPlace);
    let imageBytes = 0;
    let files = 0;
    for (const name of imageNames) {
      imageBytes += await scanFile(join(ck.imagesDir, name), name, 'image', q, opts.signal);
      files++;
    }
    let filesystemBytes = 0;
    let metadataBytes = 0;
    const flatDiff = join(ck.imagesDir, 'rootfs-diff.tar');
    if (
      !ck.rootDir &&
      (await stat(flatDiff).then(
        (st) => st.isFile(),
        () => false,
      ))
    ) {
      // A dormant checkpoint keeps its filesystem diff with the images.
      const r = await scanRootfsDiff(flatDiff, q, opts);
      filesystemBytes += r.bytes;
      files += r.files;
    }
    if (ck.rootDir) {
      for (const d of await readdir(ck.rootDir, { withFileTypes: true })) {
        if (!d.isFile()) continue;
        const p = join(ck.rootDir, d.name);
        if (/^rootfs-diff\.tar$/.test(d.name)) {
          const r = await scanRootfsDiff(p, q, opts);
          filesystemBytes += r.bytes;
          files += r.files;
        } else if ((await stat(p)).size <= 64 * 1024 * 1024) {
          metadataBytes += await scanFile(p, d.name, 'metadata', q, opts.signal);
          files++;
        }
      }
    }
    await q.finish();
    return {
      ref: ck.ref,
      findings: c.findings,
      scanned: { memoryBytes, imageBytes, filesystemBytes, metadataBytes, files },
      durationMs: Math.round(performance.now() - started),
    };
  } finally {
    await pool?.close();
  }
}
