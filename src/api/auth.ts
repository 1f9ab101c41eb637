/**
 * API tokens: `dmt_` + 32 random bytes (base64url). Only a SHA-256 of each token is stored;
 * a request's token is hashed and looked up. A token belongs to a tenant, or is an admin
 * token that sees every tenant.
 */
import { createHash, randomBytes, timingSafeEqual } from 'node:crypto';
import { open, readFile, rename } from 'node:fs/promises';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';

export interface Principal {
  tenant: string;
  admin: boolean;
}

export interface TokenRecord {
  hash: string;
  tenant: string;
  admin: boolean;
  createdAt: number;
  revokedAt?: number;
}

export function newToken(): string {
  return `dmt_${randomBytes(32).toString('base64url')}`;
}

export function hashToken(token: string): string {
  return createHash('sha256').update(token).digest('hex');
}

/** The admin's own tenant: sandboxes an admin token creates land here. */
export const ADMIN_TENANT = 'default';

export class Unauthorized extends DormantError {
  constructor(message: string) {
    super(ErrorCode.UNAUTHORIZED, message);
  }
}

/** Finds the principal for an Authorization header, comparing hashes in constant time. */
export function authenticate(header: string | undefined, tokens: readonly TokenRecord[]): Principal {
  if (header === undefined || header === '') throw new Unauthorized('no API token');
  const m = /^Bearer\s+(\S+)$/i.exec(header);
  if (!m) throw new Unauthorized('malformed Authorization header (expected "Bearer TOKEN")');
  const h = Buffer.from(hashToken(m[1]!), 'hex');
  for (const t of tokens) {
    const th = Buffer.from(t.hash, 'hex');
    if (th.length === h.length && timingSafeEqual(th, h)) {
      if (t.revokedAt !== undefined) throw new Unauthorized('this API token was revoked');
      return { tenant: t.tenant, admin: t.admin };
    }
  }
  throw new Unauthorized('unknown API token');
}

/** Reads the admin token file, creating it (0600, atomically) on first start. */
export async function ensureAdminToken(path: string): Promise<{ token: string; created: boolean }> {
  try {
    return { token: (await readFile(path, 'utf8')).trim(), created: false };
  } catch (e) {
    if (errnoCode(e) !== 'ENOENT') throw e;
  }
  const token = newToken();
  const tmp = `${path}.tmp`;
  const fh = await open(tmp, 'w', 0o600);
  try {
    await fh.writeFile(`${token}\n`);
    await fh.sync();
  } finally {
    await fh.close();
  }
  await rename(tmp, path);
  return { token, created: true };
}
