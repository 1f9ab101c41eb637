/**
 * The protobuf encoder that goes with proto.ts's decoder: re-encodes decoded fields, so a
 * message can be edited field by field and written back. dormant writes CRIU images only to
 * take privileges away (checkpoint/narrow.ts: an imported image's creds cut to a sandbox's);
 * the tests use it to build hostile images.
 */
import { decodeFields, type Field } from './proto.js';
import { IMG_COMMON_MAGIC, IMG_SERVICE_MAGIC } from './image-file.js';

function varint(v: bigint): number[] {
  const out: number[] = [];
  let x = BigInt.asUintN(64, v);
  do {
    let b = Number(x & 0x7fn);
    x >>= 7n;
    if (x !== 0n) b |= 0x80;
    out.push(b);
  } while (x !== 0n);
  return out;
}

export function encodeFields(fields: readonly Field[]): Uint8Array {
  const parts: number[] = [];
  for (const f of fields) {
    parts.push(...varint(BigInt((f.no << 3) | f.wire)));
    if (f.wire === 0) parts.push(...varint(f.value));
    else if (f.wire === 1) {
      const b = Buffer.alloc(8);
      b.writeBigUInt64LE(f.value);
      parts.push(...b);
    } else if (f.wire === 5) {
      const b = Buffer.alloc(4);
      b.writeUInt32LE(f.value);
      parts.push(...b);
    } else {
      parts.push(...varint(BigInt(f.value.length)), ...f.value);
    }
  }
  return Uint8Array.from(parts);
}

/** Field helpers for building messages. */
export const uint = (no: number, v: number | bigint): Field => ({ no, wire: 0, value: BigInt(v) });
export const bytes = (no: number, v: Uint8Array | string): Field => ({
  no,
  wire: 2,
  value: typeof v === 'string' ? Buffer.from(v) : v,
});

/** Re-encodes a message with `edit` applied to its fields (in wire order). */
export function rewriteMessage(buf: Uint8Array, edit: (fields: Field[]) => Field[]): Uint8Array {
  return encodeFields(edit(decodeFields(buf)));
}

/** Edits the embedded message at field `no` (each occurrence). */
export function editSub(no: number, edit: (fields: Field[]) => Field[]): (fields: Field[]) => Field[] {
  return (fields) =>
    fields.map((f) => (f.no === no && f.wire === 2 ? bytes(no, rewriteMessage(f.value, edit)) : f));
}

/**
 * Rewrites each entry of an image file, keeping its magic header as it was. The image must
 * have been read through the bounded reader first: lengths here are trusted.
 */
export function rewriteImage(
  img: Uint8Array,
  edit: (entry: Uint8Array, index: number) => Uint8Array,
): Buffer {
  const b = Buffer.from(img);
  const first = b.readUInt32LE(0);
  let pos = first === IMG_COMMON_MAGIC || first === IMG_SERVICE_MAGIC ? 8 : 4;
  const parts: Buffer[] = [b.subarray(0, pos)];
  let i = 0;
  while (pos < b.length) {
    const len = b.readUInt32LE(pos);
    const entry = edit(b.subarray(pos + 4, pos + 4 + len), i++);
    const l = Buffer.alloc(4);
    l.writeUInt32LE(entry.length);
    parts.push(l, Buffer.from(entry));
    pos += 4 + len;
  }
  return Buffer.concat(parts);
}
