/**
 * Byte layouts of the vault's objects (docs/VAULT.md has the overview):
 *
 * - pack   `DRMPK001 | packId(16)` then records `nonce(12) | AES-GCM(codec(1) | payload) | tag(16)`,
 *          each sealed with the tenant's data key. A record holds one chunk or several chunks
 *          back to back (compressed together); its associated data is the ids of its chunks,
 *          in order (for one chunk: its id).
 * - index  `DRMIX002 | packId(16) | sealed(zstd(entries))`, entries `id(16) offset(u32) stored(u32)
 *          raw(u32) inner(u32)`: the chunk's record (pack offset and sealed length), the chunk's
 *          length and where it starts in the record's plaintext. Entries of one record are
 *          adjacent, in order. Sealed with the tenant's index key; associated data: magic,
 *          tenant, pack id. Ids are 16 bytes (truncated HMAC-SHA256). `DRMIX001` (entries
 *          without `inner`, not compressed, one chunk per record) is still read.
 * - manifest `DRMMF001 | u32 len | header JSON | sealed(body)`: the plaintext header (ids, time,
 *          size) is authenticated as associated data; the body (file list and chunk references)
 *          is sealed with the sandbox's key.
 */
import { createRequire } from 'node:module';
import { DormantError, ErrorCode } from '../domain/errors.js';
import { CHUNK_ID_BYTES, open, seal } from './crypto.js';

type Zstd = typeof import('zstd-napi');
const zstd = createRequire(import.meta.url)('zstd-napi') as Zstd;

export const PACK_MAGIC = Buffer.from('DRMPK001');
export const INDEX_MAGIC = Buffer.from('DRMIX002');
/** The first index format: one chunk per record, entries without `inner`, not compressed. */
export const INDEX_MAGIC_V1 = Buffer.from('DRMIX001');
export const MANIFEST_MAGIC = Buffer.from('DRMMF001');
export const PACK_ID_BYTES = 16;
export const PACK_HEADER_BYTES = PACK_MAGIC.length + PACK_ID_BYTES;
export const INDEX_ENTRY_BYTES = CHUNK_ID_BYTES + 16;
const INDEX_ENTRY_BYTES_V1 = CHUNK_ID_BYTES + 12;
/**
 * Most plaintext one record holds. Several chunks sealed together cost one nonce and tag and
 * compress with more context; a restore that needs one of them decodes them all, so records
 * stay small next to a restore batch.
 */
export const RECORD_MAX_RAW_BYTES = 256 * 1024;
/** A manifest reference: kind(1) length(u32) id(16); holes carry a zero id. */
export const REF_BYTES = 1 + 4 + CHUNK_ID_BYTES;
export const REF_DATA = 0;
export const REF_HOLE = 1;

export const CODEC_RAW = 0;
export const CODEC_ZSTD = 1;

export function packHeader(packId: string): Buffer {
  return Buffer.concat([PACK_MAGIC, Buffer.from(packId, 'hex')]);
}

export interface IndexEntry {
  id: Buffer;
  /** The chunk's record: pack offset and sealed length. */
  offset: number;
  storedBytes: number;
  rawBytes: number;
  /** Where the chunk starts in its record's plaintext. */
  inner: number;
  /** The same, with the record's other chunks grouped (see {@link locateEntries}). */
  loc: ChunkLocation;
}

/** A record that holds several chunks: its plaintext length and associated data. */
export interface RecordGroup {
  rawBytes: number;
  /** The ids of its chunks, in order. */
  aad: Buffer;
  chunks: number;
}

/** Where a chunk lives. `pack` is the pack id. */
export interface ChunkLocation {
  pack: string;
  /** The record that holds the chunk: its pack offset and sealed length. */
  offset: number;
  storedBytes: number;
  /** The chunk's length. */
  rawBytes: number;
  /** Where the chunk starts in the record's plaintext. */
  inner: number;
  /** Set when the record holds several chunks; a one-chunk record is the chunk alone. */
  group?: RecordGroup;
}

/** The plaintext length of the record that holds `loc`. */
export function recordRawBytes(loc: ChunkLocation): number {
  return loc.group?.rawBytes ?? loc.rawBytes;
}

/** The associated data of the record that holds `loc` (chunk `id`). */
export function recordAad(loc: ChunkLocation, id: Uint8Array): Uint8Array {
  return loc.group?.aad ?? id;
}

/** The stored bytes that are this chunk's share of its record (by length). */
export function storedShare(loc: ChunkLocation): number {
  return loc.group === undefined ? loc.storedBytes : (loc.storedBytes * loc.rawBytes) / loc.group.rawBytes;
}

