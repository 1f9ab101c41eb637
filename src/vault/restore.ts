/**
 * Streaming restore: writes a checkpoint's files into a folder, chunk by chunk, holes as
 * holes. Every chunk is authenticated before a byte of it is written; on any failure the
 * files written so far are removed, so a caller never finds a half-restored checkpoint.
 */
import { createSecretKey } from 'node:crypto';
import { chmod, lstat, mkdir, open, readdir, rm, symlink, utimes, type FileHandle } from 'node:fs/promises';
import { createRequire } from 'node:module';
import { join } from 'node:path';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';
import { CHUNK_ID_BYTES, type TenantKeys } from './crypto.js';
import {
  PACK_HEADER_BYTES,
  REF_BYTES,
  REF_HOLE,
  packHeader,
  recordAad,
  recordRawBytes,
  type ChunkLocation,
  type ManifestBody,
  type ManifestEntry,
} from './format.js';
import type { SealPool } from './seal-pool.js';
import { decodeRecord, decodeRecords } from './seal-worker.js';
import type { StoreReader, VaultStore } from './store.js';

type ZstdBinding = typeof import('zstd-napi/binding.js');
const zstd = createRequire(import.meta.url)('zstd-napi/binding.js') as ZstdBinding;

const WINDOW_BYTES = 4 * 1024 * 1024;

/** Room in front of a window for the tail of a record that straddles two reads. */
const HEADROOM = 128 * 1024;
/** What is read at a record away from the window (bigger records are read on their own). */
const JUMP_BYTES = 2 * HEADROOM;

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
  /** Where records bigger than HEADROOM are read. */
  private big = Buffer.alloc(0);
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

  private async reader(pack: string): Promise<OpenPackReader> {
    let p = this.open.get(pack);
    if (p === undefined) {
      if (this.open.size >= 16) await this.close();
      const r = await this.store.openReader(`data/${this.tenant}/packs/${pack}.pack`);
      // The header is not covered by any record's tag: check it here so that no byte of a
      // pack goes unchecked by restore.
      const head = r.sizeBytes >= PACK_HEADER_BYTES ? await r.read(0, PACK_HEADER_BYTES) : Buffer.alloc(0);
      if (!head.equals(packHeader(pack))) {
        await r.close();
        throw this.corrupt(pack, 'has a damaged header');
      }
      p = {
        r,
        cur: { buf: Buffer.allocUnsafe(HEADROOM + WINDOW_BYTES), base: HEADROOM, start: 0, len: 0 },
        spare: Buffer.allocUnsafe(HEADROOM + WINDOW_BYTES),
        prefetch: undefined,
      };
      this.open.set(pack, p);
    }
    return p;
  }

  /**
   * Reads `length` bytes of pack `pack` from `offset` straight into `dst` at `at`: a run of
   * records back to back, for a caller that decodes them from its own buffer (no window, no
   * copy, no buffer of its own).
   */
  async readInto(pack: string, offset: number, length: number, dst: Buffer, at: number): Promise<void> {
    const p = await this.reader(pack);
    if (offset + length > p.r.sizeBytes) throw this.corrupt(pack, 'is truncated');
    await p.r.read(offset, length, dst.subarray(at, at + length));
  }

  /**
   * The sealed bytes of the record at `loc`. They lie in a buffer the next call reuses (a
   * window, or the one for big records): use them, or copy them, before calling again.
   */
  async record(loc: ChunkLocation): Promise<Buffer> {
    const p = await this.reader(loc.pack);
    const end = loc.offset + loc.storedBytes;
    const inCur = (): boolean => loc.offset >= p.cur.start && end <= p.cur.start + p.cur.len;
    if (inCur())
      return p.cur.buf.subarray(p.cur.base + loc.offset - p.cur.start, p.cur.base + end - p.cur.start);
    if (loc.storedBytes > HEADROOM) {
      if (end > p.r.sizeBytes) throw this.corrupt(loc.pack, 'is truncated');
      // Into one reused buffer (valid until the next call, as a window's bytes are): a fresh
      // one per record would cost its first touch every time.
      if (this.big.length < loc.storedBytes)
        this.big = Buffer.allocUnsafe(Math.max(loc.storedBytes, 2 * HEADROOM));
      return p.r.read(loc.offset, loc.storedBytes, this.big);
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
    // Not in the window: read one at the record. A reader going on through the pack (the
    // record starts in the window or right after it) gets a whole window and the next one read
    // ahead; one that jumps (a lazy restore's first faults, scattered eager pages) only a
    // little, and nothing ahead, so that a jump costs no 8 MiB of reading.
    const onward = p.cur.len > 0 && loc.offset >= p.cur.start && loc.offset <= p.cur.start + p.cur.len;
    const len = Math.min(onward ? WINDOW_BYTES : JUMP_BYTES, p.r.sizeBytes - loc.offset);
    if (len < loc.storedBytes) throw this.corrupt(loc.pack, 'is truncated');
    await p.r.read(loc.offset, len, p.cur.buf.subarray(HEADROOM));
    p.cur = { buf: p.cur.buf, base: HEADROOM, start: loc.offset, len };
    if (onward) this.startPrefetch(p);
    return p.cur.buf.subarray(HEADROOM, HEADROOM + loc.storedBytes);
  }

  async close(): Promise<void> {
    const all = [...this.open.values()];
    this.open.clear();
    for (const p of all) await p.prefetch?.catch(() => undefined);
    await Promise.all(all.map((p) => p.r.close()));
  }
}

