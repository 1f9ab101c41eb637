/**
 * Edits of real CRIU images for tests (a core-N.img given every capability) and synthetic
 * images, on the encoder of ../write.ts.
 */
import type { Field } from '../proto.js';
import { IMG_COMMON_MAGIC } from '../image-file.js';
import { bytes, editSub, encodeFields, rewriteImage, rewriteMessage, uint } from '../write.js';

export { bytes, editSub, encodeFields, rewriteImage, rewriteMessage, uint };

export const sub = (no: number, fields: readonly Field[]): Field => bytes(no, encodeFields(fields));

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