function indexAad(magic: Buffer, tenant: string, packId: string): Buffer {
  return Buffer.concat([magic, Buffer.from(`${tenant}/${packId}`)]);
}

export function encodeIndex(
  indexKey: Buffer,
  tenant: string,
  packId: string,
  entries: readonly Buffer[],
): Buffer {
  // Compressed: entries of one record repeat its offset and length; ids do not shrink.
  const plain = zstd.compress(Buffer.concat(entries), { compressionLevel: 3 });
  return Buffer.concat([
    INDEX_MAGIC,
    Buffer.from(packId, 'hex'),
    seal(indexKey, indexAad(INDEX_MAGIC, tenant, packId), plain),
  ]);
}

export function indexEntry(
  id: Uint8Array,
  offset: number,
  storedBytes: number,
  rawBytes: number,
  inner: number,
): Buffer {
  const b = Buffer.allocUnsafe(INDEX_ENTRY_BYTES);
  b.set(id, 0);
  b.writeUInt32LE(offset, CHUNK_ID_BYTES);
  b.writeUInt32LE(storedBytes, CHUNK_ID_BYTES + 4);
  b.writeUInt32LE(rawBytes, CHUNK_ID_BYTES + 8);
  b.writeUInt32LE(inner, CHUNK_ID_BYTES + 12);
  return b;
}

/**
 * Decodes an index; undefined when it fails authentication or is malformed (entries of a
 * record that do not tile its plaintext, or a record split by another's entries).
 */
export function decodeIndex(
  indexKey: Buffer,
  tenant: string,
  packId: string,
  blob: Buffer,
): IndexEntry[] | undefined {
  const head = INDEX_MAGIC.length + PACK_ID_BYTES;
  if (blob.length < head) return undefined;
  const magic = blob.subarray(0, INDEX_MAGIC.length);
  const v1 = magic.equals(INDEX_MAGIC_V1);
  if (!v1 && !magic.equals(INDEX_MAGIC)) return undefined;
  if (blob.subarray(INDEX_MAGIC.length, head).toString('hex') !== packId) return undefined;
  const sealed = open(
    indexKey,
    indexAad(v1 ? INDEX_MAGIC_V1 : INDEX_MAGIC, tenant, packId),
    blob.subarray(head),
  );
  if (sealed === undefined) return undefined;
  let plain: Buffer;
  try {
    plain = v1 ? sealed : zstd.decompress(sealed);
  } catch {
    return undefined;
  }
  const size = v1 ? INDEX_ENTRY_BYTES_V1 : INDEX_ENTRY_BYTES;
  if (plain.length % size !== 0) return undefined;
  return locateEntries(packId, plain, size, v1);
}

/**
 * The entries of pack `pack`'s index (`size` bytes each, in `plain`), each with its location
 * and the records of several chunks grouped, in one pass (a vault's open reads every index).
 * Undefined when the entries of a record are not adjacent or do not tile its plaintext from 0.
 */
function locateEntries(pack: string, plain: Buffer, size: number, v1: boolean): IndexEntry[] | undefined {
  const n = plain.length / size;
  const out = new Array<IndexEntry>(n);
  const seen = new Set<number>();
  const field = (k: number, f: number): number => plain.readUInt32LE(k * size + CHUNK_ID_BYTES + 4 * f);
  for (let i = 0; i < n;) {
    const offset = field(i, 0);
    const storedBytes = field(i, 1);
    let j = i;
    let raw = 0;
    for (; j < n && field(j, 0) === offset; j++) {
      if (field(j, 1) !== storedBytes || (v1 ? 0 : field(j, 3)) !== raw) return undefined;
      raw += field(j, 2);
    }
    if (seen.has(offset) || (j - i > 1 && raw > RECORD_MAX_RAW_BYTES)) return undefined;
    seen.add(offset);
    let group: RecordGroup | undefined;
    if (j - i > 1) {
      const aad = Buffer.allocUnsafe((j - i) * CHUNK_ID_BYTES);
      for (let k = i; k < j; k++)
        plain.copy(aad, (k - i) * CHUNK_ID_BYTES, k * size, k * size + CHUNK_ID_BYTES);
      group = { rawBytes: raw, aad, chunks: j - i };
    }
    for (let k = i; k < j; k++) {
      const rawBytes = field(k, 2);
      const inner = v1 ? 0 : field(k, 3);
      const loc: ChunkLocation = { pack, offset, storedBytes, rawBytes, inner, group };
      out[k] = {
        id: plain.subarray(k * size, k * size + CHUNK_ID_BYTES),
        offset,
        storedBytes,
        rawBytes,
        inner,
        loc,
      };
    }
    i = j;
  }
  return out;
}