/**
 * Decrypts and decompresses the record that holds a chunk into `out` (room for the whole
 * record: `recordRawBytes(loc)`; the chunk is at `at + loc.inner`); throws VAULT_CORRUPT
 * naming the chunk.
 */
export class ChunkDecoder {
  private readonly dctx = new zstd.DCtx();
  constructor(private readonly keys: TenantKeys) {}

  decode(id: Buffer, loc: ChunkLocation, record: Buffer, out: Buffer, at: number, what: string): void {
    const why = decodeRecord(
      this.keys.dataKey,
      this.dctx,
      recordAad(loc, id),
      record,
      out,
      at,
      recordRawBytes(loc),
    );
    if (why === undefined) return;
    throw new DormantError(
      ErrorCode.VAULT_CORRUPT,
      `${what}: chunk ${id.toString('hex').slice(0, 16)} in pack ${loc.pack} ${why}`,
      {
        details: { object: `pack ${loc.pack}`, chunk: id.toString('hex') },
        hint: 'run `dormant vault verify` to list every damaged object',
      },
    );
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
  /** Workers that decode and write the batches; without one the calling thread does. */
  pool?: SealPool;
  /** Files (by path) not restored at all. */
  skip?: (path: string) => boolean;
}

function checkRelPath(p: string, what: string): void {
  if (p === '' || p.startsWith('/') || p.split('/').some((s) => s === '..' || s === '.' || s === '')) {
    throw new DormantError(ErrorCode.VAULT_CORRUPT, `${what}: manifest holds an unsafe path "${p}"`);
  }
}

/** Records one batch reads at most (and the output it decodes to), but never less than one record. */
const BATCH_IN_BYTES = 2 * 1024 * 1024;
const BATCH_OUT_BYTES = 2 * 1024 * 1024;
/** Pack readers kept open at once; past this, in-flight batches finish and all are closed. */
const MAX_OPEN_PACKS = 64;
/** Packs a restore asks the store to fetch ahead of the one it opens (S3: 32 MiB each). */
const PREFETCH_PACKS = 2;
/** Restored files kept open at once (many small files); past this, in-flight batches finish. */
const MAX_OPEN_FILES = 256;

/** A restored file while batches still write into it. */
interface RestoredFile {
  h: FileHandle;
  path: string;
  entry: ManifestEntry;
  /** Batches dispatched that write into it and have not finished. */
  pending: number;
  /** All of its references are in batches. */
  queued: boolean;
  closed: boolean;
}

/**
 * What a batch holds: record bytes read back to back into `input` (one read per run of records
 * that lie back to back in a pack), where each record decodes to in the output, and where the
 * output goes in the restored files.
 */
interface Batch {
  input: Buffer;
  inLen: number;
  outCap: number;
  outLen: number;
  /** Per record: input offset, stored length, raw length, output offset, aad offset, aad length. */
  recs: number[];
  /** Per record: its associated data (the ids of its chunks). */
  aads: Uint8Array[];
  aadLen: number;
  /** Per record: the chunk it was read for, and its location (for messages). */
  locs: ChunkLocation[];
  keys: string[];
  /** Records decoded in this batch: output offset by `pack/offset`. */
  seen: Map<string, number>;
  copies: number[];
  /** Runs of output that go to one place in one file: file position, output offset, length. */
  writes: number[];
  writeFiles: RestoredFile[];
  files: Set<RestoredFile>;
  reads: Promise<unknown>[];
  run: { pack: string; r: StoreReader; start: number; end: number; at: number } | undefined;
  /** Logical bytes the batch restores. */
  bytes: number;
}

/**
 * Restores `body` into `destDir` (created if missing; must be empty). Returns bytes written.
 *
 * The references are cut into batches of up to 2 MiB of records (and of output). The calling thread reads each
 * batch's records (several batches ahead, one read per run of records back to back in a pack)
 * and hands them to the decode workers of `ctx.pool`, which open (AES-GCM, chunk id as
 * associated data) and decompress every record of the batch into an output buffer; a chunk that
 * appears again in a batch is decoded once and copied. Only a batch whose every record
 * authenticated is written, by one writer at a time, with positional writes. Holes are never
 * written: trailing ones come from truncate. Without a pool the calling thread decodes.
 */
/** The packs a restore of `body` reads, in the order it first needs each (pack -> position). */
function packOrder(body: ManifestBody, ctx: RestoreContext): Map<string, number> {
  const order = new Map<string, number>();
  for (const e of body.entries) {
    if (e.type !== 'file' || ctx.skip?.(e.path) === true) continue;
    for (let i = e.firstRef; i < e.firstRef + e.refCount; i++) {
      const at = i * REF_BYTES;
      if (body.refs[at] === REF_HOLE) continue;
      const loc = ctx.lookup(body.refs.toString('hex', at + 5, at + 5 + CHUNK_ID_BYTES));
      if (loc !== undefined && !order.has(loc.pack)) order.set(loc.pack, order.size);
    }
  }
  return order;
}

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
  const pool = ctx.pool;
  const maxInFlight = pool ? 2 * pool.size + 2 : 3;
  const corrupt = (message: string, object: string, extra: Record<string, string> = {}): DormantError =>
    new DormantError(ErrorCode.VAULT_CORRUPT, `${what}: ${message}`, {
      details: { object, ...extra },
      hint: 'run `dormant vault verify` to list every damaged object',
    });
  const aborted = (): DormantError =>
    new DormantError(ErrorCode.COMMAND_ABORTED, `restore of ${what} aborted`, { cause: ctx.signal?.reason });

