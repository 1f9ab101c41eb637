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
import { readdir, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { readCriuImages, readPages, type CriuImages, type ProcessImage } from '../criu/images/reader.js';
import type { Vma } from '../criu/images/messages.js';
import { TarParser, type TarHeader } from './tar.js';
import { findSecretsInBytes, fingerprint, redact, type SecretKind } from './secrets.js';
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
}

/** Bytes carried from one chunk into the next so a secret across the edge is still seen. */
const OVERLAP = 4096;
const VMA_FILE_PRIVATE = 1 << 2;
const VMA_FILE_SHARED = 1 << 1;

class Collector {
  readonly findings: SecretFinding[] = [];
  private readonly index = new Map<string, SecretFinding>();
  constructor(private readonly key: Buffer) {}

  /**
   * Scans `buf`; `base` is the offset of buf[0] in its file/address space; `keep` (when given)
   * says which matches (offset and length in `buf`) count.
   */
  scan(
    buf: Buffer,
    base: number,
    keep: ((offset: number, length: number) => boolean) | undefined,
    place: (offset: number) => Omit<
      SecretFinding,
      'kind' | 'offset' | 'preview' | 'fingerprint' | 'occurrences' | 'name'
    > & {
      offset: number;
    },
  ): void {
    for (const s of findSecretsInBytes(buf)) {
      if (keep && !keep(s.offset, s.length)) continue;
      const where = place(base + s.offset);
      const fp = fingerprint(this.key, s.value);
      const k = `${s.kind}|${where.where}|${where.process?.pid ?? ''}|${where.path ?? ''}|${fp}`;
      const prev = this.index.get(k);
      if (prev) {
        prev.occurrences++;
        continue;
      }
      const f: SecretFinding = {
        kind: s.kind,
        ...where,
        name: s.name,
        preview: redact(s.kind, s.value, s.name),
        fingerprint: fp,
        occurrences: 1,
      };
      this.index.set(k, f);
      this.findings.push(f);
    }
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

/**
 * Scans one chunk of a stream, and the seam with the chunk before it: the chunk alone finds
 * what lies inside it; the seam (the previous chunk's last OVERLAP bytes and this one's first)
 * adds only what crosses the boundary. No chunk is copied; only the seam is.
 */
function scanWithSeam(
  c: Collector,
  prevTail: Buffer | undefined,
  data: Buffer,
  /** Where a match at this offset of `data` is (negative: in the previous chunk). */
  place: Parameters<Collector['scan']>[3],
): void {
  if (prevTail !== undefined && prevTail.length > 0) {
    const seam = Buffer.concat([prevTail, data.subarray(0, OVERLAP)]);
    const edge = prevTail.length;
    c.scan(
      seam,
      0,
      (off, len) => off < edge && off + len > edge,
      (off) => place(off - edge),
    );
  }
  c.scan(data, 0, undefined, place);
}

async function scanMemory(im: CriuImages, c: Collector, opts: ScanOptions): Promise<number> {
  let bytes = 0;
  for (const p of im.processes) {
    let tail: Buffer | undefined;
    let tailEnd = -1n;
    for await (const chunk of readPages(im, p, { chunkBytes: opts.chunkBytes, signal: opts.signal })) {
      bytes += chunk.data.length;
      const contiguous = tail !== undefined && tailEnd === chunk.vaddr;
      scanWithSeam(c, contiguous ? tail : undefined, chunk.data, (off) => {
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
      // A copy: readPages may reuse the chunk's memory for the next one.
      tail = Buffer.from(chunk.data.subarray(Math.max(0, chunk.data.length - OVERLAP)));
      tailEnd = chunk.vaddr + BigInt(chunk.data.length);
    }
  }
  return bytes;
}

/** Streams a file through the collector in chunks, with overlap. */
async function scanFile(
  path: string,
  label: string,
  where: SecretFinding['where'],
  c: Collector,
): Promise<number> {
  let tail: Buffer | undefined;
  let pos = 0;
  for await (const chunk of createReadStream(path, {
    highWaterMark: 4 * 1024 * 1024,
  }) as AsyncIterable<Buffer>) {
    const base = pos;
    scanWithSeam(c, tail, chunk, (off) => ({ where, path: label, offset: base + off }));
    pos += chunk.length;
    tail = chunk.subarray(Math.max(0, chunk.length - OVERLAP));
  }
  return pos;
}

/** Streams a tar (the rootfs diff) and scans each regular file's bytes as they pass. */
async function scanRootfsDiff(
  path: string,
  c: Collector,
  opts: ScanOptions,
): Promise<{ bytes: number; files: number }> {
  const maxFile = opts.maxFileBytes ?? 64 * 1024 * 1024;
  let bytes = 0;
  let files = 0;
  let cur: { name: string; parts: Buffer[]; size: number } | undefined;
  const parser = new TarParser({
    entry(h: TarHeader) {
      if (h.type !== 'file' || h.size > maxFile) return undefined;
      files++;
      cur = { name: `/${h.name.replace(/^\.?\//, '')}`, parts: [], size: 0 };
      const mine = cur;
      return (chunk: Buffer) => {
        mine.parts.push(Buffer.from(chunk));
        mine.size += chunk.length;
      };
    },
    entryEnd() {
      if (!cur) return;
      const b = Buffer.concat(cur.parts);
      bytes += b.length;
      const name = cur.name;
      c.scan(b, 0, undefined, (offset) => ({ where: 'filesystem', path: name, offset }));
      cur = undefined;
    },
  });
  for await (const chunk of createReadStream(path, { highWaterMark: 1024 * 1024 }) as AsyncIterable<Buffer>) {
    opts.signal?.throwIfAborted();
    parser.push(chunk);
  }
  parser.end();
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
  const c = new Collector(opts.fingerprintKey ?? randomBytes(32));
  const memoryBytes = await scanMemory(im, c, opts);
  let imageBytes = 0;
  let files = 0;
  for (const name of [...im.imageFiles.keys()].sort()) {
    if (NOT_SCANNED_AS_IMAGE.test(name)) continue;
    imageBytes += await scanFile(join(ck.imagesDir, name), name, 'image', c);
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
    const r = await scanRootfsDiff(flatDiff, c, opts);
    filesystemBytes += r.bytes;
    files += r.files;
  }
  if (ck.rootDir) {
    for (const d of await readdir(ck.rootDir, { withFileTypes: true })) {
      if (!d.isFile()) continue;
      const p = join(ck.rootDir, d.name);
      if (/^rootfs-diff\.tar$/.test(d.name)) {
        const r = await scanRootfsDiff(p, c, opts);
        filesystemBytes += r.bytes;
        files += r.files;
      } else if ((await stat(p)).size <= 64 * 1024 * 1024) {
        metadataBytes += await scanFile(p, d.name, 'metadata', c);
        files++;
      }
    }
  }
  return {
    ref: ck.ref,
    findings: c.findings,
    scanned: { memoryBytes, imageBytes, filesystemBytes, metadataBytes, files },
    durationMs: Math.round(performance.now() - started),
  };
}
