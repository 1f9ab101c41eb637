/**
 * Reading podman / CRI-O / kubelet checkpoint archives (.tar, .tar.gz, .tar.zst; the
 * compression is detected from the first bytes, not the name) and unpacking them into a
 * private folder, safely: only regular files and folders are written, every name is
 * checked to stay inside the target (no absolute paths, no `..`), links and device nodes
 * are refused, files are created with O_EXCL|O_NOFOLLOW, and both the decompressed stream
 * and the unpacked bytes are capped so a decompression bomb stops early.
 */
import { closeSync, constants, createReadStream, mkdirSync, openSync, writeSync } from 'node:fs';
import { open, readFile, statfs } from 'node:fs/promises';
import { createRequire } from 'node:module';
import { join, posix } from 'node:path';
import { Duplex, pipeline, type Readable } from 'node:stream';
import { createGunzip } from 'node:zlib';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';
import { TarParser, invalidArchive, type TarHeader, type TarVisitor } from './tar.js';

type ZstdBinding = typeof import('zstd-napi/binding.js');
const zstd = createRequire(import.meta.url)('zstd-napi/binding.js') as ZstdBinding;

export type Compression = 'none' | 'gzip' | 'zstd';

export function detectCompression(head: Uint8Array): Compression {
  if (head.length >= 4 && head[0] === 0x28 && head[1] === 0xb5 && head[2] === 0x2f && head[3] === 0xfd)
    return 'zstd';
  if (head.length >= 2 && head[0] === 0x1f && head[1] === 0x8b) return 'gzip';
  return 'none';
}

export interface ArchiveLimits {
  /** Most bytes the decompressed tar stream may have (headers included). Default 64 GiB. */
  maxBytes?: number;
  /** Most bytes one member may have. Default 32 GiB (a big sandbox's pages-N.img). */
  maxMemberBytes?: number;
  /** Most entries. Default 1,000,000 (a rootfs diff); extractArchive's default is 100,000. */
  maxEntries?: number;
  signal?: AbortSignal;
}

export const DEFAULT_MAX_BYTES = 64 * 1024 ** 3;
export const DEFAULT_MAX_MEMBER_BYTES = 32 * 1024 ** 3;
const DEFAULT_MAX_ENTRIES = 1_000_000;
/** A checkpoint archive holds a few images per process and a handful of metadata files. */
const DEFAULT_MAX_ARCHIVE_ENTRIES = 100_000;
/**
 * Metadata members (config.dump, spec.dump, network.status, deleted.files, ...) are read whole
 * into memory by import and inspect; real ones are kilobytes.
 */
export const MAX_METADATA_MEMBER_BYTES = 16 * 1024 * 1024;
/** Linux's PATH_MAX and NAME_MAX: a longer member name cannot be created anyway. */
const MAX_PATH_BYTES = 4096;
const MAX_NAME_BYTES = 255;
/** Data after the tar end blocks that is tolerated (GNU tar pads to 10 KiB records). */
const MAX_TRAILING_BYTES = 1024 * 1024;
/** Left free on the staging filesystem (memory-backed: the rest of the host needs it). */
const STAGING_RESERVE_BYTES = 256 * 1024 * 1024;

function gib(n: number): string {
  return n >= 1024 ** 3 ? `${(n / 1024 ** 3).toFixed(n % 1024 ** 3 === 0 ? 0 : 1)} GiB` : `${n} bytes`;
}

/** CHECKPOINT_ARCHIVE_TOO_LARGE (413). Names the member and the cap; never a host path. */
export function tooLarge(what: string): DormantError {
  return new DormantError(ErrorCode.CHECKPOINT_ARCHIVE_TOO_LARGE, `checkpoint archive too large: ${what}`, {
    hint: 'raise the limit if the archive is trusted (a decompression bomb looks the same)',
  });
}

/** zstd's recommended output buffer (ZSTD_DStreamOutSize(), 128 KiB): one decoded block. */
const ZSTD_OUT_BYTES = zstd.dStreamOutSize();
/** Frames that need a bigger window than 128 MiB (zstd's own default limit) are refused. */
const ZSTD_WINDOW_LOG_MAX = 27;

