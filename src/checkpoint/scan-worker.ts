/**
 * Worker thread body of the secret scan: runs the detectors ({@link scanChunk}) over chunks
 * the scan's thread reads and hands over. A chunk's buffer moves here and back (transferred,
 * not copied) so the scan reuses it; the small seam (the bytes around the boundary with the
 * chunk before) comes as a copy. What comes back names each secret by kind, place, redacted
 * preview and keyed fingerprint: the secret's text never leaves this thread.
 */
import { parentPort, threadId, workerData } from 'node:worker_threads';
import { scanChunk, type ChunkHit } from './secrets.js';

export interface ScanJob {
  job: number;
  /** The chunk's memory; its first `length` bytes are the chunk. */
  data: ArrayBuffer;
  length: number;
  seam?: Uint8Array;
  /** Bytes of `seam` that belong to the chunk before. */
  edge: number;
}

export interface ScanDone {
  job: number;
  hits?: ChunkHit[];
  /** The chunk's memory, handed back (transferred). */
  data?: ArrayBuffer;
  /** The thread that scanned the chunk (tests look at it). */
  thread: number;
  error?: string;
}

export interface ScanWorkerData {
  /** The scan's fingerprint key. */
  key: Uint8Array;
}

if (parentPort !== null) {
  const port = parentPort;
  const key = Buffer.from((workerData as ScanWorkerData).key);
  port.on('message', (msg: ScanJob) => {
    let done: ScanDone;
    try {
      const seam =
        msg.seam === undefined
          ? undefined
          : Buffer.from(msg.seam.buffer, msg.seam.byteOffset, msg.seam.length);
      const hits = scanChunk(key, Buffer.from(msg.data, 0, msg.length), seam, msg.edge);
      done = { job: msg.job, hits, data: msg.data, thread: threadId };
    } catch (e) {
      done = {
        job: msg.job,
        data: msg.data,
        thread: threadId,
        error: e instanceof Error ? e.message : String(e),
      };
    }
    port.postMessage(done, done.data !== undefined ? [done.data] : []);
  });
}
