/**
 * CRIU's image file framing: a 32-bit magic (or the common/service magic followed by the
 * image's own), then entries, each a little-endian 32-bit length and that many bytes of
 * protobuf. pages-*.img are raw (no framing); pagemap-*.img address them.
 */
import { malformed } from './proto.js';

export const IMG_COMMON_MAGIC = 0x54564319;
export const IMG_SERVICE_MAGIC = 0x55105940;

/** The image magics dormant reads (numbers from CRIU's criu/include/magic.h). */
export const Magic = {
  INVENTORY: 0x58313116,
  PSTREE: 0x50273030,
  FDINFO: 0x56213732,
  PAGEMAP: 0x56084025,
  CORE: 0x55053847,
  IDS: 0x54432030,
  MM: 0x57492820,
  MNTS: 0x55563928,
  CGROUP: 0x59383330,
  FILES: 0x56303138,
  FS: 0x51403912,
  STATS: 0x57093306,
  USERNS: 0x55474906,
  SECCOMP: 0x64413049,
  CREDS: 0x54023547,
} as const;

/** No single CRIU entry comes close to this; a larger length means a damaged file. */
const MAX_ENTRY_BYTES = 64 * 1024 * 1024;

export interface ImageFile {
  magic: number;
  entries: Uint8Array[];
}

/**
 * Splits an image into its entries, checking the magic when `expected` is given. `maxEntries`
 * bounds what is allocated for a file of tiny entries (each is an object of its own).
 */
export function parseImage(
  buf: Uint8Array,
  name: string,
  expected?: number,
  maxEntries = Infinity,
): ImageFile {
  if (buf.length < 4) throw malformed(`${name}: shorter than its magic`);
  const dv = new DataView(buf.buffer, buf.byteOffset, buf.byteLength);
  let magic = dv.getUint32(0, true);
  let pos = 4;
  if (magic === IMG_COMMON_MAGIC || magic === IMG_SERVICE_MAGIC) {
    if (buf.length < 8) throw malformed(`${name}: truncated after the common magic`);
    magic = dv.getUint32(4, true);
    pos = 8;
  }
  if (expected !== undefined && magic !== expected)
    throw malformed(`${name}: magic 0x${magic.toString(16)}, expected 0x${expected.toString(16)}`);
  const entries: Uint8Array[] = [];
  while (pos < buf.length) {
    if (pos + 4 > buf.length) throw malformed(`${name}: truncated entry length at byte ${pos}`);
    const len = dv.getUint32(pos, true);
    pos += 4;
    if (len > MAX_ENTRY_BYTES || pos + len > buf.length)
      throw malformed(`${name}: entry of ${len} bytes at byte ${pos - 4} runs past the end (${buf.length})`);
    if (entries.length >= maxEntries) throw malformed(`${name}: more than ${maxEntries} entries`);
    entries.push(buf.subarray(pos, pos + len));
    pos += len;
  }
  return { magic, entries };
}
