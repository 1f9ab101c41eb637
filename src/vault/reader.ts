/**
 * Random access to one stored checkpoint: any byte range of any of its files, read from the
 * packs and authenticated, without restoring the checkpoint to disk. Lazy resume serves a
 * process's pages from here, in the order it faults them in.
 */
import { DormantError, ErrorCode } from '../domain/errors.js';
import { CHUNK_ID_BYTES } from './crypto.js';
import {
  RECORD_MAX_RAW_BYTES,
  REF_BYTES,
  REF_HOLE,
  recordAad,
  recordRawBytes,
  type ChunkLocation,
  type ManifestBody,
  type ManifestEntry,
} from './format.js';
import { REC_FIELDS } from './seal-worker.js';
import { ChunkDecoder, PackReaders, type RestoreContext } from './restore.js';

/** Decoded records kept (bytes of plaintext): for reads that come back, and what read-ahead decoded. */
const CACHE_BYTES = 8 * 1024 * 1024;
/**
 * After a read, the records of the next bytes of the same file are decoded ahead, into the
 * cache: a lazy-pages daemon mostly asks for memory in order, one piece at a time, and copies
 * each answer into the process before it asks again. With decode workers, batches of records
 * decode there while the calling thread answers; without, one record per turn of the event
 * loop while no read waits.
 */
const READ_AHEAD_BYTES = 4 * 1024 * 1024;
/** A read-ahead batch: at most this much input and output, and at most two in flight. */
const BATCH_BYTES = 2 * 1024 * 1024;
const BATCH_TARGET_RAW = 1024 * 1024;
const BATCHES_IN_FLIGHT = 2;

/** The output buffer of a decoded batch, shared by its records in the cache. */
interface Batch {
  buf: Buffer;
  /** Its records still in the cache. */
  live: number;
  /** Bytes of `buf` the batch wrote (what is wiped once its records are gone). */
  used: number;
}

interface Cached {
  rec: Buffer;
  batch?: Batch;
  /** A record decoded on this thread: the spare buffer `rec` lies in, if it came from one. */
  whole?: Buffer;
}

/** Spare record buffers kept: the cache's worth of the biggest records. */
const SPARES = CACHE_BYTES / RECORD_MAX_RAW_BYTES;

/**
 * What identifies a record in the cache: its group (shared by the location of each of its
 * chunks) or, for a one-chunk record, the chunk's location. Locations are the index's own
 * objects, which stay put while the reader holds the vault's shared lock; were one replaced,
 * the record would only be decoded again.
 */
type RecordKey = object;

function recordKey(loc: ChunkLocation): RecordKey {
  return loc.group ?? loc;
}

interface FileRefs {
  entry: ManifestEntry;
  /** File offset where each reference starts, and one past the last (the size). */
  starts: Float64Array;
}

export interface CheckpointFile {
  path: string;
  type: 'file' | 'dir' | 'symlink';
  sizeBytes: number;
}

/**
 * A checkpoint opened for reading. Every byte returned comes from a record that authenticated
 * (AES-GCM with the chunk ids as associated data); a damaged one throws VAULT_CORRUPT naming
 * the checkpoint and the chunk, and no byte of it is returned. Reads run one at a time.
 * `close()` wipes the decoded plaintext it kept and lets gc run again.
 */
export class CheckpointReader {
  private readonly files = new Map<string, FileRefs>();
  private readonly packs: PackReaders;
  private readonly decoder: ChunkDecoder;
  private readonly cache = new Map<RecordKey, Cached>();
  /** Wiped record buffers to decode into on this thread (RECORD_MAX_RAW_BYTES each). */
  private readonly spares: Buffer[] = [];
  /** Where each reference's chunk lives, looked up once (by reference number). */
  private readonly locs: (ChunkLocation | undefined)[];
  private cachedBytes = 0;
  /** Records a worker batch is decoding: settles once they are cached (or found bad). */
  private readonly inflight = new Map<RecordKey, Promise<void>>();
  private batchesInFlight = 0;
  private readonly batches = new Set<Promise<void>>();
  /** How far read-ahead has gone in `aheadPath`. */
  private aheadPath = '';
  private aheadPos = 0;
  private poolFailed = false;
  private queue: Promise<unknown> = Promise.resolve();
  private closed = false;
  private readonly what: string;

