/**
 * Runs chunk compression and sealing on worker threads (zstd is the slowest stage of ingest,
 * see PERF-NOTES), while the main thread reads, chunks, hashes and deduplicates. Chunk bytes
 * travel in reusable shared buffers; results come back as records in reusable shared buffers
 * and are copied out (each at most 64 KiB, which malloc serves from warm memory).
 */
import { Worker } from 'node:worker_threads';
import { CHUNK_ID_BYTES } from './crypto.js';
import type { SealDone, SealJob, SealSlot } from './seal-worker.js';

const BATCH_BYTES = 1024 * 1024;
const BATCH_CHUNKS = 512;
const SLOTS_PER_WORKER = 3;
const RECORD_OVERHEAD = 64;

interface Slot {
  worker: number;
  index: number;
  input: Buffer;
  output: Buffer;
}

/** A record handed back to the caller: the chunk's key and the sealed bytes (a copy). */
export type OnRecord = (key: string, id: Buffer, record: Buffer, rawBytes: number) => void;

export class SealPool {
  private readonly workers: Worker[] = [];
  private readonly free: Slot[] = [];
  private readonly waiters: ((s: Slot) => void)[] = [];
  private readonly handlers = new Map<string, (done: SealDone) => void>();
  private busy = 0;
  private failure: Error | undefined;

  constructor(readonly size: number) {
    for (let w = 0; w < size; w++) {
      const worker = new Worker(new URL('./seal-worker.js', import.meta.url));
      worker.unref();
      const slots: SealSlot[] = [];
      for (let i = 0; i < SLOTS_PER_WORKER; i++) {
        const input = new SharedArrayBuffer(BATCH_BYTES + 64 * 1024);
        const output = new SharedArrayBuffer(BATCH_BYTES + 64 * 1024 + BATCH_CHUNKS * RECORD_OVERHEAD);
        slots.push({ input, output });
        this.free.push({ worker: w, index: i, input: Buffer.from(input), output: Buffer.from(output) });
      }
      worker.postMessage({ slots });
      worker.on('message', (done: SealDone) => {
        this.handlers.get(`${w}/${done.slot}`)?.(done);
      });
      worker.on('error', (e) => {
        this.failure = e;
        for (const h of this.handlers.values()) h({ slot: -1, out: new Int32Array(0) });
      });
      this.workers.push(worker);
    }
  }

  private take(): Promise<Slot> {
    const s = this.free.pop();
    if (s) return Promise.resolve(s);
    return new Promise((resolve) => this.waiters.push(resolve));
  }

  private give(s: Slot): void {
    const w = this.waiters.shift();
    if (w) w(s);
    else this.free.push(s);
  }

  private ref(delta: number): void {
    // Keep the process alive only while batches are in flight.
    const before = this.busy;
    this.busy += delta;
    if (before === 0 && this.busy > 0) for (const w of this.workers) w.ref();
    if (before > 0 && this.busy === 0) for (const w of this.workers) w.unref();
  }

  /** A batcher for one ingest: add chunks, then `flush()`; records arrive through `onRecord`. */
  batcher(key: Buffer, onRecord: OnRecord): SealBatcher {
    return new SealBatcher(this, key, onRecord);
  }

  /** @internal */
  async run(
    key: Buffer,
    fill: (slot: Slot) => { count: number; meta: Int32Array; ids: Uint8Array },
    onDone: (slot: Slot, out: Int32Array) => void,
  ): Promise<{ done: Promise<void> }> {
    if (this.failure) throw this.failure;
    const slot = await this.take();
    const { count, meta, ids } = fill(slot);
    this.ref(1);
    const done = new Promise<void>((resolve, reject) => {
      const hk = `${slot.worker}/${slot.index}`;
      this.handlers.set(hk, (done) => {
        this.handlers.delete(hk);
        this.ref(-1);
        if (this.failure) {
          reject(this.failure);
          return;
        }
        try {
          onDone(slot, done.out);
          resolve();
        } catch (e) {
          reject(e instanceof Error ? e : new Error(String(e)));
        } finally {
          this.give(slot);
        }
      });
      const job: SealJob = { slot: slot.index, count, key, meta, ids };
      this.workers[slot.worker]!.postMessage(job);
    });
    return { done };
  }

  async close(): Promise<void> {
    await Promise.all(this.workers.map((w) => w.terminate()));
    this.workers.length = 0;
  }
}

interface Pending {
  key: string;
  id: Buffer;
  data: Uint8Array;
}

/** Collects chunks into batches and hands them to the pool. */
export class SealBatcher {
  private batch: Pending[] = [];
  private batchBytes = 0;
  private readonly inFlight = new Set<Promise<void>>();
  private error: Error | undefined;

  constructor(
    private readonly pool: SealPool,
    private readonly key: Buffer,
    private readonly onRecord: OnRecord,
  ) {}

  /**
   * Queues a chunk. `data` must stay valid until the returned promise resolves (the bytes are
   * copied into a shared buffer by then).
   */
  async add(key: string, id: Buffer, data: Uint8Array): Promise<void> {
    if (this.batchBytes + data.length > BATCH_BYTES || this.batch.length >= BATCH_CHUNKS)
      await this.dispatch();
    this.batch.push({ key, id, data });
    this.batchBytes += data.length;
  }

  /** Dispatches the current batch; resolves once its bytes are copied (not sealed). */
  async dispatch(): Promise<void> {
    if (this.error) throw this.error;
    if (this.batch.length === 0) return;
    const items = this.batch;
    this.batch = [];
    this.batchBytes = 0;
    const { done: p } = await this.pool.run(
      this.key,
      (slot) => {
        const meta = new Int32Array(items.length * 2);
        const ids = new Uint8Array(items.length * CHUNK_ID_BYTES);
        let at = 0;
        for (const [i, it] of items.entries()) {
          slot.input.set(it.data, at);
          meta[i * 2] = at;
          meta[i * 2 + 1] = it.data.length;
          ids.set(it.id, i * CHUNK_ID_BYTES);
          at += it.data.length;
        }
        return { count: items.length, meta, ids };
      },
      (slot, out) => {
        for (const [i, it] of items.entries()) {
          const off = out[i * 2]!;
          const len = out[i * 2 + 1]!;
          this.onRecord(it.key, it.id, Buffer.from(slot.output.subarray(off, off + len)), it.data.length);
        }
      },
    );
    this.inFlight.add(p);
    p.then(
      () => this.inFlight.delete(p),
      (e: unknown) => {
        this.inFlight.delete(p);
        this.error ??= e instanceof Error ? e : new Error(String(e));
      },
    );
  }

  /** Dispatches what is left and waits for every record to arrive. */
  async flush(): Promise<void> {
    await this.dispatch();
    await Promise.all([...this.inFlight]);
    if (this.error) throw this.error;
  }
}
