/**
 * Streaming ingest: walks a folder, splits each file into chunks and holes, and writes the new
 * chunks (compressed, then sealed) into pack files. Memory use is bounded by the read buffers
 * and the pack write queue, whatever the size of the checkpoint.
 */
import { open, readdir, lstat, readlink, type FileHandle } from 'node:fs/promises';
import { createRequire } from 'node:module';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import { DormantError, ErrorCode } from '../domain/errors.js';
import { PAGE_BYTES, splitPieces, type Chunker } from './chunker.js';
import { SEAL_OVERHEAD, chunkId, sealParts, type TenantKeys } from './crypto.js';
import {
  CODEC_RAW,
  CODEC_ZSTD,
  PACK_HEADER_BYTES,
  REF_BYTES,
  REF_DATA,
  REF_HOLE,
  encodeIndex,
  indexEntry,
  packHeader,
  type ManifestEntry,
} from './format.js';
import type { SealPool } from './seal-pool.js';
import type { StoreWriter, VaultStore } from './store.js';

type ZstdBinding = typeof import('zstd-napi/binding.js');
const zstd = createRequire(import.meta.url)('zstd-napi/binding.js') as ZstdBinding;

/** Where a chunk lives. `pack` is the pack id. */
export interface ChunkLocation {
  pack: string;
  offset: number;
  storedBytes: number;
  rawBytes: number;
}

