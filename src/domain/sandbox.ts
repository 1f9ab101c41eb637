/**
 * Sandboxes as the domain sees them: states, the operations that move between them, and the
 * rules for which operation is legal in which state. No I/O here.
 */
import { DormantError } from './errors.js';
import type { GpuPolicy } from './gpu.js';
import type { EgressPolicy } from './egress.js';

export const SANDBOX_STATES = [
  'creating',
  'running',
  'paused',
  'hibernating',
  'hibernated',
  'resuming',
  'archived',
  'deleting',
  'failed',
] as const;
export type SandboxState = (typeof SANDBOX_STATES)[number];

export const SANDBOX_OPS = [
  'pause',
  'hibernate',
  'resume',
  'archive',
  'fork',
  'exec',
  'rm',
  'keepalive',
] as const;
export type SandboxOp = (typeof SANDBOX_OPS)[number];

/** States a sandbox rests in; the others are transient and only seen while an operation runs. */
export const RESTING_STATES: readonly SandboxState[] = [
  'running',
  'paused',
  'hibernated',
  'archived',
  'failed',
];

/** Which operation may start from which resting state. Absent: illegal (409). */
const LEGAL: Record<SandboxOp, readonly SandboxState[]> = {
  pause: ['running', 'paused'],
  hibernate: ['running', 'paused', 'hibernated'],
  resume: ['running', 'paused', 'hibernated', 'archived'],
  archive: ['running', 'paused', 'hibernated', 'archived'],
  fork: ['running', 'paused', 'hibernated'],
  exec: ['running'],
  keepalive: ['running', 'paused', 'hibernated', 'archived'],
  rm: [
    'creating',
    'running',
    'paused',
    'hibernating',
    'hibernated',
    'resuming',
    'archived',
    'failed',
    'deleting',
  ],
};

/** The state an operation leaves the sandbox in, and the transient state it passes through. */
export const OP_TARGET: Partial<Record<SandboxOp, { via?: SandboxState; to: SandboxState }>> = {
  pause: { to: 'paused' },
  hibernate: { via: 'hibernating', to: 'hibernated' },
  resume: { via: 'resuming', to: 'running' },
  archive: { to: 'archived' },
};

const HINTS: Partial<Record<SandboxOp, string>> = {
  exec: 'resume the sandbox first: dormant resume ID',
  fork: 'an archived sandbox has no process state to fork; resume it first',
  pause: 'only a running sandbox can be paused; resume it first',
};

/** True when `op` would change nothing (pause a paused sandbox): the API answers success. */
export function isNoop(op: SandboxOp, state: SandboxState): boolean {
  const target = OP_TARGET[op];
  return target !== undefined && target.to === state;
}

/** Throws ILLEGAL_TRANSITION (409) when `op` may not start from `state`. */
export function assertLegal(op: SandboxOp, state: SandboxState, sandboxId: string): void {
  if (!LEGAL[op].includes(state)) {
    throw new DormantError('ILLEGAL_TRANSITION', `cannot ${op} sandbox ${sandboxId}: it is ${state}`, {
      hint: HINTS[op] ?? `wait until the sandbox settles (it is ${state}) and try again`,
      details: { sandboxId, state, op },
    });
  }
}

/** Sandbox names: what a DNS label allows, so a name can appear in a URL. */
export const NAME_PATTERN = /^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$/;

export function validateName(name: string): string {
  if (!NAME_PATTERN.test(name)) {
    throw new DormantError(
      'INVALID_ARGUMENT',
      `invalid sandbox name "${name.slice(0, 80)}": use 1-63 lowercase letters, digits and inner dashes`,
    );
  }
  return name;
}

/** Label keys: like a Kubernetes label key, so one can be copied from there. */
export const LABEL_KEY_PATTERN = /^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$/;
export const MAX_LABELS = 64;
export const MAX_LABEL_VALUE = 256;

/** Throws INVALID_ARGUMENT unless `key` is a valid label key. */
export function validateLabelKey(key: string): string {
  if (!LABEL_KEY_PATTERN.test(key))
    throw new DormantError(
      'INVALID_ARGUMENT',
      `invalid label key "${key.slice(0, 80)}": use 1-63 letters, digits, '.', '_', '/' and '-', starting with a letter or digit`,
    );
  return key;
}

/** The labels, checked: valid keys, values of at most 256 characters, at most 64 labels. */
export function validateLabels(labels: Readonly<Record<string, string>>): Record<string, string> {
  const keys = Object.keys(labels);
  if (keys.length > MAX_LABELS)
    throw new DormantError('INVALID_ARGUMENT', `too many labels (${keys.length}): at most ${MAX_LABELS}`);
  for (const k of keys) {
    validateLabelKey(k);
    if (labels[k]!.length > MAX_LABEL_VALUE)
      throw new DormantError(
        'INVALID_ARGUMENT',
        `label ${k}: the value is longer than ${MAX_LABEL_VALUE} characters`,
      );
  }
  return { ...labels };
}

/**
 * `labels` changed by `patch`: a string sets the key, null removes it. The result is checked
 * as a whole (the count limit applies to what is left).
 */
export function patchLabels(
  labels: Readonly<Record<string, string>>,
  patch: Readonly<Record<string, string | null>>,
): Record<string, string> {
  for (const k of Object.keys(patch)) validateLabelKey(k);
  const kept = Object.entries({ ...labels, ...patch }).filter((e): e is [string, string] => e[1] !== null);
  return validateLabels(Object.fromEntries(kept));
}

