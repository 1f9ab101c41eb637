/**
 * Reading podman / CRI-O / kubelet checkpoint archives (.tar, .tar.gz, .tar.zst; the
 * compression is detected from the first bytes, not the name) and unpacking them into a
 * private folder, safely: only regular files and folders are written, every name is
 * checked to stay inside the target (no absolute paths, no `..`), links and device nodes
 * are refused, files are created with O_EXCL|O_NOFOLLOW, and both the decompressed stream
 * and the unpacked bytes are capped so a decompression bomb stops early.
 */
import { closeSync, constants, createReadStream, mkdirSync, openSync, writeSync } from 'node:fs';
import { open } from 'node:fs/promises';
import { join, posix } from 'node:path';
import { createGunzip } from 'node:zlib';
import type { Readable } from 'node:stream';
import { DecompressStream } from 'zstd-napi';
import { DormantError, ErrorCode } from '../domain/errors.js';
import { TarParser, invalidArchive, type TarHeader } from './tar.js';

export type Compression = 'none' | 'gzip' | 'zstd';

export function detectCompression(head: Uint8Array): Compression {
  if (head.length >= 4 && head[0] === 0x28 && head[1] === 0xb5 && head[2] === 0x2f && head[3] === 0xfd)
    return 'zstd';
  if (head.length >= 2 && head[0] === 0x1f && head[1] === 0x8b) return 'gzip';
  return 'none';
}

export interface ArchiveLimits {
  /** Most bytes the decompressed stream may have. Default 64 GiB. */
  maxBytes?: number;
  /** Most entries. Default 1,000,000. */
  maxEntries?: number;
  signal?: AbortSignal;
}

const DEFAULT_MAX_BYTES = 64 * 1024 ** 3;
const DEFAULT_MAX_ENTRIES = 1_000_000;

function tooLarge(what: string): DormantError {
  return new DormantError(ErrorCode.CHECKPOINT_ARCHIVE_TOO_LARGE, `checkpoint archive too large: ${what}`, {
    status: 413,
    hint: 'raise the limit if the archive is trusted (a decompression bomb looks the same)',
  });
}

/** Opens `file` as a stream of decompressed tar bytes. */
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
  const dec = compression === 'gzip' ? createGunzip() : new DecompressStream();
  raw.on('error', (e) => dec.destroy(e));
  return { stream: raw.pipe(dec), compression };
}

/**
 * Feeds the archive's tar entries to `visit` (a TarParser visitor), enforcing the limits.
 * Resolves when the archive ends; rejects on a damaged, truncated or oversized archive.
 */
export async function walkArchive(
  file: string,
  visit: ConstructorParameters<typeof TarParser>[0],
  limits: ArchiveLimits = {},
): Promise<{ compression: Compression; bytes: number; entries: number }> {
  const maxBytes = limits.maxBytes ?? DEFAULT_MAX_BYTES;
  const maxEntries = limits.maxEntries ?? DEFAULT_MAX_ENTRIES;
  const { stream, compression } = await openTarStream(file);
  const parser = new TarParser(visit);
  let bytes = 0;
  try {
    for await (const chunk of stream as AsyncIterable<Buffer>) {
      limits.signal?.throwIfAborted();
      bytes += chunk.length;
      if (bytes > maxBytes) throw tooLarge(`${file} unpacks to more than ${maxBytes} bytes`);
      parser.push(chunk);
      if (parser.entries > maxEntries) throw tooLarge(`${file} has more than ${maxEntries} entries`);
    }
  } catch (e) {
    stream.destroy();
    if (e instanceof DormantError) throw e;
    throw invalidArchive(`${file}: ${e instanceof Error ? e.message : String(e)}`, e);
  }
  parser.end();
  return { compression, bytes, entries: parser.entries };
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
  opts: ArchiveLimits & { include?: (name: string) => boolean } = {},
): Promise<{ files: string[]; compression: Compression; bytes: number }> {
  const files: string[] = [];
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
  let fd: number | undefined;
  const visitor = {
    entry(h: TarHeader): ((chunk: Buffer) => void) | undefined {
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
        while (off < chunk.length) off += writeSync(myFd, chunk, off);
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
    const r = await walkArchive(file, visitor, opts);
    return { files, compression: r.compression, bytes: r.bytes };
  } finally {
    if (fd !== undefined) closeSync(fd);
  }
}