  constructor(
    private readonly body: ManifestBody,
    private readonly ctx: Omit<RestoreContext, 'onProgress' | 'signal' | 'skip'>,
    private readonly release: () => Promise<void>,
  ) {
    this.what = `checkpoint ${ctx.checkpointId}`;
    this.packs = new PackReaders(ctx.store, ctx.tenant, this.what);
    this.decoder = new ChunkDecoder(ctx.keys);
    this.locs = new Array<ChunkLocation | undefined>(body.refs.length / REF_BYTES);
    for (const e of body.entries) {
      if (e.type !== 'file') continue;
      const starts = new Float64Array(e.refCount + 1);
      let at = 0;
      for (let i = 0; i < e.refCount; i++) {
        starts[i] = at;
        at += body.refs.readUInt32LE((e.firstRef + i) * REF_BYTES + 1);
      }
      starts[e.refCount] = at;
      if (at !== e.sizeBytes)
        throw new DormantError(
          ErrorCode.VAULT_CORRUPT,
          `${this.what}: the references of ${e.path} add up to ${String(at)} bytes, not its ${String(e.sizeBytes)}`,
          { details: { object: `manifest ${ctx.checkpointId}` } },
        );
      this.files.set(e.path, { entry: e, starts });
    }
  }

  /** The checkpoint's folder, in walk order. */
  list(): CheckpointFile[] {
    return this.body.entries.map((e) => ({ path: e.path, type: e.type, sizeBytes: e.sizeBytes }));
  }

  /** Size of file `path`, or undefined when the checkpoint has no such file. */
  size(path: string): number | undefined {
    return this.files.get(path)?.entry.sizeBytes;
  }

  /**
   * Reads `length` bytes of file `path` from `offset` (holes read as zeros) into `out` at
   * `at` (a new buffer when omitted). The range must lie within the file. Unless `readAhead`
   * is false, the bytes that follow are decoded ahead for the next read.
   */
  read(
    path: string,
    offset: number,
    length: number,
    out?: Buffer,
    at = 0,
    opts: { readAhead?: boolean } = {},
  ): Promise<Buffer> {
    this.waiting++;
    const p = this.queue.then(() => {
      this.waiting--;
      return this.readNow(path, offset, length, out ?? Buffer.alloc(length), at);
    });
    this.queue = p.then(
      () => (opts.readAhead === false ? undefined : this.startReadAhead(path, offset + length)),
      () => undefined,
    );
    return p;
  }

  /** Reads queued and not yet started. */
  private waiting = 0;
  /** Bumped by every read: a read-ahead of an older read stops. */
  private generation = 0;

  private startReadAhead(path: string, from: number): void {
    const f = this.files.get(path);
    if (f === undefined || this.closed || from >= f.entry.sizeBytes) return;
    if (this.ctx.pool !== undefined && !this.poolFailed) {
      // Carry on from where read-ahead got to, if that is ahead of this read and not too far.
      if (this.aheadPath !== path || this.aheadPos < from || this.aheadPos > from + READ_AHEAD_BYTES) {
        this.aheadPath = path;
        this.aheadPos = from;
      }
      this.pump(f, from + READ_AHEAD_BYTES);
      return;
    }
    const gen = ++this.generation;
    const end = Math.min(f.entry.sizeBytes, from + READ_AHEAD_BYTES);
    let i = this.refAt(f, from);
    const step = (): void => {
      if (gen !== this.generation || this.waiting > 0 || this.closed || i >= f.entry.refCount) return;
      if (f.starts[i]! >= end) return;
      const r = f.entry.firstRef + i;
      const len = f.starts[i + 1]! - f.starts[i]!;
      i++;
      const t =
        this.body.refs[r * REF_BYTES] === REF_HOLE
          ? this.queue
          : // Queued like a read, so it never runs beside one; a damaged record is left to
            // the read that needs it to report.
            this.queue.then(() =>
              gen === this.generation && this.waiting === 0 && !this.closed
                ? this.withRecord(r, len, f.entry.path, () => undefined).then(
                    () => undefined,
                    () => undefined,
                  )
                : undefined,
            );
      this.queue = t;
      void t.then(() => setImmediate(step));
    };
    setImmediate(step);
  }