/** Packs roll over at this size: one fdatasync per pack keeps sync cost at ~400 MB/s (PERF-NOTES). */
export const PACK_TARGET_BYTES = 32 * 1024 * 1024;
const READ_BYTES = 4 * 1024 * 1024;
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

  /** Adds one sealed record to the current pack, starting one if needed. */
  add(key: string, id: Buffer, record: readonly Uint8Array[], recordBytes: number, rawBytes: number): void {
    let p = this.current;
    if (p === undefined) {
      const packId = randomBytes(16).toString('hex');
      const h = packHeader(packId);
      p = {
        id: packId,
        entries: [],
        queue: [h],
        queuedBytes: h.length,
        offset: PACK_HEADER_BYTES,
        writer: undefined,
        tail: Promise.resolve(),
        full: false,
      };
      this.current = p;
      this.open.push(p);
    }
    for (const part of record) p.queue.push(part);
    p.queuedBytes += recordBytes;
    p.entries.push(indexEntry(id, p.offset, recordBytes, rawBytes));
    this.pending.set(key, { pack: p.id, offset: p.offset, storedBytes: recordBytes, rawBytes });
    p.offset += recordBytes;
    this.storedBytes += recordBytes;
    if (p.offset >= this.targetBytes) {
      p.full = true;
      this.current = undefined;
    }
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
    p.queue = [];
    p.queuedBytes = 0;
    this.inFlightBytes += n;
    p.tail = p.tail.then(async () => {
      p.writer ??= await this.store.create(`data/${this.tenant}/packs/${p.id}.pack`);
      await p.writer.write(parts);
      this.inFlightBytes -= n;
      crashPoint('pack-data-written');
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
  signal?: AbortSignal;
  onProgress?: (c: Readonly<IngestCounters>) => void;
}

/** Compresses and seals one chunk; returns the record's parts and length. */
class Sealer {
  private readonly cctx = new zstd.CCtx();
  private scratch = Buffer.alloc(zstd.compressBound(64 * 1024));
  private readonly codecRaw = Buffer.from([CODEC_RAW]);
  private readonly codecZstd = Buffer.from([CODEC_ZSTD]);

  constructor(private readonly dataKey: Buffer) {}

  seal(id: Buffer, data: Uint8Array): { parts: Buffer[]; bytes: number } {
    const bound = zstd.compressBound(data.length);
    if (this.scratch.length < bound) this.scratch = Buffer.alloc(bound);
    const n = this.cctx.compress(this.scratch, data, 1);
    // Keep compression only where it pays for the decompression on restore.
    const useZstd = n < data.length - (data.length >> 5);
    const payload = useZstd ? this.scratch.subarray(0, n) : data;
    const parts = sealParts(this.dataKey, id, [useZstd ? this.codecZstd : this.codecRaw, payload]);
    return { parts, bytes: SEAL_OVERHEAD + 1 + payload.length };
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
  const sealer = new Sealer(ctx.keys.dataKey);
  const seenHere = new Set<string>();
  const carryMax = ctx.chunker.params.maxBytes + 2 * PAGE_BYTES;
  const work = Buffer.allocUnsafe(READ_BYTES + carryMax);
  const reads = [Buffer.allocUnsafe(READ_BYTES), Buffer.allocUnsafe(READ_BYTES)];

  const rootSt = await lstat(srcDir).catch((e: unknown) => {
    throw new DormantError(ErrorCode.INVALID_ARGUMENT, `cannot read checkpoint folder ${srcDir}`, {
      cause: e,
    });
  });
  if (!rootSt.isDirectory()) throw new DormantError(ErrorCode.INVALID_ARGUMENT, `${srcDir} is not a folder`);

  // splitPieces reports pieces synchronously; they are handled after it returns, in order,
  // because handing a chunk to the worker pool may have to wait for a free buffer.
  let pieces: number[] = []; // start, end pairs; a hole is (-1, length)
  const sink = {
    data(start: number, end: number): void {
      pieces.push(start, end);
    },
    hole(length: number): void {
      pieces.push(-1, length);
    },
  };
  const batcher = ctx.pool?.batcher(ctx.keys.dataKey, (key, id, record, rawBytes) => {
    counters.storedBytes += record.length;
    ctx.packs.add(key, id, [record], record.length, rawBytes);
  });
  const handlePieces = async (): Promise<void> => {
    const list = pieces;
    pieces = [];
    let added = false;
    for (let i = 0; i < list.length; i += 2) {
      const start = list[i]!;
      const end = list[i + 1]!;
      if (start < 0) {
        counters.holeBytes += end;
        refs.hole(end);
        continue;
      }
      const chunk = work.subarray(start, end);
      const id = chunkId(ctx.keys.idKeyObject, chunk);
      const key = id.toString('hex');
      counters.chunks++;
      refs.data(id, end - start);
      if (seenHere.has(key) || ctx.known(key) || ctx.packs.pending.has(key)) continue;
      seenHere.add(key);
      counters.newChunks++;
      counters.newBytes += end - start;
      if (batcher) {
        await batcher.add(key, id, chunk);
      } else {
        const { parts, bytes } = sealer.seal(id, chunk);
        counters.storedBytes += bytes;
        ctx.packs.add(key, id, parts, bytes, end - start);
        added = true;
      }
    }
    // The chunks point into the read buffer, which is about to be reused: copy them out now.
    if (batcher) await batcher.dispatch();
    if (added || batcher) await ctx.packs.pump();
  };

  const ingestFile = async (h: FileHandle): Promise<number> => {
    let carry = 0;
    let offset = 0; // stream offset of work[0]
    let total = 0;
    let which = 0;
    let next = h.read(reads[0]!, 0, READ_BYTES, null);
    for (;;) {
      const { bytesRead } = await next;
      const buf = reads[which]!;
      which ^= 1;
      const eof = bytesRead === 0;
      if (!eof) next = h.read(reads[which]!, 0, READ_BYTES, null);
      buf.copy(work, carry, 0, bytesRead);
      const have = carry + bytesRead;
      total += bytesRead;
      const pos = splitPieces(ctx.chunker, work, 0, have, offset, eof, sink);
      await handlePieces();
      carry = have - pos;
      work.copyWithin(0, pos, have);
      offset += pos;
      counters.logicalBytes += bytesRead;
      ctx.onProgress?.(counters);
      if (ctx.signal?.aborted) {
        await next.catch(() => undefined);
        throw new DormantError(ErrorCode.COMMAND_ABORTED, `ingest of ${srcDir} aborted`, {
          cause: ctx.signal.reason,
        });
      }
      if (eof) return total;
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
        const h = await open(p, 'r');
        let size: number;
        try {
          size = await ingestFile(h);
        } finally {
          await h.close();
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
  await walk(srcDir, '');
  await batcher?.flush();
  return { entries, refs: Buffer.from(refs.bytes()), counters };
}
