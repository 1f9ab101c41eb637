/**
 * Streaming ingest: walks a folder, splits each file into chunks and holes, and writes the new
 * chunks (compressed, then sealed) into pack files. Memory use is bounded by the read buffers
 * and the pack write queue, whatever the size of the checkpoint.
 */
import { open, readdir, lstat, readlink, type FileHandle } from 'node:fs/promises';
import { createRequire } from 'node:module';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';
import { PAGE_BYTES, splitPieces, type Chunker } from './chunker.js';
import { CHUNK_ID_BYTES, chunkId, type TenantKeys } from './crypto.js';
import {
  PACK_HEADER_BYTES,
  REF_BYTES,
  REF_DATA,
  REF_HOLE,
  encodeIndex,
  indexEntry,
  packHeader,
  type ChunkLocation,
  type ManifestEntry,
  type RecordGroup,
} from './format.js';
import { RECORD_OVERHEAD_BYTES, type SealItem, type SealPool } from './seal-pool.js';
import { sealChunks } from './seal-worker.js';
import type { StoreWriter, VaultStore } from './store.js';

type ZstdBinding = typeof import('zstd-napi/binding.js');
const zstd = createRequire(import.meta.url)('zstd-napi/binding.js') as ZstdBinding;

export type { ChunkLocation } from './format.js';

/** One chunk of a record being added to a pack, in the record's order. */
export interface RecordChunk {
  key: string;
  id: Buffer;
  rawBytes: number;
}

/** Packs roll over at this size: one fdatasync per pack keeps sync cost at ~400 MB/s (measured on this project's machines). */
export const PACK_TARGET_BYTES = 32 * 1024 * 1024;
const READ_BYTES = 4 * 1024 * 1024;
/** How long a read that caught up with a file still being written waits before the next. */
const FOLLOW_POLL_MS = 2;
const WRITE_BATCH_BYTES = 2 * 1024 * 1024;
const MAX_QUEUED_BYTES = 16 * 1024 * 1024;

/**
 * Test-only crash points: with DORMANT_VAULT_TEST_KILL_AT=<step> the process kills itself
 * (SIGKILL, no cleanup) when it reaches that step, which is what a power cut or OOM kill does.
 */
export function crashPoint(step: string): void {
  if (process.env.DORMANT_VAULT_TEST_KILL_AT === step) process.kill(process.pid, 'SIGKILL');
}

interface OpenPack {
  id: string;
  entries: Buffer[];
  queue: Uint8Array[];
  queuedBytes: number;
  /** Run once the queued parts are written (they may point into buffers to be reused). */
  releases: (() => void)[];
  offset: number;
  writer: StoreWriter | undefined;
  /** Writes of this pack, in order. */
  tail: Promise<void>;
  full: boolean;
}

/**
 * Appends records to packs and commits each full pack: its data, then its index, each synced.
 * `add` is synchronous (records may arrive from worker threads at any time); `pump` moves
 * queued bytes to the store and applies backpressure.
 */
export class PackWriter {
  private current: OpenPack | undefined;
  private readonly open: OpenPack[] = [];
  private inFlightBytes = 0;
  private readonly commits: Promise<void>[] = [];
  private failed: Error | undefined;
  /** Chunks added to a pack that is not yet committed; dropped again on failure. */
  readonly pending = new Map<string, ChunkLocation>();
  storedBytes = 0;
  packsWritten = 0;

  constructor(
    private readonly store: VaultStore,
    private readonly tenant: string,
    private readonly keys: TenantKeys,
    private readonly onCommitted: (packId: string, entries: Map<string, ChunkLocation>) => void,
    private readonly targetBytes = PACK_TARGET_BYTES,
  ) {}

  private currentPack(): OpenPack {
    let p = this.current;
    if (p === undefined) {
      const packId = randomBytes(16).toString('hex');
      const h = packHeader(packId);
      p = {
        id: packId,
        entries: [],
        queue: [h],
        queuedBytes: h.length,
        releases: [],
        offset: PACK_HEADER_BYTES,
        writer: undefined,
        tail: Promise.resolve(),
        full: false,
      };
      this.current = p;
      this.open.push(p);
    }
    return p;
  }

