/**
 * An independent reader of ocicrypt-style encrypted layers, for tests: unwraps the JWE with
 * an RSA private key, checks the HMAC over the ciphertext, decrypts AES-256-CTR and checks the
 * plain digest against the private options.
 */
import {
  constants,
  createDecipheriv,
  createHash,
  createHmac,
  privateDecrypt,
  timingSafeEqual,
  type KeyObject,
} from 'node:crypto';

interface Jwe {
  protected: string;
  recipients: { header: { alg: string }; encrypted_key: string }[];
  iv: string;
  ciphertext: string;
  tag: string;
}

export function decryptLayer(
  blob: Buffer,
  annotations: Record<string, string>,
  key: KeyObject,
): {
  plain: Buffer;
  priv: { symkey: string; digest: string; cipher: string; cipheroptions: { nonce: string } };
} {
  const jwe = JSON.parse(
    Buffer.from(annotations['org.opencontainers.image.enc.keys.jwe']!, 'base64').toString(),
  ) as Jwe;
  const pub = JSON.parse(
    Buffer.from(annotations['org.opencontainers.image.enc.pubopts']!, 'base64').toString(),
  ) as { cipher: string; hmac: string };
  if ((JSON.parse(Buffer.from(jwe.protected, 'base64url').toString()) as { enc: string }).enc !== 'A256GCM')
    throw new Error('unexpected JWE enc');
  let cek: Buffer | undefined;
  for (const r of jwe.recipients) {
    if (r.header.alg !== 'RSA-OAEP') continue;
    try {
      cek = privateDecrypt(
        { key, padding: constants.RSA_PKCS1_OAEP_PADDING, oaepHash: 'sha1' },
        Buffer.from(r.encrypted_key, 'base64url'),
      );
      break;
    } catch {
      // another recipient's
    }
  }
  if (!cek) throw new Error('no JWE recipient entry opens with this key');
  const gcm = createDecipheriv('aes-256-gcm', cek, Buffer.from(jwe.iv, 'base64url'));
  gcm.setAAD(Buffer.from(jwe.protected, 'ascii'));
  gcm.setAuthTag(Buffer.from(jwe.tag, 'base64url'));
  const privJson = Buffer.concat([gcm.update(Buffer.from(jwe.ciphertext, 'base64url')), gcm.final()]);
  const priv = JSON.parse(privJson.toString()) as {
    symkey: string;
    digest: string;
    cipher: string;
    cipheroptions: { nonce: string };
  };
  if (priv.cipher !== 'AES_256_CTR_HMAC_SHA256' || pub.cipher !== priv.cipher)
    throw new Error('unexpected cipher');
  const symkey = Buffer.from(priv.symkey, 'base64');
  const mac = createHmac('sha256', symkey).update(blob).digest();
  const want = Buffer.from(pub.hmac, 'base64');
  if (mac.length !== want.length || !timingSafeEqual(mac, want))
    throw new Error('HMAC mismatch: the layer was altered');
  const ctr = createDecipheriv('aes-256-ctr', symkey, Buffer.from(priv.cipheroptions.nonce, 'base64'));
  const plain = Buffer.concat([ctr.update(blob), ctr.final()]);
  if (`sha256:${createHash('sha256').update(plain).digest('hex')}` !== priv.digest)
    throw new Error('plain digest mismatch');
  return { plain, priv };
}