  // Input buffers, reused batch after batch (each has an ArrayBuffer of its own: it moves).
  const freeInputs: Buffer[] = [];
  const takeInput = (bytes: number): Buffer =>
    bytes === BATCH_IN_BYTES
      ? (freeInputs.pop() ?? pool?.take(bytes) ?? Buffer.from(new ArrayBuffer(bytes)))
      : Buffer.from(new ArrayBuffer(bytes));
  const giveInput = (b: Buffer): void => {
    if (b.length === BATCH_IN_BYTES) freeInputs.push(b);
  };
  // Output buffers, reused the same way; they hold plaintext, so they are wiped at the end.
  const freeOutputs: Buffer[] = [];
  const takeOutput = (bytes: number): Buffer =>
    bytes <= BATCH_OUT_BYTES
      ? (freeOutputs.pop() ?? pool?.take(BATCH_OUT_BYTES) ?? Buffer.from(new ArrayBuffer(BATCH_OUT_BYTES)))
      : Buffer.from(new ArrayBuffer(bytes));
  const giveOutput = (b: Buffer): void => {
    if (b.length === BATCH_OUT_BYTES) freeOutputs.push(b);
    else b.fill(0);
  };
  let localDctx: InstanceType<ZstdBinding['DCtx']> | undefined;
  // One writer: writes into one tmpfs file from several threads at once are slower, not faster.
  let writing: Promise<void> = Promise.resolve();
  const writeOut = async (out: Buffer, b: Batch): Promise<void> => {
    const w = b.writes;
    for (let i = 0; i < w.length; i += 3) {
      const h = b.writeFiles[i / 3]!.h;
      const pos = w[i]!;
      const from = w[i + 1]!;
      const len = w[i + 2]!;
      let done = 0;
      while (done < len) done += (await h.write(out, from + done, len - done, pos + done)).bytesWritten;
    }
  };
  const localKey = pool ? undefined : createSecretKey(ctx.keys.dataKey);

