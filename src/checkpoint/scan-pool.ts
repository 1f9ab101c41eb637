/**
 * The worker threads of one secret scan. The detectors are CPU work (about 0.6 GB/s on one
 * core, measured): on the daemon's thread they would stall every API call for the length of
 * a scan. Here the scan's thread only reads chunks and hands them over; the workers run the
 * detectors. Chunk memory moves to a worker and back (transferred, not copied), so the scan
 * reuses a fixed set of buffers. Jobs go round the workers in turn.
 *
 * A pool belongs to one scan: the scan closes it when it ends or fails, which ends its
 * threads (`liveScanWorkers` counts them, for the tests).
 */
import { availableParallelism } from 'node:os';
import { Worker } from 'node:worker_threads';
import type { ChunkHit } from './secrets.js';
import type { ScanDone, ScanJob, ScanWorkerData } from './scan-worker.js';

/** More workers than this gain little: reading the pages becomes the limit. */
const MAX_SCAN_WORKERS = 4;

let live = 0;

/** Scan worker threads now running in this process. */
export function liveScanWorkers(): number {
  return live;
}

/**
 * Workers for a scan: one per core the process may use but one (left to the daemon's own
 * thread, which reads and dispatches), at least 1 and at most MAX_SCAN_WORKERS. On a 2-core
 * machine two workers were slower than one (measured: docs/BENCHMARKS.md, "Secret scan").
 */
export function defaultScanWorkers(): number {
  return Math.max(1, Math.min(MAX_SCAN_WORKERS, availableParallelism() - 1));
}

export interface ChunkResult {
  hits: ChunkHit[];
  /** The chunk's memory, back from the worker (a new Buffer over the same bytes). */
  data: Buffer;
  /** The worker thread that scanned it. */
  thread: number;
}

interface Pending {
  worker: Worker;
  resolve: (r: ChunkResult) => void;
  reject: (e: Error) => void;
}

export class ScanPool {
  private readonly workers: Worker[] = [];
  private readonly pending = new Map<number, Pending>();
  private nextJob = 1;
  private turn = 0;
  private failure: Error | undefined;

  constructor(size: number, key: Buffer) {
    const data: ScanWorkerData = { key: new Uint8Array(key) };
    try {
      for (let i = 0; i < size; i++) this.spawn(data);
    } catch (e) {
      // No thread outlives a pool that failed to start.
      void this.close();
      throw e;
    }
  }

  get size(): number {
    return this.workers.length;
  }

  private spawn(data: ScanWorkerData): void {
    const worker = new Worker(new URL('./scan-worker.js', import.meta.url), { workerData: data });
    live++;
    worker.on('message', (done: ScanDone) => {
      const p = this.pending.get(done.job);
      if (p === undefined) return;
      this.pending.delete(done.job);
      if (done.error !== undefined || done.hits === undefined || done.data === undefined)
        p.reject(new Error(`secret scan worker failed: ${done.error ?? 'no answer'}`));
      else p.resolve({ hits: done.hits, data: Buffer.from(done.data), thread: done.thread });
    });
    worker.on('error', (e) => this.fail(worker, e));
    worker.on('exit', (code) => {
      live--;
      this.fail(worker, new Error(`secret scan worker exited (code ${code})`));
    });
    this.workers.push(worker);
  }

  private fail(worker: Worker, e: Error): void {
    this.failure ??= e;
    for (const [job, p] of [...this.pending]) {
      if (p.worker !== worker) continue;
      this.pending.delete(job);
      p.reject(e);
    }
  }

  /**
   * Scans `data` (and its seam: see scanChunk) on the next worker. `data` must start at the
   * first byte of a memory of its own: that memory moves to the worker (the caller must not
   * touch `data` again) and comes back in the result.
   */
  scan(data: Buffer, seam: Buffer | undefined, edge: number): Promise<ChunkResult> {
    if (this.failure) return Promise.reject(this.failure);
    if (data.byteOffset !== 0) throw new RangeError('a scan chunk must start its own memory');
    const worker = this.workers[this.turn++ % this.workers.length]!;
    const job = this.nextJob++;
    const msg: ScanJob = {
      job,
      data: data.buffer as ArrayBuffer,
      length: data.length,
      ...(seam !== undefined ? { seam } : {}),
      edge,
    };
    return new Promise<ChunkResult>((resolve, reject) => {
      this.pending.set(job, { worker, resolve, reject });
      worker.postMessage(msg, [msg.data]);
    });
  }

  /** Ends the threads; jobs still running fail. Safe to call twice. */
  async close(): Promise<void> {
    const ws = this.workers.splice(0);
    this.failure ??= new Error('the secret scan ended');
    await Promise.all(ws.map((w) => w.terminate()));
  }
}