  /**
   * Starts worker batches for the records of `f` from `aheadPos` up to `limit`, while fewer
   * than BATCHES_IN_FLIGHT run. Reading the sealed bytes goes through the queue (the pack
   * readers serve one caller at a time, so a read may wait behind a batch's sealed reads, not
   * behind its decoding); decoding does not. A reader that asks again as soon as it has its
   * answer (CRIU's lazy-pages daemon does) always has a read waiting: were batches held back
   * while one waits, every read would decode on this thread and the workers would idle.
   */
  private pump(f: FileRefs, limit: number): void {
    if (this.closed || this.poolFailed || this.batchesInFlight >= BATCHES_IN_FLIGHT) return;
    if (this.aheadPath !== f.entry.path || this.aheadPos >= Math.min(limit, f.entry.sizeBytes)) return;
    this.batchesInFlight++;
    const build = this.queue.then(() => this.buildBatch(f, limit));
    this.queue = build.catch(() => undefined);
    const run: Promise<void> = build
      .then((b) => (b === undefined ? undefined : this.decodeBatch(b)))
      .catch(() => {
        // A worker that failed: reads decode on this thread from now on.
        this.poolFailed = true;
      })
      .finally(() => {
        this.batchesInFlight--;
        this.batches.delete(run);
        this.pump(f, limit);
      });
    this.batches.add(run);
  }

  /** Collects and reads the next records of read-ahead into a batch, or undefined when none. */
  private async buildBatch(
    f: FileRefs,
    limit: number,
  ): Promise<
    | { input: Buffer; out: Buffer; recs: number[]; aads: Uint8Array[]; keys: RecordKey[]; done: () => void }
    | undefined
  > {
    if (this.closed || this.aheadPath !== f.entry.path) return undefined;
    const pool = this.ctx.pool!;
    const end = Math.min(limit, f.entry.sizeBytes);
    let i = this.refAt(f, this.aheadPos);
    const picked: { loc: ChunkLocation; id: Buffer; key: RecordKey }[] = [];
    const seen = new Set<RecordKey>();
    let inBytes = 0;
    let outBytes = 0;
    for (; i < f.entry.refCount && f.starts[i]! < end; i++) {
      const r = f.entry.firstRef + i;
      if (this.body.refs[r * REF_BYTES] === REF_HOLE) continue;
      const loc = this.locAt(r);
      // A missing chunk is for the read that needs it to report.
      if (loc === undefined) continue;
      const key = recordKey(loc);
      if (seen.has(key) || this.cache.has(key) || this.inflight.has(key)) continue;
      const raw = recordRawBytes(loc);
      if (inBytes + loc.storedBytes > BATCH_BYTES || outBytes + raw > BATCH_BYTES) break;
      seen.add(key);
      picked.push({ loc, id: this.idAt(r), key });
      inBytes += loc.storedBytes;
      outBytes += raw;
      if (outBytes >= BATCH_TARGET_RAW) {
        i++;
        break;
      }
    }
    this.aheadPos = i < f.entry.refCount ? Math.min(f.starts[i]!, end) : f.entry.sizeBytes;
    if (picked.length === 0) return undefined;
    let settle!: () => void;
    const ready = new Promise<void>((r) => (settle = r));
    for (const p of picked) this.inflight.set(p.key, ready);
    const input = pool.take(BATCH_BYTES);
    const out = pool.take(BATCH_BYTES);
    const recs: number[] = [];
    const aads: Uint8Array[] = [];
    let at = 0;
    let outAt = 0;
    let aadAt = 0;
    try {
      // Records back to back in one pack (as a checkpoint's new chunks are) are read as one
      // run, straight into the batch's input.
      let run: { pack: string; offset: number; end: number; at: number } | undefined;
      const readRun = async (): Promise<void> => {
        if (run !== undefined)
          await this.packs.readInto(run.pack, run.offset, run.end - run.offset, input, run.at);
        run = undefined;
      };
      for (const p of picked) {
        if (run !== undefined && run.pack === p.loc.pack && run.end === p.loc.offset)
          run.end += p.loc.storedBytes;
        else {
          await readRun();
          run = { pack: p.loc.pack, offset: p.loc.offset, end: p.loc.offset + p.loc.storedBytes, at };
        }
        const aad = recordAad(p.loc, p.id);
        recs.push(at, p.loc.storedBytes, recordRawBytes(p.loc), outAt, aadAt, aad.length);
        aads.push(aad);
        at += p.loc.storedBytes;
        outAt += recordRawBytes(p.loc);
        aadAt += aad.length;
      }
      await readRun();
    } catch (e) {
      for (const p of picked) this.inflight.delete(p.key);
      settle();
      pool.give(input);
      pool.give(out);
      throw e;
    }
    return {
      input,
      out,
      recs,
      aads,
      keys: picked.map((p) => p.key),
      done: () => {
        for (const p of picked) this.inflight.delete(p.key);
        settle();
      },
    };
  }

