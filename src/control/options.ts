/** What the lifecycle controller is made with: its ports and options. */

import type { StatePort, VaultPort } from './ports.js';
import type { Runtime, SandboxSpec as RuntimeSpec } from '../runtime/runtime.js';
import type { ArchiveLimits } from '../checkpoint/archive.js';
import type { PlatformFacts } from '../domain/compat.js';
import type { EgressPolicy } from '../domain/egress.js';
import type { RuntimeKind } from '../domain/sandbox.js';
import type { GpuNode } from './gpu.js';
import type { OperationTimings } from '../domain/timings.js';
import type { SandboxProfile } from '../checkpoint/profile-check.js';
import type { ImageService } from './images.js';
import type { TemplateStore } from '../state/templates.js';

/** The vault's port, by the name the daemon and older callers know it. */
export type CheckpointVault = VaultPort;

export interface Clock {
  now(): number;
}

/**
 * Seals a sandbox's environment values at rest (the vault's TenantSecrets: the tenant's key).
 * The database holds only what `seal` returns; `open` is called only to build the runtime spec
 * (and for an export the user asked for).
 */
export interface EnvSecrets {
  seal(
    tenant: string,
    sandboxId: string,
    env: Readonly<Record<string, string>>,
  ): Promise<Record<string, string>>;
  open(
    tenant: string,
    sandboxId: string,
    env: Readonly<Record<string, string>>,
  ): Promise<Record<string, string>>;
  /** A secret key, stable across restarts, for the toolbox agents' tokens (ops/toolbox.ts). */
  agentTokenKey?(): Buffer;
}

export const systemClock: Clock = { now: () => Date.now() };

export interface ControllerOptions {
  store: StatePort;
  /**
   * This node's name in a fleet (the state in PostgreSQL, shared by nodes): its sandboxes are
   * the ones it reconciles, meters and applies policy to, and a sandbox it makes or wakes
   * becomes its own. Undefined on a node alone (SQLite): every sandbox is its own.
   */
  node?: string;
  runtime: Runtime;
  vault: VaultPort;
  /** Memory-backed folder for CRIU images in flight (never persistent disk). */
  stagingDir: string;
  /**
   * Host folders a tenant's rootfs, image layout or import archive may come from (the operator's
   * `serve --allow-root`). Empty or unset: tenants name no host path at all. Admin callers may
   * name any absolute path: they hold the node already.
   */
  allowedSourceRoots?: readonly string[];
  /** Committed checkpoints kept per sandbox (older ones are deleted). Default 2. */
  keepCheckpoints?: number;
  clock?: Clock;
  /** Where OCI images are unpacked (one folder per manifest digest). Default: under stagingDir. */
  imageCacheDir?: string;
  /**
   * Registry pulls, tenants' registry logins and the image cache's collector (control/images.ts).
   * Without it `image` names only OCI layout folders.
   */
  images?: ImageService;
  /** Read-only host folders mounted into every sandbox (e.g. /usr for python3 in tests). */
  readonlyBinds?: RuntimeSpec['readonlyBinds'];
  /**
   * What an imported checkpoint's images may hold (checkpoint/profile-check.ts), over the
   * defaults: the capabilities sandboxes get, no_new_privs, a seccomp filter, a sandbox's
   * namespaces and mounts. Set `userNamespace` to the sandboxes' uid/gid mapping when they run
   * in one. Admin imports are also allowed images in the host's user namespace.
   */
  checkpointProfile?: Partial<SandboxProfile>;
  /** Disk quota of a sandbox's writable layer when its create names none. Default 10 GiB. */
  defaultDiskBytes?: number;
  /**
   * Egress of a sandbox whose create names none (domain/egress.ts): the tenant's, else the
   * node's. Default `internet`. Applied at create; a sandbox keeps the policy it was made with.
   */
  defaultEgress?: { node: EgressPolicy; tenants: Record<string, EgressPolicy> };
  /** The runtime of a sandbox whose create names none: the tenant's, else the node's. Default runc. */
  defaultRuntime?: { node: RuntimeKind; tenants: Record<string, RuntimeKind> };
  /** Fault injection for crash tests: throw at the named step. */
  failAt?: (step: string) => void;
  /** Caps on what an imported archive may unpack to (defaults: archive.ts). */
  importLimits?: Pick<ArchiveLimits, 'maxBytes' | 'maxMemberBytes' | 'maxEntries'>;
  /**
   * Seals `--env` values in the database (the daemon always gives it). Without it they are
   * stored as given (embedding, tests of other parts).
   */
  secrets?: EnvSecrets;
  /**
   * Resume a hibernated sandbox with CRIU's lazy pages (userfaultfd): the sandbox runs as soon
   * as its processes are back and its memory is copied in behind it. Default true; false:
   * eager. GPU checkpoints always restore eagerly.
   */
  lazyRestore?: boolean;
  /**
   * With lazy restore: serve the lazy pages straight from the vault (a page server for
   * `criu lazy-pages`), so resume never writes the memory to staging. Default true; false:
   * the pages images are restored to staging and CRIU's daemon reads them there.
   */
  servePagesFromVault?: boolean;
  /**
   * With pages served from the vault: only checkpoints larger than this (logical bytes) are;
   * smaller ones are staged, as their fetch costs little before the sandbox runs and CRIU's
   * own daemon then pages them in at local speed, also for a process that touches all of its
   * memory at once (from the page server that is one fault per round trip). Default 256 MiB;
   * 0: every checkpoint.
   */
  pagesFromVaultAboveBytes?: number;
  /**
   * What the decrypted template checkpoints kept in the staging folder between creates may
   * take, all together (ops/template-cache.ts). Default 1 GiB; 0 keeps none.
   */
  templateCacheBytes?: number;
  /**
   * Whether this node can restore lazily (userfaultfd in the kernel, CRIU's uffd support):
   * undefined when it can, else why not. Asked once, when the controller is made; without
   * it, lazy restore is taken to work. Where it cannot, resumes are eager (and `warn` says so once).
   */
  lazyRestoreProbe?: () => Promise<string | undefined>;
  /** Warnings for the operator (lazy restore unavailable, ...). Default: none. */
  warn?: (message: string) => void;
  /** This node's architecture, CRIU version and CPU flags, recorded in checkpoints and checked before restores. */
  platform?: () => Promise<PlatformFacts>;
  /**
   * Called after every hibernate, resume from a checkpoint and fork (also failed ones) with the
   * wall time of each step: the debug log and the benchmark print them.
   */
  onTimings?: (t: OperationTimings) => void;
  /** Resource use of a sandbox's cgroup right now (undefined: no processes). */
  usage?: (sandboxId: string) => Promise<{ memoryBytes: number; cpuUsageUsec: number } | undefined>;
  /** This node's GPUs and the CUDA checkpoint steps. Default: the real node (systemGpuNode). */
  gpu?: GpuNode;
  /** Where templates are recorded (the daemon's database); without it there are none. */
  templates?: TemplateStore;
}
