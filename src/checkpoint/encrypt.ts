/**
 * Encrypted OCI layers in the ocicrypt layout (what podman / skopeo / containerd's imgcrypt read):
 *
 * - the layer is encrypted with a fresh 32-byte key and 16-byte nonce, AES-256-CTR, and an
 *   HMAC-SHA256 (same key) over the ciphertext: the `AES_256_CTR_HMAC_SHA256` cipher;
 * - its media type gains `+encrypted`; its digest and size are the encrypted blob's;
 * - `org.opencontainers.image.enc.pubopts` = base64 of the public options JSON
 *   `{cipher, hmac, cipheroptions}`;
 * - `org.opencontainers.image.enc.keys.jwe` = base64 of a JWE (JSON serialization, one
 *   recipient per key, RSA-OAEP key wrap, A256GCM content) whose plaintext is the private
 *   options JSON `{symkey, digest, cipheroptions: {nonce}, cipher}`; `digest` is the plain
 *   layer's.
 *
 * Byte fields are standard base64 (Go's encoding of []byte); JWE parts are base64url.
 */
import {
  createCipheriv,
  createHash,
  createHmac,
  createPublicKey,
  publicEncrypt,
  randomBytes,
  constants,
  type KeyObject,
} from 'node:crypto';
import { createReadStream, createWriteStream } from 'node:fs';
import { readFile } from 'node:fs/promises';
import { once } from 'node:events';
import { DormantError, ErrorCode } from '../domain/errors.js';

export const ENC_CIPHER = 'AES_256_CTR_HMAC_SHA256';
export const ANN_ENC_KEYS_JWE = 'org.opencontainers.image.enc.keys.jwe';
export const ANN_ENC_PUBOPTS = 'org.opencontainers.image.enc.pubopts';

export interface PrivateOptions {
  symkey: string;
  cipheroptions: { nonce: string };
  digest: string;
  cipher: string;
}
export interface PublicOptions {
  cipher: string;
  hmac: string;
  cipheroptions: Record<string, string>;
}

const b64u = (b: Buffer): string => b.toString('base64url');

/**
 * Reads recipients: `jwe:FILE` (or a bare FILE) holding an RSA public key in PEM (or an X.509
 * certificate's). Anything else is refused, naming the recipient.
 */
export async function loadRecipients(specs: string[]): Promise<KeyObject[]> {
  if (specs.length === 0)
    throw new DormantError(
      ErrorCode.INVALID_ARGUMENT,
      '--encrypt needs at least one --recipient jwe:PUBKEY.pem',
    );
  const keys: KeyObject[] = [];
  for (const spec of specs) {
    const m = /^(?:([a-z0-9]+):)?(.+)$/.exec(spec);
    const scheme = m?.[1] ?? 'jwe';
    const file = m?.[2] ?? spec;
    if (scheme !== 'jwe')
      throw new DormantError(
        ErrorCode.INVALID_ARGUMENT,
        `--recipient ${spec}: only jwe:PUBKEY.pem is supported`,
      );
    let pem: Buffer;
    try {
      pem = await readFile(file);
    } catch (e) {
      throw new DormantError(
        ErrorCode.INVALID_ARGUMENT,
        `--recipient ${spec}: cannot read ${file} (${(e as Error).message})`,
      );
    }
    let key: KeyObject;
    try {
      key = createPublicKey(pem);
    } catch {
      throw new DormantError(
        ErrorCode.INVALID_ARGUMENT,
        `--recipient ${spec}: ${file} is not a PEM public key`,
        { hint: 'e.g. openssl rsa -in key.pem -pubout -out pub.pem' },
      );
    }
    if (key.asymmetricKeyType !== 'rsa' || (key.asymmetricKeyDetails?.modulusLength ?? 0) < 2048)
      throw new DormantError(
        ErrorCode.INVALID_ARGUMENT,
        `--recipient ${spec}: ${file} is a ${key.asymmetricKeyType ?? 'unknown'} key${key.asymmetricKeyType === 'rsa' ? ' shorter than 2048 bits' : ''}; an RSA public key of 2048 bits or more is needed`,
      );
    keys.push(key);
  }
  return keys;
}