/**
 * zstd decompression that honours backpressure both ways, unlike zstd-napi's DecompressStream
 * (which decodes a whole input chunk at once: 135 KB of a bomb became 4 GiB of queued
 * buffers). Output is decoded one 128 KiB block at a time, and only while the reader wants
 * more (`push` returned true, or `_read` was called again); an input chunk's callback is held
 * until all of its output has been taken, so the writable side fills and the source pauses.
 * Memory: the readable high-water mark plus one block, the input chunk, and zstd's window
 * (at most 128 MiB, by ZSTD_WINDOW_LOG_MAX).
 */
export class BoundedZstdDecompress extends Duplex {
  private readonly dctx = new zstd.DCtx();
  private input: Buffer | undefined;
  private inputDone: ((e?: Error | null) => void) | undefined;
  private inFrame = false;
  /** Whether the reader asked for output that has not been pushed yet. */
  private wanted = false;

  constructor(opts: { readableHighWaterMark?: number; writableHighWaterMark?: number } = {}) {
    super({
      readableHighWaterMark: opts.readableHighWaterMark ?? ZSTD_OUT_BYTES,
      writableHighWaterMark: opts.writableHighWaterMark ?? 64 * 1024,
    });
    this.dctx.setParameter(zstd.DParameter.windowLogMax, ZSTD_WINDOW_LOG_MAX);
  }

  override _write(chunk: Buffer, _encoding: BufferEncoding, done: (e?: Error | null) => void): void {
    this.input = chunk;
    this.inputDone = done;
    this.pump();
  }

  override _read(): void {
    this.wanted = true;
    this.pump();
  }

  override _final(done: (e?: Error | null) => void): void {
    if (this.inFrame) {
      done(new Error('the zstd stream ends inside a frame (truncated)'));
      return;
    }
    this.push(null);
    done();
  }

  private finishInput(e?: Error): void {
    const done = this.inputDone;
    this.input = undefined;
    this.inputDone = undefined;
    done?.(e);
  }

  private pump(): void {
    while (this.input !== undefined && this.wanted) {
      const out = Buffer.allocUnsafe(ZSTD_OUT_BYTES);
      let ret: number, produced: number, consumed: number;
      try {
        [ret, produced, consumed] = this.dctx.decompressStream(out, this.input);
      } catch (e) {
        this.finishInput(e instanceof Error ? e : new Error(String(e)));
        return;
      }
      this.input = this.input.subarray(consumed);
      // push() says whether the reader wants more: when it does not, stop until _read.
      if (produced > 0) this.wanted = this.push(out.subarray(0, produced));
      // The chunk is spent once its input is consumed and zstd holds no more output for it.
      if (this.input.length === 0 && (produced < out.length || ret === 0)) {
        this.inFrame = ret !== 0;
        this.finishInput();
        return;
      }
    }
  }
}

/**
 * Opens `file` as a stream of decompressed tar bytes. Every stage honours backpressure (node's
 * zlib streams do; zstd through BoundedZstdDecompress), so the bytes in memory stay bounded
 * however well the archive compresses: about one read chunk plus one decoded block.
 */
export async function openTarStream(file: string): Promise<{ stream: Readable; compression: Compression }> {
  const fh = await open(file, 'r');
  let head: Buffer;
  try {
    head = Buffer.alloc(8);
    await fh.read(head, 0, 8, 0);
  } finally {
    await fh.close();
  }
  const compression = detectCompression(head);
  const raw = createReadStream(file, { highWaterMark: 1024 * 1024 });
  if (compression === 'none') return { stream: raw, compression };
  const dec = compression === 'gzip' ? createGunzip({ chunkSize: 128 * 1024 }) : new BoundedZstdDecompress();
  // pipeline, not pipe: an error or destroy on either side ends (and closes) both.
  return { stream: pipeline(raw, dec, () => undefined), compression };
}

