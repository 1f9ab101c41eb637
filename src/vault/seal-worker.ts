/**
 * Worker thread body: compresses (zstd level 1, kept only when it saves >3%) and seals
 * (AES-256-GCM, chunk id as associated data) the chunks of one read buffer. The ingest loop
 * reads files straight into buffers that move here (transferred, not copied) with the chunks'
 * offsets; records (`nonce | ciphertext | tag`, back to back) go into an output buffer that
 * moves back with it and that the pack writer writes as it is. Both are reused job after job,
 * so no fresh memory is touched (fresh pages are what makes big allocations slow on these VMs).
 */
import { parentPort } from 'node:worker_threads';
import { createRequire } from 'node:module';
import { CHUNK_ID_BYTES, sealParts } from './crypto.js';
import { CODEC_RAW, CODEC_ZSTD } from './format.js';

type ZstdBinding = typeof import('zstd-napi/binding.js');
const zstd = createRequire(import.meta.url)('zstd-napi/binding.js') as ZstdBinding;

export interface SealJob {
  job: number;
  key: Uint8Array;
  input: ArrayBuffer;
  output: ArrayBuffer;
  /** count x (input offset, length). */
  meta: Int32Array;
  /** count x CHUNK_ID_BYTES chunk ids. */
  ids: Uint8Array;
}

export interface SealDone {
  job: number;
  /** The length of each record; records lie back to back from the output's first byte. */
  lengths: Int32Array;
  /** The job's buffers, handed back (transferred). */
  input?: ArrayBuffer;
  output?: ArrayBuffer;
  /** Set when the job failed. */
  error?: string;
}

const CODEC_RAW_BYTE = Buffer.from([CODEC_RAW]);
const CODEC_ZSTD_BYTE = Buffer.from([CODEC_ZSTD]);
const cctx = new zstd.CCtx();
let scratch = Buffer.alloc(zstd.compressBound(64 * 1024));

function sealJob(msg: SealJob): SealDone {
  const input = Buffer.from(msg.input);
  const output = Buffer.from(msg.output);
  const key = Buffer.from(msg.key);
  const count = msg.meta.length >> 1;
  const lengths = new Int32Array(count);
  let at = 0;
  try {
    for (let i = 0; i < count; i++) {
      const off = msg.meta[i * 2]!;
      const len = msg.meta[i * 2 + 1]!;
      const data = input.subarray(off, off + len);
      const bound = zstd.compressBound(len);
      if (scratch.length < bound) scratch = Buffer.alloc(bound);
      const n = cctx.compress(scratch, data, 1);
      const useZstd = n < len - (len >> 5);
      const payload = useZstd ? scratch.subarray(0, n) : data;
      const id = msg.ids.subarray(i * CHUNK_ID_BYTES, (i + 1) * CHUNK_ID_BYTES);
      const start = at;
      for (const p of sealParts(key, id, [useZstd ? CODEC_ZSTD_BYTE : CODEC_RAW_BYTE, payload])) {
        p.copy(output, at);
        at += p.length;
      }
      lengths[i] = at - start;
    }
  } finally {
    key.fill(0);
  }
  return { job: msg.job, lengths, input: msg.input, output: msg.output };
}

if (parentPort !== null) {
  const port = parentPort;
  port.on('message', (msg: SealJob) => {
    let done: SealDone;
    try {
      done = sealJob(msg);
    } catch (e) {
      done = { job: msg.job, lengths: new Int32Array(0), error: e instanceof Error ? e.message : String(e) };
    }
    port.postMessage(done, done.input && done.output ? [done.input, done.output] : []);
  });
}
