/**
 * The database of record: sandboxes, their transitions, and their checkpoints. One port,
 * with SQLite as the embedded implementation (state/sqlite.ts) and PostgreSQL for a fleet
 * (state/postgres.ts).
 */
import type { MeterSample } from '../domain/cost.js';
import type { Sandbox, SandboxState, Transition } from '../domain/sandbox.js';
import type { TemplateStore } from './templates.js';
import type { NodeCapacity, NodeInfo, NodeState } from '../domain/node.js';

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
  /** Only those living on this node (Sandbox.node). */
  node?: string;
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

/** A tenant's login to a registry: `sealed` is the password sealed with the tenant's key. */
export interface RegistryCredentialRow {
  tenant: string;
  host: string;
  username: string;
  sealed: string;
  createdAt: number;
}

/** What a node says of itself as it registers (FleetStore.registerNode). */
export interface NodeRegistration {
  name: string;
  url: string;
  proxyUrl?: string;
  capacity: NodeCapacity;
  startedAt: number;
}

/**
 * The nodes of a fleet, in the database they share (PostgreSQL only). Lease times are the
 * database's clock, so the nodes' own clocks never decide who is alive.
 */
export interface FleetStore {
  /**
   * Registers the node (or comes back as it) with a lease of `leaseMs`; a node that was
   * draining stays draining, a lost one is active again. Answers its state.
   */
  registerNode(n: NodeRegistration, leaseMs: number): Promise<NodeState>;
  /**
   * Extends the node's lease by `leaseMs` from now and answers its state; undefined when the
   * node was marked lost meanwhile (its sandboxes are no longer its own) or is unknown.
   */
  renewNode(name: string, leaseMs: number): Promise<NodeState | undefined>;
  /**
   * The nodes, with their awake sandboxes and the memory those may use (kept at each change);
   * `counts: false` leaves out the count of their sandboxes by state (what placement does not
   * need, and the one part whose cost grows with the sandboxes).
   */
  listNodes(o?: { counts?: boolean }): Promise<NodeInfo[]>;
  getNode(name: string, o?: { counts?: boolean }): Promise<NodeInfo | undefined>;
  /** Drain or undrain: false when there is no such node or it is lost. */
  setNodeState(name: string, state: 'active' | 'draining'): Promise<boolean>;
  /** Nodes not lost whose lease ran out. */
  expiredNodes(): Promise<string[]>;
  /**
   * Marks the node lost if its lease has still run out (compare-and-set: of several nodes
   * finding it, one gets true), and gives its sleeping sandboxes (hibernated, archived,
   * failed) to node `by`. Meant inside `atomically`, with taking back its awake ones.
   */
  markNodeLost(name: string, by: string, at: number): Promise<boolean>;
  /** Rows from before the fleet (no node) still awake: this node's, which ran them. */
  adoptUnplaced(name: string): Promise<number>;
}

/**
 * The port every implementation answers asynchronously: SQLite (embedded, one node) answers at
 * once, PostgreSQL (a fleet) over the network. Writes that must land together go through
 * `atomically`, whose callback is handed a store bound to the transaction.
 */
export interface StateStore {
  /**
   * Goes up with every change to a sandbox made through this store, for a reader in the same
   * process that keeps what it read while this stays the same. Undefined where other
   * processes write the same database (PostgreSQL shared by nodes): nothing may be kept.
   */
  readonly sandboxVersion: number | undefined;
  insertToken(t: TokenRow): Promise<void>;
  listTokens(): Promise<TokenRow[]>;
  revokeToken(hash: string, at: number): Promise<boolean>;
  insertSandbox(s: Sandbox, reason: string): Promise<void>;
  getSandbox(id: string): Promise<Sandbox | undefined>;
  listSandboxes(tenant?: string): Promise<Sandbox[]>;
  /** The sandboxes `q` selects, in a stable order: createdAt, then id. */
  querySandboxes(q: SandboxQuery): Promise<Sandbox[]>;
  /**
   * Runs `fn` as one transaction: all of its writes land, or none (a throw rolls back). `fn`
   * works through `tx`, a store bound to the transaction; other callers of this store wait
   * (SQLite) or see the rows as before until it commits (PostgreSQL). Calling `atomically` on
   * `tx` runs the inner callback in the same transaction.
   */
  atomically<T>(fn: (tx: StateStore) => Promise<T>): Promise<T>;
  /**
   * Moves a sandbox from `from` to `to` and records the transition, atomically; returns false
   * (changing nothing) when the sandbox is no longer in `from`. Two callers racing on the same
   * sandbox and `from`: exactly one gets true, also across processes sharing the database.
   */
  transition(
    id: string,
    from: SandboxState,
    to: SandboxState,
    reason: string,
    at: number,
    patch?: Partial<Sandbox>,
  ): Promise<boolean>;
  updateSandbox(id: string, patch: Partial<Omit<Sandbox, 'id' | 'state'>>): Promise<void>;
  deleteSandbox(id: string, reason: string, at: number): Promise<void>;
  /**
   * Records something that happened to a sandbox without changing its state (the idle policy
   * skipped it, and why): a transition from its state to the same state, seen in the events.
   */
  note(id: string, reason: string, at: number): Promise<void>;
  transitions(opts?: { sinceId?: number; sandboxId?: string; limit?: number }): Promise<Transition[]>;
  insertCheckpoint(c: CheckpointRecord): Promise<void>;
  getCheckpoint(id: string): Promise<CheckpointRecord | undefined>;
  listCheckpoints(opts?: { sandboxId?: string; tenant?: string }): Promise<CheckpointRecord[]>;
  /** Marks the checkpoint deleted at `at` (kept for metering; no longer listed). */
  deleteCheckpoint(id: string, at?: number): Promise<void>;
  /** Every checkpoint ever recorded, with its deletion time if deleted. */
  checkpointHistory(): Promise<(CheckpointRecord & { deletedAt?: number })[]>;
  insertSamples(samples: readonly StoredSample[]): Promise<void>;
  samples(opts?: { since?: number; until?: number }): Promise<MeterSample[]>;
  /**
   * One sandbox's samples from `since` on, oldest first, at most `limit`, preceded by the last
   * one before `since` if any (a rate needs the sample before).
   */
  sandboxSamples(sandboxId: string, opts: { since: number; limit: number }): Promise<StoredSample[]>;
  putRegistryCredential(r: RegistryCredentialRow): Promise<void>;
  /** One tenant's logins (every tenant's when undefined), by host. */
  listRegistryCredentials(tenant?: string): Promise<RegistryCredentialRow[]>;
  /** False when it was not there. */
  deleteRegistryCredential(tenant: string, host: string): Promise<boolean>;
  /** The fleet's nodes, where the database is shared by nodes (PostgreSQL); bound to the transaction on a `tx`. */
  readonly fleet?: FleetStore;
  /** The templates, in the same database (state/templates.ts); bound to the transaction on a `tx`. */
  templates(): TemplateStore;
  /**
   * Rewrites the storage so nothing overwritten stays readable in it (SQLite: VACUUM and an
   * emptied WAL). Absent where the database manages that itself.
   */
  compact?(): Promise<void>;
  close(): Promise<void>;
}