  const readers = new Map<string, StoreReader>();
  // Packs in the order the restore first needs them, for a store that fetches from afar (S3):
  // while one pack is decoded, the next ones are on their way.
  const order = ctx.store.prefetch ? packOrder(body, ctx) : undefined;
  const packs = order ? [...order.keys()] : [];
  const openPack = async (pack: string): Promise<StoreReader> => {
    const i = order?.get(pack);
    if (i !== undefined) {
      for (const next of packs.slice(i + 1, i + 1 + PREFETCH_PACKS))
        ctx.store.prefetch?.(`data/${ctx.tenant}/packs/${next}.pack`);
    }
    const r = await ctx.store.openReader(`data/${ctx.tenant}/packs/${pack}.pack`);
    // The header is not covered by any record's tag: check it here so that no byte of a pack
    // goes unchecked by restore.
    const head = r.sizeBytes >= PACK_HEADER_BYTES ? await r.read(0, PACK_HEADER_BYTES) : Buffer.alloc(0);
    if (!head.equals(packHeader(pack))) {
      await r.close();
      throw corrupt(`pack ${pack} has a damaged header`, `pack ${pack}`);
    }
    return r;
  };
  const closeReaders = async (): Promise<void> => {
    const all = [...readers.values()];
    readers.clear();
    await Promise.allSettled(all.map((r) => r.close()));
  };

  const files: RestoredFile[] = [];
  let openFiles = 0;
  const finishing: Promise<void>[] = [];
  let restored = 0;
  let failure: Error | undefined;
  const fail = (e: unknown): void => {
    failure ??= e instanceof Error ? e : new Error(String(e));
  };
  // A function, not an inline check: batches set `failure` while this thread awaits.
  const rethrow = (): void => {
    if (failure !== undefined) throw failure;
  };
  const inFlight = new Set<Promise<void>>();

  const finishFile = (f: RestoredFile): void => {
    if (!f.queued || f.pending > 0 || f.closed || failure !== undefined) return;
    f.closed = true;
    const done = (async () => {
      try {
        // Trailing holes: the size comes from truncate, the bytes are never written.
        await f.h.truncate(f.entry.sizeBytes);
      } finally {
        await f.h.close();
        openFiles--;
      }
      await chmod(f.path, f.entry.mode);
      await utimes(f.path, f.entry.mtimeMs / 1000, f.entry.mtimeMs / 1000);
      ctx.onProgress?.(restored);
    })();
    done.catch((e: unknown) => {
      fail(e);
    });
    finishing.push(done);
  };

  const runBatch = async (b: Batch): Promise<void> => {
    await Promise.all(b.reads);
    const aad = new Uint8Array(b.aadLen);
    let aadAt = 0;
    for (const a of b.aads) {
      aad.set(a, aadAt);
      aadAt += a.length;
    }
    const recs = Int32Array.from(b.recs);
    const copies = Int32Array.from(b.copies);
    let out = takeOutput(b.outLen);
    let bad: { rec: number; why: string } | undefined;
    if (pool) {
      // The key is copied into the message (the worker wipes its copy after the batch).
      const r = await pool.decode(b.input, out, { key: ctx.keys.dataKey, recs, aad, copies });
      out = r.output;
      giveInput(r.input);
      if (r.done.error !== undefined) {
        giveOutput(out);
        throw new Error(`restoring ${what}: ${r.done.error}`);
      }
      if (r.done.badRecord !== undefined) bad = { rec: r.done.badRecord, why: r.done.why ?? 'is damaged' };
    } else {
      localDctx ??= new zstd.DCtx();
      bad = decodeRecords(localKey!, localDctx, b.input, recs, aad, copies, out);
      giveInput(b.input);
    }
    try {
      if (bad !== undefined) {
        const loc = b.locs[bad.rec]!;
        const key = b.keys[bad.rec]!;
        throw corrupt(`chunk ${key.slice(0, 16)} in pack ${loc.pack} ${bad.why}`, `pack ${loc.pack}`, {
          chunk: key,
        });
      }
      // Every record of the batch is authenticated: its bytes may go out now.
      const w = writing.then(() => (failure === undefined ? writeOut(out, b) : undefined));
      writing = w.catch(() => undefined);
      await w;
    } finally {
      giveOutput(out);
    }
    restored += b.bytes;
    for (const f of b.files) {
      f.pending--;
      finishFile(f);
    }
  };

