/**
 * The Runtime port: what the rest of dormant needs from a container runtime to run,
 * freeze, checkpoint and restore a sandbox. Pure types; the runc adapter is in runc.ts.
 *
 * A sandbox here is one container with its own host-side directory (bundle, writable
 * layer, log, network reservation). The runtime knows nothing of the vault, tenants or
 * policies: the daemon hands it folders to write CRIU images into and to restore from.
 */
import type { EgressPolicy } from '../domain/egress.js';
import type { RuntimeKind } from '../domain/sandbox.js';
import type { StepSink } from '../domain/timings.js';
import type { AgentAddress } from './agent-client.js';

export type { RuntimeKind };

/** A host folder made visible, read-only, inside the sandbox. */
export interface ReadonlyBind {
  /** Absolute path on the host. */
  source: string;
  /** Absolute path inside the sandbox. */
  destination: string;
}

/** A host character device created inside the sandbox (a GPU's /dev/nvidia0, say). */
export interface DeviceNode {
  /** Under /dev, the same inside the sandbox as on the host. */
  path: string;
  major: number;
  minor: number;
}

export interface SandboxLimits {
  /** Memory limit (the cgroup's hard limit) in bytes. */
  memoryBytes?: number;
  /** CPU bandwidth in cores (0.5 = half a core). */
  cpus?: number;
  /** Most tasks (processes and threads) the sandbox may have at once. */
  pids?: number;
  /**
   * Disk quota of the writable layer, in bytes: the layer lives on an image of this size
   * (quota.ts) and a write past it fails inside with ENOSPC. Absent: no quota (the layer is a
   * folder on the host disk, as sandboxes made before quotas have).
   */
  diskBytes?: number;
}

/** What a sandbox is made of. Validated and frozen by `compileSandboxSpec`. */
export interface SandboxSpec {
  /** Lowercase letters, digits, `-`, `_`, `.`; 1 to 48 characters; unique on this node. */
  id: string;
  /** The root filesystem folder; it is never written to (it is the overlay's lower layer). */
  rootfs: string;
  /** The command run as the sandbox's pid 1. */
  args: readonly string[];
  env?: Readonly<Record<string, string>>;
  /** Working directory inside the sandbox. Default `/`. */
  cwd?: string;
  /** Default: the id. */
  hostname?: string;
  /** TCP ports reachable from the host at the sandbox's address; everything else is refused. */
  ports?: readonly number[];
  limits?: SandboxLimits;
  readonlyBinds?: readonly ReadonlyBind[];
  /** Character devices the sandbox may use (created in its /dev, allowed in its cgroup). */
  devices?: readonly DeviceNode[];
  /**
   * Writable bind mounts a container engine gives its containers (podman's /etc/hostname,
   * /etc/hosts, /run/.containerenv, its /dev/shm), for a sandbox imported from one: a
   * checkpoint records them as external mounts that the restore must supply. Their sources are
   * the runtime's (SandboxState.engineBinds), outside anything the sandbox can replace.
   */
  engineBinds?: readonly EngineBind[];
  /**
   * false: no cgroup namespace of its own. For a container imported from an engine that gave
   * it none (podman on cgroup v1): its checkpoint holds the cgroup hierarchies as bind mounts,
   * which runc maps on restore only without one. Default true.
   */
  cgroupNamespace?: boolean;
  /**
   * Where it may open connections beyond the node (domain/egress.ts), with DNS through the
   * node's resolvers. Absent: no way out at all (sandboxes made before egress existed).
   */
  egress?: EgressPolicy;
  /** Which adapter runs it, where one Runtime holds both (runsc-dispatch.ts). Default runc. */
  runtime?: RuntimeKind;
}

/** An engine's bind mount: a file, or a folder (`dir`), at `destination` inside. */
export interface EngineBind {
  destination: string;
  dir: boolean;
}

/** The addresses of a sandbox's private link (a /30 of the runtime's subnet). */
export interface SandboxNetwork {
  /** Network namespace name (`ip netns`), persistent for the sandbox's whole life. */
  netns: string;
  /** The sandbox's address (its eth0); declared ports are reachable here from the host. */
  address: string;
  /** The host end of the link (also the sandbox's default gateway). */
  hostAddress: string;
  prefixLength: number;
  /** Name of the host-side veth interface. */
  hostInterface: string;
}

/**
 * `absent`: prepared (or hibernated) but no container exists; `created`: runc created it,
 * its command has not started; `running`; `paused`: frozen; `stopped`: its pid 1 exited.
 */
export type SandboxStatus = 'absent' | 'created' | 'running' | 'paused' | 'stopped';

