/**
 * The database of record: sandboxes, their transitions, and their checkpoints. One port,
 * with SQLite as the embedded implementation (PostgreSQL for a fleet can follow).
 */
import type { MeterSample } from '../domain/cost.js';
import type { Sandbox, SandboxState, Transition } from '../domain/sandbox.js';

export interface CheckpointRecord {
  id: string;
  sandboxId: string;
  tenant: string;
  createdAt: number;
  /** 'memory': processes and filesystem diff; 'filesystem': the diff only (archive). */
  kind: 'memory' | 'filesystem';
  logicalBytes: number;
  storedBytes: number;
  /** Facts a restore checks against the node: arch, kernel, criu version, cpu flags. */
  meta: Record<string, unknown>;
}

export interface TokenRow {
  hash: string;
  tenant: string;
  admin: boolean;
  createdAt: number;
  revokedAt?: number;
}

/** What `querySandboxes` selects: every field given must match. */
export interface SandboxQuery {
  tenant?: string;
  /** Any of these states. */
  states?: readonly SandboxState[];
  name?: string;
  /** Each must match: `[key, value]` the label has that value, `[key]` the key is present. */
  labels?: readonly (readonly [string, string?])[];
  /** Only sandboxes after this one in the listing order (createdAt, then id). */
  after?: { createdAt: number; id: string };
  /** At most this many. */
  limit: number;
}

/** A meter sample as stored: the writable layer's use too, where it is known. */
/**
 * `egressBytes`: all the sandbox sent beyond the node so far (runtime/egress.ts), summed over
 * counter resets; `egressCounter`: the raw counter it was computed from, so a restarted meter
 * carries on from it.
 */
export type StoredSample = MeterSample & { diskBytes?: number; egressBytes?: number; egressCounter?: number };

export interface StateStore {
  /**
   * Goes up with every change to a sandbox made through this store (the daemon's only writer):
   * a reader in the same process may keep what it read while this stays the same.
   */
  readonly sandboxVersion: number;
  insertToken(t: TokenRow): void;
  listTokens(): TokenRow[];
  revokeToken(hash: string, at: number): boolean;
  insertSandbox(s: Sandbox, reason: string): void;
  getSandbox(id: string): Sandbox | undefined;
  listSandboxes(tenant?: string): Sandbox[];
  /** The sandboxes `q` selects, in a stable order: createdAt, then id. */
  querySandboxes(q: SandboxQuery): Sandbox[];
  /** Runs `fn` as one transaction: all of its writes land, or none. */
  atomically<T>(fn: () => T): T;
  /**
   * Moves a sandbox from `from` to `to` and records the transition, atomically; returns false
   * (changing nothing) when the sandbox is no longer in `from`.
   */
  transition(
    id: string,
    from: SandboxState,
    to: SandboxState,
    reason: string,
    at: number,
    patch?: Partial<Sandbox>,
  ): boolean;
  updateSandbox(id: string, patch: Partial<Omit<Sandbox, 'id' | 'state'>>): void;
  deleteSandbox(id: string, reason: string, at: number): void;
  /**
   * Records something that happened to a sandbox without changing its state (the idle policy
   * skipped it, and why): a transition from its state to the same state, seen in the events.
   */
  note(id: string, reason: string, at: number): void;
  transitions(opts?: { sinceId?: number; sandboxId?: string; limit?: number }): Transition[];
  insertCheckpoint(c: CheckpointRecord): void;
  getCheckpoint(id: string): CheckpointRecord | undefined;
  listCheckpoints(opts?: { sandboxId?: string; tenant?: string }): CheckpointRecord[];
  /** Marks the checkpoint deleted at `at` (kept for metering; no longer listed). */
  deleteCheckpoint(id: string, at?: number): void;
  /** Every checkpoint ever recorded, with its deletion time if deleted. */
  checkpointHistory(): (CheckpointRecord & { deletedAt?: number })[];
  insertSamples(samples: readonly StoredSample[]): void;
  samples(opts?: { since?: number; until?: number }): MeterSample[];
  /**
   * One sandbox's samples from `since` on, oldest first, at most `limit`, preceded by the last
   * one before `since` if any (a rate needs the sample before).
   */
  sandboxSamples(sandboxId: string, opts: { since: number; limit: number }): StoredSample[];
  close(): void;
}
