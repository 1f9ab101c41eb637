/**
 * What the lifecycle controller needs of the parts below it, and nothing more: the database of
 * record (`StatePort`) and the vault (`VaultPort`); the runtime's port is runtime/runtime.ts.
 * The daemon hands it the SQLite store and the local vault, which have these shapes; the unit
 * tests hand it the in-memory fakes of control/testing/fakes.ts, so every step of every
 * operation can be made to fail without root, runc or CRIU.
 */
import type { StateStore } from '../state/store.js';
import type { PageSource } from '../runtime/runtime.js';

/**
 * The part of the state store the controller reads and writes: sandboxes, their transitions
 * and their checkpoints (tokens, events and meter samples are the API's and the meter's).
 */
export type StatePort = Pick<
  StateStore,
  | 'insertSandbox'
  | 'getSandbox'
  | 'listSandboxes'
  | 'querySandboxes'
  | 'atomically'
  | 'transition'
  | 'updateSandbox'
  | 'deleteSandbox'
  | 'note'
  | 'insertCheckpoint'
  | 'getCheckpoint'
  | 'listCheckpoints'
  | 'deleteCheckpoint'
>;

/**
 * A stored checkpoint opened for random reads: the runtime's page source (a lazy resume
 * serves the sandbox's pages from it).
 */
export type CheckpointReaderPort = PageSource;

/** What the controller needs of the vault (vault/index.ts implements it). */
export interface VaultPort {
  putCheckpoint(o: {
    tenant: string;
    sandboxId: string;
    checkpointId: string;
    srcDir: string;
    meta?: Record<string, string>;
    /** srcDir is still being written until this settles (see the vault's putCheckpoint). */
    growing?: Promise<unknown>;
    signal?: AbortSignal;
  }): Promise<{ logicalBytes: number; storedBytes: number }>;
  restoreCheckpoint(o: {
    tenant: string;
    checkpointId: string;
    destDir: string;
    signal?: AbortSignal;
    /** Files (by path in the checkpoint) not restored. */
    skip?: (path: string) => boolean;
  }): Promise<unknown>;
  /**
   * Random reads of a stored checkpoint's files, authenticated; held open (and gc kept
   * waiting) until closed. Optional: without it, lazy resumes stage the pages images.
   */
  openCheckpoint?(o: {
    tenant: string;
    checkpointId: string;
    signal?: AbortSignal;
  }): Promise<CheckpointReaderPort>;
  deleteCheckpoint(o: { tenant: string; checkpointId: string }): Promise<unknown>;
  /** Crypto-shreds the sandbox's key and deletes its checkpoints. */
  destroySandboxKey(o: { tenant: string; sandboxId: string }): Promise<unknown>;
  listCheckpoints(o?: {
    tenant?: string;
    sandboxId?: string;
  }): Promise<{ tenant: string; checkpointId: string }[]>;
}