/**
 * The bytes of an uncompressed archive, 1 MiB at a time, read at positions: after each chunk,
 * `skip` says how many bytes the parser needs no more of (a member nobody takes), and the
 * next read starts past them. A member that runs past the end of the file is truncated: the
 * reads end there, and the parser says so.
 */
async function* positionalChunks(
  file: string,
  parser: () => TarParser,
  stepped: { bytes: number },
): AsyncGenerator<Buffer> {
  const fh = await open(file, 'r');
  try {
    const size = (await fh.stat()).size;
    let pos = 0;
    while (pos < size) {
      // A fresh buffer each time: the parser may keep part of a chunk until the next one.
      const buf = Buffer.allocUnsafe(Math.min(1024 * 1024, size - pos));
      const { bytesRead } = await fh.read(buf, 0, buf.length, pos);
      if (bytesRead === 0) return;
      pos += bytesRead;
      yield buf.subarray(0, bytesRead);
      const n = parser().skippable;
      if (n === 0) continue;
      if (pos + n > size) return; // truncated inside the member: the parser says so at its end
      parser().skip();
      pos += n;
      stepped.bytes += n;
    }
  } finally {
    await fh.close();
  }
}

/** Throws when a member name is longer than Linux could create (PATH_MAX, NAME_MAX). */
function checkNameLength(h: TarHeader): void {
  const shown = (s: string): string => JSON.stringify(s.length > 120 ? `${s.slice(0, 120)}...` : s);
  for (const [what, v] of [
    ['name', h.name],
    ['link target', h.linkName],
  ] as const) {
    const bytes = Buffer.byteLength(v);
    if (bytes > MAX_PATH_BYTES)
      throw invalidArchive(`member ${what} ${shown(v)} is ${bytes} bytes, over the cap of ${MAX_PATH_BYTES}`);
    if (what === 'name' && v.split('/').some((p) => Buffer.byteLength(p) > MAX_NAME_BYTES))
      throw invalidArchive(`member name ${shown(v)} has a part over ${MAX_NAME_BYTES} bytes`);
  }
}

/**
 * Feeds the archive's tar entries to `visit` (a TarParser visitor), enforcing the limits while
 * it streams: a member over its cap is refused at its header (tar headers give sizes before
 * the bytes), before any of its bytes are decompressed; the total is checked the same way and
 * again on every chunk. Resolves when the archive ends; rejects on a damaged, truncated or
 * oversized archive.
 */