  private placed(p: OpenPack, chunks: readonly RecordChunk[], recordBytes: number): void {
    let inner = 0;
    let group: RecordGroup | undefined;
    if (chunks.length > 1) {
      let raw = 0;
      for (const c of chunks) raw += c.rawBytes;
      group = { rawBytes: raw, aad: Buffer.concat(chunks.map((c) => c.id)), chunks: chunks.length };
    }
    for (const c of chunks) {
      p.entries.push(indexEntry(c.id, p.offset, recordBytes, c.rawBytes, inner));
      this.pending.set(c.key, {
        pack: p.id,
        offset: p.offset,
        storedBytes: recordBytes,
        rawBytes: c.rawBytes,
        inner,
        ...(group ? { group } : {}),
      });
      inner += c.rawBytes;
    }
    p.offset += recordBytes;
    this.storedBytes += recordBytes;
    if (p.offset >= this.targetBytes) {
      p.full = true;
      this.current = undefined;
    }
  }

  /** Adds one sealed record (holding `chunks`, in order) to the current pack, starting one if needed. */
  add(chunks: readonly RecordChunk[], record: readonly Uint8Array[], recordBytes: number): void {
    const p = this.currentPack();
    for (const part of record) p.queue.push(part);
    p.queuedBytes += recordBytes;
    this.placed(p, chunks, recordBytes);
  }

  /**
   * Adds records that lie back to back in `buf` (`lengths[r]` bytes each, holding the next
   * `counts[r]` of `items`), writing them straight from `buf`. `release` runs once every byte
   * of `buf` is written (or the writer has failed), after which the caller may reuse it.
   */
  addRecords(
    buf: Buffer,
    items: readonly { key: string; id: Buffer; start: number; end: number }[],
    lengths: Int32Array,
    counts: Int32Array,
    release: () => void,
  ): void {
    let at = 0;
    let pieces = 0;
    let left = 0;
    const once = (): void => {
      if (--left === 0) release();
    };
    const parts: [OpenPack, number, number][] = [];
    let item = 0;
    for (let r = 0; r < lengths.length;) {
      const p = this.currentPack();
      const from = at;
      // Records go to this pack until it is full; the rest start the next one.
      while (r < lengths.length && !p.full) {
        const chunks: RecordChunk[] = [];
        for (let k = 0; k < counts[r]!; k++, item++) {
          const it = items[item]!;
          chunks.push({ key: it.key, id: it.id, rawBytes: it.end - it.start });
        }
        this.placed(p, chunks, lengths[r]!);
        at += lengths[r]!;
        r++;
      }
      parts.push([p, from, at]);
      pieces++;
    }
    left = pieces;
    for (const [p, from, to] of parts) {
      p.queue.push(buf.subarray(from, to));
      p.queuedBytes += to - from;
      p.releases.push(once);
    }
    if (pieces === 0) release();
  }

  private fail(e: unknown): void {
    this.failed ??= e instanceof Error ? e : new Error(String(e));
  }

  private throwIfFailed(): void {
    if (this.failed !== undefined) throw this.failed;
  }

  private flushQueue(p: OpenPack): void {
    if (p.queuedBytes === 0) return;
    const parts = p.queue;
    const n = p.queuedBytes;
    const releases = p.releases;
    p.queue = [];
    p.queuedBytes = 0;
    p.releases = [];
    this.inFlightBytes += n;
    p.tail = p.tail
      .then(async () => {
        p.writer ??= await this.store.create(`data/${this.tenant}/packs/${p.id}.pack`, this.targetBytes);
        await p.writer.write(parts);
        this.inFlightBytes -= n;
        crashPoint('pack-data-written');
      })
      .finally(() => {
        for (const r of releases) r();
      });
    p.tail.catch((e: unknown) => this.fail(e));
  }

  private commit(p: OpenPack): void {
    const written = p.tail;
    // The pack commits in the background while the next one fills; the manifest waits for all.
    const commit = (async () => {
      try {
        await written;
        await p.writer!.commit();
      } catch (e) {
        await p.writer?.abort();
        throw e;
      }
      crashPoint('pack-committed');
      await this.store.write(
        `data/${this.tenant}/index/${p.id}.idx`,
        encodeIndex(this.keys.indexKey, this.tenant, p.id, p.entries),
      );
      crashPoint('index-committed');
      const done = new Map<string, ChunkLocation>();
      for (const [k, loc] of this.pending) {
        if (loc.pack === p.id) {
          done.set(k, loc);
          this.pending.delete(k);
        }
      }
      this.packsWritten++;
      this.onCommitted(p.id, done);
    })();
    commit.catch((e: unknown) => this.fail(e));
    this.commits.push(commit);
  }

