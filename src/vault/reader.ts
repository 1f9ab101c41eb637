/**
 * Random access to one stored checkpoint: any byte range of any of its files, read from the
 * packs and authenticated, without restoring the checkpoint to disk. Lazy resume serves a
 * process's pages from here, in the order it faults them in.
 */
import { DormantError, ErrorCode } from '../domain/errors.js';
import { CHUNK_ID_BYTES } from './crypto.js';
import { REF_BYTES, REF_HOLE, recordRawBytes, type ManifestBody, type ManifestEntry } from './format.js';
import { ChunkDecoder, PackReaders, type RestoreContext } from './restore.js';

/**
 * Decoded records kept: for reads that come back to them (a fault next to the last one) and
 * for what read-ahead decoded.
 */
const CACHED_RECORDS = 24;
/**
 * After a read, while no other read waits, the records of the next bytes of the same file are
 * decoded into the cache, one record per turn of the event loop: a lazy-pages daemon mostly
 * asks for memory in order, and it copies one answer into the process while the next is
 * decoded.
 */
const READ_AHEAD_BYTES = 4 * 1024 * 1024;

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
  private readonly cache = new Map<string, Buffer>();
  private queue: Promise<unknown> = Promise.resolve();
  private closed = false;
  private readonly what: string;
  /** Plaintext bytes returned so far. */
  readBytes = 0;

  constructor(
    private readonly body: ManifestBody,
    private readonly ctx: Omit<RestoreContext, 'pool' | 'onProgress' | 'signal'>,
    private readonly release: () => Promise<void>,
  ) {
    this.what = `checkpoint ${ctx.checkpointId}`;
    this.packs = new PackReaders(ctx.store, ctx.tenant, this.what);
    this.decoder = new ChunkDecoder(ctx.keys);
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

  /** The checkpoint's meta (architecture, CRIU version, ...). */
  get meta(): Record<string, string> {
    return this.body.meta;
  }

  /** Size of file `path`, or undefined when the checkpoint has no such file. */
  size(path: string): number | undefined {
    return this.files.get(path)?.entry.sizeBytes;
  }

  /**
   * Reads `length` bytes of file `path` from `offset` (holes read as zeros) into `out` at
   * `at` (a new buffer when omitted). The range must lie within the file.
   */
  read(path: string, offset: number, length: number, out?: Buffer, at = 0): Promise<Buffer> {
    this.waiting++;
    const p = this.queue.then(() => {
      this.waiting--;
      return this.readNow(path, offset, length, out ?? Buffer.alloc(length), at);
    });
    this.queue = p.then(
      () => this.startReadAhead(path, offset + length),
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
    const gen = ++this.generation;
    const end = Math.min(f.entry.sizeBytes, from + READ_AHEAD_BYTES);
    let i = this.refAt(f, from);
    const step = (): void => {
      if (gen !== this.generation || this.waiting > 0 || this.closed || i >= f.entry.refCount) return;
      if (f.starts[i]! >= end) return;
      const ref = (f.entry.firstRef + i) * REF_BYTES;
      const len = f.starts[i + 1]! - f.starts[i]!;
      i++;
      const t =
        this.body.refs[ref] === REF_HOLE
          ? this.queue
          : // Queued like a read, so it never runs beside one; a damaged record is left to
            // the read that needs it to report.
            this.queue.then(() =>
              gen === this.generation && this.waiting === 0 && !this.closed
                ? this.chunkRecord(ref, len, f.entry.path).then(
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
      const ref = (entry.firstRef + i) * REF_BYTES;
      if (this.body.refs[ref] === REF_HOLE) {
        out.fill(0, dst, dst + n);
      } else {
        const plain = await this.chunkRecord(ref, refEnd - refStart, entry.path);
        plain.rec.copy(out, dst, plain.inner + (pos - refStart), plain.inner + (pos - refStart) + n);
      }
      pos += n;
    }
    this.readBytes += length;
    return out;
  }

  /** The decoded record that holds the chunk of reference `ref`, and where the chunk starts in it. */
  private async chunkRecord(ref: number, len: number, path: string): Promise<{ rec: Buffer; inner: number }> {
    const id = this.body.refs.subarray(ref + 5, ref + 5 + CHUNK_ID_BYTES);
    const key = id.toString('hex');
    const loc = this.ctx.lookup(key);
    if (loc === undefined)
      throw new DormantError(
        ErrorCode.VAULT_CORRUPT,
        `${this.what}: chunk ${key.slice(0, 16)} of ${path} is missing from the vault${this.ctx.explainMissing()}`,
        {
          details: { object: `chunk ${key}` },
          hint: 'run `dormant vault verify` to list every damaged object',
        },
      );
    if (loc.rawBytes !== len)
      throw new DormantError(
        ErrorCode.VAULT_CORRUPT,
        `${this.what}: chunk ${key.slice(0, 16)} has the wrong length in its index`,
        { details: { object: `pack ${loc.pack}` } },
      );
    const where = `${loc.pack}/${String(loc.offset)}`;
    let rec = this.cache.get(where);
    if (rec !== undefined) {
      // Most recently used last.
      this.cache.delete(where);
      this.cache.set(where, rec);
      return { rec, inner: loc.inner };
    }
    const sealed = await this.packs.record(loc);
    let spare: Buffer | undefined;
    if (this.cache.size >= CACHED_RECORDS) {
      const [oldest, buf] = this.cache.entries().next().value as [string, Buffer];
      this.cache.delete(oldest);
      spare = buf;
    }
    const raw = recordRawBytes(loc);
    rec = spare !== undefined && spare.length >= raw ? spare.subarray(0, raw) : Buffer.allocUnsafe(raw);
    if (spare !== undefined && rec.buffer !== spare.buffer) spare.fill(0);
    // Opened with the first chunk's id for a one-chunk record, all of them for a group.
    this.decoder.decode(id, loc, sealed, rec, 0, this.what);
    this.cache.set(where, rec);
    return { rec, inner: loc.inner };
  }

  /** Wipes what it decoded, closes its packs and releases the vault. Safe to call twice. */
  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    await this.queue.catch(() => undefined);
    for (const b of this.cache.values()) b.fill(0);
    this.cache.clear();
    try {
      await this.packs.close();
    } finally {
      await this.release();
    }
  }
}