export async function walkArchive(
  file: string,
  visit: {
    /** As TarVisitor's; `at`: where the entry's bytes start in the (decompressed) tar stream. */
    entry(h: TarHeader, at: number, compression: Compression): ((chunk: Buffer) => void) | undefined;
    entryEnd?(h: TarHeader): void;
  },
  limits: ArchiveLimits & { memberCap?: (name: string) => number | undefined } = {},
): Promise<{ compression: Compression; bytes: number; entries: number }> {
  const maxBytes = limits.maxBytes ?? DEFAULT_MAX_BYTES;
  const maxMemberBytes = limits.maxMemberBytes ?? DEFAULT_MAX_MEMBER_BYTES;
  const maxEntries = limits.maxEntries ?? DEFAULT_MAX_ENTRIES;
  const { stream, compression } = await openTarStream(file);
  // An uncompressed archive is read at positions, so that members nobody takes (the pages a
  // scan reads in place) are stepped over instead of read.
  const stepped = { bytes: 0 };
  let chunks: AsyncIterable<Buffer> = stream as AsyncIterable<Buffer>;
  if (compression === 'none') {
    stream.destroy();
    chunks = positionalChunks(file, () => parser, stepped);
  }
  let bytes = 0;
  let declared = 0;
  let entries = 0;
  const checked: TarVisitor = {
    entry(h) {
      checkNameLength(h);
      if (++entries > maxEntries) throw tooLarge(`more than ${maxEntries} entries`);
      const cap = Math.min(maxMemberBytes, limits.memberCap?.(h.name) ?? Infinity);
      if (h.size > cap)
        throw tooLarge(`member ${JSON.stringify(h.name)} is ${gib(h.size)}, over the cap of ${gib(cap)}`);
      declared += h.size;
      if (declared > maxBytes)
        throw tooLarge(
          `member ${JSON.stringify(h.name)} takes the archive past its cap of ${gib(maxBytes)} unpacked`,
        );
      return visit.entry(h, parser.position, compression);
    },
    ...(visit.entryEnd ? { entryEnd: (h: TarHeader) => visit.entryEnd!(h) } : {}),
  };
  const parser = new TarParser(checked);
  try {
    for await (const chunk of chunks) {
      limits.signal?.throwIfAborted();
      bytes += chunk.length;
      if (bytes > maxBytes) throw tooLarge(`it unpacks to more than ${gib(maxBytes)}`);
      parser.push(chunk);
      // Nothing after the end blocks is read: a small tail (record padding, what a gzip
      // member's trailer leaves) is fine, more is a bomb hiding behind a valid archive.
      if (parser.trailingBytes > MAX_TRAILING_BYTES)
        throw invalidArchive(`more than ${MAX_TRAILING_BYTES} bytes after the end of the tar archive`);
    }
    bytes += stepped.bytes;
  } catch (e) {
    stream.destroy();
    if (e instanceof DormantError) throw e;
    throw invalidArchive(e instanceof Error ? e.message : String(e), e);
  }
  parser.end();
  return { compression, bytes, entries: parser.entries };
}

/** Members that import and inspect read whole into memory: metadata, capped small. */
export function isMetadataMember(rel: string): boolean {
  // CRIU's logs too, wherever they are (inspect reads dump.log from checkpoint/).
  if (rel.endsWith('.log')) return true;
  return (
    !rel.includes('/') &&
    (rel.endsWith('.dump') ||
      rel.endsWith('.json') ||
      rel.endsWith('.log') ||
      ['network.status', 'deleted.files', 'stats-dump', 'bind.mounts', 'pod.options'].includes(rel))
  );
}

/**
 * Checks an archive member name and returns it normalized (relative, no `.`/`..`), or
 * throws. Names are data from the archive; nothing about them is trusted.
 */
export function safeMemberName(name: string): string {
  if (name.includes('\0')) throw invalidArchive(`member name with a NUL byte`);
  if (name.startsWith('/')) throw invalidArchive(`absolute path ${JSON.stringify(name)}`);
  const parts = name.split('/').filter((p) => p !== '' && p !== '.');
  if (parts.some((p) => p === '..'))
    throw invalidArchive(`path ${JSON.stringify(name)} climbs out of the archive`);
  return parts.join('/');
}

/**
 * Unpacks the archive into `destDir` (which must exist and be private). Returns the
 * relative paths written. Refuses links, devices and fifos with CHECKPOINT_ARCHIVE_INVALID;
 * a member written twice is refused too (O_EXCL), so a later entry cannot replace an
 * earlier one. `include` may skip members by name (they are still read and checked).
 */