/** Sandbox and checkpoint ids: a prefix and 16 lowercase base32 characters. */
export const ID_PATTERN = /^(sb|ck)-[a-z2-7]{16}$/;

const B32 = 'abcdefghijklmnopqrstuvwxyz234567';
export function newId(prefix: 'sb' | 'ck' | 'tp', random: (n: number) => Uint8Array): string {
  const bytes = random(16);
  let s = '';
  for (const b of bytes) s += B32.charAt(b & 31);
  return `${prefix}-${s}`;
}

export interface PortSpec {
  /** Port inside the sandbox. */
  port: number;
  /** Reachable through the wake proxy without a token. */
  public: boolean;
}

export interface SandboxPolicy {
  /** Freeze after this long idle; undefined: never. */
  pauseAfterMs?: number;
  /** Hibernate after this long idle. */
  hibernateAfterMs?: number;
  /** Archive after this long hibernated. */
  archiveAfterMs?: number;
  /** Delete after this long archived; undefined: never. */
  deleteAfterMs?: number;
  /** Stop (archive) after this long since creation; undefined: no cap. */
  lifetimeMs?: number;
}

export const DEFAULT_POLICY: Readonly<SandboxPolicy> = Object.freeze({
  hibernateAfterMs: 15 * 60_000,
  archiveAfterMs: 7 * 86_400_000,
});

/** The container runtimes a sandbox can run on: runc (namespaces, CRIU) or gVisor's runsc. */
export const RUNTIME_KINDS = ['runc', 'runsc'] as const;
export type RuntimeKind = (typeof RUNTIME_KINDS)[number];

export interface SandboxSpec {
  /** A root filesystem folder, or an OCI image layout folder (with an optional tag). */
  source:
    | { kind: 'rootfs'; path: string }
    /** An OCI image layout; `rootfs` is where dormant unpacked it, `digest` its manifest's. */
    | { kind: 'image'; path: string; tag?: string; digest: string; rootfs: string };
  /** Working directory of the command (from the image, or /). */
  cwd?: string;
  command: string[];
  env: Record<string, string>;
  ports: PortSpec[];
  memoryBytes: number;
  cpus: number;
  /** Disk quota of the writable layer; absent on sandboxes made before quotas (none). */
  diskBytes?: number;
  onResume?: string[];
  policy: SandboxPolicy;
  /** Host device nodes it was given at create (its GPUs: /dev/nvidiaN and the control nodes). */
  devices?: { path: string; major: number; minor: number }[];
  /** Set on a sandbox made by `checkpoint import`: the archive's file name. */
  importedFrom?: string;
  /** The caller's own key/value labels (validateLabels); absent: none. */
  labels?: Record<string, string>;
  /**
   * Set on a fork: the seed of its toolbox agent's token, its origin's (the fork's memory holds
   * a copy of the origin's agent, which knows only that token). Absent: the sandbox's id.
   */
  agentSeed?: string;
  /** Its hostname, when not its name (an imported container keeps the one it had). */
  hostname?: string;
  /**
   * The container engine's bind mounts an imported checkpoint holds as external mounts
   * (/etc/hostname, /etc/hosts, /run/.containerenv, /dev/shm, ...): the sandbox gets each,
   * writable, from a source of the runtime's.
   */
  engineBinds?: { destination: string; dir: boolean }[];
  /** false: no cgroup namespace (an import whose checkpoint holds cgroup v1 binds). */
  cgroupNamespace?: false;
  /** Where it may connect beyond the node (domain/egress.ts); absent: nowhere (made before egress). */
  egress?: EgressPolicy;
  /** Its container runtime, set only for gVisor; absent: runc. */
  runtime?: 'runsc';
}

export interface Sandbox {
  id: string;
  tenant: string;
  name: string;
  state: SandboxState;
  spec: SandboxSpec;
  createdAt: number;
  stateSince: number;
  lastActiveAt: number;
  /** Newest committed checkpoint, if any. */
  checkpointId?: string;
  /** Why the sandbox is failed, or why the last operation failed. */
  lastError?: string;
  /** Memory in use when running or paused (from its cgroup); 0 when hibernated or archived. */
  memoryBytes: number;
  /** The sandbox's address on the host side of its network namespace. */
  address?: string;
  /** GPUs it was created with: `all` or indexes like `0,1`; absent: none. */
  gpus?: string;
  /**
   * What hibernate does when its processes hold GPU state (declared GPUs or not). The store
   * always fills it in; absent (an object made elsewhere) means the default, keep-running.
   */
  gpuPolicy?: GpuPolicy;
  /**
   * Set (durably, before the restore starts) while a lazy restore from this checkpoint is
   * still copying pages in; cleared once every page is in or the restore is undone. Found set
   * after a daemon restart, the pages will never arrive: reconcile sends the sandbox back to
   * this checkpoint.
   */
  lazyRestoreOf?: string;
  /**
   * The node it lives on, in a fleet (state in PostgreSQL): the one whose runtime holds its
   * processes while it is awake, and the one that last ran it while it sleeps. Absent on a
   * node with SQLite, and on a sandbox taken back from a lost node (any node may wake it).
   */
  node?: string;
}

export interface Transition {
  id: number;
  sandboxId: string;
  tenant: string;
  from: SandboxState | null;
  to: SandboxState;
  at: number;
  reason: string;
}
