/**
 * The vault's store as the configuration names it: an S3-compatible bucket (docs/VAULT.md),
 * and its locks. What stays local in `<data-dir>/vault`: the bounded cache of packs, and the
 * writer/gc and writeNew lock files unless the locks are PostgreSQL's (vaultLocksFor).
 */
import { join } from 'node:path';
import { DormantError, ErrorCode } from '../domain/errors.js';
import { openVaultLocks } from '../state/pg-locks.js';
import { run } from '../sys/exec.js';
import { S3Store, parseS3Url, type VaultLocks } from '../vault/index.js';
import type { S3VaultConfig } from './config.js';

/**
 * Where the vault's writers, gc and key creation take turns. A vault in a bucket with the
 * state in PostgreSQL: advisory locks in that database, since the nodes that share the bucket
 * prefix share the database (and the daemon and the `dormant vault` commands of one node must
 * use the same ones). Otherwise undefined: the lock files in `<data-dir>/vault/locks`.
 * The caller closes what it gets, after the vault.
 */
export async function vaultLocksFor(
  state: { url: string } | undefined,
  vault: S3VaultConfig | undefined,
  warn: (m: string) => void,
): Promise<VaultLocks | undefined> {
  if (state === undefined || vault === undefined) return undefined;
  return openVaultLocks(state.url, { onLost: warn });
}

async function secretOf(v: S3VaultConfig): Promise<string | undefined> {
  const s = v.secretAccessKey;
  if (s === undefined) return undefined;
  if ('value' in s) return s.value;
  let out: string;
  try {
    out = (await run('/bin/sh', ['-c', s.command], { timeoutMs: 30_000 })).stdout.trim();
  } catch (e) {
    throw new DormantError(
      ErrorCode.INVALID_ARGUMENT,
      `vault.secretAccessKeyCommand failed: ${(e as Error).message}`,
      {
        cause: e,
        hint: 'the command must print the S3 secret key on stdout and exit 0',
      },
    );
  }
  if (out === '')
    throw new DormantError(ErrorCode.INVALID_ARGUMENT, 'vault.secretAccessKeyCommand printed nothing', {
      hint: 'the command must print the S3 secret key on stdout',
    });
  return out;
}

/**
 * Builds the S3 store, checks what the server gets wrong (ranged reads, multipart uploads:
 * the store works around either, and `warn` says so) and that the bucket answers.
 */
export async function s3VaultStore(
  v: S3VaultConfig,
  vaultDir: string,
  warn: (m: string) => void,
  locks?: VaultLocks,
): Promise<S3Store> {
  const loc = parseS3Url(v.url);
  const secret = await secretOf(v);
  const store = new S3Store({
    ...loc,
    ...(v.endpoint !== undefined ? { endpoint: v.endpoint } : {}),
    ...(v.region !== undefined ? { region: v.region } : {}),
    ...(v.accessKeyId !== undefined && secret !== undefined
      ? { credentials: { accessKeyId: v.accessKeyId, secretAccessKey: secret } }
      : {}),
    lockDir: join(vaultDir, 'locks'),
    ...(locks ? { locks } : {}),
    ...(v.cacheBytes > 0 ? { cache: { dir: join(vaultDir, 'cache'), maxBytes: v.cacheBytes } } : {}),
    partSizeBytes: v.partSizeBytes,
  });
  try {
    for (const w of (await store.checkServer()).warnings) warn(w);
  } catch (e) {
    store.destroy();
    throw e;
  }
  return store;
}