  let batch: Batch | undefined;
  const newBatch = (inBytes: number, outBytes: number): Batch => ({
    input: takeInput(Math.max(BATCH_IN_BYTES, inBytes)),
    inLen: 0,
    outCap: Math.max(BATCH_OUT_BYTES, outBytes),
    outLen: 0,
    recs: [],
    aads: [],
    aadLen: 0,
    locs: [],
    keys: [],
    seen: new Map(),
    copies: [],
    writes: [],
    writeFiles: [],
    files: new Set(),
    reads: [],
    run: undefined,
    bytes: 0,
  });
  const endRun = (b: Batch): void => {
    const run = b.run;
    if (run === undefined) return;
    b.run = undefined;
    const read = run.r.read(run.start, run.end - run.start, b.input.subarray(run.at)).catch((e: unknown) => {
      if (e instanceof DormantError && e.code === ErrorCode.VAULT_CORRUPT)
        throw corrupt(`pack ${run.pack} is truncated`, `pack ${run.pack}`);
      throw e;
    });
    read.catch(() => undefined);
    b.reads.push(read);
  };
  const settle = async (): Promise<void> => {
    await Promise.allSettled([...inFlight]);
  };
  const dispatch = async (): Promise<void> => {
    const b = batch;
    batch = undefined;
    if (b === undefined || (b.recs.length === 0 && b.copies.length === 0)) {
      if (b) giveInput(b.input);
      return;
    }
    endRun(b);
    const p: Promise<void> = runBatch(b).then(
      () => {
        inFlight.delete(p);
      },
      (e: unknown) => {
        inFlight.delete(p);
        fail(e);
      },
    );
    inFlight.add(p);
    while (inFlight.size >= maxInFlight) await Promise.race(inFlight);
    rethrow();
    if (ctx.signal?.aborted) throw aborted();
  };

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
      if (ctx.skip?.(e.path) === true) continue;
      if (openFiles >= MAX_OPEN_FILES) {
        await dispatch();
        await settle();
        await Promise.allSettled(finishing);
        rethrow();
      }
      openFiles++;
      const f: RestoredFile = {
        h: await open(p, 'wx', 0o600).catch((err: unknown) => {
          openFiles--;
          throw err;
        }),
        path: p,
        entry: e,
        pending: 0,
        queued: false,
        closed: false,
      };
      files.push(f);
      let fileAt = 0;
      for (let i = e.firstRef; i < e.firstRef + e.refCount; i++) {
        const at = i * REF_BYTES;
        const len = body.refs.readUInt32LE(at + 1);
        if (body.refs[at] === REF_HOLE) {
          fileAt += len;
          continue;
        }
        const key = body.refs.toString('hex', at + 5, at + 5 + CHUNK_ID_BYTES);
        const loc = ctx.lookup(key);
        if (loc === undefined) {
          throw corrupt(
            `chunk ${key.slice(0, 16)} of ${e.path} is missing from the vault${ctx.explainMissing()}`,
            `chunk ${key}`,
          );
        }
        if (loc.rawBytes !== len) {
          throw new DormantError(
            ErrorCode.VAULT_CORRUPT,
            `${what}: chunk ${key.slice(0, 16)} has the wrong length in its index`,
          );
        }
        let r = readers.get(loc.pack);
        if (r === undefined) {
          if (readers.size >= MAX_OPEN_PACKS) {
            // Close them all once every read of theirs is done: the open batch goes first.
            await dispatch();
            await settle();
            rethrow();
            await closeReaders();
          }
          r = await openPack(loc.pack);
          readers.set(loc.pack, r);
        }
        if (loc.offset + loc.storedBytes > r.sizeBytes)
          throw corrupt(`pack ${loc.pack} is truncated`, `pack ${loc.pack}`);
        const recRaw = recordRawBytes(loc);
        const recKey = `${loc.pack}/${loc.offset}`;
        let b = batch;
        // Where the chunk's bytes already are in this batch's output, if its record is decoded.
        const recAt = b?.seen.get(recKey);
        const src = recAt === undefined ? -1 : recAt + loc.inner;
        const w0 = b?.writes;
        const l0 = w0 === undefined ? -1 : w0.length - 3;
        // Right after the last write, in the file and in the output: nothing to decode or copy.
        const inPlace =
          src >= 0 &&
          l0 >= 0 &&
          b!.writeFiles[l0 / 3] === f &&
          w0![l0]! + w0![l0 + 2]! === fileAt &&
          w0![l0 + 1]! + w0![l0 + 2]! === src;
        const fits =
          b !== undefined &&
          (inPlace ||
            (src >= 0
              ? b.outLen + len <= b.outCap
              : b.outLen + recRaw <= b.outCap && b.inLen + loc.storedBytes <= b.input.length));
        if (!fits) {
          await dispatch();
          b = batch = newBatch(loc.storedBytes, recRaw);
        }
        b = b!;
        let outAt: number;
        if (inPlace && fits) {
          outAt = src;
        } else if (src >= 0 && fits) {
          // Decoded earlier in the batch: copied after the decode, so that writes stay long.
          outAt = b.outLen;
          b.copies.push(src, outAt, len);
          b.outLen += len;
        } else {
          const run = b.run;
          if (run !== undefined && run.pack === loc.pack && run.end === loc.offset) {
            run.end += loc.storedBytes;
          } else {
            endRun(b);
            b.run = { pack: loc.pack, r, start: loc.offset, end: loc.offset + loc.storedBytes, at: b.inLen };
          }
          const aad = recordAad(loc, body.refs.subarray(at + 5, at + 5 + CHUNK_ID_BYTES));
          b.recs.push(b.inLen, loc.storedBytes, recRaw, b.outLen, b.aadLen, aad.length);
          b.aads.push(aad);
          b.aadLen += aad.length;
          b.locs.push(loc);
          b.keys.push(key);
          b.seen.set(recKey, b.outLen);
          b.inLen += loc.storedBytes;
          outAt = b.outLen + loc.inner;
          b.outLen += recRaw;
        }
        b.bytes += len;
        // Extend the last write when this chunk continues it in the file and in the output.
        const w = b.writes;
        const last = w.length - 3;
        if (
          last >= 0 &&
          b.writeFiles[last / 3] === f &&
          w[last]! + w[last + 2]! === fileAt &&
          w[last + 1]! + w[last + 2]! === outAt
        ) {
          w[last + 2]! += len;
        } else {
          w.push(fileAt, outAt, len);
          b.writeFiles.push(f);
        }
        if (!b.files.has(f)) {
          b.files.add(f);
          f.pending++;
        }
        fileAt += len;
      }
      if (fileAt !== e.sizeBytes) {
        throw new DormantError(
          ErrorCode.VAULT_CORRUPT,
          `${what}: ${e.path} restores to ${fileAt} bytes, manifest says ${e.sizeBytes}`,
        );
      }
      f.queued = true;
      finishFile(f);
      if (ctx.signal?.aborted) throw aborted();
    }
    await dispatch();
    await settle();
    rethrow();
    await Promise.all(finishing);
    rethrow();
    // Folder modes last (a read-only folder would refuse its own files), deepest first.
    for (const e of [...body.entries].reverse()) {
      if (e.type !== 'dir') continue;
      const p = join(destDir, ...e.path.split('/'));
      await chmod(p, e.mode);
      await utimes(p, e.mtimeMs / 1000, e.mtimeMs / 1000);
    }
  } catch (err) {
    fail(err);
    if (batch) endRun(batch);
    await Promise.allSettled(batch?.reads ?? []);
    await settle();
    await Promise.allSettled(finishing);
    await Promise.allSettled(files.filter((f) => !f.closed).map((f) => f.h.close()));
    await removeRestored(destDir, createdRoot);
    throw err;
  } finally {
    await closeReaders();
    for (const b of freeOutputs) b.fill(0);
    if (pool) for (const b of [...freeInputs, ...freeOutputs]) pool.give(b);
  }
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
