/**
 * Worker thread body. Seal jobs (ingest): compress (zstd level 1, kept only when it saves >3%)
 * and seal (AES-256-GCM, chunk id as associated data) the chunks of one read buffer. Decode
 * jobs (restore): open and decompress the records of one batch (see `decodeRecords`). The
 * ingest loop
 * reads files straight into buffers that move here (transferred, not copied) with the chunks'
 * offsets; records (`nonce | ciphertext | tag`, back to back) go into an output buffer that
 * moves back with it and that the pack writer writes as it is. Both are reused job after job,
 * so no fresh memory is touched (fresh pages are what makes big allocations slow on these VMs).
 */
import { createDecipheriv, createSecretKey, type KeyObject } from 'node:crypto';
import { parentPort } from 'node:worker_threads';
import { createRequire } from 'node:module';
import { CHUNK_ID_BYTES, NONCE_BYTES, TAG_BYTES, sealParts } from './crypto.js';
import { CODEC_RAW, CODEC_ZSTD } from './format.js';

type ZstdBinding = typeof import('zstd-napi/binding.js');
const zstd = createRequire(import.meta.url)('zstd-napi/binding.js') as ZstdBinding;

export interface SealJob {
  kind?: 'seal';
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

/**
 * A batch of a restore: records (`nonce | GCM(codec | payload) | tag`) read into `input`, to be
 * opened and decompressed into `output`. Both buffers move here and back (transferred).
 */
export interface DecodeJob {
  kind: 'decode';
  job: number;
  key: Uint8Array;
  input: ArrayBuffer;
  output: ArrayBuffer;
  /** count x (input offset, stored length, raw length, output offset). */
  recs: Int32Array;
  /** count x CHUNK_ID_BYTES chunk ids (the associated data of each record). */
  ids: Uint8Array;
  /** (from, to, length) output offsets: chunks that appear again in the batch are copied. */
  copies: Int32Array;
}

export interface DecodeDone {
  job: number;
  /** The job's buffers, handed back (transferred). */
  input?: ArrayBuffer;
  output?: ArrayBuffer;
  /** The record that failed to open or decode, and why ("fails authentication"). */
  badRecord?: number;
  why?: string;
  /** Set when the job failed otherwise. */
  error?: string;
}

export type WorkerJob = SealJob | DecodeJob;

interface Zdctx {
  decompress(dest: Uint8Array, src: Uint8Array): number;
}

/**
 * Opens one record (`nonce | GCM(codec | payload) | tag`, `id` as associated data) and decodes
 * its `raw` bytes into `out` at `at`. Returns why it is bad ("fails authentication"), or
 * undefined when it is good; nothing is written for a record that fails authentication, and
 * plaintext that passed through a temporary buffer is wiped. Restore and verify both use it.
 */
export function decodeRecord(
  key: KeyObject | Buffer,
  dctx: Zdctx,
  id: Uint8Array,
  record: Uint8Array,
  out: Buffer,
  at: number,
  raw: number,
): string | undefined {
  const stored = record.length;
  if (stored < NONCE_BYTES + TAG_BYTES + 1) return 'fails authentication';
  const d = createDecipheriv('aes-256-gcm', key, record.subarray(0, NONCE_BYTES), {
    authTagLength: TAG_BYTES,
  });
  d.setAAD(id);
  d.setAuthTag(record.subarray(stored - TAG_BYTES));
  const plain = d.update(record.subarray(NONCE_BYTES, stored - TAG_BYTES));
  try {
    try {
      d.final();
    } catch {
      return 'fails authentication';
    }
    const codec = plain[0];
    if (codec === CODEC_RAW) {
      if (plain.length - 1 !== raw) return 'has the wrong length';
      plain.copy(out, at, 1);
    } else if (codec === CODEC_ZSTD) {
      let n: number;
      try {
        n = dctx.decompress(out.subarray(at, at + raw), plain.subarray(1));
      } catch (e) {
        return `does not decompress (${e instanceof Error ? e.message : String(e)})`;
      }
      if (n !== raw) return 'has the wrong length';
    } else {
      return 'has an unknown codec';
    }
    return undefined;
  } finally {
    plain.fill(0);
  }
}

/**
 * Opens and decompresses every record of a batch into `out` ({@link decodeRecord}), then
 * copies the repeated chunks; returns the first record that fails (and why) without looking
 * further, or undefined when all are good.
 */
export function decodeRecords(
  key: KeyObject,
  dctx: Zdctx,
  input: Buffer,
  recs: Int32Array,
  ids: Uint8Array,
  copies: Int32Array,
  out: Buffer,
): { rec: number; why: string } | undefined {
  const count = recs.length >> 2;
  for (let i = 0; i < count; i++) {
    const off = recs[i * 4]!;
    const why = decodeRecord(
      key,
      dctx,
      ids.subarray(i * CHUNK_ID_BYTES, (i + 1) * CHUNK_ID_BYTES),
      input.subarray(off, off + recs[i * 4 + 1]!),
      out,
      recs[i * 4 + 3]!,
      recs[i * 4 + 2]!,
    );
    if (why !== undefined) return { rec: i, why };
  }
  for (let i = 0; i < copies.length; i += 3)
    out.copy(out, copies[i + 1], copies[i], copies[i]! + copies[i + 2]!);
  return undefined;
}

let dctx: Zdctx | undefined;

function decodeJob(msg: DecodeJob): DecodeDone {
  const key = createSecretKey(msg.key);
  msg.key.fill(0);
  dctx ??= new zstd.DCtx();
  const back = { job: msg.job, input: msg.input, output: msg.output };
  const bad = decodeRecords(
    key,
    dctx,
    Buffer.from(msg.input),
    msg.recs,
    msg.ids,
    msg.copies,
    Buffer.from(msg.output),
  );
  return bad === undefined ? back : { ...back, badRecord: bad.rec, why: bad.why };
}

if (parentPort !== null) {
  const port = parentPort;
  port.on('message', (msg: WorkerJob) => {
    if (msg.kind === 'decode') {
      let done: DecodeDone;
      try {
        done = decodeJob(msg);
      } catch (e) {
        const error = e instanceof Error ? e.message : String(e);
        done = { job: msg.job, input: msg.input, output: msg.output, error };
      }
      port.postMessage(done, done.input && done.output ? [done.input, done.output] : []);
      return;
    }
    let done: SealDone;
    try {
      done = sealJob(msg);
    } catch (e) {
      done = { job: msg.job, lengths: new Int32Array(0), error: e instanceof Error ? e.message : String(e) };
    }
    port.postMessage(done, done.input && done.output ? [done.input, done.output] : []);
  });
}
