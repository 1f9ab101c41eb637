/**
 * The vault's arbitration between processes, a port with two implementations:
 *
 * - {@link LocalVaultLocks} (the default): lock files in `<vault>/locks`, exact among the
 *   processes of one machine (the daemon, `dormant vault ...` commands);
 * - PostgreSQL advisory locks (`state/pg-locks.ts`, `openVaultLocks`), for nodes that share
 *   one database of record and one bucket prefix (a fleet).
 *
 * Two things need it. Writers and gc exclude each other: a writer may reuse any indexed chunk
 * until its manifest commits, so gc must not sweep meanwhile. And `writeNew` on a store with no
 * create-if-absent of its own (S3: not every server honours `If-None-Match: *`) is a HEAD and a
 * PUT that must not interleave with another writer's of the same name: two nodes creating the
 * same tenant key at once would each seal data with their own key, and one key would be lost.
 */
import { LocalLock, type Release } from './lock.js';
import { LocalMutex } from './local-mutex.js';

export type { Release } from './lock.js';

/** How long a lock may be waited for, and what stops the wait. */
export interface LockWait {
  timeoutMs: number;
  signal?: AbortSignal;
}

/** Writers (and readers, restores, backups) share it; gc holds it alone. */
export interface WriterGcLock {
  /** A writer's lock; waits while gc runs (up to `timeoutMs`: VAULT_BUSY). */
  shared(o: LockWait): Promise<Release>;
  /** gc's lock: keeps new writers out, then waits for running ones (up to `timeoutMs`: VAULT_BUSY). */
  exclusive(o: LockWait): Promise<Release>;
}

/** The locks of the vaults of one node. `location` is the store's (`VaultStore.location`). */
export interface VaultLocks {
  /** The writer/gc lock of the vault at `location`. */
  writersAndGc(location: string): WriterGcLock;
  /**
   * Runs `fn` (a HEAD then a PUT) while no other writer of object `name` of the vault at
   * `location` runs its own; a bounded wait, then VAULT_BUSY naming the object.
   */
  whileCreating<T>(location: string, name: string, fn: () => Promise<T>): Promise<T>;
  /** Ends what the locks hold open (connections); call after the vaults using them are closed. */
  close(): Promise<void>;
}

/**
 * Lock files in `dir` (`<data-dir>/vault/locks`): the writer/gc lock of lock.ts, and one lock
 * file (`s3-write-new`) every `writeNew` of this node queues on. Exact on one machine only.
 */
export class LocalVaultLocks implements VaultLocks {
  private readonly creating: LocalMutex;

  constructor(private readonly dir: string) {
    this.creating = new LocalMutex(dir, 's3-write-new');
  }

  writersAndGc(_location: string): WriterGcLock {
    return new LocalLock(this.dir);
  }

  whileCreating<T>(_location: string, _name: string, fn: () => Promise<T>): Promise<T> {
    return this.creating.run(fn);
  }

  async close(): Promise<void> {
    // Nothing held open between calls.
  }
}