/** One entry of a checkpoint's folder, in walk order (parents before children). */
export interface ManifestEntry {
  /** Relative path with `/` separators; '' never appears (the root is implied). */
  path: string;
  type: 'file' | 'dir' | 'symlink';
  /** Permission bits (07777). */
  mode: number;
  sizeBytes: number;
  mtimeMs: number;
  /** Symlink target. */
  target?: string;
  /** This file's references: refs[firstRef .. firstRef + refCount). */
  firstRef: number;
  refCount: number;
}

/** The authenticated but readable part of a manifest (listing needs no sandbox key). */
export interface ManifestHeader {
  v: 1;
  tenant: string;
  sandboxId: string;
  checkpointId: string;
  createdAt: string;
  /** Sum of file sizes. */
  logicalBytes: number;
  fileCount: number;
}

export interface ManifestBody {
  entries: ManifestEntry[];
  /** Caller-supplied facts (architecture, CRIU version, ...). Sealed, never secrets anyway. */
  meta: Record<string, string>;
  /** Packed references, REF_BYTES each. */
  refs: Buffer;
}

export function encodeManifest(key: Buffer, header: ManifestHeader, body: ManifestBody): Buffer {
  const h = Buffer.from(JSON.stringify(header));
  const len = Buffer.alloc(4);
  len.writeUInt32LE(h.length);
  const json = Buffer.from(JSON.stringify({ entries: body.entries, meta: body.meta }));
  const jlen = Buffer.alloc(4);
  jlen.writeUInt32LE(json.length);
  const aad = Buffer.concat([MANIFEST_MAGIC, len, h]);
  // Compressed: the file list and the kinds and lengths of references shrink a lot; ids do not.
  const plain = zstd.compress(Buffer.concat([jlen, json, body.refs]), { compressionLevel: 3 });
  return Buffer.concat([aad, seal(key, aad, plain)]);
}

function corrupt(name: string, what: string): DormantError {
  return new DormantError(ErrorCode.VAULT_CORRUPT, what, {
    details: { object: name },
    hint: 'run `dormant vault verify` to see every damaged object; restore the vault from a replica',
  });
}

/** Reads the header without the key. Throws VAULT_CORRUPT when the layout is broken. */
export function decodeManifestHeader(
  name: string,
  blob: Buffer,
): { header: ManifestHeader; headerBytes: number } {
  const m = MANIFEST_MAGIC.length;
  if (blob.length < m + 4 || !blob.subarray(0, m).equals(MANIFEST_MAGIC)) {
    throw corrupt(name, `manifest ${name} has no manifest header`);
  }
  const hl = blob.readUInt32LE(m);
  if (hl > 64 * 1024 || m + 4 + hl > blob.length)
    throw corrupt(name, `manifest ${name} has a broken header length`);
  let header: ManifestHeader;
  try {
    header = JSON.parse(blob.subarray(m + 4, m + 4 + hl).toString('utf8')) as ManifestHeader;
  } catch (e) {
    throw corrupt(name, `manifest ${name} has an unreadable header (${e instanceof Error ? e.message : ''})`);
  }
  if (
    header.v !== 1 ||
    typeof header.tenant !== 'string' ||
    typeof header.sandboxId !== 'string' ||
    typeof header.checkpointId !== 'string'
  ) {
    throw corrupt(name, `manifest ${name} has an unknown header`);
  }
  return { header, headerBytes: m + 4 + hl };
}

/** Opens the body; undefined when authentication fails (any flipped byte, header included). */
export function decodeManifestBody(key: Buffer, blob: Buffer, headerBytes: number): ManifestBody | undefined {
  const sealed = open(key, blob.subarray(0, headerBytes), blob.subarray(headerBytes));
  if (sealed === undefined) return undefined;
  // Authenticated above: whatever fails from here on is a bug or a wrong format version.
  const plain = zstd.decompress(sealed);
  if (plain.length < 4) return undefined;
  const jl = plain.readUInt32LE(0);
  const parsed = JSON.parse(plain.subarray(4, 4 + jl).toString('utf8')) as {
    entries: ManifestEntry[];
    meta: Record<string, string>;
  };
  const refs = plain.subarray(4 + jl);
  if (refs.length % REF_BYTES !== 0) return undefined;
  return { entries: parsed.entries, meta: parsed.meta, refs };
}
