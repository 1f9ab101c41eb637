/**
 * Streaming restore: writes a checkpoint's files into a folder, chunk by chunk, holes as
 * holes. Every chunk is authenticated before a byte of it is written; on any failure the
 * files written so far are removed, so a caller never finds a half-restored checkpoint.
 */
import { chmod, lstat, mkdir, open, readdir, rm, symlink, utimes, type FileHandle } from 'node:fs/promises';
import { createRequire } from 'node:module';
import { join } from 'node:path';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';
import { CHUNK_ID_BYTES, open as openSealed, type TenantKeys } from './crypto.js';
import {
  CODEC_RAW,
  CODEC_ZSTD,
  PACK_HEADER_BYTES,
  REF_BYTES,
  REF_HOLE,
  packHeader,
  type ManifestBody,
} from './format.js';
import type { ChunkLocation } from './ingest.js';
import type { StoreReader, VaultStore } from './store.js';

type ZstdBinding = typeof import('zstd-napi/binding.js');
const zstd = createRequire(import.meta.url)('zstd-napi/binding.js') as ZstdBinding;

const WINDOW_BYTES = 4 * 1024 * 1024;
const OUT_BYTES = 4 * 1024 * 1024;

/** Room in front of a window for the tail of a record that straddles two reads. */
const HEADROOM = 128 * 1024;

interface Window {
  buf: Buffer;
  /** Index in `buf` where the window's bytes start. */
  base: number;
  /** Pack offset of the window's first byte. */
  start: number;
  len: number;
}

interface OpenPackReader {
  r: StoreReader;
  cur: Window;
  spare: Buffer;
  /** A read of the bytes after `cur`, into `spare` at HEADROOM. */
  prefetch: Promise<{ start: number; len: number }> | undefined;
}

/**
 * Reads records from packs through reused windows, reading the next window while the current
 * one is decoded. A checkpoint's new chunks sit back to back in its packs, so a restore reads
 * each pack once, sequentially, into warm memory.
 */
export class PackReaders {
  private readonly open = new Map<string, OpenPackReader>();
  constructor(
    private readonly store: VaultStore,
    private readonly tenant: string,
    /** What is being read, for messages ("checkpoint ck-1"). */
    private readonly what: string,
  ) {}

  private corrupt(pack: string, why: string): DormantError {
    return new DormantError(ErrorCode.VAULT_CORRUPT, `${this.what}: pack ${pack} ${why}`, {
      details: { object: `pack ${pack}` },
      hint: 'run `dormant vault verify` to list every damaged object',
    });
  }

  private startPrefetch(p: OpenPackReader): void {
    const start = p.cur.start + p.cur.len;
    const len = Math.min(WINDOW_BYTES, p.r.sizeBytes - start);
    if (len <= 0) {
      p.prefetch = undefined;
      return;
    }
    const spare = p.spare;
    p.prefetch = p.r.read(start, len, spare.subarray(HEADROOM)).then(() => ({ start, len }));
    // A failed prefetch is reported when (and if) its bytes are needed.
    p.prefetch.catch(() => undefined);
  }

  private swapIn(p: OpenPackReader, w: Window): void {
    p.spare = p.cur.buf;
    p.cur = w;
  }

  async record(loc: ChunkLocation): Promise<Buffer> {
    let p = this.open.get(loc.pack);
    if (p === undefined) {
      if (this.open.size >= 16) await this.close();
      const r = await this.store.openReader(`data/${this.tenant}/packs/${loc.pack}.pack`);
      // The header is not covered by any record's tag: check it here so that no byte of a
      // pack goes unchecked by restore.
      const head = r.sizeBytes >= PACK_HEADER_BYTES ? await r.read(0, PACK_HEADER_BYTES) : Buffer.alloc(0);
      if (!head.equals(packHeader(loc.pack))) {
        await r.close();
        throw this.corrupt(loc.pack, 'has a damaged header');
      }
      p = {
        r,
        cur: { buf: Buffer.allocUnsafe(HEADROOM + WINDOW_BYTES), base: HEADROOM, start: 0, len: 0 },
        spare: Buffer.allocUnsafe(HEADROOM + WINDOW_BYTES),
        prefetch: undefined,
      };
      this.open.set(loc.pack, p);
    }
    const end = loc.offset + loc.storedBytes;
    const inCur = (): boolean => loc.offset >= p.cur.start && end <= p.cur.start + p.cur.len;
    if (inCur())
      return p.cur.buf.subarray(p.cur.base + loc.offset - p.cur.start, p.cur.base + end - p.cur.start);
    if (loc.storedBytes > HEADROOM) {
      if (end > p.r.sizeBytes) throw this.corrupt(loc.pack, 'is truncated');
      return p.r.read(loc.offset, loc.storedBytes);
    }
    if (p.prefetch) {
      const pf = await p.prefetch.catch(() => undefined);
      p.prefetch = undefined;
      if (pf !== undefined) {
        const curEnd = p.cur.start + p.cur.len;
        if (
          pf.start === curEnd &&
          loc.offset >= p.cur.start &&
          loc.offset < curEnd &&
          end <= pf.start + pf.len
        ) {
          // The record straddles the two reads: move its head in front of the prefetched bytes.
          const tail = curEnd - loc.offset;
          p.cur.buf.copy(
            p.spare,
            HEADROOM - tail,
            p.cur.base + loc.offset - p.cur.start,
            p.cur.base + p.cur.len,
          );
          this.swapIn(p, { buf: p.spare, base: HEADROOM - tail, start: loc.offset, len: tail + pf.len });
        } else {
          this.swapIn(p, { buf: p.spare, base: HEADROOM, start: pf.start, len: pf.len });
        }
        if (inCur()) {
          this.startPrefetch(p);
          return p.cur.buf.subarray(p.cur.base + loc.offset - p.cur.start, p.cur.base + end - p.cur.start);
        }
      }
    }
    // Not where a sequential reader would be: read a window at the record.
    const len = Math.min(WINDOW_BYTES, p.r.sizeBytes - loc.offset);
    if (len < loc.storedBytes) throw this.corrupt(loc.pack, 'is truncated');
    await p.r.read(loc.offset, len, p.cur.buf.subarray(HEADROOM));
    p.cur = { buf: p.cur.buf, base: HEADROOM, start: loc.offset, len };
    this.startPrefetch(p);
    return p.cur.buf.subarray(HEADROOM, HEADROOM + loc.storedBytes);
  }

