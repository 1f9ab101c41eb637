/**
 * The vault's cryptography, in one place: key derivation (HKDF-SHA256), chunk ids
 * (HMAC-SHA256 keyed per tenant) and sealing (AES-256-GCM with a fresh random 96-bit nonce
 * per message and the caller's associated data). Every sealed object is `nonce | ciphertext |
 * tag`; opening fails closed, it never returns unauthenticated bytes.
 */
import {
  createCipheriv,
  createDecipheriv,
  createHmac,
  createSecretKey,
  hkdfSync,
  randomFillSync,
  type KeyObject,
} from 'node:crypto';

export const KEY_BYTES = 32;
export const NONCE_BYTES = 12;
export const TAG_BYTES = 16;
export const SEAL_OVERHEAD = NONCE_BYTES + TAG_BYTES;
/**
 * Chunk ids are HMAC-SHA256 truncated to 128 bits: keyed, so nobody without the tenant key can
 * aim for a collision, and 2^-64 odds of an accidental one even at 2^32 chunks (64 TiB). Every
 * id is stored three times (index, manifest, AAD), so halving it saves ~3 MB per GiB stored.
 */
export const CHUNK_ID_BYTES = 16;

/** The keys one tenant's data is handled with, all derived from the tenant's data key. */
export interface TenantKeys {
  /** HMAC key for chunk ids: equal content gives equal ids within the tenant only. */
  readonly idKey: Buffer;
  /** The same key imported once (HMAC per chunk is measurably faster with a KeyObject). */
  readonly idKeyObject: KeyObject;
  /** AES-256-GCM key for chunk records in packs. */
  readonly dataKey: Buffer;
  /** AES-256-GCM key for pack indexes. */
  readonly indexKey: Buffer;
  /** AES-256-GCM key that wraps the tenant's sandbox keys. */
  readonly wrapKey: Buffer;
  /** Seed for the tenant's gear table (chunk boundaries differ per tenant). */
  readonly gear: Int32Array;
}

export function deriveKey(secret: Uint8Array, info: string, bytes = KEY_BYTES): Buffer {
  return Buffer.from(hkdfSync('sha256', secret, Buffer.alloc(0), `dormant-vault-v1 ${info}`, bytes));
}

export function deriveTenantKeys(tenantKey: Uint8Array): TenantKeys {
  const gearBytes = deriveKey(tenantKey, 'gear', 1024);
  const gear = new Int32Array(256);
  for (let i = 0; i < 256; i++) gear[i] = gearBytes.readInt32LE(i * 4);
  const idKey = deriveKey(tenantKey, 'chunk-id');
  return Object.freeze({
    idKey,
    idKeyObject: createSecretKey(idKey),
    dataKey: deriveKey(tenantKey, 'chunk-data'),
    indexKey: deriveKey(tenantKey, 'pack-index'),
    wrapKey: deriveKey(tenantKey, 'sandbox-key-wrap'),
    gear,
  });
}

/** Overwrites key material held in memory (best effort: V8 may have copied it). */
export function wipeTenantKeys(k: TenantKeys): void {
  k.idKey.fill(0);
  k.dataKey.fill(0);
  k.indexKey.fill(0);
  k.wrapKey.fill(0);
  k.gear.fill(0);
}

export function chunkId(idKey: Buffer | KeyObject, data: Uint8Array): Buffer {
  return createHmac('sha256', idKey).update(data).digest().subarray(0, CHUNK_ID_BYTES);
}

/** Random nonces drawn from a pool: one getrandom call per 1024 nonces instead of per chunk. */
class NoncePool {
  private pool = Buffer.alloc(NONCE_BYTES * 1024);
  private at = this.pool.length;
  next(): Buffer {
    if (this.at >= this.pool.length) {
      this.pool = Buffer.alloc(this.pool.length);
      randomFillSync(this.pool);
      this.at = 0;
    }
    const n = this.pool.subarray(this.at, this.at + NONCE_BYTES);
    this.at += NONCE_BYTES;
    return n;
  }
}
const nonces = new NoncePool();

/**
 * Seals `parts` (concatenated) under `key` with associated data `aad`, returning the pieces of
 * `nonce | ciphertext | tag` so the caller can write them without another copy.
 */
export function sealParts(key: Buffer, aad: Uint8Array, parts: readonly Uint8Array[]): Buffer[] {
  const nonce = nonces.next();
  const c = createCipheriv('aes-256-gcm', key, nonce);
  c.setAAD(aad);
  const out: Buffer[] = [nonce];
  for (const p of parts) out.push(c.update(p));
  const fin = c.final();
  if (fin.length > 0) out.push(fin);
  out.push(c.getAuthTag());
  return out;
}

export function seal(key: Buffer, aad: Uint8Array, plaintext: Uint8Array): Buffer {
  return Buffer.concat(sealParts(key, aad, [plaintext]));
}

/** Opens `nonce | ciphertext | tag`; returns undefined when authentication fails. */
export function open(key: Buffer, aad: Uint8Array, sealed: Uint8Array): Buffer | undefined {
  if (sealed.length < SEAL_OVERHEAD) return undefined;
  const d = createDecipheriv('aes-256-gcm', key, sealed.subarray(0, NONCE_BYTES));
  d.setAAD(aad);
  d.setAuthTag(sealed.subarray(sealed.length - TAG_BYTES));
  const body = d.update(sealed.subarray(NONCE_BYTES, sealed.length - TAG_BYTES));
  try {
    const fin = d.final();
    return fin.length > 0 ? Buffer.concat([body, fin]) : body;
  } catch {
    // GCM tag mismatch: the bytes (or the key, or the associated data) are not what was sealed.
    body.fill(0);
    return undefined;
  }
}