export interface SandboxState {
  id: string;
  status: SandboxStatus;
  /** Host pid of the sandbox's pid 1 while a container exists. */
  pid: number | undefined;
  network: SandboxNetwork;
  /** The sandbox's combined stdout and stderr, kept across checkpoints. */
  logPath: string;
  /** The writable layer: everything the sandbox changed in its filesystem. */
  upperDir: string;
  /** Where the host side of each of its engine binds is (SandboxSpec.engineBinds). */
  engineBinds?: { destination: string; source: string }[];
}

export interface CallOptions {
  signal?: AbortSignal;
  timeoutMs?: number;
  /** Records the wall time of each runc/criu call and host-side step (hibernate/resume timings). */
  timer?: StepSink;
}

export interface PrepareOptions extends CallOptions {
  /**
   * Mount the rootfs overlay too (default true). False leaves the writable layer at rest so
   * it can be filled first; restore() mounts it.
   */
  mountRootfs?: boolean;
}

export interface ExecOptions extends CallOptions {
  env?: Readonly<Record<string, string>>;
  cwd?: string;
  /** Bytes given to the command's stdin; default: stdin is empty. */
  input?: string | Buffer;
}

export interface ExecResult {
  stdout: string;
  stderr: string;
  exitCode: number;
  durationMs: number;
}

export interface CheckpointOptions extends CallOptions {
  /** Folder CRIU writes its images into (created if missing; should be memory-backed). */
  imagesDir: string;
  /** Folder for CRIU's log and scratch files (not secret-free: keep it private too). */
  workDir: string;
  /** Keep the sandbox running after the dump (a snapshot) instead of ending it. */
  leaveRunning?: boolean;
}

export interface CheckpointResult {
  durationMs: number;
  /** Where CRIU's dump log is, for the daemon to keep or show. */
  logPath: string;
}

/**
 * A stored checkpoint's files opened for random reads (the vault's `openCheckpoint` answers
 * one): where a lazy restore's pages come from when they are not staged.
 */
export interface PageSource {
  /**
   * Reads into `out` at `at` when given (and returns it), else into a new buffer; `readAhead:
   * false` for a scattered read that the next one will not follow.
   */
  read(
    path: string,
    offset: number,
    length: number,
    out?: Buffer,
    at?: number,
    opts?: { readAhead?: boolean },
  ): Promise<Buffer>;
  /** The checkpoint's files. */
  list(): { path: string; sizeBytes: number }[];
  close(): Promise<void>;
}

export interface RestoreOptions extends CallOptions {
  imagesDir: string;
  workDir: string;
  /**
   * Restore memory lazily (CRIU lazy-pages over userfaultfd): the sandbox runs as soon as its
   * process tree is back, and a `criu lazy-pages` daemon copies the pages in behind it. The
   * images must stay in place until `pagesLoaded` settles.
   */
  lazyPages?: boolean;
  /** Limit for the lazy-pages daemon to finish copying. Default 120 s. */
  pagesTimeoutMs?: number;
  /**
   * With lazyPages: the daemon asks this page server (TCP) for every lazy page instead of
   * reading the pages images, which then need hold only the pages that are not lazy.
   */
  pageServer?: { address: string; port: number };
  /**
   * With lazyPages: the pages come from `source` (their images in `imagesDir` are skipped or
   * ignored): the runtime writes the pages that are not lazy into `imagesDir` and serves the
   * rest to the lazy-pages daemon itself. It owns the source from this call on, and closes it
   * once every page is in, when the restore fails, or when the sandbox is stopped (or its
   * lazy pages ended). `what` names the pages in errors.
   */
  pages?: { source: PageSource; what: string };
}

export interface RestoreResult {
  durationMs: number;
  pid: number;
  logPath: string;
  /**
   * Settles when every page is in memory: at once for an eager restore; for a lazy one when
   * the lazy-pages daemon exits (rejects if it fails: the sandbox is then not usable).
   */
  pagesLoaded: Promise<void>;
}

/**
 * The container runtime as dormant sees it. Every method is safe to call again after a
 * crash of the caller: each one first looks at what exists.
 */