  async close(): Promise<void> {
    const all = [...this.open.values()];
    this.open.clear();
    for (const p of all) await p.prefetch?.catch(() => undefined);
    await Promise.all(all.map((p) => p.r.close()));
  }
}

/** Decrypts and decompresses one chunk record into `out`; throws VAULT_CORRUPT naming the chunk. */
export class ChunkDecoder {
  private readonly dctx = new zstd.DCtx();
  constructor(private readonly keys: TenantKeys) {}

  decode(id: Buffer, loc: ChunkLocation, record: Buffer, out: Buffer, at: number, what: string): void {
    const plain = openSealed(this.keys.dataKey, id, record);
    const bad = (why: string): DormantError =>
      new DormantError(
        ErrorCode.VAULT_CORRUPT,
        `${what}: chunk ${id.toString('hex').slice(0, 16)} in pack ${loc.pack} ${why}`,
        {
          details: { object: `pack ${loc.pack}`, chunk: id.toString('hex') },
          hint: 'run `dormant vault verify` to list every damaged object',
        },
      );
    if (plain === undefined) throw bad('fails authentication');
    try {
      if (plain[0] === CODEC_RAW) {
        if (plain.length - 1 !== loc.rawBytes) throw bad('has the wrong length');
        plain.copy(out, at, 1);
      } else if (plain[0] === CODEC_ZSTD) {
        let n: number;
        try {
          n = this.dctx.decompress(out.subarray(at, at + loc.rawBytes), plain.subarray(1));
        } catch (e) {
          throw bad(`does not decompress (${e instanceof Error ? e.message : String(e)})`);
        }
        if (n !== loc.rawBytes) throw bad('has the wrong length');
      } else {
        throw bad('has an unknown codec');
      }
    } finally {
      plain.fill(0);
    }
  }
}

export interface RestoreContext {
  store: VaultStore;
  tenant: string;
  checkpointId: string;
  keys: TenantKeys;
  lookup: (key: string) => ChunkLocation | undefined;
  /** Explains a missing chunk (for instance: its index failed authentication). */
  explainMissing: () => string;
  signal?: AbortSignal;
  onProgress?: (restoredBytes: number) => void;
}

function checkRelPath(p: string, what: string): void {
  if (p === '' || p.startsWith('/') || p.split('/').some((s) => s === '..' || s === '.' || s === '')) {
    throw new DormantError(ErrorCode.VAULT_CORRUPT, `${what}: manifest holds an unsafe path "${p}"`);
  }
}

