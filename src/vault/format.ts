/**
 * Byte layouts of the vault's objects (docs/VAULT.md has the overview):
 *
 * - pack   `DRMPK001 | packId(16)` then records `nonce(12) | AES-GCM(codec(1) | payload) | tag(16)`,
 *          each sealed with the tenant's data key and its chunk id as associated data.
 * - index  `DRMIX001 | packId(16) | sealed(entries)`, entries `id(16) offset(u32) stored(u32) raw(u32)`,
 *          sealed with the tenant's index key; associated data: magic, tenant, pack id. Ids are
 *          16 bytes (truncated HMAC-SHA256).
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
export const INDEX_MAGIC = Buffer.from('DRMIX001');
export const MANIFEST_MAGIC = Buffer.from('DRMMF001');
export const PACK_ID_BYTES = 16;
export const PACK_HEADER_BYTES = PACK_MAGIC.length + PACK_ID_BYTES;
export const INDEX_ENTRY_BYTES = CHUNK_ID_BYTES + 12;
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
  offset: number;
  storedBytes: number;
  rawBytes: number;
}

function indexAad(tenant: string, packId: string): Buffer {
  return Buffer.concat([INDEX_MAGIC, Buffer.from(`${tenant}/${packId}`)]);
}

export function encodeIndex(
  indexKey: Buffer,
  tenant: string,
  packId: string,
  entries: readonly Buffer[],
): Buffer {
  return Buffer.concat([
    INDEX_MAGIC,
    Buffer.from(packId, 'hex'),
    seal(indexKey, indexAad(tenant, packId), Buffer.concat(entries)),
  ]);
}

export function indexEntry(id: Uint8Array, offset: number, storedBytes: number, rawBytes: number): Buffer {
  const b = Buffer.allocUnsafe(INDEX_ENTRY_BYTES);
  b.set(id, 0);
  b.writeUInt32LE(offset, CHUNK_ID_BYTES);
  b.writeUInt32LE(storedBytes, CHUNK_ID_BYTES + 4);
  b.writeUInt32LE(rawBytes, CHUNK_ID_BYTES + 8);
  return b;
}

/** Decodes an index; undefined when it fails authentication or is malformed. */
export function decodeIndex(
  indexKey: Buffer,
  tenant: string,
  packId: string,
  blob: Buffer,
): IndexEntry[] | undefined {
  const head = INDEX_MAGIC.length + PACK_ID_BYTES;
  if (blob.length < head || !blob.subarray(0, INDEX_MAGIC.length).equals(INDEX_MAGIC)) return undefined;
  if (blob.subarray(INDEX_MAGIC.length, head).toString('hex') !== packId) return undefined;
  const plain = open(indexKey, indexAad(tenant, packId), blob.subarray(head));
  if (plain?.length === undefined || plain.length % INDEX_ENTRY_BYTES !== 0) return undefined;
  const out: IndexEntry[] = [];
  for (let at = 0; at < plain.length; at += INDEX_ENTRY_BYTES) {
    out.push({
      id: plain.subarray(at, at + CHUNK_ID_BYTES),
      offset: plain.readUInt32LE(at + CHUNK_ID_BYTES),
      storedBytes: plain.readUInt32LE(at + CHUNK_ID_BYTES + 4),
      rawBytes: plain.readUInt32LE(at + CHUNK_ID_BYTES + 8),
    });
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
