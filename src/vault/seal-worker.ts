/**
 * Worker thread body. Seal jobs (ingest): compress (zstd level 1, kept only when it saves >3%)
 * and seal (AES-256-GCM) the chunks of one read buffer, several chunks to a record (up to
 * RECORD_MAX_RAW_BYTES of them, in order; their ids are the record's associated data): one
 * nonce and tag per record instead of per chunk, more context for zstd, and far fewer
 * cipher contexts to set up on restore. Decode jobs (restore): open and decompress the
 * records of one batch (see `decodeRecords`). The ingest loop reads files straight into
 * buffers that move here (transferred, not copied) with the chunks' offsets; records
 * (`nonce | ciphertext | tag`, back to back) go into an output buffer that moves back with
 * it and that the pack writer writes as it is. Both are reused job after job, so no fresh
 * memory is touched (fresh pages are what makes big allocations slow on these VMs).
 */
import { createDecipheriv, createSecretKey, type KeyObject } from 'node:crypto';
import { parentPort } from 'node:worker_threads';
import { createRequire } from 'node:module';
import { CHUNK_ID_BYTES, NONCE_BYTES, SEAL_OVERHEAD, TAG_BYTES, sealParts } from './crypto.js';
import { CODEC_RAW, CODEC_ZSTD, RECORD_MAX_RAW_BYTES } from './format.js';

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
  /** How many chunks (of the job's, in order) each record holds. */
  counts: Int32Array;
  /** The job's buffers, handed back (transferred). */
  input?: ArrayBuffer;
  output?: ArrayBuffer;
  /** Set when the job failed. */
  error?: string;
}

const CODEC_RAW_BYTE = Buffer.from([CODEC_RAW]);
const CODEC_ZSTD_BYTE = Buffer.from([CODEC_ZSTD]);

interface Zcctx {
  compress(dest: Uint8Array, src: Uint8Array, level: number): number;
}

/** Reused scratch space of the sealing thread (compressed output, gathered chunks). */
const space: { z: Buffer; gather: Buffer } = { z: Buffer.alloc(0), gather: Buffer.alloc(0) };
function grown(b: Buffer, bytes: number): Buffer {
  return b.length >= bytes ? b : Buffer.alloc(Math.max(bytes, b.length * 2));
}

/**
 * Seals the chunks `meta` names in `input` into records back to back in `output`, which must
 * hold every chunk plus one record overhead per chunk: consecutive chunks go into one record
 * until the next would take it past RECORD_MAX_RAW_BYTES. Returns each record's length and
 * chunk count. The ingest's calling thread uses it too when it runs without workers.
 */
export function sealChunks(
  cctx: Zcctx,
  key: Buffer,
  input: Buffer,
  meta: Int32Array,
  ids: Uint8Array,
  output: Buffer,
): { lengths: Int32Array; counts: Int32Array } {
  const count = meta.length >> 1;
  const lengths: number[] = [];
  const counts: number[] = [];
  let at = 0;
  for (let i = 0; i < count;) {
    // The record: chunks i..j-1.
    let j = i;
    let raw = 0;
    let contiguous = true;
    while (j < count) {
      const len = meta[j * 2 + 1]!;
      if (j > i && raw + len > RECORD_MAX_RAW_BYTES) break;
      if (j > i && meta[j * 2]! !== meta[(j - 1) * 2]! + meta[(j - 1) * 2 + 1]!) contiguous = false;
      raw += len;
      j++;
    }
    let data: Buffer;
    if (contiguous) {
      data = input.subarray(meta[i * 2], meta[i * 2]! + raw);
    } else {
      space.gather = grown(space.gather, raw);
      let g = 0;
      for (let k = i; k < j; k++) {
        input.copy(space.gather, g, meta[k * 2], meta[k * 2]! + meta[k * 2 + 1]!);
        g += meta[k * 2 + 1]!;
      }
      data = space.gather.subarray(0, raw);
    }
    space.z = grown(space.z, zstd.compressBound(raw));
    const n = cctx.compress(space.z, data, 1);
    // Keep compression only where it pays for the decompression on restore.
    const useZstd = n < raw - (raw >> 5);
    const payload = useZstd ? space.z.subarray(0, n) : data;
    const start = at;
    const aad = ids.subarray(i * CHUNK_ID_BYTES, j * CHUNK_ID_BYTES);
    for (const p of sealParts(key, aad, [useZstd ? CODEC_ZSTD_BYTE : CODEC_RAW_BYTE, payload])) {
      p.copy(output, at);
      at += p.length;
    }
    lengths.push(at - start);
    counts.push(j - i);
    i = j;
  }
  if (space.gather.length > 0) space.gather.fill(0);
  return { lengths: Int32Array.from(lengths), counts: Int32Array.from(counts) };
}

