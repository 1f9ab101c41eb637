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

/**
 * Runs the detectors over a small made-up buffer (binary, zeros, text with near-miss and
 * whole secrets) a few times, so V8 has compiled them before the first chunk comes: a fresh
 * thread otherwise interprets its first megabytes several times slower (measured: about
 * 50 ms of the first 4 MiB chunk).
 */
function warmUp(key: Buffer): void {
  // Anchors and near misses only: a hit would cost a fingerprint each time.
  const parts: Buffer[] = [];
  let seed = 1;
  for (let i = 0; i < 16; i++) {
    const noise = Buffer.alloc(2048);
    for (let j = 0; j < noise.length; j++) noise[j] = (seed = (seed * 1103515245 + 12345) >>> 0) >>> 24;
    parts.push(noise, Buffer.alloc(2048));
    parts.push(
      Buffer.from(
        `{"user": "agent", "tool": "bash", "ok": true}\n api_key = "x${i}y" TOKEN=\${AKIA000000000000000}\n`.repeat(
          24,
        ),
      ),
    );
  }
  const buf = Buffer.concat(parts);
  // Until a run takes a third of the first (compiled), or at most 40 runs (~70 KiB each).
  let first = 0;
  for (let i = 0; i < 40; i++) {
    const t = performance.now();
    scanChunk(key, buf, buf.subarray(0, 8192), 4096);
    const ms = performance.now() - t;
    if (i === 0) first = ms;
    else if (ms < first / 3 && i >= 4) break;
  }
}

if (parentPort !== null) {
  const port = parentPort;
  const key = Buffer.from((workerData as ScanWorkerData).key);
  warmUp(Buffer.alloc(32));
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