  private async decodeBatch(b: {
    input: Buffer;
    out: Buffer;
    recs: number[];
    aads: Uint8Array[];
    keys: RecordKey[];
    done: () => void;
  }): Promise<void> {
    const pool = this.ctx.pool!;
    const aad = new Uint8Array(b.aads.reduce((n, a) => n + a.length, 0));
    let at = 0;
    for (const a of b.aads) {
      aad.set(a, at);
      at += a.length;
    }
    try {
      const r = await pool.decode(b.input, b.out, {
        key: this.ctx.keys.dataKey,
        recs: Int32Array.from(b.recs),
        aad,
        copies: new Int32Array(0),
      });
      pool.give(r.input);
      // Records before a bad one decoded; that one and the rest are left to the reads that
      // need them (which report the damage).
      const good = r.done.error !== undefined ? 0 : (r.done.badRecord ?? b.keys.length);
      if (this.closed || good === 0) {
        r.output.fill(0);
        return;
      }
      let used = 0;
      for (let f = 0; f < b.recs.length; f += REC_FIELDS)
        used = Math.max(used, b.recs[f + 3]! + b.recs[f + 2]!);
      const batch: Batch = { buf: r.output, live: 0, used };
      for (let k = 0; k < good; k++) {
        const f = k * REC_FIELDS;
        const rec = r.output.subarray(b.recs[f + 3], b.recs[f + 3]! + b.recs[f + 2]!);
        batch.live++;
        this.cachePut(b.keys[k]!, { rec, batch });
      }
    } finally {
      b.done();
    }
  }

  private cachePut(key: RecordKey, c: Cached): void {
    this.cache.set(key, c);
    this.newest = key;
    this.cachedBytes += c.rec.length;
    while (this.cachedBytes > CACHE_BYTES && this.cache.size > 1) {
      const [oldest, old] = this.cache.entries().next().value as [RecordKey, Cached];
      this.dropCached(oldest, old);
    }
  }

  private dropCached(key: RecordKey, c: Cached): void {
    this.cache.delete(key);
    this.cachedBytes -= c.rec.length;
    if (c.batch === undefined) {
      c.rec.fill(0);
      if (c.whole !== undefined && this.spares.length < SPARES) this.spares.push(c.whole);
    } else if (--c.batch.live === 0) {
      c.batch.buf.fill(0, 0, c.batch.used);
      this.ctx.pool?.give(c.batch.buf);
    }
  }