/** Restores `body` into `destDir` (created if missing; must be empty). Returns bytes written. */
export async function restoreInto(destDir: string, body: ManifestBody, ctx: RestoreContext): Promise<number> {
  const what = `checkpoint ${ctx.checkpointId}`;
  let createdRoot = false;
  try {
    const names = await readdir(destDir);
    if (names.length > 0) {
      throw new DormantError(ErrorCode.INVALID_ARGUMENT, `restore target ${destDir} is not empty`, {
        hint: 'restore into a new or empty folder',
      });
    }
  } catch (e) {
    if (errnoCode(e) !== 'ENOENT') throw e;
    await mkdir(destDir, { recursive: true, mode: 0o700 });
    createdRoot = true;
  }
  const readers = new PackReaders(ctx.store, ctx.tenant, what);
  const decoder = new ChunkDecoder(ctx.keys);
  // Two output buffers: one is written to the file while the other fills.
  const outs = [Buffer.allocUnsafe(OUT_BYTES), Buffer.allocUnsafe(OUT_BYTES)];
  const writing: Promise<void>[] = [Promise.resolve(), Promise.resolve()];
  let restored = 0;
  try {
    for (const e of body.entries) {
      checkRelPath(e.path, what);
      const p = join(destDir, ...e.path.split('/'));
      if (e.type === 'dir') {
        await mkdir(p, { mode: 0o700 });
        continue;
      }
      if (e.type === 'symlink') {
        await symlink(e.target ?? '', p);
        continue;
      }
      const h: FileHandle = await open(p, 'wx', 0o600);
      try {
        let fileAt = 0; // file offset of out[0]
        let fill = 0;
        let which = 0;
        let out = outs[0]!;
        const flush = async (): Promise<void> => {
          if (fill > 0) {
            const buf = out;
            const n = fill;
            const pos = fileAt;
            const w = (async () => {
              let done = 0;
              while (done < n) done += (await h.write(buf, done, n - done, pos + done)).bytesWritten;
            })();
            w.catch(() => undefined);
            writing[which] = w;
            which ^= 1;
            out = outs[which]!;
            // The buffer about to be filled must be done with its previous write.
            await writing[which];
          }
          fileAt += fill;
          fill = 0;
        };
        const drain = async (): Promise<void> => {
          await flush();
          await Promise.all(writing);
        };
        for (let i = e.firstRef; i < e.firstRef + e.refCount; i++) {
          const at = i * REF_BYTES;
          const len = body.refs.readUInt32LE(at + 1);
          if (body.refs[at] === REF_HOLE) {
            await flush();
            fileAt += len;
            continue;
          }
          const id = body.refs.subarray(at + 5, at + 5 + CHUNK_ID_BYTES);
          const key = id.toString('hex');
          const loc = ctx.lookup(key);
          if (loc === undefined) {
            throw new DormantError(
              ErrorCode.VAULT_CORRUPT,
              `${what}: chunk ${key.slice(0, 16)} of ${e.path} is missing from the vault${ctx.explainMissing()}`,
              {
                details: { object: `chunk ${key}` },
                hint: 'run `dormant vault verify` to list every damaged object',
              },
            );
          }
          if (loc.rawBytes !== len) {
            throw new DormantError(
              ErrorCode.VAULT_CORRUPT,
              `${what}: chunk ${key.slice(0, 16)} has the wrong length in its index`,
            );
          }
          if (fill + len > OUT_BYTES) {
            await flush();
            if (ctx.signal?.aborted) {
              throw new DormantError(ErrorCode.COMMAND_ABORTED, `restore of ${what} aborted`, {
                cause: ctx.signal.reason,
              });
            }
          }
          const rec = await readers.record(loc);
          decoder.decode(id, loc, rec, out, fill, what);
          fill += len;
          restored += len;
        }
        await drain();
        if (fileAt !== e.sizeBytes) {
          throw new DormantError(
            ErrorCode.VAULT_CORRUPT,
            `${what}: ${e.path} restores to ${fileAt} bytes, manifest says ${e.sizeBytes}`,
          );
        }
        // Trailing holes: the size comes from truncate, the bytes are never written.
        await h.truncate(e.sizeBytes);
      } finally {
        await Promise.allSettled(writing);
        writing[0] = writing[1] = Promise.resolve();
        await h.close();
      }
      await chmod(p, e.mode);
      await utimes(p, e.mtimeMs / 1000, e.mtimeMs / 1000);
      ctx.onProgress?.(restored);
      if (ctx.signal?.aborted) {
        throw new DormantError(ErrorCode.COMMAND_ABORTED, `restore of ${what} aborted`, {
          cause: ctx.signal.reason,
        });
      }
    }
    // Folder modes last (a read-only folder would refuse its own files), deepest first.
    for (const e of [...body.entries].reverse()) {
      if (e.type !== 'dir') continue;
      const p = join(destDir, ...e.path.split('/'));
      await chmod(p, e.mode);
      await utimes(p, e.mtimeMs / 1000, e.mtimeMs / 1000);
    }
  } catch (err) {
    for (const o of outs) o.fill(0);
    await removeRestored(destDir, createdRoot);
    throw err;
  } finally {
    await readers.close();
  }
  for (const o of outs) o.fill(0);
  return restored;
}

async function removeRestored(destDir: string, createdRoot: boolean): Promise<void> {
  // The folder was empty (or absent) before restore: everything in it is ours to remove.
  const fixModes = async (d: string): Promise<void> => {
    await chmod(d, 0o700).catch(() => undefined);
    for (const n of await readdir(d).catch(() => [] as string[])) {
      const p = join(d, n);
      const st = await lstat(p).catch(() => undefined);
      if (st?.isDirectory()) await fixModes(p);
    }
  };
  await fixModes(destDir);
  if (createdRoot) {
    await rm(destDir, { recursive: true, force: true });
    return;
  }
  for (const n of await readdir(destDir)) await rm(join(destDir, n), { recursive: true, force: true });
}
