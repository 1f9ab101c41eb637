/**
 * A protobuf encoder for tests: re-encodes decoded fields, so a test can edit a real CRIU
 * image (a core-N.img given every capability) or build a synthetic one. Test-only: dormant
 * never writes CRIU images.
 */
import { decodeFields, type Field } from '../proto.js';
import { IMG_COMMON_MAGIC, IMG_SERVICE_MAGIC } from '../image-file.js';

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
export const sub = (no: number, fields: readonly Field[]): Field => bytes(no, encodeFields(fields));

/** Re-encodes a message with `edit` applied to its fields (in wire order). */
export function rewriteMessage(buf: Uint8Array, edit: (fields: Field[]) => Field[]): Uint8Array {
  return encodeFields(edit(decodeFields(buf)));
}

/** Edits the embedded message at field `no` (each occurrence). */
export function editSub(no: number, edit: (fields: Field[]) => Field[]): (fields: Field[]) => Field[] {
  return (fields) =>
    fields.map((f) => (f.no === no && f.wire === 2 ? bytes(no, rewriteMessage(f.value, edit)) : f));
}

/** An image file: its magic(s) then each entry with its 32-bit length. */
export function encodeImage(magic: number, entries: readonly Uint8Array[], common = true): Buffer {
  const head = Buffer.alloc(common ? 8 : 4);
  if (common) {
    head.writeUInt32LE(IMG_COMMON_MAGIC, 0);
    head.writeUInt32LE(magic, 4);
  } else head.writeUInt32LE(magic, 0);
  const parts: Buffer[] = [head];
  for (const e of entries) {
    const len = Buffer.alloc(4);
    len.writeUInt32LE(e.length);
    parts.push(len, Buffer.from(e));
  }
  return Buffer.concat(parts);
}

/** Rewrites each entry of an image file, keeping its magic header as it was. */
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

/** Every capability the kernel has (41), as CRIU's two 32-bit words. */
export const ALL_CAPS_WORDS = [0xffffffff, 0x1ff] as const;

/**
 * The edit of hole 2 of issue 20: a core-N.img whose thread holds every capability in its
 * effective, permitted and bounding sets, with no_new_privs cleared (CRIU then leaves it clear).
 */
export function allCapsNoNewPrivs(coreImg: Uint8Array): Buffer {
  const creds = (fields: Field[]): Field[] => {
    const kept = fields.filter((f) => ![10, 11, 12, 18].includes(f.no));
    const words = (no: number) => ALL_CAPS_WORDS.map((w) => uint(no, w));
    return [...kept, ...words(10), ...words(11), ...words(12)];
  };
  // core_entry.thread_core (5) -> thread_core_entry.creds (10)
  return rewriteImage(coreImg, (e) => rewriteMessage(e, editSub(5, editSub(10, creds))));
}