  /** The index of the reference of `f` that holds byte `offset`. */
  private refAt(f: FileRefs, offset: number): number {
    let lo = 0;
    let hi = f.entry.refCount - 1;
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (f.starts[mid]! <= offset) lo = mid;
      else hi = mid - 1;
    }
    return lo;
  }

  private async readNow(
    path: string,
    offset: number,
    length: number,
    out: Buffer,
    at: number,
  ): Promise<Buffer> {
    if (this.closed) throw new DormantError(ErrorCode.INTERNAL, `${this.what} is closed for reading`);
    const f = this.files.get(path);
    if (f === undefined)
      throw new DormantError(ErrorCode.INVALID_ARGUMENT, `${this.what} has no file ${path.slice(0, 200)}`);
    if (
      !Number.isSafeInteger(offset) ||
      !Number.isSafeInteger(length) ||
      offset < 0 ||
      length < 0 ||
      offset + length > f.entry.sizeBytes ||
      at < 0 ||
      at + length > out.length
    )
      throw new DormantError(
        ErrorCode.INVALID_ARGUMENT,
        `read of ${String(length)} bytes at ${String(offset)} is outside ${path} of ${this.what} (${String(f.entry.sizeBytes)} bytes)`,
      );
    const { starts, entry } = f;
    const lo = this.refAt(f, offset);
    let pos = offset;
    const end = offset + length;
    for (let i = lo; pos < end; i++) {
      const refStart = starts[i]!;
      const refEnd = starts[i + 1]!;
      const n = Math.min(end, refEnd) - pos;
      const dst = at + (pos - offset);
      const r = entry.firstRef + i;
      if (this.body.refs[r * REF_BYTES] === REF_HOLE) {
        out.fill(0, dst, dst + n);
      } else {
        const from = pos - refStart;
        const loc = this.checkedLoc(r, refEnd - refStart, entry.path);
        const key = recordKey(loc);
        const hit = this.cache.get(key);
        // Cached (most reads, with read-ahead): copied in this turn, no await per reference.
        if (hit !== undefined) {
          this.touch(key, hit);
          hit.rec.copy(out, dst, loc.inner + from, loc.inner + from + n);
        } else
          await this.withRecord(r, refEnd - refStart, entry.path, (rec, inner) =>
            rec.copy(out, dst, inner + from, inner + from + n),
          );
      }
      pos += n;
    }
    return out;
  }

  /** The chunk id of reference number `r`. */
  private idAt(r: number): Buffer {
    const at = r * REF_BYTES + 5;
    return this.body.refs.subarray(at, at + CHUNK_ID_BYTES);
  }

  /** Where the chunk of reference number `r` lives (looked up once), or undefined if nowhere. */
  private locAt(r: number): ChunkLocation | undefined {
    let loc = this.locs[r];
    if (loc === undefined) {
      const at = r * REF_BYTES + 5;
      loc = this.ctx.lookup(this.body.refs.toString('hex', at, at + CHUNK_ID_BYTES));
      this.locs[r] = loc;
    }
    return loc;
  }

  /** {@link locAt}, or VAULT_CORRUPT when the chunk is missing or its length is not `len`. */
  private checkedLoc(r: number, len: number, path: string): ChunkLocation {
    const loc = this.locAt(r);
    if (loc === undefined) {
      const key = this.idAt(r).toString('hex');
      throw new DormantError(
        ErrorCode.VAULT_CORRUPT,
        `${this.what}: chunk ${key.slice(0, 16)} of ${path} is missing from the vault${this.ctx.explainMissing()}`,
        {
          details: { object: `chunk ${key}` },
          hint: 'run `dormant vault verify` to list every damaged object',
        },
      );
    }
    if (loc.rawBytes !== len)
      throw new DormantError(
        ErrorCode.VAULT_CORRUPT,
        `${this.what}: chunk ${this.idAt(r).toString('hex').slice(0, 16)} has the wrong length in its index`,
        { details: { object: `pack ${loc.pack}` } },
      );
    return loc;
  }

  /** The record most recently put in or taken from the cache (its last entry). */
  private newest: RecordKey | undefined;

  /** Marks a cached record as the most recently used. */
  private touch(key: RecordKey, c: Cached): void {
    if (key === this.newest) return;
    this.cache.delete(key);
    this.cache.set(key, c);
    this.newest = key;
  }

  /**
   * Calls `use` with the decoded record that holds the chunk of reference number `r` and
   * where the chunk starts in it, in the same turn as it is looked up or decoded: a cached
   * record may be evicted (and wiped) by anything that runs later.
   */
  private async withRecord(
    r: number,
    len: number,
    path: string,
    use: (rec: Buffer, inner: number) => void,
  ): Promise<void> {
    const loc = this.checkedLoc(r, len, path);
    const key = recordKey(loc);
    // A worker batch is decoding it: wait for that rather than decode it twice.
    const coming = this.inflight.get(key);
    if (coming !== undefined) await coming;
    const hit = this.cache.get(key);
    if (hit !== undefined) {
      this.touch(key, hit);
      use(hit.rec, loc.inner);
      return;
    }
    const sealed = await this.packs.record(loc);
    const raw = recordRawBytes(loc);
    // A spare buffer when one fits: a fresh one costs the first touch of its pages.
    const whole =
      raw <= RECORD_MAX_RAW_BYTES
        ? (this.spares.pop() ?? Buffer.allocUnsafe(RECORD_MAX_RAW_BYTES))
        : undefined;
    const rec = whole?.subarray(0, raw) ?? Buffer.allocUnsafe(raw);
    // Opened with the first chunk's id for a one-chunk record, all of them for a group.
    try {
      this.decoder.decode(this.idAt(r), loc, sealed, rec, 0, this.what);
    } catch (e) {
      rec.fill(0);
      if (whole !== undefined) this.spares.push(whole);
      throw e;
    }
    use(rec, loc.inner);
    this.cachePut(key, whole === undefined ? { rec } : { rec, whole });
  }

  /** Wipes what it decoded, closes its packs and releases the vault. Safe to call twice. */
  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    await this.queue.catch(() => undefined);
    await Promise.allSettled([...this.batches]);
    for (const [key, c] of [...this.cache]) this.dropCached(key, c);
    try {
      await this.packs.close();
    } finally {
      await this.release();
    }
  }
}
