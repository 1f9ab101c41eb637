/**
 * The vault's port: encrypted, deduplicated checkpoint storage. Other layers use only what
 * this module exports.
 *
 * ```ts
 * const vault = await openVault({ dir: '/var/lib/dormant/vault', masterKey: { file: '/var/lib/dormant/master.key' } });
 * await vault.putCheckpoint({ tenant: 'acme', sandboxId: 'sb-1', checkpointId: 'ck-1', srcDir: '/dev/shm/ck-1' });
 * await vault.restoreCheckpoint({ tenant: 'acme', checkpointId: 'ck-1', destDir: '/dev/shm/restore-ck-1' });
 * await vault.close();
 * ```
 */
import { Vault, type VaultOptions } from './vault.js';

export type {
  CheckpointInfo,
  GcOptions,
  GcReport,
  PutCheckpointOptions,
  PutCheckpointResult,
  RestoreCheckpointOptions,
  RestoreCheckpointResult,
  TenantStats,
  VaultOptions,
  VaultStats,
  VerifyProblem,
  VerifyReport,
} from './vault.js';
export type { Vault } from './vault.js';
export type { CheckpointReader, CheckpointFile } from './reader.js';
export type { MasterKeySource } from './keys.js';
export { TenantSecrets, SEALED_VALUE_PREFIX } from './keys.js';
export type { VaultStore, StoreEntry, StoreReader, StoreWriter } from './store.js';
export { LocalVaultLocks } from './locks.js';
export type { LockWait, Release, VaultLocks, WriterGcLock } from './locks.js';
export { LocalDirStore } from './store.js';
export { S3Store, parseS3Url } from './s3-store.js';
export type { S3StoreOptions, S3Location, S3ServerProblems } from './s3-store.js';
export type { IngestCounters } from './ingest.js';

/**
 * Opens (creating on first use) the vault in `dir`. Loads the master key from `masterKey`:
 * a file (generated with mode 0600 and a warning when the vault is new and the file missing),
 * a command that prints it (a KMS hook), or the key itself. Throws VAULT_KEY_WRONG when the
 * key is not the one the vault was created with. Call `close()` to wipe keys from memory.
 */
export function openVault(opts: VaultOptions): Promise<Vault> {
  return Vault.open(opts);
}