export async function extractArchive(
  file: string,
  destDir: string,
  opts: ArchiveLimits & {
    include?: (name: string) => boolean;
    /**
     * Members of an uncompressed archive to leave where they are (the pages: reading them in
     * place saves writing a copy of the whole memory to staging): returned in `inPlace` as
     * where their bytes start in the archive, and not written.
     */
    leaveInPlace?: (name: string) => boolean;
  } = {},
): Promise<{
  files: string[];
  compression: Compression;
  bytes: number;
  inPlace: Map<string, { offset: number; size: number }>;
}> {
  const files: string[] = [];
  const inPlace = new Map<string, { offset: number; size: number }>();
  const madeDirs = new Set<string>(['']);
  const ensureDir = (rel: string): void => {
    if (madeDirs.has(rel)) return;
    ensureDir(posix.dirname(rel) === '.' ? '' : posix.dirname(rel));
    try {
      mkdirSync(join(destDir, rel), { mode: 0o700 });
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code !== 'EEXIST') throw e;
    }
    madeDirs.add(rel);
  };
  // What staging can take, decided up front: a member that would not fit is refused at its
  // header, not after it has filled the (memory-backed) staging filesystem.
  const room = await stagingRoom(destDir);
  let stagedBytes = 0;
  let fd: number | undefined;
  const visitor = {
    entry(h: TarHeader, at: number, compression: Compression): ((chunk: Buffer) => void) | undefined {
      const rel = safeMemberName(h.name);
      if (h.type === 'dir') {
        if (rel !== '') ensureDir(rel);
        return undefined;
      }
      if (h.type !== 'file') {
        const what =
          h.type === 'symlink' || h.type === 'hardlink'
            ? `a link to ${JSON.stringify(h.linkName)}`
            : `a ${h.type} (type ${JSON.stringify(h.typeflag)})`;
        throw invalidArchive(
          `${JSON.stringify(h.name)} is ${what}; checkpoint archives hold only files and folders`,
        );
      }
      if (rel === '') throw invalidArchive('a file member with an empty name');
      if (opts.include && !opts.include(rel)) return undefined;
      if (compression === 'none' && opts.leaveInPlace?.(rel)) {
        if (inPlace.has(rel) || files.includes(rel)) throw invalidArchive(`${rel} appears twice`);
        inPlace.set(rel, { offset: at, size: h.size });
        return undefined;
      }
      stagedBytes += Math.ceil(h.size / 4096) * 4096;
      if (stagedBytes > room)
        throw tooLarge(
          `member ${JSON.stringify(rel)} (${gib(h.size)}) does not fit in staging (${gib(Math.max(0, room))} free for imports)`,
        );
      ensureDir(posix.dirname(rel) === '.' ? '' : posix.dirname(rel));
      try {
        fd = openSync(
          join(destDir, rel),
          constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL | constants.O_NOFOLLOW,
          0o600,
        );
      } catch (e) {
        if ((e as NodeJS.ErrnoException).code === 'EEXIST') throw invalidArchive(`${rel} appears twice`);
        throw e;
      }
      files.push(rel);
      const myFd = fd;
      return (chunk: Buffer) => {
        let off = 0;
        try {
          while (off < chunk.length) off += writeSync(myFd, chunk, off);
        } catch (e) {
          // Another import or a sandbox took the room counted above.
          if (errnoCode(e) === 'ENOSPC' || errnoCode(e) === 'EDQUOT')
            throw tooLarge(`staging ran out of space while writing member ${JSON.stringify(rel)}`);
          throw e;
        }
      };
    },
    entryEnd(): void {
      if (fd !== undefined) {
        closeSync(fd);
        fd = undefined;
      }
    },
  };
  try {
    const r = await walkArchive(file, visitor, {
      ...opts,
      maxEntries: opts.maxEntries ?? DEFAULT_MAX_ARCHIVE_ENTRIES,
      memberCap: (name) => (isMetadataMember(safeMemberName(name)) ? MAX_METADATA_MEMBER_BYTES : undefined),
    });
    return { files, compression: r.compression, bytes: r.bytes, inPlace };
  } finally {
    if (fd !== undefined) closeSync(fd);
  }
}

const TMPFS_MAGIC = 0x01021994;

/**
 * Bytes an import may write under `dir`: the filesystem's free space, and on tmpfs (staging is
 * /dev/shm) no more than the memory available either, since tmpfs pages are memory, less a
 * reserve for the rest of the host.
 */
export async function stagingRoom(dir: string): Promise<number> {
  const fs = await statfs(dir);
  let free = fs.bavail * fs.bsize;
  if (fs.type === TMPFS_MAGIC) {
    const m = /^MemAvailable:\s+(\d+) kB$/m.exec(await readFile('/proc/meminfo', 'utf8'));
    if (m) free = Math.min(free, Number(m[1]) * 1024);
  }
  return free - STAGING_RESERVE_BYTES;
}