  /** Hands queued bytes to the store and commits full packs; waits when too much is in flight. */
  async pump(final = false): Promise<void> {
    this.throwIfFailed();
    if (final) this.current = undefined;
    for (const p of [...this.open]) {
      const closing = p.full || final;
      if (closing || p.queuedBytes >= WRITE_BATCH_BYTES) this.flushQueue(p);
      if (closing) {
        this.open.splice(this.open.indexOf(p), 1);
        this.commit(p);
      }
    }
    if (this.inFlightBytes > MAX_QUEUED_BYTES) {
      await Promise.all(this.open.map((p) => p.tail.catch(() => undefined)));
      await Promise.all(this.commits.map((c) => c.catch(() => undefined)));
    }
    this.throwIfFailed();
  }

  /** Commits the last pack and waits until every pack and index is durable. */
  async finish(): Promise<void> {
    await this.pump(true);
    await Promise.allSettled(this.commits);
    this.throwIfFailed();
  }

  async abort(): Promise<void> {
    this.current = undefined;
    const open = this.open.splice(0);
    for (const p of open) {
      await p.tail.catch(() => undefined);
      await p.writer?.abort();
    }
    await Promise.allSettled(this.commits);
    this.pending.clear();
  }
}

/** Counters the ingest reports through `onProgress` and in its result. */
export interface IngestCounters {
  filesDone: number;
  /** Bytes read from the source folder. */
  logicalBytes: number;
  /** Bytes that were runs of zero pages (stored as holes). */
  holeBytes: number;
  /** Bytes of chunks not already in the vault. */
  newBytes: number;
  /** Bytes written to packs (after compression and sealing). */
  storedBytes: number;
  chunks: number;
  newChunks: number;
}

/** Growable buffer of manifest references. */
class RefList {
  buf = Buffer.alloc(REF_BYTES * 1024);
  count = 0;
  private lastHole = false;
  private grow(): void {
    if ((this.count + 1) * REF_BYTES <= this.buf.length) return;
    const b = Buffer.alloc(this.buf.length * 2);
    this.buf.copy(b);
    this.buf = b;
  }
  data(id: Buffer, length: number): void {
    this.grow();
    const at = this.count * REF_BYTES;
    this.buf[at] = REF_DATA;
    this.buf.writeUInt32LE(length, at + 1);
    id.copy(this.buf, at + 5);
    this.count++;
    this.lastHole = false;
  }
  hole(length: number): void {
    // Adjacent zero runs (split by a read boundary) merge into one hole reference.
    if (this.lastHole) {
      const at = (this.count - 1) * REF_BYTES;
      const prev = this.buf.readUInt32LE(at + 1);
      if (prev + length <= 0xffff_0000) {
        this.buf.writeUInt32LE(prev + length, at + 1);
        return;
      }
    }
    this.grow();
    const at = this.count * REF_BYTES;
    this.buf.fill(0, at, at + REF_BYTES);
    this.buf[at] = REF_HOLE;
    this.buf.writeUInt32LE(length, at + 1);
    this.count++;
    this.lastHole = true;
  }
  endFile(): void {
    this.lastHole = false;
  }
  /** Appends every reference of `other` (one file's, as a file of its own). */
  append(other: RefList): void {
    const n = other.count * REF_BYTES;
    while ((this.count + other.count) * REF_BYTES > this.buf.length) {
      const b = Buffer.alloc(this.buf.length * 2);
      this.buf.copy(b);
      this.buf = b;
    }
    other.buf.copy(this.buf, this.count * REF_BYTES, 0, n);
    this.count += other.count;
    this.lastHole = false;
  }
  bytes(): Buffer {
    return this.buf.subarray(0, this.count * REF_BYTES);
  }
}

export interface IngestContext {
  chunker: Chunker;
  keys: TenantKeys;
  /** Looks a chunk up in the vault's index (committed packs). */
  known: (key: string) => boolean;
  packs: PackWriter;
  /** Worker threads for compression and sealing; without it, they run on this thread. */
  pool?: SealPool;
  /**
   * Files (by path in the folder) that hold whole memory pages back to back, chunked on page
   * boundaries only (CRIU's `pages-*.img`): far less hashing for the same deduplication.
   */
  pageAligned?: (path: string) => boolean;
  /**
   * The folder is still being written (a CRIU dump in progress) until this settles: page
   * images (see `pageAligned`) are read while they grow, the rest once it has resolved. When
   * it rejects, the ingest fails with its error and nothing is committed.
   */
  growing?: Promise<unknown>;
  signal?: AbortSignal;
  onProgress?: (c: Readonly<IngestCounters>) => void;
}