export interface Runtime {
  /** Sets up the sandbox's directory, writable layer, network and log, without a container. */
  prepare(spec: SandboxSpec, opts?: PrepareOptions): Promise<SandboxState>;
  /** prepare() plus a created (not yet started) container. */
  create(spec: SandboxSpec, opts?: CallOptions): Promise<SandboxState>;
  start(id: string, opts?: CallOptions): Promise<void>;
  state(id: string, opts?: CallOptions): Promise<SandboxState>;
  exec(id: string, args: readonly string[], opts?: ExecOptions): Promise<ExecResult>;
  /** Host pids of the sandbox's processes, read from its cgroup (no runc call); [] when none. */
  pids(id: string): Promise<number[]>;
  /**
   * Whether the sandbox listens on TCP `port`, for a runtime whose sandboxes' sockets the
   * host's socket tables do not show (gVisor's). undefined, or absent: read the host's tables
   * of the sandbox's process (`sys/listening.ts`).
   */
  listening?(id: string, port: number): Promise<boolean | undefined>;
  /**
   * The cgroup.procs files that list the sandbox's processes, in the order `pids` reads them
   * (for a keeper that must end them after dormant has died). Optional.
   */
  procsFiles?(id: string): string[];
  /**
   * Checks an egress policy before anything is made: its host names must resolve
   * (EGRESS_HOST_UNRESOLVABLE otherwise). Optional.
   */
  checkEgress?(policy: EgressPolicy): Promise<void>;
  /**
   * Gives sandbox `id` another egress policy: its record holds it for the next start or
   * restore, and a network that is up (running, or kept while it sleeps) follows at once.
   * Optional: a runtime without it keeps the policy it was prepared with.
   */
  setEgress?(id: string, policy: EgressPolicy): Promise<void>;
  /** Bytes each sandbox sent beyond the node since its rules were last written, by id. Optional. */
  egressBytes?(): Promise<Map<string, number>>;
  /** Freezes every process (cgroup freezer); memory stays. */
  freeze(id: string, opts?: CallOptions): Promise<void>;
  thaw(id: string, opts?: CallOptions): Promise<void>;
  /**
   * CRIU dump into `imagesDir`. Established TCP connections are dumped as closed (clients
   * reconnect); listening sockets are kept. Without `leaveRunning` the container is gone
   * afterwards (its directory, network and log stay for restore). A failure leaves it running.
   */
  checkpoint(id: string, opts: CheckpointOptions): Promise<CheckpointResult>;
  /** Restores a prepared sandbox from `imagesDir`, detached, with the same pids inside. */
  restore(id: string, opts: RestoreOptions): Promise<RestoreResult>;
  /**
   * Ends the sandbox's processes and removes its container (after a `leaveRunning`
   * checkpoint is safely stored, or before a fresh start); its writable layer, network and
   * log stay, and its root filesystem is unmounted until the next create or restore.
   */
  stop(id: string, opts?: CallOptions): Promise<void>;
  /**
   * The part of `stop` a caller waits for: every process of the sandbox is killed and gone
   * (its memory freed), its root filesystem unmounted and its emptied cgroups removed. The
   * container's runtime state stays for a later `stop`, which is then quick. Optional: without
   * it, callers use `stop`.
   */
  endProcesses?(id: string, opts?: CallOptions): Promise<void>;
  /**
   * Writes sandbox `id`'s writable layer (everything it changed in its filesystem) as the
   * file `tarPath`, for the vault: a checkpoint or an archive carries it, so the layer need
   * not stay on the host while the sandbox sleeps. Its processes should be frozen or gone.
   */
  packLayer(id: string, tarPath: string, opts?: CallOptions): Promise<void>;
  /**
   * Replaces sandbox `id`'s writable layer with the file `tarPath` that `packLayer` wrote.
   * Call while its root filesystem is not mounted (prepare with `mountRootfs: false`).
   */
  applyLayer(id: string, tarPath: string, opts?: CallOptions): Promise<void>;
  /** Empties sandbox `id`'s writable layer (its diff is safe elsewhere), durably. */
  emptyLayer(id: string): Promise<void>;
  /** Copies sandbox `fromId`'s writable layer into prepared sandbox `toId`'s (a fork). */
  copyLayer(fromId: string, toId: string): Promise<void>;
  /**
   * Ends (SIGKILL) any `criu lazy-pages` still serving pages from `workDir`: one a daemon
   * that died left behind, orphaned. Returns the host pids it ended. Optional: a runtime
   * without lazy restore has none.
   */
  endLazyPages?(workDir: string): Promise<number[]>;
  /** Sends a signal to the sandbox's pid 1 (default SIGKILL). */
  kill(id: string, signal?: NodeJS.Signals, opts?: CallOptions): Promise<void>;
  /** Removes everything: container, mounts, cgroup, network, log collector, directory. */
  destroy(id: string, opts?: CallOptions): Promise<void>;
  /** Ids of the sandboxes this runtime has prepared and not destroyed. */
  list(): Promise<string[]>;
  /**
   * The toolbox agent of running sandbox `id` (runtime/agent-client.ts speaks to it): the one
   * there if it answers a ping with `token`, else one started now (concurrent calls start it
   * once). Optional: a runtime without it has no toolbox. Fails with an AgentError when the
   * agent cannot start or answer.
   */
  ensureAgent?(id: string, token: string, opts?: CallOptions): Promise<AgentAddress>;

  /**
   * Where the runtime keeps the log of the sandbox's last failed restore (CRIU's, for runc),
   * whether or not one exists. Optional: a runtime that keeps none has no such log.
   */
  restoreLogPath?(id: string): string;
}