let cctx: Zcctx | undefined;

/** Seals one chunk as a record of its own (gc, when it splits a record). */
export function sealOne(key: Buffer, id: Uint8Array, data: Buffer): Buffer {
  cctx ??= new zstd.CCtx();
  const out = Buffer.allocUnsafe(data.length + 1 + SEAL_OVERHEAD);
  const r = sealChunks(cctx, key, data, Int32Array.of(0, data.length), id, out);
  return out.subarray(0, r.lengths[0]);
}

function sealJob(msg: SealJob): SealDone {
  const key = Buffer.from(msg.key);
  cctx ??= new zstd.CCtx();
  try {
    const r = sealChunks(cctx, key, Buffer.from(msg.input), msg.meta, msg.ids, Buffer.from(msg.output));
    return { job: msg.job, ...r, input: msg.input, output: msg.output };
  } finally {
    key.fill(0);
  }
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
  /**
   * count x (input offset, stored length, raw length, output offset, associated data offset,
   * associated data length).
   */
  recs: Int32Array;
  /** The records' associated data (their chunk ids), back to back. */
  aad: Uint8Array;
  /** (from, to, length) output offsets: chunks that appear again in the batch are copied. */
  copies: Int32Array;
}

/** Int32s per record in `DecodeJob.recs`. */
export const REC_FIELDS = 6;

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

/** Decryption output is taken in pieces of at most this: glibc mmaps bigger blocks afresh. */
const PIECE_BYTES = 64 * 1024;

/**
 * Opens one record (`nonce | GCM(codec | payload) | tag`, `aad` as associated data: the ids of
 * its chunks) and decodes its `raw` bytes into `out` at `at`. Returns why it is bad ("fails
 * authentication"), or undefined when it is good; nothing is written for a record that fails
 * authentication, and plaintext that passed through temporary buffers is wiped. Restore,
 * verify and gc all use it.
 */
export function decodeRecord(
  key: KeyObject | Buffer,
  dctx: Zdctx,
  aad: Uint8Array,
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
  d.setAAD(aad);
  d.setAuthTag(record.subarray(stored - TAG_BYTES));
  const end = stored - TAG_BYTES;
  const pieces: Buffer[] = [];
  for (let p = NONCE_BYTES; p < end; p += PIECE_BYTES)
    pieces.push(d.update(record.subarray(p, Math.min(end, p + PIECE_BYTES))));
  try {
    try {
      d.final();
    } catch {
      return 'fails authentication';
    }
    const codec = pieces[0]![0];
    let length = -1;
    for (const p of pieces) length += p.length;
    if (codec === CODEC_RAW) {
      if (length !== raw) return 'has the wrong length';
      let o = at;
      for (const [i, p] of pieces.entries()) o += p.copy(out, o, i === 0 ? 1 : 0);
    } else if (codec === CODEC_ZSTD) {
      let src: Buffer;
      if (pieces.length === 1) {
        src = pieces[0]!.subarray(1);
      } else {
        space.gather = grown(space.gather, length);
        let g = 0;
        for (const [i, p] of pieces.entries()) g += p.copy(space.gather, g, i === 0 ? 1 : 0);
        src = space.gather.subarray(0, length);
      }
      let n: number;
      try {
        n = dctx.decompress(out.subarray(at, at + raw), src);
      } catch (e) {
        return `does not decompress (${e instanceof Error ? e.message : String(e)})`;
      } finally {
        if (pieces.length > 1) src.fill(0);
      }
      if (n !== raw) return 'has the wrong length';
    } else {
      return 'has an unknown codec';
    }
    return undefined;
  } finally {
    for (const p of pieces) p.fill(0);
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
  aad: Uint8Array,
  copies: Int32Array,
  out: Buffer,
): { rec: number; why: string } | undefined {
  const count = recs.length / REC_FIELDS;
  for (let i = 0; i < count; i++) {
    const r = i * REC_FIELDS;
    const off = recs[r]!;
    const why = decodeRecord(
      key,
      dctx,
      aad.subarray(recs[r + 4], recs[r + 4]! + recs[r + 5]!),
      input.subarray(off, off + recs[r + 1]!),
      out,
      recs[r + 3]!,
      recs[r + 2]!,
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
    msg.aad,
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
      const error = e instanceof Error ? e.message : String(e);
      done = { job: msg.job, lengths: new Int32Array(0), counts: new Int32Array(0), error };
    }
    port.postMessage(done, done.input && done.output ? [done.input, done.output] : []);
  });
}