/** Seals a job's chunks on the calling thread (no workers): the same records workers make. */
class Sealer {
  private readonly cctx = new zstd.CCtx();

  constructor(private readonly dataKey: Buffer) {}

  /** Seals `items` (chunks in `buf`) into a new buffer of records; see `sealChunks`. */
  seal(buf: Buffer, items: readonly SealItem[]): { output: Buffer; lengths: Int32Array; counts: Int32Array } {
    const meta = new Int32Array(items.length * 2);
    const ids = new Uint8Array(items.length * CHUNK_ID_BYTES);
    let bytes = 0;
    for (const [i, it] of items.entries()) {
      meta[i * 2] = it.start;
      meta[i * 2 + 1] = it.end - it.start;
      ids.set(it.id, i * CHUNK_ID_BYTES);
      bytes += it.end - it.start + RECORD_OVERHEAD_BYTES;
    }
    // A buffer of its own each time: the pack writer writes from it later.
    const output = Buffer.allocUnsafe(bytes);
    return { output, ...sealChunks(this.cctx, this.dataKey, buf, meta, ids, output) };
  }
}

/**
 * Ingests `srcDir` and returns its manifest entries and references. Chunks are written to
 * packs as they are found; nothing is visible to readers until the caller commits a manifest.
 */
export async function ingestFolder(
  srcDir: string,
  ctx: IngestContext,
): Promise<{ entries: ManifestEntry[]; refs: Buffer; counters: IngestCounters }> {
  const counters: IngestCounters = {
    filesDone: 0,
    logicalBytes: 0,
    holeBytes: 0,
    newBytes: 0,
    storedBytes: 0,
    chunks: 0,
    newChunks: 0,
  };
  const refs = new RefList();
  const entries: ManifestEntry[] = [];
  const pool = ctx.pool;
  const sealer = pool ? undefined : new Sealer(ctx.keys.dataKey);
  const seenHere = new Set<string>();
  // Each read lands at HEAD in a buffer, and the unconsumed tail of the previous buffer (less
  // than a chunk plus two pages) is copied in front of it, so a buffer's bytes are contiguous
  // and the buffer itself can move to a worker with the offsets of its new chunks.
  const HEAD = ctx.chunker.params.maxBytes + 2 * PAGE_BYTES;
  const BUF_BYTES = HEAD + READ_BYTES;
  // Chunks are at least a page long, or the chunker's minimum, except next to a file's ends.
  const maxChunks = Math.ceil(BUF_BYTES / Math.min(PAGE_BYTES, ctx.chunker.params.minBytes)) + 2;
  const OUT_BYTES = BUF_BYTES + RECORD_OVERHEAD_BYTES * maxChunks;
  const maxJobs = pool ? 2 * pool.size + 1 : 0;
  // Without workers, two buffers alternate: one is read into while the other is chunked.
  const spare: Buffer[] = pool ? [] : [Buffer.allocUnsafe(BUF_BYTES), Buffer.allocUnsafe(BUF_BYTES)];
  let jobsInFlight = 0;
  let jobError: Error | undefined;
  const jobWaiters: (() => void)[] = [];
  const jobDone = async (): Promise<void> => new Promise<void>((resolve) => jobWaiters.push(resolve));

  const takeBuffer = async (): Promise<Buffer> => {
    if (!pool) return spare.pop()!;
    while (jobsInFlight >= maxJobs) await jobDone();
    if (jobError) throw jobError;
    return pool.take(BUF_BYTES);
  };
  const giveBuffer = (b: Buffer): void => {
    if (pool) pool.give(b);
    else spare.push(b);
  };
  const drainJobs = async (): Promise<void> => {
    while (jobsInFlight > 0) await jobDone();
  };
  const submit = (p: SealPool, input: Buffer, items: SealItem[]): void => {
    const output = p.take(OUT_BYTES);
    jobsInFlight++;
    p.seal(ctx.keys.dataKey, input, items, output)
      .then(
        (r) => {
          p.give(r.input);
          for (const n of r.lengths) counters.storedBytes += n;
          ctx.packs.addRecords(r.output, items, r.lengths, r.counts, () => p.give(r.output));
        },
        (e: unknown) => {
          jobError ??= e instanceof Error ? e : new Error(String(e));
        },
      )
      .finally(() => {
        jobsInFlight--;
        jobWaiters.shift()?.();
      });
  };

  // splitPieces reports pieces synchronously; they are handled after it returns, in order.
  let pieces: number[] = []; // start, end pairs; a hole is (-1, length)
  const sink = {
    data(start: number, end: number): void {
      pieces.push(start, end);
    },
    hole(length: number): void {
      pieces.push(-1, length);
    },
  };
  /** Records the pieces found in `buf` into `refs`; returns the chunks new to the vault. */
  const handlePieces = (buf: Buffer, refs: RefList): SealItem[] => {
    const list = pieces;
    pieces = [];
    const items: SealItem[] = [];
    for (let i = 0; i < list.length; i += 2) {
      const start = list[i]!;
      const end = list[i + 1]!;
      if (start < 0) {
        counters.holeBytes += end;
        refs.hole(end);
        continue;
      }
      const chunk = buf.subarray(start, end);
      const id = chunkId(ctx.keys.idKeyObject, chunk);
      const key = id.toString('hex');
      counters.chunks++;
      refs.data(id, end - start);
      if (seenHere.has(key) || ctx.known(key) || ctx.packs.pending.has(key)) continue;
      seenHere.add(key);
      counters.newChunks++;
      counters.newBytes += end - start;
      items.push({ key, id, start, end });
    }
    if (sealer && items.length > 0) {
      const r = sealer.seal(buf, items);
      for (const n of r.lengths) counters.storedBytes += n;
      ctx.packs.addRecords(r.output, items, r.lengths, r.counts, () => undefined);
      return [];
    }
    return items;
  };

  // A file still being written is read as it grows: a read that finds no new bytes waits a
  // little and tries again, for as long as `follow` says the file may still grow. Only a read
  // that began after that may end the file, so no byte written before then is missed.
  let writerDone = ctx.growing === undefined;
  let writerError: Error | undefined;
  let writerSettled: Promise<void> = Promise.resolve();
  if (ctx.growing !== undefined) {
    writerSettled = ctx.growing.then(
      () => {
        writerDone = true;
      },
      (e: unknown) => {
        writerDone = true;
        writerError = e instanceof Error ? e : new Error(`the checkpoint writer failed: ${String(e)}`);
      },
    );
  }
  const nap = (): Promise<void> =>
    Promise.race([writerSettled, new Promise<void>((r) => setTimeout(r, FOLLOW_POLL_MS))]);
  const readFrom = async (h: FileHandle, buf: Buffer, follow?: () => Promise<boolean>): Promise<number> => {
    let more = follow !== undefined && !writerDone;
    for (;;) {
      const { bytesRead } = await h.read(buf, HEAD, READ_BYTES, null);
      if (bytesRead > 0 || !more) return bytesRead;
      if (ctx.signal?.aborted) return 0;
      await nap();
      more = await follow!();
    }
  };

  const ingestFile = async (
    h: FileHandle,
    pageAligned: boolean,
    refs: RefList,
    follow?: () => Promise<boolean>,
  ): Promise<number> => {
    let carry = 0;
    let streamAt = 0; // stream offset of the first carried byte
    let total = 0;
    let cur = await takeBuffer();
    let reading = readFrom(h, cur, follow);
    for (;;) {
      const bytesRead = await reading;
      const eof = bytesRead === 0;
      let next: Buffer | undefined;
      if (!eof) {
        next = await takeBuffer();
        reading = readFrom(h, next, follow);
      }
      const from = HEAD - carry;
      const have = HEAD + bytesRead;
      total += bytesRead;
      const pos = splitPieces(ctx.chunker, cur, from, have, streamAt - from, eof, sink, pageAligned);
      const items = handlePieces(cur, refs);
      carry = have - pos;
      // The next read fills next[HEAD..]; the carried bytes go just in front of it.
      if (next) cur.copy(next, HEAD - carry, pos, have);
      streamAt += pos - from;
      if (pool && items.length > 0) submit(pool, cur, items);
      else giveBuffer(cur);
      await ctx.packs.pump();
      if (jobError) throw jobError;
      counters.logicalBytes += bytesRead;
      ctx.onProgress?.(counters);
      if (ctx.signal?.aborted) {
        if (!eof) await reading.catch(() => undefined);
        throw new DormantError(ErrorCode.COMMAND_ABORTED, `ingest of ${srcDir} aborted`, {
          cause: ctx.signal.reason,
        });
      }
      if (next === undefined) return total;
      cur = next;
    }
  };

  const walk = async (dir: string, rel: string): Promise<void> => {
    const names = (await readdir(dir)).sort();
    for (const name of names) {
      const p = join(dir, name);
      const r = rel === '' ? name : `${rel}/${name}`;
      const st = await lstat(p);
      const mode = st.mode & 0o7777;
      if (st.isDirectory()) {
        entries.push({
          path: r,
          type: 'dir',
          mode,
          sizeBytes: 0,
          mtimeMs: st.mtimeMs,
          firstRef: refs.count,
          refCount: 0,
        });
        await walk(p, r);
      } else if (st.isSymbolicLink()) {
        entries.push({
          path: r,
          type: 'symlink',
          mode,
          sizeBytes: 0,
          mtimeMs: st.mtimeMs,
          target: await readlink(p),
          firstRef: refs.count,
          refCount: 0,
        });
      } else if (st.isFile()) {
        const first = refs.count;
        const ahead = early.get(r);
        let size: number;
        if (ahead !== undefined && ahead.size === st.size) {
          // Read while it was written, and it has not changed since the writer finished.
          refs.append(ahead.refs);
          size = ahead.size;
        } else {
          if (ahead !== undefined) {
            // It grew after it was read to its end: read again (its chunks are known now).
            counters.logicalBytes -= ahead.logicalBytes;
            counters.holeBytes -= ahead.holeBytes;
            counters.chunks -= ahead.chunks;
          }
          const h = await open(p, 'r');
          try {
            size = await ingestFile(h, ctx.pageAligned?.(r) === true, refs);
          } finally {
            await h.close();
          }
        }
        refs.endFile();
        counters.filesDone++;
        entries.push({
          path: r,
          type: 'file',
          mode,
          sizeBytes: size,
          mtimeMs: st.mtimeMs,
          firstRef: first,
          refCount: refs.count - first,
        });
      } else {
        throw new DormantError(
          ErrorCode.INVALID_ARGUMENT,
          `${p}: only files, folders and symlinks can be stored in a checkpoint`,
        );
      }
    }
  };
  /** Page images read while the writer was still writing them, by path. */
  const early = new Map<
    string,
    { refs: RefList; size: number; logicalBytes: number; holeBytes: number; chunks: number }
  >();
  /** Page images at the top of the folder not read yet (CRIU writes them there). */
  const unreadImages = async (): Promise<string[]> => {
    try {
      return (await readdir(srcDir)).filter((n) => ctx.pageAligned?.(n) === true && !early.has(n)).sort();
    } catch (e) {
      if (errnoCode(e) !== 'ENOENT') throw e;
      return [];
    }
  };
  /**
   * While the writer runs, follows its page images one after another. CRIU writes one process's
   * pages, then the next one's: a file stops being followed once it has stopped growing and
   * another has appeared. Should it grow after all, the walk finds its size changed and reads
   * it again, so the heuristic costs time at worst, never bytes.
   */
  const followWriter = async (): Promise<void> => {
    while (!writerDone) {
      const name = (await unreadImages())[0];
      if (name === undefined) {
        await nap();
        continue;
      }
      const mayGrow = async (): Promise<boolean> =>
        !writerDone && !(await unreadImages()).some((n) => n !== name);
      const before = { ...counters };
      const fileRefs = new RefList();
      const h = await open(join(srcDir, name), 'r');
      let size: number;
      try {
        size = await ingestFile(h, true, fileRefs, mayGrow);
      } finally {
        await h.close();
      }
      early.set(name, {
        refs: fileRefs,
        size,
        logicalBytes: counters.logicalBytes - before.logicalBytes,
        holeBytes: counters.holeBytes - before.holeBytes,
        chunks: counters.chunks - before.chunks,
      });
    }
    if (writerError !== undefined) throw writerError;
  };
  try {
    if (ctx.growing !== undefined) await followWriter();
    const rootSt = await lstat(srcDir).catch((e: unknown) => {
      throw new DormantError(ErrorCode.INVALID_ARGUMENT, `cannot read checkpoint folder ${srcDir}`, {
        cause: e,
      });
    });
    if (!rootSt.isDirectory())
      throw new DormantError(ErrorCode.INVALID_ARGUMENT, `${srcDir} is not a folder`);
    await walk(srcDir, '');
  } finally {
    // Jobs still running hold buffers and add records; let them finish either way.
    await drainJobs();
  }
  if (jobError) throw jobError;
  return { entries, refs: Buffer.from(refs.bytes()), counters };
}
