/**
 * Runs chunk compression and sealing on worker threads (zstd is the slowest stage of ingest,
 * measured), while the main thread reads, chunks, hashes and deduplicates.
 *
 * No chunk byte is copied between threads: the ingest loop reads files straight into buffers
 * it takes from the pool, and a job names chunks by offset. The input buffer and an output
 * buffer move to the worker (transferred, not copied), which writes the records back to back
 * into the output; both come back, and the pack writer writes the output as it is before
 * handing it back to the pool. Buffers are kept for reuse, so the hot path touches only warm
 * memory. (Not SharedArrayBuffers: V8 copies into those with relaxed atomic stores, several
 * times slower than memcpy.)
 *
 * Restore uses the same workers the other way round (`decode`): a batch of records read into
 * a pooled buffer moves to a worker with a pooled output buffer, which comes back holding the
 * decoded chunks for the restore to write.
 */
import { Worker } from 'node:worker_threads';
import { CHUNK_ID_BYTES, SEAL_OVERHEAD } from './crypto.js';
import type { DecodeDone, DecodeJob, SealDone, SealJob } from './seal-worker.js';

/** Room a job needs in its output beyond the chunk bytes: one record's overhead per chunk (at most). */
export const RECORD_OVERHEAD_BYTES = 1 + SEAL_OVERHEAD;
/** Free buffers kept per size for reuse; more than this are left to the garbage collector. */
const KEEP_FREE = 16;

/** One chunk of a job: where it lies in the input buffer, and its id. */
export interface SealItem {
  key: string;
  id: Buffer;
  start: number;
  end: number;
}

/** A finished job: record lengths and chunk counts, and the job's two buffers, handed back. */
export interface SealResult {
  lengths: Int32Array;
  counts: Int32Array;
  input: Buffer;
  output: Buffer;
}

interface Running {
  worker: number;
  onDone: (done: SealDone & DecodeDone) => void;
}

/** One restore batch for {@link SealPool.decode}; see `DecodeJob` in seal-worker.ts. */
export type DecodeRequest = Omit<DecodeJob, 'kind' | 'job' | 'input' | 'output'>;

export class SealPool {
  private readonly workers: Worker[] = [];
  private readonly jobsPerWorker: number[] = [];
  private readonly running = new Map<number, Running>();
  private readonly free = new Map<number, Buffer[]>();
  private nextJob = 1;
  private failure: Error | undefined;

  constructor(size: number) {
    for (let w = 0; w < size; w++) this.spawn();
  }

  /** Worker threads now running. */
  get size(): number {
    return this.workers.length;
  }

  private spawn(): void {
    const w = this.workers.length;
    const worker = new Worker(new URL('./seal-worker.js', import.meta.url));
    worker.unref();
    worker.on('message', (done: SealDone & DecodeDone) => {
      const r = this.running.get(done.job);
      if (r === undefined) return;
      this.running.delete(done.job);
      this.jobsPerWorker[w]!--;
      if (this.jobsPerWorker[w] === 0) worker.unref();
      r.onDone(done);
    });
    worker.on('error', (e) => {
      this.failure ??= e;
      for (const [job, r] of [...this.running]) {
        if (r.worker !== w) continue;
        this.running.delete(job);
        r.onDone({ job, lengths: new Int32Array(0), counts: new Int32Array(0), error: e.message });
      }
    });
    this.workers.push(worker);
    this.jobsPerWorker.push(0);
  }

  /** The least busy worker. */
  private pick(): number {
    let w = 0;
    for (let i = 1; i < this.workers.length; i++) if (this.jobsPerWorker[i]! < this.jobsPerWorker[w]!) w = i;
    return w;
  }

  private post(
    w: number,
    job: number,
    msg: unknown,
    transfer: ArrayBuffer[],
    onDone: Running['onDone'],
  ): void {
    this.running.set(job, { worker: w, onDone });
    // Keep the process alive only while jobs are in flight.
    if (this.jobsPerWorker[w]!++ === 0) this.workers[w]!.ref();
    this.workers[w]!.postMessage(msg, transfer);
  }

  /**
   * A buffer of exactly `bytes` with an ArrayBuffer of its own, reused when one is free. Give
   * it back with `give`.
   */
  take(bytes: number): Buffer {
    const b = this.free.get(bytes)?.pop();
    return b ?? Buffer.from(new ArrayBuffer(bytes));
  }

  give(b: Buffer): void {
    let list = this.free.get(b.length);
    if (list === undefined) {
      list = [];
      this.free.set(b.length, list);
    }
    if (list.length < KEEP_FREE) list.push(b);
  }

  /**
   * Seals `items` (chunks in `input`, a buffer from `take`) on the least busy worker, into
   * `output` (a buffer from `take`, big enough for every chunk plus RECORD_OVERHEAD_BYTES
   * each). Both buffers move to the worker: the caller must not touch them again, and gets
   * them back (as new Buffer objects) when the promise resolves. Rejects when the worker fails.
   */
  seal(key: Buffer, input: Buffer, items: readonly SealItem[], output: Buffer): Promise<SealResult> {
    if (this.failure) return Promise.reject(this.failure);
    const meta = new Int32Array(items.length * 2);
    const ids = new Uint8Array(items.length * CHUNK_ID_BYTES);
    for (let i = 0; i < items.length; i++) {
      const it = items[i]!;
      meta[i * 2] = it.start;
      meta[i * 2 + 1] = it.end - it.start;
      ids.set(it.id, i * CHUNK_ID_BYTES);
    }
    const w = this.pick();
    const job = this.nextJob++;
    return new Promise((resolve, reject) => {
      const msg: SealJob = {
        kind: 'seal',
        job,
        key,
        input: input.buffer as ArrayBuffer,
        output: output.buffer as ArrayBuffer,
        meta,
        ids,
      };
      this.post(w, job, msg, [msg.input, msg.output], (done) => {
        if (done.error !== undefined || done.input === undefined || done.output === undefined)
          reject(new Error(`seal worker failed: ${done.error ?? 'no buffers back'}`));
        else
          resolve({
            lengths: done.lengths,
            counts: done.counts,
            input: Buffer.from(done.input),
            output: Buffer.from(done.output),
          });
      });
    });
  }

  /**
   * Decodes one restore batch on the least busy worker: `input` and `output` (buffers from
   * `take`) move to the worker and come back in the answer (as new Buffers) whatever its
   * verdict (`badRecord`). Rejects only when the worker itself fails; the buffers are lost then.
   */
  decode(
    input: Buffer,
    output: Buffer,
    req: DecodeRequest,
  ): Promise<{ input: Buffer; output: Buffer; done: DecodeDone }> {
    if (this.failure) return Promise.reject(this.failure);
    const w = this.pick();
    const job = this.nextJob++;
    return new Promise((resolve, reject) => {
      const msg: DecodeJob = {
        kind: 'decode',
        job,
        input: input.buffer as ArrayBuffer,
        output: output.buffer as ArrayBuffer,
        ...req,
      };
      this.post(w, job, msg, [msg.input, msg.output], (done) => {
        if (done.input === undefined || done.output === undefined)
          reject(new Error(`decode worker failed: ${done.error ?? 'no buffers back'}`));
        else resolve({ input: Buffer.from(done.input), output: Buffer.from(done.output), done });
      });
    });
  }

  async close(): Promise<void> {
    await Promise.all(this.workers.map((w) => w.terminate()));
    this.workers.length = 0;
    this.free.clear();
  }
}
