/**
 * Worker thread body: compresses (zstd level 1, kept only when it saves >3%) and seals
 * (AES-256-GCM, chunk id as associated data) a batch of chunks that the ingest loop placed in
 * a shared input buffer, writing `nonce | ciphertext | tag` records into a shared output
 * buffer. Both buffers are reused batch after batch, so no fresh memory is touched (fresh
 * pages are what makes big allocations slow on these VMs).
 */
import { parentPort } from 'node:worker_threads';
import { createRequire } from 'node:module';
import { CHUNK_ID_BYTES, sealParts } from './crypto.js';
import { CODEC_RAW, CODEC_ZSTD } from './format.js';

type ZstdBinding = typeof import('zstd-napi/binding.js');
const zstd = createRequire(import.meta.url)('zstd-napi/binding.js') as ZstdBinding;

export interface SealSlot {
  input: SharedArrayBuffer;
  output: SharedArrayBuffer;
}

export interface SealJob {
  slot: number;
  count: number;
  key: Uint8Array;
  /** count x (input offset, length). */
  meta: Int32Array;
  /** count x CHUNK_ID_BYTES chunk ids. */
  ids: Uint8Array;
}

export interface SealDone {
  slot: number;
  /** count x (output offset, record length). */
  out: Int32Array;
}

if (parentPort !== null) {
  const port = parentPort;
  let slots: SealSlot[] = [];
  const cctx = new zstd.CCtx();
  let scratch = Buffer.alloc(zstd.compressBound(64 * 1024));
  const codecRaw = Buffer.from([CODEC_RAW]);
  const codecZstd = Buffer.from([CODEC_ZSTD]);
  port.on('message', (msg: { slots: SealSlot[] } | SealJob) => {
    if ('slots' in msg) {
      slots = msg.slots;
      return;
    }
    const slot = slots[msg.slot]!;
    const input = Buffer.from(slot.input);
    const output = Buffer.from(slot.output);
    const key = Buffer.from(msg.key);
    const out = new Int32Array(msg.count * 2);
    let at = 0;
    for (let i = 0; i < msg.count; i++) {
      const off = msg.meta[i * 2]!;
      const len = msg.meta[i * 2 + 1]!;
      const data = input.subarray(off, off + len);
      const bound = zstd.compressBound(len);
      if (scratch.length < bound) scratch = Buffer.alloc(bound);
      const n = cctx.compress(scratch, data, 1);
      const useZstd = n < len - (len >> 5);
      const payload = useZstd ? scratch.subarray(0, n) : data;
      const id = Buffer.from(msg.ids.buffer, msg.ids.byteOffset + i * CHUNK_ID_BYTES, CHUNK_ID_BYTES);
      const parts = sealParts(key, id, [useZstd ? codecZstd : codecRaw, payload]);
      out[i * 2] = at;
      for (const p of parts) {
        p.copy(output, at);
        at += p.length;
      }
      out[i * 2 + 1] = at - out[i * 2]!;
    }
    key.fill(0);
    const done: SealDone = { slot: msg.slot, out };
    port.postMessage(done);
  });
}