/** A JWE in the JSON serialization: `plaintext` under A256GCM, its key wrapped (RSA-OAEP) for each recipient. */
export function jweEncrypt(plaintext: Buffer, recipients: KeyObject[]): string {
  const cek = randomBytes(32);
  const iv = randomBytes(12);
  const protectedHeader = b64u(Buffer.from(JSON.stringify({ enc: 'A256GCM' })));
  const gcm = createCipheriv('aes-256-gcm', cek, iv);
  gcm.setAAD(Buffer.from(protectedHeader, 'ascii'));
  const ciphertext = Buffer.concat([gcm.update(plaintext), gcm.final()]);
  const jwe = {
    protected: protectedHeader,
    recipients: recipients.map((key) => ({
      header: { alg: 'RSA-OAEP' },
      encrypted_key: b64u(
        publicEncrypt({ key, padding: constants.RSA_PKCS1_OAEP_PADDING, oaepHash: 'sha1' }, cek),
      ),
    })),
    iv: b64u(iv),
    ciphertext: b64u(ciphertext),
    tag: b64u(gcm.getAuthTag()),
  };
  cek.fill(0);
  return JSON.stringify(jwe);
}

/**
 * Encrypts the file `plainFile` into `outFile` (new, mode 0600) in one pass. Returns the
 * encrypted blob's digest and size, the plain layer's digest, and the layer annotations.
 */
export async function encryptLayer(
  plainFile: string,
  outFile: string,
  recipients: KeyObject[],
): Promise<{ digest: string; size: number; plainDigest: string; annotations: Record<string, string> }> {
  const symkey = randomBytes(32);
  const nonce = randomBytes(16);
  try {
    const ctr = createCipheriv('aes-256-ctr', symkey, nonce);
    const mac = createHmac('sha256', symkey);
    const plainHash = createHash('sha256');
    const encHash = createHash('sha256');
    let size = 0;
    const out = createWriteStream(outFile, { mode: 0o600, flags: 'wx' });
    const failed = new Promise<never>((_, reject) => out.once('error', reject));
    failed.catch(() => undefined);
    const put = async (b: Buffer): Promise<void> => {
      if (b.length === 0) return;
      mac.update(b);
      encHash.update(b);
      size += b.length;
      if (!out.write(b)) await Promise.race([once(out, 'drain'), failed]);
    };
    try {
      for await (const chunk of createReadStream(plainFile, {
        highWaterMark: 1024 * 1024,
      }) as AsyncIterable<Buffer>) {
        plainHash.update(chunk);
        await put(ctr.update(chunk));
      }
      await put(ctr.final());
      out.end();
      await Promise.race([once(out, 'finish'), failed]);
    } catch (e) {
      out.destroy();
      throw e;
    }
    const plainDigest = `sha256:${plainHash.digest('hex')}`;
    const priv: PrivateOptions = {
      symkey: symkey.toString('base64'),
      cipheroptions: { nonce: nonce.toString('base64') },
      digest: plainDigest,
      cipher: ENC_CIPHER,
    };
    const pub: PublicOptions = {
      cipher: ENC_CIPHER,
      hmac: mac.digest().toString('base64'),
      cipheroptions: {},
    };
    const privJson = Buffer.from(JSON.stringify(priv));
    const jwe = jweEncrypt(privJson, recipients);
    privJson.fill(0);
    return {
      digest: `sha256:${encHash.digest('hex')}`,
      size,
      plainDigest,
      annotations: {
        [ANN_ENC_KEYS_JWE]: Buffer.from(jwe).toString('base64'),
        [ANN_ENC_PUBOPTS]: Buffer.from(JSON.stringify(pub)).toString('base64'),
      },
    };
  } finally {
    symkey.fill(0);
  }
}
