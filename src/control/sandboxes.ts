/**
 * The lifecycle controller: the one place that moves sandboxes between states. It ties the
 * database of record, the runtime and the vault together, one operation per sandbox at a
 * time, and keeps the contract of DESIGN.md: a checkpoint is committed before the original
 * processes end, a failed hibernate leaves the sandbox as it was, a failed resume leaves the
 * checkpoint in place and says why, and a restart of the daemon reconciles every sandbox.
 */
import { randomBytes } from 'node:crypto';
import { createWriteStream } from 'node:fs';
import { mkdir, open, readFile, realpath, rename, rm, stat } from 'node:fs/promises';
import { Transform } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { arch, release } from 'node:os';
import { basename, isAbsolute, join } from 'node:path';
import type { Socket } from 'node:net';
import { DormantError, ErrorCode, asError, errnoCode, isDormantError } from '../domain/errors.js';
import {
  ID_PATTERN,
  assertLegal,
  isNoop,
  newId,
  validateName,
  type PortSpec,
  type Sandbox,
  type SandboxPolicy,
  type SandboxSpec,
  type SandboxState,
} from '../domain/sandbox.js';
import type { CheckpointRecord } from '../state/store.js';
import type { CheckpointReaderPort, StatePort, VaultPort } from './ports.js';
import type { Runtime, SandboxSpec as RuntimeSpec } from '../runtime/runtime.js';
import { parseImageRef, unpackImage, type ImageConfig } from '../runtime/image.js';
import { wipeStaged } from '../runtime/staging.js';
import { MAX_DISK_BYTES, MIN_DISK_BYTES } from '../runtime/oci.js';
import { run } from '../sys/exec.js';
import { KeyedMutex } from './mutex.js';
import { FS_DIFF, FS_META, emptyFolder, packFilesystem, unpackFilesystem } from './filesystem.js';
import { openCheckpointPath, openDormantCheckpoint } from '../checkpoint/source.js';
import { inspectCheckpoint } from '../checkpoint/inspect.js';
import {
  ANNOTATION_MANIFEST,
  ANNOTATION_PORTS,
  imageDiffers,
  imageMismatch,
  imageRequired,
  readArchiveFacts,
  type ArchiveFacts,
} from '../checkpoint/import.js';
import { applyDeletedFiles, applyRootfsDiff, rootfsDiffMembers } from '../checkpoint/rootfs-diff.js';
import { exportCheckpoint, type ArchiveMember } from '../checkpoint/export.js';
import type { ArchiveLimits, Compression } from '../checkpoint/archive.js';
import { restoreProblems, type PlatformFacts } from '../domain/compat.js';
import {
  DEFAULT_GPU_POLICY,
  gpuRestoreProblems,
  parseGpuPolicy,
  parseGpus,
  type GpuCheckpointFacts,
  type GpuPolicy,
} from '../domain/gpu.js';
import type { GpuHolder } from '../sys/gpu.js';
import { checkpointUnsupported, systemGpuNode, type GpuNode } from './gpu.js';

/** What a GPU checkpoint records besides the node's GPUs: the processes whose CUDA state it holds. */
type GpuMeta = GpuCheckpointFacts & { nsPids: number[] };

function describeHolders(holders: readonly GpuHolder[]): string {
  return holders
    .slice(0, 3)
    .map((h) => `pid ${h.nsPid}: ${h.evidence[0] ?? '?'}`)
    .concat(holders.length > 3 ? [`${holders.length - 3} more`] : [])
    .join('; ');
}

function gpuMetaOf(m: Record<string, unknown>): GpuMeta | undefined {
  const g = m.gpu;
  if (typeof g !== 'object' || g === null) return undefined;
  const v = g as Partial<GpuMeta>;
  if (typeof v.driverApiVersion !== 'number' || !Array.isArray(v.devices) || !Array.isArray(v.nsPids))
    return undefined;
  return v as GpuMeta;
}
import { StepTimer, type OperationTimings, type StepSink } from '../domain/timings.js';
import { readCriuImages } from '../criu/images/reader.js';
import { sandboxProfile, type SandboxProfile } from '../checkpoint/profile-check.js';
import { assertWithinProfile } from '../checkpoint/profile-check-io.js';
import { SANDBOX_CAPABILITIES } from '../runtime/oci.js';
import { isPagesImage, startPageServer, writeEagerPages, type PageServer } from '../criu/page-server.js';
import { startKeeper, type Keeper } from '../sys/keeper.js';

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
}

export const systemClock: Clock = { now: () => Date.now() };

export interface ControllerOptions {
  store: StatePort;
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
}

export interface CreateSandboxInput {
  tenant: string;
  /** The caller holds an admin token: host paths outside the allowed folders are accepted. */
  admin?: boolean;
  name?: string;
  rootfs?: string;
  image?: string;
  command: string[];
  env?: Record<string, string>;
  ports?: (number | PortSpec)[];
  memoryBytes?: number;
  cpus?: number;
  /** Disk quota of the writable layer. Default: the daemon's (10 GiB unless configured). */
  diskBytes?: number;
  policy?: SandboxPolicy;
  onResume?: string[];
  /** GPUs: `all` or indexes like `0,1`. Refused on a node without an NVIDIA driver. */
  gpus?: string;
  /** What hibernate does when the sandbox holds GPU state. Default keep-running. */
  gpuPolicy?: GpuPolicy;
}

export interface ImportArchiveInput {
  tenant: string;
  /** The caller holds an admin token: host paths outside the allowed folders are accepted. */
  admin?: boolean;
  /** A podman export or a kubelet / CRI-O checkpoint archive on this node (absolute path). */
  archive: string;
  /** The base image as an OCI image layout (DIR[:TAG]); default: an image dormant holds. */
  image?: string;
  name?: string;
  /** Ports reachable through the proxy; default: what a dormant export recorded. */
  ports?: number[];
  memoryBytes?: number;
}

/** A lazy restore's pages, served from the vault while they stream in. */
interface PagesFromVault {
  server: PageServer;
  reader: CheckpointReaderPort;
  /** Hold the server's connections, to end the sandbox's processes should dormant die. */
  keepers: Keeper[];
  /** Set once the server is being stopped: a keeper that starts after that is released at once. */
  ended: { now: boolean };
}

/** Checkpoints up to this size are staged for a lazy resume, bigger ones served from the vault. */
const PAGES_FROM_VAULT_ABOVE_BYTES = 256 * 1024 * 1024;

/** CRIU and the kernel say x86_64 / aarch64; Node says x64 / arm64. */
const NODE_ARCH: Record<string, string> = { x86_64: 'x64', amd64: 'x64', aarch64: 'arm64' };

const DEFAULT_MEMORY = 512 * 1024 ** 2;
/** The writable layer's disk quota when neither the create nor the daemon names one. */
export const DEFAULT_DISK_BYTES = 10 * 1024 ** 3;

/** A tenant named a host path outside the operator's allowed folders (403). */
function hostPathForbidden(what: string, path: string, roots: readonly string[] = []): DormantError {
  const shown = path.slice(0, 200).replace(/\0/g, '\\0');
  return new DormantError(
    ErrorCode.HOST_PATH_FORBIDDEN,
    roots.length === 0
      ? `${what} ${shown}: a tenant token cannot name host paths on this node`
      : `${what} ${shown} is outside the allowed folders`,
    {
      status: 403,
      hint:
        roots.length === 0
          ? 'the operator can allow folders with `dormant serve --allow-root DIR`; checkpoint archives can be uploaded (`dormant checkpoint import FILE` sends the file)'
          : 'use a path under a folder the operator allowed (dormant serve --allow-root), or upload the archive',
    },
  );
}

/** Whether `path` (already resolved, or as given when missing) is inside one of `roots`. */
async function insideRoots(path: string, roots: readonly string[]): Promise<boolean> {
  const realRoots = await Promise.all(roots.map((r) => realpath(r).catch(() => r)));
  return realRoots.some((r) => path === r || path.startsWith(`${r.replace(/\/$/, '')}/`));
}

function invalid(message: string, hint?: string): DormantError {
  return new DormantError(ErrorCode.INVALID_ARGUMENT, message, { status: 400, ...(hint ? { hint } : {}) });
}

/** A disk quota, checked before anything is made (the runtime checks it again). */
function checkDiskBytes(bytes: number): number {
  if (!(Number.isSafeInteger(bytes) && bytes >= MIN_DISK_BYTES && bytes <= MAX_DISK_BYTES))
    throw invalid(
      `disk quota ${String(bytes)} bytes is out of range`,
      'give --disk from 32M to 16T less 1G, e.g. --disk 10G',
    );
  return bytes;
}

export class SandboxController {
  private readonly store: StatePort;
  private readonly runtime: Runtime;
  private readonly vault: VaultPort;
  private readonly clock: Clock;
  private readonly locks = new KeyedMutex();
  private readonly opts: ControllerOptions;
  private readonly gpu: GpuNode;
  private readonly timings = new Map<string, OperationTimings>();
  /** Resolves true when resumes restore lazily on this node (asked once). */
  private readonly lazy: Promise<boolean>;
  /** Lazy restores whose pages are still coming in (or being undone). */
  private readonly lazyInFlight = new Set<Promise<boolean>>();
  /** Page servers of lazy restores in flight, by sandbox. */
  private readonly pageServers = new Map<string, PagesFromVault>();

  constructor(opts: ControllerOptions) {
    this.opts = opts;
    this.gpu = opts.gpu ?? systemGpuNode();
    this.store = opts.store;
    this.runtime = opts.runtime;
    this.vault = opts.vault;
    this.clock = opts.clock ?? systemClock;
    this.lazy =
      opts.lazyRestore === false
        ? Promise.resolve(false)
        : (opts.lazyRestoreProbe?.() ?? Promise.resolve(undefined)).then(
            (why) => {
              if (why === undefined) return true;
              opts.warn?.(`lazy restore is not available on this node (${why}): resumes restore eagerly`);
              return false;
            },
            (e: unknown) => {
              opts.warn?.(
                `lazy restore is not available on this node (${asError(e).message.split('\n')[0] ?? ''}): resumes restore eagerly`,
              );
              return false;
            },
          );
  }

  private step(name: string): void {
    this.opts.failAt?.(name);
  }

  private timer(): StepTimer {
    return new StepTimer(() => performance.now());
  }

  private report(t: OperationTimings): void {
    this.timings.set(`${t.op}:${t.sandboxId}`, t);
    try {
      this.opts.onTimings?.(t);
    } catch {
      // A listener's failure is not the operation's.
    }
  }

  /** The step timings of the sandbox's last hibernate, resume or fork (as the fork's id). */
  lastTimings(id: string, op: OperationTimings['op']): OperationTimings | undefined {
    return this.timings.get(`${op}:${id}`);
  }

  /** The sandbox, if the tenant may see it (an admin passes undefined). Else SANDBOX_NOT_FOUND. */
  get(id: string, tenant?: string): Sandbox {
    // An id, or a name within the tenant (names are unique per tenant).
    const s =
      this.store.getSandbox(id) ??
      (ID_PATTERN.test(id) ? undefined : this.store.listSandboxes(tenant).find((x) => x.name === id));
    if (!s || (tenant !== undefined && s.tenant !== tenant)) {
      throw new DormantError('SANDBOX_NOT_FOUND', `no sandbox ${id.slice(0, 80)}`, {
        status: 404,
        hint: 'dormant ls shows the sandboxes you can see',
      });
    }
    return s;
  }

  list(tenant?: string): Sandbox[] {
    return this.store.listSandboxes(tenant);
  }

  /** The sandbox with `memoryBytes` read from its cgroup now (0 unless running or paused). */
  async withUsage(s: Sandbox): Promise<Sandbox> {
    if ((s.state !== 'running' && s.state !== 'paused') || !this.opts.usage) return { ...s, memoryBytes: 0 };
    const u = await this.opts.usage(s.id).catch(() => undefined);
    return { ...s, memoryBytes: u?.memoryBytes ?? 0 };
  }

  /** Activity now; a lease (lastActiveAt in the future, from keepalive) is never shortened. */
  private markActive(id: string): void {
    const cur = this.store.getSandbox(id);
    if (cur) this.store.updateSandbox(id, { lastActiveAt: Math.max(cur.lastActiveAt, this.clock.now()) });
  }

  /** Resource use of the sandbox's cgroup now; undefined when it has no processes. */
  async usage(id: string): Promise<{ memoryBytes: number; cpuUsageUsec: number } | undefined> {
    return this.opts.usage ? this.opts.usage(id).catch(() => undefined) : undefined;
  }

  /** Records activity on the sandbox (API call, proxied traffic): the idle clock restarts. */
  touch(id: string): void {
    this.markActive(id);
  }

  /** The environment as the database keeps it: values sealed when secrets are configured. */
  private async sealEnv(
    tenant: string,
    id: string,
    env: Record<string, string>,
  ): Promise<Record<string, string>> {
    return this.opts.secrets ? this.opts.secrets.seal(tenant, id, env) : env;
  }

  /** The sandbox's environment in clear: only for its runtime spec (and an export). */
  private async openEnv(s: Sandbox): Promise<Record<string, string>> {
    return this.opts.secrets ? this.opts.secrets.open(s.tenant, s.id, s.spec.env) : s.spec.env;
  }

  /**
   * Seals every environment value still stored in clear (rows from before sealing); returns
   * how many sandboxes changed. The daemon runs it at start, then compacts the database so the
   * old pages (and WAL frames) with the clear values are overwritten.
   */
  async sealStoredEnv(isSealed: (env: Readonly<Record<string, string>>) => boolean): Promise<number> {
    const secrets = this.opts.secrets;
    if (!secrets) return 0;
    let n = 0;
    for (const s of this.store.listSandboxes()) {
      if (isSealed(s.spec.env)) continue;
      await this.locks.run(s.id, async () => {
        const cur = this.store.getSandbox(s.id);
        if (!cur || isSealed(cur.spec.env)) return;
        // Values sealed already (none, unless a start was cut short) are opened first.
        const clear: Record<string, string> = {};
        const sealed: Record<string, string> = {};
        for (const [k, v] of Object.entries(cur.spec.env))
          if (isSealed({ [k]: v })) sealed[k] = v;
          else clear[k] = v;
        const opened = await secrets.open(cur.tenant, cur.id, sealed);
        const env = await secrets.seal(cur.tenant, cur.id, { ...opened, ...clear });
        this.store.updateSandbox(cur.id, { spec: { ...cur.spec, env } });
        n++;
      });
    }
    return n;
  }

  private async runtimeSpec(s: Sandbox): Promise<RuntimeSpec> {
    const src = s.spec.source;
    return {
      id: s.id,
      rootfs: src.kind === 'rootfs' ? src.path : src.rootfs,
      ...(s.spec.cwd !== undefined ? { cwd: s.spec.cwd } : {}),
      args: s.spec.command,
      env: await this.openEnv(s),
      hostname: s.name,
      ports: s.spec.ports.map((p) => p.port),
      limits: {
        memoryBytes: s.spec.memoryBytes,
        cpus: s.spec.cpus,
        pids: 512,
        // Sandboxes made before quotas have none: their layer is a folder on the host disk.
        ...(s.spec.diskBytes !== undefined ? { diskBytes: s.spec.diskBytes } : {}),
      },
      ...(this.opts.readonlyBinds ? { readonlyBinds: this.opts.readonlyBinds } : {}),
      ...(s.spec.devices !== undefined && s.spec.devices.length > 0 ? { devices: s.spec.devices } : {}),
    };
  }

  /**
   * A source path must be absolute, without `..` or NUL, and, where allowed folders are set,
   * inside one of them after symlinks are resolved (a link inside an allowed folder must not
   * lead out of it). Returns the resolved path.
   */
  private async checkPath(path: string, what: string, admin: boolean): Promise<string> {
    if (!isAbsolute(path) || path.split('/').includes('..') || path.includes('\0')) {
      throw invalid(
        `${what} "${path.slice(0, 200).replace(/\0/g, '\\0')}" must be an absolute path without ".."`,
      );
    }
    const roots = this.opts.allowedSourceRoots ?? [];
    // Refused before the path is even resolved: a tenant learns nothing of the host's folders.
    if (!admin && roots.length === 0) throw hostPathForbidden(what, path);
    let real: string;
    try {
      real = await realpath(path);
    } catch (e) {
      if (errnoCode(e) === 'ENOENT' || errnoCode(e) === 'ENOTDIR') {
        // For a tenant, a missing path outside the allowed folders looks like any other path
        // outside them (no probing of which host files exist).
        if (!admin && !(await insideRoots(path, roots))) throw hostPathForbidden(what, path, roots);
        throw invalid(`${what} ${path} does not exist`);
      }
      throw e;
    }
    if (!admin && !(await insideRoots(real, roots))) throw hostPathForbidden(what, path, roots);
    return real;
  }

  private async validateSource(
    input: CreateSandboxInput,
  ): Promise<{ source: SandboxSpec['source']; image?: ImageConfig }> {
    if (input.image !== undefined) {
      if (input.rootfs !== undefined) throw invalid('give --rootfs or --image, not both');
      const { layout } = parseImageRef(input.image);
      await this.checkPath(layout, 'image', input.admin === true);
      const img = await unpackImage(
        input.image,
        this.opts.imageCacheDir ?? join(this.opts.stagingDir, 'images'),
      );
      const { tag } = parseImageRef(input.image);
      return {
        source: {
          kind: 'image',
          path: layout,
          ...(tag !== undefined ? { tag } : {}),
          digest: img.digest,
          rootfs: img.rootfs,
        },
        image: img.config,
      };
    }
    const path = input.rootfs;
    if (path === undefined)
      throw invalid('a sandbox needs a root filesystem', 'pass --rootfs DIR or --image OCI_LAYOUT_DIR[:TAG]');
    const real = await this.checkPath(path, 'rootfs', input.admin === true);
    if (!(await stat(real)).isDirectory()) throw invalid(`rootfs ${path} is not a folder`);
    // The resolved path: what was checked is what gets mounted.
    return { source: { kind: 'rootfs', path: real } };
  }

  async create(input: CreateSandboxInput): Promise<Sandbox> {
    const { source, image } = await this.validateSource(input);
    const command = input.command.length > 0 ? input.command : (image?.command ?? []);
    if (command.length === 0) throw invalid('a sandbox needs a command', 'dormant create ... -- CMD ARG...');
    const id = newId('sb', randomBytes);
    const name = validateName(input.name ?? id);
    if (this.store.listSandboxes(input.tenant).some((s) => s.name === name)) {
      throw new DormantError('SANDBOX_NAME_TAKEN', `a sandbox named ${name} already exists`, { status: 409 });
    }
    const ports = (input.ports ?? []).map((p) => (typeof p === 'number' ? { port: p, public: false } : p));
    for (const p of ports)
      if (!Number.isInteger(p.port) || p.port < 1 || p.port > 65535)
        throw invalid(`invalid port ${String(p.port)}`);
    const gpus = input.gpus === undefined ? undefined : parseGpus(input.gpus);
    const gpuPolicy = input.gpuPolicy === undefined ? DEFAULT_GPU_POLICY : parseGpuPolicy(input.gpuPolicy);
    if (gpus !== undefined) await this.checkGpusAvailable(gpus);
    const devices = gpus !== undefined ? await this.gpuDevices(gpus) : [];
    const now = this.clock.now();
    const sandbox: Sandbox = {
      id,
      tenant: input.tenant,
      name,
      state: 'creating',
      ...(gpus !== undefined ? { gpus } : {}),
      gpuPolicy,
      spec: {
        source,
        command,
        env: await this.sealEnv(input.tenant, id, { ...image?.env, ...input.env }),
        ...(image?.workingDir !== undefined ? { cwd: image.workingDir } : {}),
        ...(devices.length > 0 ? { devices } : {}),
        ports,
        memoryBytes: input.memoryBytes ?? DEFAULT_MEMORY,
        cpus: input.cpus ?? 1,
        diskBytes: checkDiskBytes(input.diskBytes ?? this.opts.defaultDiskBytes ?? DEFAULT_DISK_BYTES),
        // Only what the caller set: node and tenant defaults apply to the rest when the policy
        // runs, so changing a default reaches existing sandboxes.
        policy: { ...input.policy },
        ...(input.onResume ? { onResume: input.onResume } : {}),
      },
      createdAt: now,
      stateSince: now,
      lastActiveAt: now,
      memoryBytes: 0,
    };
    this.store.insertSandbox(sandbox, 'create');
    return this.locks.run(id, async () => {
      try {
        this.step('create:before-runtime');
        const st = await this.runtime.create(await this.runtimeSpec(sandbox));
        this.step('create:created');
        await this.runtime.start(id);
        this.store.transition(id, 'creating', 'running', 'create', this.clock.now(), {
          address: st.network.address,
        });
        return this.get(id);
      } catch (e) {
        await this.runtime.destroy(id).catch(() => undefined);
        this.store.transition(id, 'creating', 'failed', 'create failed', this.clock.now(), {
          lastError: asError(e).message,
        });
        throw e;
      }
    });
  }

  async exec(
    id: string,
    tenant: string | undefined,
    args: string[],
    opts: { timeoutMs?: number; input?: string } = {},
  ) {
    const s = this.get(id, tenant);
    assertLegal('exec', s.state, id);
    if (args.length === 0) throw invalid('exec needs a command');
    const r = await this.runtime.exec(id, args, opts);
    this.markActive(id);
    return r;
  }

  /** The sandbox's output log, across hibernations. */
  async logPath(id: string, tenant?: string): Promise<string> {
    this.get(id, tenant);
    return (await this.runtime.state(id)).logPath;
  }

  async pause(id: string, tenant?: string, reason = 'pause'): Promise<Sandbox> {
    return this.locks.run(id, async () => {
      const s = this.get(id, tenant);
      assertLegal('pause', s.state, id);
      if (isNoop('pause', s.state)) return s;
      await this.runtime.freeze(id);
      this.store.transition(id, 'running', 'paused', reason, this.clock.now());
      return this.get(id);
    });
  }

  private staging(ckId: string): string {
    return join(this.opts.stagingDir, ckId);
  }

  private async wipe(dir: string): Promise<void> {
    // A mount left below (CRIU's cgroup yard in a restore's work dir) would make rm fail.
    await wipeStaged(dir);
  }

  /** A cleanup step that failed after a failed operation: said to the operator, not thrown over the first error. */
  private warnCleanup(id: string, what: string, e: unknown): void {
    this.opts.warn?.(`sandbox ${id}: cleanup (${what}) failed: ${asError(e).message.split('\n')[0] ?? ''}`);
  }

  /**
   * Hibernate: freeze, dump with the processes left in place (frozen), store the images in
   * the vault, commit the checkpoint, and only then end the processes. Any failure before the
   * commit thaws the sandbox back to where it was.
   */
  async hibernate(id: string, tenant?: string, reason = 'hibernate'): Promise<Sandbox> {
    // The caller gets the sandbox once it is hibernated (checkpoint committed, processes gone,
    // memory freed); the container's remains are removed after that, the lock still held.
    return this.answerEarly(id, (answer) => this.hibernateLocked(id, tenant, reason, answer));
  }

  /**
   * Runs `work` under the sandbox's lock and settles with the first value it passes to
   * `answer`, while it goes on with what the caller need not wait for (the lock is held until
   * it ends). A failure before the answer rejects; one after it is `work`'s to record.
   */
  private answerEarly(id: string, work: (answer: (s: Sandbox) => void) => Promise<void>): Promise<Sandbox> {
    return new Promise<Sandbox>((answer, refuse) => {
      this.locks.run(id, () => work(answer)).catch(refuse);
    });
  }

  private async hibernateLocked(
    id: string,
    tenant: string | undefined,
    reason: string,
    answer: (s: Sandbox) => void,
  ): Promise<void> {
    const s = this.get(id, tenant);
    assertLegal('hibernate', s.state, id);
    if (isNoop('hibernate', s.state)) {
      answer(s);
      return;
    }
    const before = s.state;
    // Refusals happen here, before anything changes: the sandbox stays as it is.
    const holders = await this.gpuGate(s, 'hibernate');
    const gpuFacts = holders.length > 0 ? await this.gpu.checkpointFacts() : undefined;
    const ckId = newId('ck', randomBytes);
    const dir = this.staging(ckId);
    this.store.transition(id, before, 'hibernating', reason, this.clock.now());
    const t = this.timer();
    let committed = false;
    let reported = false;
    const cudaDone: { pid: number; step: 'lock' | 'checkpoint' }[] = [];
    try {
      try {
        await mkdir(dir, { recursive: true, mode: 0o700 });
        let gpuMeta: GpuMeta | undefined;
        if (gpuFacts !== undefined) {
          // The driver's lock and checkpoint need the processes running: thaw a paused sandbox.
          if (before === 'paused') await this.runtime.thaw(id);
          for (const h of holders) {
            await this.gpu.step('lock', h.pid);
            cudaDone.push({ pid: h.pid, step: 'lock' });
            await this.gpu.step('checkpoint', h.pid);
            cudaDone[cudaDone.length - 1]!.step = 'checkpoint';
          }
          gpuMeta = { ...gpuFacts, nsPids: holders.map((h) => h.nsPid) };
          this.step('hibernate:gpu-checkpointed');
        }
        await t.time('freeze', () => this.runtime.freeze(id, { timer: t }));
        this.step('hibernate:frozen');
        // The images are wiped with the rest of the staging folder once the checkpoint is
        // committed, beside the end of the processes: not on the way to the commit.
        const rec = await this.dumpToVault(s, ckId, dir, 'hibernate', t, false, gpuMeta);
        await t.time('commit', async () => {
          this.store.insertCheckpoint(rec);
          this.store.updateSandbox(id, { checkpointId: ckId });
        });
        committed = true;
        this.step('hibernate:committed');
      } catch (e) {
        await this.wipe(dir);
        if (committed) throw e;
        // Not committed: the sandbox goes back to what it was, running or paused, its CUDA
        // state back on the GPU.
        let undo = '';
        if (before === 'running' || cudaDone.length > 0) await this.runtime.thaw(id).catch(() => undefined);
        if (cudaDone.length > 0) {
          undo = await this.cudaUndo(cudaDone);
          if (before === 'paused') await this.runtime.freeze(id).catch(() => undefined);
        }
        this.store.transition(id, 'hibernating', before, 'hibernate failed', this.clock.now(), {
          lastError: `${asError(e).message}${undo}`,
        });
        throw new DormantError(
          'HIBERNATE_FAILED',
          `hibernate of sandbox ${id} failed; it is ${before} again: ${asError(e).message}${undo}`,
          {
            status: 500,
            cause: e,
            hint: 'dormant doctor shows what this node supports',
          },
        );
      }
      // Committed: the processes end (and the writable layer, whose diff is in the
      // checkpoint, is emptied) while the staging folder is wiped and older checkpoints are
      // pruned; none of the three waits for another. The caller is answered once the
      // processes are gone; the container's remains go after that.
      const [ended, ...rest] = await Promise.allSettled([
        t.time('end processes', async () => {
          if (this.runtime.endProcesses) await this.runtime.endProcesses(id, { timer: t });
          else await this.endProcesses(id, t);
          await emptyFolder(this.runtime.upperDir(id));
        }),
        t.time('wipe staging', () => this.wipe(dir)),
        t.time('prune', () => this.pruneCheckpoints(id, s.tenant)),
      ]);
      if (ended.status === 'rejected') await this.afterUnendedHibernate(id, ckId, ended.reason);
      this.store.transition(id, 'hibernating', 'hibernated', reason, this.clock.now(), { memoryBytes: 0 });
      for (const r of rest) if (r.status === 'rejected') throw r.reason;
      // The timings are those the caller waited for; removing the container's remains is not.
      this.report(t.finish('hibernate', id, true));
      reported = true;
      answer(this.get(id));
      if (this.runtime.endProcesses) {
        // runc's state; a failure here leaves a hibernated sandbox whose remains the next
        // resume (or a restart's reconcile) removes anyway.
        await this.runtime.stop(id).catch((e: unknown) => {
          this.store.note(
            id,
            `removing the container after hibernate failed: ${asError(e).message}`,
            this.clock.now(),
          );
        });
      }
    } finally {
      if (!reported) this.report(t.finish('hibernate', id, false));
    }
  }

  /**
   * A hibernate committed its checkpoint but could not end the processes. If they still exist
   * they carry on: the sandbox is running again (thawed), the checkpoint kept as a restore
   * point, and the error is thrown. If they are gone after all, it returns and the sandbox is
   * hibernated.
   */
  private async afterUnendedHibernate(id: string, ckId: string, cause: unknown): Promise<void> {
    const st = await this.runtime.state(id).catch(() => undefined);
    if (st?.status !== 'running' && st?.status !== 'paused') return;
    await this.runtime.thaw(id).catch(() => undefined);
    const why = `checkpoint ${ckId} is stored, but the processes could not be ended: ${asError(cause).message}`;
    this.store.transition(
      id,
      'hibernating',
      'running',
      'hibernate could not end the processes',
      this.clock.now(),
      {
        lastError: why,
      },
    );
    throw new DormantError(
      'HIBERNATE_FAILED',
      `hibernate of sandbox ${id} failed; it is running again: ${why}`,
      {
        status: 500,
        cause,
        hint: `the checkpoint stays; dormant hibernate ${id} tries again`,
      },
    );
  }

  /**
   * Dumps a frozen sandbox with its processes left in place and stores the images in the
   * vault. Returns the checkpoint record, not yet committed to the database.
   */
  private async dumpToVault(
    s: Sandbox,
    ckId: string,
    dir: string,
    stepPrefix: string,
    t: StepTimer,
    wipeImages = true,
    gpuMeta?: GpuMeta,
  ): Promise<CheckpointRecord> {
    const images = join(dir, 'images');
    const platform = await this.platform();
    const meta: Record<string, string> = {
      arch: platform.arch,
      kernel: release(),
      kind: 'memory',
      [FS_META]: 'tar',
      ...(platform.criuVersion !== undefined ? { criuVersion: platform.criuVersion } : {}),
      ...(gpuMeta !== undefined ? { gpu: JSON.stringify(gpuMeta) } : {}),
    };
    // The vault reads CRIU's page images while CRIU writes them (the dump is mostly the
    // kernel copying pages, on one core): storing overlaps the dump instead of following it.
    const written = (async () => {
      await t.time('checkpoint', () =>
        this.runtime.checkpoint(s.id, {
          imagesDir: images,
          workDir: join(dir, 'work'),
          leaveRunning: true,
          timer: t,
        }),
      );
      this.step(`${stepPrefix}:dumped`);
      // The processes are still frozen: the diff is consistent with the memory just dumped.
      await packFilesystem(this.runtime.upperDir(s.id), join(images, FS_DIFF));
    })();
    const storing = t.time('vault put', () =>
      this.vault.putCheckpoint({
        tenant: s.tenant,
        sandboxId: s.id,
        checkpointId: ckId,
        srcDir: images,
        meta,
        growing: written,
      }),
    );
    const [dumped, stored] = await Promise.allSettled([written, storing]);
    // A failed dump is the reason (the put then fails with it too).
    if (dumped.status === 'rejected') throw dumped.reason;
    if (stored.status === 'rejected') throw stored.reason;
    const put = stored.value;
    this.step(`${stepPrefix}:stored`);
    if (wipeImages) await t.time('wipe images', () => this.wipe(images));
    return {
      id: ckId,
      sandboxId: s.id,
      tenant: s.tenant,
      createdAt: this.clock.now(),
      kind: 'memory',
      logicalBytes: put.logicalBytes,
      storedBytes: put.storedBytes,
      meta: {
        ...meta,
        ...(platform.cpuFlags !== undefined ? { cpuFlags: platform.cpuFlags } : {}),
        ...(gpuMeta !== undefined ? { gpu: gpuMeta } : {}),
      },
    };
  }

  /** The device nodes of GPUs `gpus` on this node; refuses (409) when one is missing. */
  private async gpuDevices(gpus: string): Promise<{ path: string; major: number; minor: number }[]> {
    if (this.gpu.deviceNodes === undefined) return [];
    try {
      return await this.gpu.deviceNodes(gpus);
    } catch (e) {
      throw new DormantError(
        'GPU_UNAVAILABLE',
        `cannot create a sandbox with GPUs (${gpus}): ${asError(e).message}`,
        {
          status: 409,
          cause: e,
          hint: 'ls /dev/nvidia* shows the GPUs this node has; --gpus all takes every one',
        },
      );
    }
  }

  /** Refuses GPUs on a node without an NVIDIA driver. */
  private async checkGpusAvailable(gpus: string): Promise<void> {
    const sup = await this.gpu.support();
    if (sup.driverVersion === undefined) {
      throw new DormantError(
        'GPU_UNAVAILABLE',
        `cannot create a sandbox with GPUs (${gpus}): this node has no NVIDIA driver (/proc/driver/nvidia/version is missing)`,
        {
          status: 409,
          hint: 'create it without --gpus, or on a node where dormant doctor shows an NVIDIA driver',
        },
      );
    }
  }

  /** The sandbox's processes that hold GPU state now (none when it has no processes). */
  async gpuHolders(id: string): Promise<GpuHolder[]> {
    // From the sandbox's cgroup: no `runc state` on every hibernate's path.
    const pids = await this.runtime.pids(id);
    return pids.length === 0 ? [] : this.gpu.holders(pids);
  }

  /**
   * What the sandbox's GPU policy allows before its processes are checkpointed: throws the
   * refusal (nothing has changed yet), or returns the processes whose CUDA state must be
   * checkpointed first (empty: CRIU alone is enough).
   */
  private async gpuGate(s: Sandbox, op: 'hibernate' | 'fork'): Promise<GpuHolder[]> {
    const holders = await this.gpuHolders(s.id);
    if (holders.length === 0 && s.gpus === undefined) return [];
    const policy = s.gpuPolicy ?? DEFAULT_GPU_POLICY;
    const what =
      holders.length > 0
        ? `holds GPU state (${describeHolders(holders)})`
        : `was created with GPUs (${s.gpus ?? ''})`;
    if (op === 'fork' && holders.length > 0) {
      throw new DormantError('GPU_FORK_UNSUPPORTED', `cannot fork sandbox ${s.id}: it ${what}`, {
        status: 409,
        hint: 'two copies of one CUDA process cannot share its GPU state; fork it while no process uses the GPU',
      });
    }
    if (op === 'fork') return [];
    if (policy === 'keep-running') {
      throw new DormantError(
        'GPU_KEEP_RUNNING',
        `sandbox ${s.id} ${what} and its GPU policy is keep-running: it is not hibernated`,
        {
          status: 409,
          hint: `it keeps running; to stop it keeping only its files: dormant archive ${s.id}. GPU sandboxes created with --gpu-policy checkpoint hibernate where dormant doctor shows CUDA checkpointing`,
          details: { sandboxId: s.id, gpuPolicy: policy, pids: holders.map((h) => h.nsPid) },
        },
      );
    }
    if (policy === 'filesystem-only') {
      throw new DormantError(
        'GPU_FILESYSTEM_ONLY',
        `sandbox ${s.id} ${what} and its GPU policy is filesystem-only: its processes are not checkpointed`,
        {
          status: 409,
          hint: `archive it instead (its files are kept, its processes end): dormant archive ${s.id}`,
          details: { sandboxId: s.id, gpuPolicy: policy, pids: holders.map((h) => h.nsPid) },
        },
      );
    }
    if (holders.length === 0) return [];
    const why = checkpointUnsupported(await this.gpu.support());
    if (why !== undefined) {
      throw new DormantError(
        'GPU_CHECKPOINT_UNSUPPORTED',
        `sandbox ${s.id} ${what} and its GPU policy is checkpoint, but ${why}: it is not hibernated`,
        {
          status: 409,
          hint: 'dormant doctor shows the GPU rows; the sandbox keeps running',
          details: { sandboxId: s.id, gpuPolicy: policy, pids: holders.map((h) => h.nsPid) },
        },
      );
    }
    return holders;
  }

  /** Puts CUDA state back after a failed hibernate; returns what could not be undone, if anything. */
  private async cudaUndo(done: readonly { pid: number; step: 'lock' | 'checkpoint' }[]): Promise<string> {
    const failed: string[] = [];
    for (const d of done) {
      try {
        if (d.step === 'checkpoint') await this.gpu.step('restore', d.pid);
        await this.gpu.step('unlock', d.pid);
      } catch (e) {
        failed.push(`pid ${d.pid}: ${asError(e).message}`);
      }
    }
    return failed.length > 0 ? `; CUDA state could not be put back: ${failed.join('; ')}` : '';
  }

  /** After CRIU restored the processes: their device memory back onto the GPU, CUDA unlocked. */
  private async cudaRestore(id: string, meta: GpuMeta): Promise<void> {
    const st = await this.runtime.state(id);
    const procs = st.pid === undefined ? [] : await this.gpu.processes(st.pid);
    try {
      for (const nsPid of meta.nsPids) {
        const p = procs.find((x) => x.nsPid === nsPid);
        if (!p) throw new Error(`restored process ${nsPid} (pid inside the sandbox) is missing`);
        await this.gpu.step('restore', p.pid);
        await this.gpu.step('unlock', p.pid);
      }
      this.step('resume:gpu-restored');
    } catch (e) {
      // Half-restored GPU processes are of no use: end them; the checkpoint stays.
      await this.runtime.stop(id).catch(() => undefined);
      throw new DormantError(
        'GPU_RESTORE_FAILED',
        `CUDA restore of sandbox ${id} failed: ${asError(e).message}`,
        {
          status: 500,
          cause: e,
        },
      );
    }
  }

  /** Records an event on the sandbox without changing its state (why the idle policy skipped it). */
  note(id: string, reason: string): void {
    this.store.note(id, reason, this.clock.now());
  }

  /** The node's facts; without a `platform` option only the architecture is known. */
  private async platform(): Promise<Partial<PlatformFacts> & { arch: string }> {
    return this.opts.platform ? this.opts.platform() : { arch: arch() };
  }

  /** Refuses a restore this node cannot do, naming why. */
  private async checkCompatible(sandboxId: string, ck: CheckpointRecord | undefined): Promise<void> {
    if (!ck) return;
    const m = ck.meta;
    const from = {
      ...(typeof m.arch === 'string' ? { arch: m.arch } : {}),
      ...(typeof m.criuVersion === 'string' ? { criuVersion: m.criuVersion } : {}),
      ...(Array.isArray(m.cpuFlags)
        ? { cpuFlags: m.cpuFlags.filter((f): f is string => typeof f === 'string') }
        : {}),
    };
    const node = await this.platform();
    // Only what this node knows about itself is compared.
    const problems = restoreProblems(
      {
        ...(from.arch !== undefined ? { arch: from.arch } : {}),
        ...(from.criuVersion !== undefined && node.criuVersion !== undefined
          ? { criuVersion: from.criuVersion }
          : {}),
        ...(from.cpuFlags !== undefined && node.cpuFlags !== undefined ? { cpuFlags: from.cpuFlags } : {}),
      },
      { arch: node.arch, criuVersion: node.criuVersion ?? '0', cpuFlags: node.cpuFlags ?? [] },
    );
    const gpuMeta = gpuMetaOf(m);
    if (gpuMeta !== undefined) {
      const why = checkpointUnsupported(await this.gpu.support());
      if (why !== undefined) problems.push(`the checkpoint holds CUDA state and ${why}`);
      else
        problems.push(
          ...gpuRestoreProblems(gpuMeta, await this.gpu.checkpointFacts().catch(() => undefined)),
        );
    }
    if (problems.length > 0) {
      throw new DormantError(
        'RESTORE_INCOMPATIBLE',
        `checkpoint ${ck.id} of sandbox ${sandboxId} cannot be restored here: ${problems.join('; ')}`,
        {
          status: 409,
          hint: 'resume it on a node of the same kind (dormant doctor shows this one), or archive it and start it afresh',
        },
      );
    }
  }

  /**
   * A new sandbox restored from `id`'s newest checkpoint (a running or paused sandbox is
   * checkpointed first and keeps running), with a copy of its filesystem. The fork has its own
   * network address; listening sockets bound to all addresses listen again there.
   */
  async fork(id: string, tenant: string | undefined, opts: { name?: string } = {}): Promise<Sandbox> {
    const src = this.get(id, tenant);
    assertLegal('fork', src.state, src.id);
    const forkId = newId('sb', randomBytes);
    const name = validateName(opts.name ?? forkId);
    if (this.store.listSandboxes(src.tenant).some((x) => x.name === name)) {
      throw new DormantError('SANDBOX_NAME_TAKEN', `a sandbox named ${name} already exists`, { status: 409 });
    }
    const now = this.clock.now();
    const sandbox: Sandbox = {
      ...src,
      // Sealed again: a sealed value names the sandbox it belongs to.
      spec: { ...src.spec, env: await this.sealEnv(src.tenant, forkId, await this.openEnv(src)) },
      id: forkId,
      name,
      state: 'creating',
      createdAt: now,
      stateSince: now,
      lastActiveAt: now,
      memoryBytes: 0,
    };
    delete sandbox.checkpointId;
    delete sandbox.lastError;
    delete sandbox.address;
    const dir = this.staging(`${forkId}-fork`);
    await mkdir(dir, { recursive: true, mode: 0o700 });
    const t = this.timer();
    let ok = false;
    try {
      // Under the source's lock: a consistent checkpoint and filesystem copy of the source.
      const ckId = await this.locks.run(src.id, async () => {
        const cur = this.get(src.id);
        assertLegal('fork', cur.state, src.id);
        let ck = cur.checkpointId;
        if (cur.state === 'running' || cur.state === 'paused') {
          await this.gpuGate(cur, 'fork');
          ck = newId('ck', randomBytes);
          await this.runtime.freeze(src.id);
          try {
            const rec = await this.dumpToVault(cur, ck, dir, 'fork', t);
            this.store.insertCheckpoint(rec);
            this.store.updateSandbox(src.id, { checkpointId: ck });
            this.store.insertSandbox(sandbox, `fork of ${src.id}`);
          } finally {
            if (cur.state === 'running') await this.runtime.thaw(src.id);
          }
          await this.pruneCheckpoints(src.id, src.tenant);
        } else {
          this.store.insertSandbox(sandbox, `fork of ${src.id}`);
          // A checkpoint from before diffs went into the vault: the diff is on disk.
          const rec = ck !== undefined ? this.store.getCheckpoint(ck) : undefined;
          if (rec?.meta[FS_META] !== 'tar') await this.copyFilesystem(this.runtime.upperDir(src.id), forkId);
        }
        if (ck === undefined)
          throw new DormantError('CHECKPOINT_NOT_FOUND', `sandbox ${src.id} has no checkpoint to fork`, {
            status: 409,
          });
        return ck;
      });
      return await this.locks.run(forkId, async () => {
        const images = join(dir, 'images');
        await t.time('vault fetch', () =>
          this.vault.restoreCheckpoint({ tenant: src.tenant, checkpointId: ckId, destDir: images }),
        );
        await this.checkImported(images, this.store.getCheckpoint(ckId));
        // The checkpoint's diff (the source's files when it was dumped) is the fork's start,
        // written before its overlay is mounted (restore mounts it), after prepare has made
        // (and mounted) its writable layer's disk image.
        await this.runtime.prepare(await this.runtimeSpec(this.get(forkId)), {
          timer: t,
          mountRootfs: false,
        });
        await t.time('unpack filesystem', () => this.applyFilesystem(forkId, images));
        const st = await t.time('restore', () =>
          this.runtime
            .restore(forkId, { imagesDir: images, workDir: join(dir, 'work'), timer: t })
            .then(() => this.runtime.state(forkId)),
        );
        this.store.transition(forkId, 'creating', 'running', `fork of ${src.id}`, this.clock.now(), {
          address: st.network.address,
        });
        ok = true;
        return this.get(forkId);
      });
    } catch (e) {
      if (this.store.getSandbox(forkId)) {
        await this.runtime.destroy(forkId).catch(() => undefined);
        this.store.transition(forkId, 'creating', 'failed', 'fork failed', this.clock.now(), {
          lastError: asError(e).message,
        });
      }
      throw e;
    } finally {
      await this.wipe(dir);
      this.report(t.finish('fork', forkId, ok));
    }
  }

  /** Prepares the fork's runtime side and copies the source's writable layer into it. */
  private async copyFilesystem(srcUpper: string, forkId: string): Promise<void> {
    const fork = this.store.getSandbox(forkId)!;
    const st = await this.runtime.prepare(await this.runtimeSpec(fork));
    // cp -a keeps modes, owners, links and overlayfs whiteouts (character devices 0/0).
    await run('cp', ['-a', '--', `${srcUpper}/.`, st.upperDir], { timeoutMs: 600_000 });
  }

  /** Ends a sandbox's processes and removes its container; its filesystem and network stay. */
  private async endProcesses(id: string, t?: StepTimer): Promise<void> {
    // stop() is a no-op for a sandbox without a container: no `runc state` first.
    await this.runtime.stop(id, t ? { timer: t } : {});
  }

  private async pruneCheckpoints(id: string, tenant: string): Promise<void> {
    const keep = this.opts.keepCheckpoints ?? 2;
    const all = this.store.listCheckpoints({ sandboxId: id });
    const memory = all.filter((c) => c.kind === 'memory');
    // An archive's diff is superseded by the first memory checkpoint after it.
    const stale = all.filter((c) => c.kind === 'filesystem' && memory.length > 0);
    for (const old of [...memory.slice(keep), ...stale]) {
      await this.vault.deleteCheckpoint({ tenant, checkpointId: old.id });
      this.store.deleteCheckpoint(old.id, this.clock.now());
    }
  }

  /**
   * Back to running. From hibernated it restores the newest checkpoint, or `opts.from` (an
   * older one of the same sandbox, when the newest is damaged).
   */
  async resume(
    id: string,
    tenant?: string,
    reason = 'resume',
    opts: { from?: string } = {},
  ): Promise<Sandbox> {
    // The caller gets the sandbox as soon as it runs. With lazy restore its pages are still
    // being copied in: the sandbox's lock is held until they are, so no other operation (a
    // hibernate, say) can touch it half-loaded.
    // Steps are recorded only on a restore from a checkpoint (a thaw has none to show).
    const t = this.timer();
    return this.answerEarly(id, async (answer) => {
      let ok = false;
      try {
        const r = await this.resumeLocked(id, tenant, reason, opts, t);
        if (t.steps().length > 0) t.mark('running');
        answer(r.sandbox);
        if (r.pagesLoaded) this.step('resume:pages-pending');
        ok = r.pagesLoaded
          ? await t.time('pages loaded', () => this.afterLazyRestore(r.sandbox, r.pagesLoaded!))
          : true;
      } finally {
        if (t.steps().length > 0) this.report(t.finish('resume', this.store.getSandbox(id)?.id ?? id, ok));
      }
    });
  }

  /**
   * Waits for a lazy restore's pages, then clears the sandbox's in-flight marker. If they fail
   * to arrive (the lazy-pages daemon died or failed) the sandbox is unusable but its checkpoint
   * is not: its processes are ended and it is hibernated again on that checkpoint.
   * True when every page arrived.
   */
  private async afterLazyRestore(s: Sandbox, pagesLoaded: Promise<void>): Promise<boolean> {
    const p = this.afterLazyRestoreNow(s, pagesLoaded);
    this.lazyInFlight.add(p);
    try {
      return await p;
    } finally {
      this.lazyInFlight.delete(p);
    }
  }

  /**
   * Waits (at most `timeoutMs`) for every lazy restore in flight to have all its pages in or
   * to be undone. Call before shutting down: a page server that goes away with the process
   * leaves CRIU's lazy-pages daemon filling the missing pages with zeros.
   */
  async settleLazyRestores(timeoutMs = 30_000): Promise<void> {
    if (this.lazyInFlight.size === 0) return;
    let timer: NodeJS.Timeout | undefined;
    await Promise.race([
      Promise.allSettled([...this.lazyInFlight]),
      new Promise((r) => (timer = setTimeout(r, timeoutMs))),
    ]);
    clearTimeout(timer);
  }

  /**
   * Waits (at most `timeoutMs`) for every operation on a sandbox to end, the part after its
   * answer too (a hibernate answers before it removes the container). Call before shutting
   * down, once no request can start another: work cut off by the exit is left half done.
   */
  async settle(timeoutMs = 60_000): Promise<void> {
    let timer: NodeJS.Timeout | undefined;
    await Promise.race([this.locks.idle(), new Promise((r) => (timer = setTimeout(r, timeoutMs)))]);
    clearTimeout(timer);
  }

  private async afterLazyRestoreNow(s: Sandbox, pagesLoaded: Promise<void>): Promise<boolean> {
    const images = this.staging(`${s.id}-restore`);
    const failure = await pagesLoaded.then(
      () => undefined,
      (e: unknown) => asError(e),
    );
    if (failure === undefined) {
      // The keeper goes before the marker: a daemon that dies in between leaves a healthy
      // sandbox recorded mid-restore (reconcile puts it back on its checkpoint), never a
      // sandbox recorded running whose processes its keeper ended.
      await this.endPageServer(s.id);
      this.store.updateSandbox(s.id, { lazyRestoreOf: undefined });
      await this.wipe(images);
      return true;
    }
    // Best effort, as it must not leave the sandbox recorded running: a restore later
    // refuses to run over processes that are still there.
    const undo = await this.backToCheckpoint(s.id, s.lazyRestoreOf ?? s.checkpointId).then(
      () => '',
      (u: unknown) => ` (ending it: ${asError(u).message.split('\n')[0] ?? ''})`,
    );
    // A page that did not authenticate (served from the vault): the checkpoint is damaged, and
    // the operator learns which older one may still restore, as a resume that fails at once says.
    const ckId = s.lazyRestoreOf ?? s.checkpointId;
    const cause =
      isDormantError(failure) && failure.code.startsWith('VAULT_')
        ? ((d) => `${d.message} (${d.hint ?? ''})`)(
            this.damaged(s.id, ckId, failure, 'its processes were ended'),
          )
        : failure.message;
    const why = `lazy restore failed, back to its checkpoint: ${cause}${undo}`;
    // Only now, with its tasks ended: a daemon that lost its page server would fill the
    // missing pages with zeros.
    await this.endPageServer(s.id);
    // Seen hibernated only once no image of it is left in staging.
    await this.wipe(images).catch(() => undefined);
    this.store.transition(s.id, 'running', 'hibernated', why, this.clock.now(), {
      lastError: why,
      memoryBytes: 0,
      lazyRestoreOf: undefined,
    });
    return false;
  }

  /** CHECKPOINT_DAMAGED for checkpoint `used` of sandbox `id`, naming an older one to resume from. */
  private damaged(id: string, used: string | undefined, e: DormantError, outcome: string): DormantError {
    const older = this.store
      .listCheckpoints({ sandboxId: id })
      .find((c) => c.kind === 'memory' && c.id !== used);
    return new DormantError(
      'CHECKPOINT_DAMAGED',
      `checkpoint ${used ?? '?'} of sandbox ${id} cannot be read (${e.code}): ${e.message.split('\n')[0] ?? ''}; ${outcome}`,
      {
        status: 409,
        cause: e,
        hint: older
          ? `resume from the previous checkpoint (losing what changed since): dormant resume ${id} --from ${older.id}`
          : 'no older checkpoint of this sandbox is kept; dormant vault verify shows what is damaged',
      },
    );
  }

  /**
   * Undoes a lazy restore from checkpoint `ckId`: ends the sandbox's processes (they may be
   * waiting on pages that will never come), any lazy-pages daemon still serving them, and,
   * when the checkpoint carries the filesystem diff, empties the writable layer (the diff
   * lives on in the vault; without one the layer is the only copy and stays).
   */
  private async backToCheckpoint(id: string, ckId: string | undefined): Promise<void> {
    await this.runtime.stop(id);
    await this.runtime.endLazyPages?.(join(this.staging(`${id}-restore`), 'work'));
    const ck = ckId !== undefined ? this.store.getCheckpoint(ckId) : undefined;
    if (ck?.meta[FS_META] === 'tar') await emptyFolder(this.runtime.upperDir(id));
  }

  private async resumeLocked(
    id: string,
    tenant: string | undefined,
    reason: string,
    opts: { from?: string },
    t: StepTimer,
  ): Promise<{ sandbox: Sandbox; pagesLoaded?: Promise<void> }> {
    {
      const s = this.get(id, tenant);
      assertLegal('resume', s.state, id);
      if (opts.from !== undefined) {
        const ck = this.store.getCheckpoint(opts.from);
        if (!ck || ck.sandboxId !== s.id || ck.kind !== 'memory') {
          throw new DormantError(
            'CHECKPOINT_NOT_FOUND',
            `sandbox ${s.id} has no checkpoint ${opts.from.slice(0, 80)}`,
            {
              status: 404,
              hint: `dormant checkpoint ls ${s.id} lists its checkpoints`,
            },
          );
        }
        if (s.state !== 'hibernated') {
          throw new DormantError(
            'ILLEGAL_TRANSITION',
            `cannot resume sandbox ${s.id} from a checkpoint: it is ${s.state}`,
            {
              status: 409,
              hint: 'only a hibernated sandbox resumes from a checkpoint',
            },
          );
        }
      }
      if (isNoop('resume', s.state)) return { sandbox: s };
      if (s.state === 'paused') {
        await this.runtime.thaw(id);
        this.store.transition(id, 'paused', 'running', reason, this.clock.now(), {
          lastActiveAt: Math.max(s.lastActiveAt, this.clock.now()),
        });
        return { sandbox: this.get(id) };
      }
      const from = s.state;
      this.store.transition(id, from, 'resuming', reason, this.clock.now());
      let pagesLoaded: Promise<void> | undefined;
      try {
        if (from === 'hibernated')
          ({ pagesLoaded } = await this.restoreFromVault(s, opts.from ?? s.checkpointId, t));
        else await this.freshStart(s);
      } catch (e) {
        this.store.transition(id, 'resuming', from, 'resume failed', this.clock.now(), {
          lastError: asError(e).message,
          lazyRestoreOf: undefined,
        });
        if (
          isDormantError(e, 'RESTORE_INCOMPATIBLE') ||
          isDormantError(e, ErrorCode.CHECKPOINT_OUTSIDE_PROFILE)
        )
          throw e;
        if (isDormantError(e) && e.code.startsWith('VAULT_') && from === 'hibernated') {
          // A damaged checkpoint: say so, and name the older one that may still restore.
          throw this.damaged(id, opts.from ?? s.checkpointId, e, 'the sandbox stays hibernated');
        }
        // The runtime keeps the CRIU log of a failed restore for the node's admin.
        const criuLog = isDormantError(e) ? e.details?.criuLog : undefined;
        throw new DormantError(
          'RESUME_FAILED',
          `resume of sandbox ${id} failed; it is still ${from}${from === 'hibernated' ? ' and its checkpoint is intact' : ''}: ${asError(e).message}`,
          {
            status: 500,
            cause: e,
            hint: `dormant doctor shows what this node supports; dormant logs ID shows its output${typeof criuLog === 'string' ? `; criu's log of the failed restore: ${criuLog}` : ''}`,
            ...(typeof criuLog === 'string' ? { details: { criuLog } } : {}),
          },
        );
      }
      let why = reason;
      if (s.spec.onResume && s.spec.onResume.length > 0)
        why = `${reason}; ${await t.time('on-resume hook', () => this.runResumeHook(s))}`;
      const now = this.clock.now();
      this.store.transition(id, 'resuming', 'running', why, now, {
        lastActiveAt: Math.max(s.lastActiveAt, now),
        lastError: undefined,
      });
      // The marker (set by restoreFromVault) stays until afterLazyRestore has every page.
      return { sandbox: this.get(id), ...(pagesLoaded ? { pagesLoaded } : {}) };
    }
  }

  /**
   * Runs the sandbox's post-resume hook (reconnect databases, refresh tokens). Its outcome goes
   * to the sandbox's log and into the transition's reason, so the events show it too.
   */
  private async runResumeHook(s: Sandbox): Promise<string> {
    let outcome: string;
    let output = '';
    try {
      const r = await this.runtime.exec(s.id, s.spec.onResume ?? [], { timeoutMs: 60_000 });
      outcome = `on-resume hook exited ${r.exitCode}`;
      output = `${r.stdout}${r.stderr}`;
    } catch (e) {
      outcome = `on-resume hook failed: ${asError(e).message.split('\n')[0] ?? ''}`;
    }
    try {
      const path = (await this.runtime.state(s.id)).logPath;
      const fh = await open(path, 'a');
      try {
        await fh.write(
          `${output}${output === '' || output.endsWith('\n') ? '' : '\n'}[dormant] ${outcome}\n`,
        );
      } finally {
        await fh.close();
      }
    } catch {
      // The log is best effort; the outcome is still in the transition.
    }
    return outcome;
  }

  /**
   * Restores the sandbox from checkpoint `ckId`. With lazy restore, returns the promise of
   * its pages arriving; the staging folder must stay until it settles (afterLazyRestore).
   */
  private async restoreFromVault(
    s: Sandbox,
    ckId: string | undefined,
    t: StepTimer,
  ): Promise<{ pagesLoaded: Promise<void> | undefined }> {
    if (ckId === undefined)
      throw new DormantError('CHECKPOINT_NOT_FOUND', `sandbox ${s.id} has no checkpoint`, { status: 409 });
    // One restore per sandbox at a time (its lock), so the sandbox names the folder.
    const dir = this.staging(`${s.id}-restore`);
    let keep = false;
    let unpacked = false;
    let restored = false;
    let preparing = false;
    let served: PagesFromVault | undefined;
    try {
      const ck = this.store.getCheckpoint(ckId);
      await t.time('compatibility', () => this.checkCompatible(s.id, ck));
      const gpuMeta = ck ? gpuMetaOf(ck.meta) : undefined;
      // CUDA's restore reads the whole host copy of device memory at once: no lazy pages for
      // a GPU checkpoint, nor for a sandbox given GPUs (its device mappings restore eagerly).
      const lazy = gpuMeta === undefined && s.gpus === undefined && (await this.lazy);
      // Lazy pages come straight from the vault (the page images never reach staging) for a
      // big checkpoint, whose fetch to staging would hold up the resume.
      const fromVault =
        lazy &&
        this.opts.servePagesFromVault !== false &&
        this.vault.openCheckpoint !== undefined &&
        (ck?.logicalBytes ?? Number.POSITIVE_INFINITY) >
          (this.opts.pagesFromVaultAboveBytes ?? PAGES_FROM_VAULT_ABOVE_BYTES);
      // A checkpoint with its diff: the writable layer is filled before the overlay is mounted.
      const hasDiff = ck?.meta[FS_META] === 'tar';
      await mkdir(dir, { recursive: true, mode: 0o700 });
      const images = join(dir, 'images');
      // The sandbox's host side (network, log collector, rootfs mount) does not need the images:
      // it is set up while they come out of the vault.
      preparing = true;
      const [fetched, prepared] = await Promise.allSettled([
        t.time('vault fetch', () =>
          this.vault.restoreCheckpoint({
            tenant: s.tenant,
            checkpointId: ckId,
            destDir: images,
            ...(fromVault ? { skip: isPagesImage } : {}),
          }),
        ),
        t.time('prepare', async () =>
          this.runtime.prepare(await this.runtimeSpec(s), { timer: t, mountRootfs: !hasDiff }),
        ),
      ]);
      if (fetched.status === 'rejected') {
        // A hibernated sandbox's rootfs stays unmounted (archivable, nothing holding it).
        if (prepared.status === 'fulfilled') await this.runtime.stop(s.id).catch(() => undefined);
        throw fetched.reason;
      }
      if (prepared.status === 'rejected') throw prepared.reason;
      await this.checkImported(images, ck).catch(async (e: unknown) => {
        await this.runtime.stop(s.id).catch(() => undefined);
        throw e;
      });
      this.step('resume:fetched');
      unpacked = await t.time('unpack filesystem', () => this.applyFilesystem(s.id, images));
      if (fromVault) {
        served = await t.time('page server', () => this.servePages(s, ckId, images, t));
        this.pageServers.set(s.id, served);
      }
      // Durable before the pages start to move: a daemon that dies before they are all in
      // leaves the marker for reconcile (the sandbox goes back to this checkpoint).
      if (lazy) this.store.updateSandbox(s.id, { lazyRestoreOf: ckId });
      const r = await t.time('restore', () =>
        this.runtime.restore(s.id, {
          imagesDir: images,
          workDir: join(dir, 'work'),
          lazyPages: lazy,
          ...(served ? { pageServer: { address: served.server.address, port: served.server.port } } : {}),
          timer: t,
        }),
      );
      if (gpuMeta !== undefined) await this.cudaRestore(s.id, gpuMeta);
      restored = true;
      this.step('resume:restored');
      if (ckId !== s.checkpointId) this.store.updateSandbox(s.id, { checkpointId: ckId });
      keep = lazy;
      // A page that fails to authenticate stops the server (it answers nothing more): the
      // pages then never all arrive, and the sandbox goes back to its checkpoint.
      const pages = served ? Promise.race([r.pagesLoaded, served.server.failed]) : r.pagesLoaded;
      // Wrapped: awaiting a returned promise directly would wait for the pages too.
      return { pagesLoaded: keep ? pages : undefined };
    } finally {
      // Each step runs whatever the others do, and none replaces the restore's own error.
      if (!keep) {
        await this.endPageServer(s.id).catch((e: unknown) => this.warnCleanup(s.id, 'page server', e));
        await this.wipe(dir).catch((e: unknown) => this.warnCleanup(s.id, 'staging', e));
      }
      // A failed restore stays hibernated: its diff goes back to living only in the vault,
      // and its rootfs is not mounted (prepare mounted it when there was no diff).
      if (unpacked && !restored) await this.unmountAndEmpty(s.id);
      else if (preparing && !restored)
        await this.runtime.stop(s.id).catch((e: unknown) => this.warnCleanup(s.id, 'unmount', e));
    }
  }

  /**
   * Opens checkpoint `ckId` for reading, writes the pages images' non-lazy pages into
   * `images` and starts a page server that reads the lazy ones from the vault.
   */
  private async servePages(s: Sandbox, ckId: string, images: string, t: StepSink): Promise<PagesFromVault> {
    const reader = await t.time('open checkpoint', () =>
      this.vault.openCheckpoint!({ tenant: s.tenant, checkpointId: ckId }),
    );
    try {
      const dump = await t.time('read images', () => readCriuImages(images));
      await t.time('eager pages', () =>
        writeEagerPages(
          dump.processes,
          images,
          reader,
          reader.list().filter((f) => isPagesImage(f.path)),
        ),
      );
      const keepers: Keeper[] = [];
      const ended = { now: false };
      const procsFiles = this.runtime.procsFiles?.(s.id);
      const server = await startPageServer({
        processes: dump.processes,
        source: reader,
        what: `sandbox ${s.id} (checkpoint ${ckId})`,
        // Should dormant die while pages are still on the way, its processes are ended
        // before CRIU's lazy-pages daemon sees the connection drop (and fills with zeros).
        ...(procsFiles
          ? {
              onConnection: async (sock: Socket) => {
                const k = await startKeeper({ hold: [sock], procsFiles });
                // Left running, it would end a healthy sandbox whenever this daemon exits.
                if (ended.now) await k.release();
                else keepers.push(k);
              },
            }
          : {}),
      });
      return { server, reader, keepers, ended };
    } catch (e) {
      await reader.close();
      throw e;
    }
  }

  /** Stops the page server of `id`'s lazy restore, if one runs. Call once its tasks are ended or whole. */
  private async endPageServer(id: string): Promise<void> {
    const p = this.pageServers.get(id);
    if (p === undefined) return;
    this.pageServers.delete(id);
    p.ended.now = true;
    await Promise.all(p.keepers.map((k) => k.release()));
    await p.server.close().catch(() => undefined);
    await p.reader.close().catch(() => undefined);
  }

  /**
   * Puts a checkpoint folder's filesystem diff (if it carries one) into sandbox `id`'s
   * writable layer, replacing what is there, and removes it from the folder. Returns whether
   * there was one. Call while the sandbox's overlay is not mounted.
   */
  private async applyFilesystem(id: string, folder: string): Promise<boolean> {
    const tar = join(folder, FS_DIFF);
    if (
      !(await stat(tar).then(
        (st) => st.isFile(),
        () => false,
      ))
    )
      return false;
    await unpackFilesystem(tar, this.runtime.upperDir(id));
    await rm(tar, { force: true });
    return true;
  }

  /** Ends what runs of `id` (unmounting its overlay) and empties its writable layer. */
  private async unmountAndEmpty(id: string): Promise<void> {
    await this.runtime.stop(id).catch(() => undefined);
    await emptyFolder(this.runtime.upperDir(id)).catch(() => undefined);
  }

  private async freshStart(s: Sandbox): Promise<void> {
    // Ends anything left and unmounts the overlay, so the writable layer is at rest.
    await this.endProcesses(s.id);
    // An archive keeps the diff in the vault: back into the writable layer first.
    const ck = s.checkpointId !== undefined ? this.store.getCheckpoint(s.checkpointId) : undefined;
    if (ck && ck.meta[FS_META] === 'tar') {
      const dir = this.staging(`${s.id}-restore`);
      try {
        await mkdir(dir, { recursive: true, mode: 0o700 });
        const files = join(dir, 'files');
        await this.vault.restoreCheckpoint({ tenant: s.tenant, checkpointId: ck.id, destDir: files });
        await this.applyFilesystem(s.id, files);
      } finally {
        await this.wipe(dir);
      }
    }
    await this.runtime.create(await this.runtimeSpec(s));
    await this.runtime.start(s.id);
  }

  /** The profile an imported checkpoint is held to: what this node gives its sandboxes. */
  private checkpointProfile(admin: boolean): SandboxProfile {
    return sandboxProfile({
      capabilities: SANDBOX_CAPABILITIES,
      readonlyBinds: (this.opts.readonlyBinds ?? []).map((b) => b.destination),
      ...(admin ? { allowHostUserNamespace: true } : {}),
      ...this.opts.checkpointProfile,
    });
  }

  /**
   * Before an imported checkpoint is restored: its images are held to the profile again (checked
   * at import; imports from before the check existed are caught here).
   */
  private async checkImported(images: string, ck: CheckpointRecord | undefined): Promise<void> {
    if (ck?.meta.importedFrom === undefined) return;
    await assertWithinProfile(
      images,
      this.checkpointProfile(ck.meta.importedBy === 'admin'),
      `checkpoint ${ck.id}`,
    );
  }

  /**
   * The base image of an archive being imported: `--image` when given (it must be the one the
   * archive names), else an image one of the tenant's sandboxes was made from that matches
   * the archive's recorded digests (or, with no digest recorded, its name).
   */
  private async importBase(
    facts: ArchiveFacts,
    image: string | undefined,
    tenant: string,
    admin: boolean,
  ): Promise<{ source: SandboxSpec['source']; image: ImageConfig }> {
    const cacheDir = this.opts.imageCacheDir ?? join(this.opts.stagingDir, 'images');
    const describe = async (ref: string) => {
      const img = await unpackImage(ref, cacheDir);
      const { layout, tag } = parseImageRef(ref);
      const refName = img.refName ?? tag;
      const identity = {
        ref,
        manifestDigest: img.digest,
        configDigest: img.configDigest,
        ...(refName !== undefined ? { refName } : {}),
      };
      const source: SandboxSpec['source'] = {
        kind: 'image',
        path: layout,
        ...(tag !== undefined ? { tag } : {}),
        digest: img.digest,
        rootfs: img.rootfs,
      };
      return { identity, source, image: img.config };
    };
    if (image !== undefined) {
      await this.checkPath(parseImageRef(image).layout, 'image', admin);
      const d = await describe(image);
      const why = imageMismatch(facts, d.identity);
      if (why !== undefined) throw imageDiffers(why);
      return { source: d.source, image: d.image };
    }
    if (facts.imageIds.length === 0 && facts.imageName === undefined) throw imageRequired(facts);
    const seen = new Set<string>();
    for (const s of this.store.listSandboxes(tenant)) {
      const src = s.spec.source;
      if (src.kind !== 'image') continue;
      const ref = src.tag !== undefined ? `${src.path}:${src.tag}` : src.path;
      if (seen.has(ref)) continue;
      seen.add(ref);
      const d = await describe(ref).catch(() => undefined);
      if (!d) continue;
      const byId =
        facts.imageIds.includes(d.identity.manifestDigest) ||
        facts.imageIds.includes(d.identity.configDigest);
      const byName =
        facts.imageIds.length === 0 &&
        d.identity.refName !== undefined &&
        imageMismatch(facts, d.identity) === undefined;
      if (byId || byName) return { source: d.source, image: d.image };
    }
    throw imageRequired(facts);
  }

  /**
   * `dormant checkpoint import`: a podman export or a kubelet / CRI-O checkpoint archive
   * becomes a hibernated sandbox. The archive is unpacked (through the hostile-input guards of
   * the archive reader) into memory-backed staging, its filesystem diff goes into the new
   * sandbox's writable layer, its CRIU images into the vault, and the staging is wiped. A
   * failure removes everything of the new sandbox; a crash leaves it for reconcile to remove.
   */
  async importArchive(input: ImportArchiveInput): Promise<Sandbox> {
    const archive = await this.checkPath(input.archive, 'archive', input.admin === true);
    if (!(await stat(archive)).isFile()) throw invalid(`archive ${input.archive} is not a file`);
    return this.importFrom(input, archive);
  }

  /**
   * `dormant checkpoint import` of an uploaded archive: the bytes are streamed into
   * memory-backed staging (0600, never the data disk: the archive holds plaintext memory),
   * refused once past `maxBytes`, imported as `importArchive` does, and wiped.
   */
  async importUpload(
    input: Omit<ImportArchiveInput, 'archive'> & { fileName?: string },
    body: NodeJS.ReadableStream,
    maxBytes: number,
  ): Promise<Sandbox> {
    const dir = this.staging(`${randomBytes(8).toString('hex')}-upload`);
    await mkdir(dir, { recursive: true, mode: 0o700 });
    try {
      const name = (input.fileName ?? 'upload.tar').replace(/[^A-Za-z0-9._-]/g, '_').slice(0, 100);
      const file = join(dir, name.startsWith('.') ? `_${name}` : name);
      let seen = 0;
      const cap = new Transform({
        transform(chunk: Buffer, _enc, done) {
          seen += chunk.length;
          if (seen > maxBytes)
            done(
              new DormantError(
                ErrorCode.CHECKPOINT_ARCHIVE_TOO_LARGE,
                `the uploaded archive is larger than this node accepts (${maxBytes} bytes)`,
                { status: 413 },
              ),
            );
          else done(null, chunk);
        },
      });
      await pipeline(body, cap, createWriteStream(file, { mode: 0o600, flags: 'wx' }));
      if (seen === 0) throw invalid('the upload is empty', 'send the archive as the request body');
      return await this.importFrom({ ...input, archive: name }, file);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  }

  private async importFrom(input: ImportArchiveInput, archive: string): Promise<Sandbox> {
    // Checked before anything is unpacked: a bad path is the caller's mistake, said at once.
    if (input.image !== undefined)
      await this.checkPath(parseImageRef(input.image).layout, 'image', input.admin === true);
    if (input.name !== undefined) {
      const n = validateName(input.name);
      if (this.store.listSandboxes(input.tenant).some((s) => s.name === n))
        throw new DormantError('SANDBOX_NAME_TAKEN', `a sandbox named ${n} already exists`, { status: 409 });
    }
    const id = newId('sb', randomBytes);
    const dir = this.staging(`${id}-import`);
    await mkdir(dir, { recursive: true, mode: 0o700 });
    let inserted = false;
    try {
      const ck = await openCheckpointPath(archive, { stagingDir: dir, ...this.opts.importLimits });
      this.step('import:unpacked');
      const facts = await readArchiveFacts(ck.rootDir);
      const base = await this.importBase(facts, input.image, input.tenant, input.admin === true);
      // Reading the images refuses malformed ones before anything is created.
      const report = await inspectCheckpoint(ck);
      // And what they would restore is held to a sandbox's profile, also before anything is made.
      await assertWithinProfile(ck.imagesDir, this.checkpointProfile(input.admin === true), 'the archive');
      const command = facts.command.length > 0 ? facts.command : base.image.command;
      if (command.length === 0) throw invalid(`archive ${input.archive} records no command`);
      const derived = (() => {
        try {
          const n = validateName(facts.name ?? id);
          return this.store.listSandboxes(input.tenant).some((s) => s.name === n) ? id : n;
        } catch {
          return id;
        }
      })();
      const name = input.name !== undefined ? validateName(input.name) : derived;
      const ports = (input.ports ?? facts.ports).map((port) => ({ port, public: false }));
      for (const p of ports)
        if (!Number.isInteger(p.port) || p.port < 1 || p.port > 65535)
          throw invalid(`invalid port ${String(p.port)}`);
      const now = this.clock.now();
      const cwd = facts.cwd ?? base.image.workingDir;
      const sandbox: Sandbox = {
        id,
        tenant: input.tenant,
        name,
        state: 'creating',
        spec: {
          source: base.source,
          command,
          env: await this.sealEnv(input.tenant, id, { ...base.image.env, ...facts.env }),
          ...(cwd !== undefined ? { cwd } : {}),
          ports,
          memoryBytes: input.memoryBytes ?? facts.memoryBytes ?? DEFAULT_MEMORY,
          cpus: 1,
          diskBytes: checkDiskBytes(this.opts.defaultDiskBytes ?? DEFAULT_DISK_BYTES),
          policy: {},
          importedFrom: basename(archive),
        },
        createdAt: now,
        stateSince: now,
        lastActiveAt: now,
        memoryBytes: 0,
      };
      this.store.insertSandbox(sandbox, `import of ${basename(archive)}`);
      inserted = true;
      return await this.locks.run(id, async () => {
        const st = await this.runtime.prepare(await this.runtimeSpec(sandbox));
        // The layer is written at rest (overlayfs must not see its upper dir change under it).
        await this.runtime.stop(id);
        this.step('import:prepared');
        if (ck.rootDir !== undefined) {
          const diff = join(ck.rootDir, 'rootfs-diff.tar');
          if (
            await stat(diff).then(
              (x) => x.isFile(),
              () => false,
            )
          )
            await applyRootfsDiff(diff, st.upperDir);
          const deleted = join(ck.rootDir, 'deleted.files');
          if (
            await stat(deleted).then(
              (x) => x.isFile(),
              () => false,
            )
          ) {
            await applyDeletedFiles(await readFile(deleted, 'utf8'), st.upperDir);
          }
        }
        // Into the checkpoint with the images: while it sleeps, the diff lives only in the vault.
        await packFilesystem(st.upperDir, join(ck.imagesDir, FS_DIFF));
        this.step('import:filesystem');
        const platform = await this.platform();
        const m = report.metadata;
        const ckId = newId('ck', randomBytes);
        const meta: Record<string, string> = {
          arch: m.arch !== undefined ? (NODE_ARCH[m.arch] ?? m.arch) : platform.arch,
          kernel: m.kernel ?? release(),
          kind: 'memory',
          importedFrom: basename(archive),
          // Which profile it was checked against (admins' may be in the host's user namespace).
          importedBy: input.admin === true ? 'admin' : 'tenant',
          engine: facts.engine,
          [FS_META]: 'tar',
          ...(m.criuVersion !== undefined ? { criuVersion: m.criuVersion } : {}),
        };
        const put = await this.vault.putCheckpoint({
          tenant: input.tenant,
          sandboxId: id,
          checkpointId: ckId,
          srcDir: ck.imagesDir,
          meta,
        });
        // The plaintext is in the vault now: off the staging at once.
        await ck.close();
        this.step('import:stored');
        this.store.insertCheckpoint({
          id: ckId,
          sandboxId: id,
          tenant: input.tenant,
          createdAt: this.clock.now(),
          kind: 'memory',
          logicalBytes: put.logicalBytes,
          storedBytes: put.storedBytes,
          meta,
        });
        this.store.transition(
          id,
          'creating',
          'hibernated',
          `import of ${basename(archive)}`,
          this.clock.now(),
          // Its address is known from prepare(); a resume keeps it.
          { checkpointId: ckId, address: st.network.address },
        );
        this.step('import:committed');
        await emptyFolder(st.upperDir);
        return this.get(id);
      });
    } catch (e) {
      if (inserted) await this.undoImport(id, input.tenant);
      throw e;
    } finally {
      await this.wipe(dir);
    }
  }

  /** Removes every trace of an import that did not finish: runtime side, vault data, the row. */
  private async undoImport(id: string, tenant: string): Promise<void> {
    await this.runtime.destroy(id).catch(() => undefined);
    await this.vault.destroySandboxKey({ tenant, sandboxId: id }).catch(() => undefined);
    this.store.deleteSandbox(id, 'import failed', this.clock.now());
  }

  /**
   * A checkpoint of the vault written as a podman / CRI-O archive (with the sandbox's
   * filesystem diff, when the checkpoint is its newest), into a private staging file. The
   * caller streams it out and calls `close()`. Refused with CHECKPOINT_HAS_SECRETS unless
   * `allowPlaintext`.
   */
  async exportArchive(
    ckId: string,
    tenant: string | undefined,
    opts: {
      allowPlaintext?: boolean;
      encrypted?: boolean;
      compression?: Compression;
      signal?: AbortSignal;
    } = {},
  ): Promise<{ file: string; sizeBytes: number; findings: number; close(): Promise<void> }> {
    const c = this.store.getCheckpoint(ckId);
    if (!c || (tenant !== undefined && c.tenant !== tenant))
      throw new DormantError('CHECKPOINT_NOT_FOUND', `no checkpoint ${ckId.slice(0, 80)}`, { status: 404 });
    if (c.kind !== 'memory')
      throw new DormantError(
        'INVALID_ARGUMENT',
        `checkpoint ${ckId} holds only a filesystem (no processes)`,
        {
          status: 409,
        },
      );
    const s = this.store.getSandbox(c.sandboxId);
    const dir = this.staging(`${ckId}-export-${randomBytes(4).toString('hex')}`);
    await mkdir(dir, { recursive: true, mode: 0o700 });
    const close = () => this.wipe(dir);
    try {
      const ck = await openDormantCheckpoint({
        vault: this.vault,
        tenant: c.tenant,
        checkpointId: c.id,
        stagingDir: dir,
      });
      const extra: ArchiveMember[] = [];
      const annotations: Record<string, string> = {};
      let image: { id?: string; name?: string } = {};
      if (s) {
        const src = s.spec.source;
        if (src.kind === 'image') {
          annotations[ANNOTATION_MANIFEST] = src.digest;
          const img = await unpackImage(
            src.tag !== undefined ? `${src.path}:${src.tag}` : src.path,
            this.opts.imageCacheDir ?? join(this.opts.stagingDir, 'images'),
          ).catch(() => undefined);
          image = {
            id: (img?.configDigest ?? src.digest).replace(/^sha256:/, ''),
            ...((img?.refName ?? src.tag) !== undefined ? { name: img?.refName ?? src.tag } : {}),
          };
        }
        annotations[ANNOTATION_PORTS] = JSON.stringify(s.spec.ports.map((p) => p.port));
        if (c.meta[FS_META] === 'tar') {
          // The checkpoint carries its own diff (GNU tar of the upper folder, whiteouts as
          // devices): unpacked on staging, then written the way podman expects it
          // (deleted.files for whiteouts).
          const tree = join(dir, 'fs-tree');
          await unpackFilesystem(join(ck.imagesDir, FS_DIFF), tree);
          extra.push(...(await rootfsDiffMembers(tree, join(dir, 'rootfs-diff.tar'))));
        } else if (s.checkpointId === c.id) {
          // Older checkpoints: the writable layer belongs with the newest checkpoint only.
          await this.locks.run(s.id, async () => {
            const upper = (await this.runtime.state(s.id)).upperDir;
            extra.push(...(await rootfsDiffMembers(upper, join(dir, 'rootfs-diff.tar'))));
          });
        }
      }
      const out = join(
        dir,
        `${ckId}.tar${opts.compression === 'gzip' ? '.gz' : opts.compression === 'none' ? '' : '.zst'}`,
      );
      const r = await exportCheckpoint(ck, {
        out,
        format: 'podman',
        compression: opts.compression ?? 'zstd',
        allowPlaintext: opts.allowPlaintext === true,
        encrypted: opts.encrypted === true,
        extra,
        meta: {
          id: Buffer.from(c.id).toString('hex').padEnd(64, '0').slice(0, 64),
          name: s?.name ?? c.sandboxId,
          ...(image.id !== undefined ? { image: image.id } : {}),
          ...(image.name !== undefined ? { imageName: image.name } : {}),
          createdAt: new Date(s?.createdAt ?? c.createdAt).toISOString(),
          checkpointedAt: new Date(c.createdAt).toISOString(),
          ...(s
            ? {
                env: Object.entries(await this.openEnv(s)).map(([k, v]) => `${k}=${v}`),
                args: s.spec.command,
              }
            : {}),
          ...(s?.spec.cwd !== undefined ? { cwd: s.spec.cwd } : {}),
          ...(s ? { memoryBytes: s.spec.memoryBytes } : {}),
          annotations,
        },
        ...(opts.signal ? { signal: opts.signal } : {}),
      });
      // The unpacked images are in the archive now; only the archive stays until it is sent.
      await ck.close();
      return { file: r.out, sizeBytes: r.sizeBytes, findings: r.scan.findings.length, close };
    } catch (e) {
      await close();
      throw e;
    }
  }

  /**
   * Keep only the filesystem: its diff goes into the vault as a 'filesystem' checkpoint, the
   * processes end, the memory checkpoints are deleted and the writable layer is emptied.
   */
  async archive(id: string, tenant?: string, reason = 'archive'): Promise<Sandbox> {
    return this.locks.run(id, async () => {
      const s = this.get(id, tenant);
      assertLegal('archive', s.state, id);
      if (isNoop('archive', s.state)) return s;
      const ckId = newId('ck', randomBytes);
      const dir = this.staging(`${ckId}-archive`);
      let fsCk: CheckpointRecord;
      try {
        await mkdir(dir, { recursive: true, mode: 0o700 });
        const files = join(dir, 'files');
        await mkdir(files, { mode: 0o700 });
        await this.archiveDiff(s, join(dir, 'from'), join(files, FS_DIFF));
        const meta = { arch: arch(), kind: 'filesystem', [FS_META]: 'tar' };
        const put = await this.vault.putCheckpoint({
          tenant: s.tenant,
          sandboxId: id,
          checkpointId: ckId,
          srcDir: files,
          meta,
        });
        fsCk = {
          id: ckId,
          sandboxId: id,
          tenant: s.tenant,
          createdAt: this.clock.now(),
          kind: 'filesystem',
          logicalBytes: put.logicalBytes,
          storedBytes: put.storedBytes,
          meta,
        };
      } finally {
        await this.wipe(dir);
      }
      this.step('archive:stored');
      // The record goes in one transaction: archived, its diff the current checkpoint, the
      // others dropped. A crash before it leaves the sandbox as it was (the start-up sweep
      // deletes the unrecorded copy); after it, an archived sandbox whose processes reconcile
      // ends and whose old vault copies the sweep deletes.
      const old = this.store.listCheckpoints({ sandboxId: id });
      const now = this.clock.now();
      this.store.atomically(() => {
        this.store.insertCheckpoint(fsCk);
        for (const c of old) this.store.deleteCheckpoint(c.id, now);
        this.store.transition(id, s.state, 'archived', reason, now, {
          memoryBytes: 0,
          checkpointId: fsCk.id,
        });
      });
      this.step('archive:recorded');
      await this.endProcesses(id);
      await emptyFolder(this.runtime.upperDir(id));
      this.step('archive:ended');
      for (const c of old) await this.vault.deleteCheckpoint({ tenant: s.tenant, checkpointId: c.id });
      return this.get(id);
    });
  }

  /**
   * Writes sandbox `s`'s filesystem diff as the tar `tarPath`: from its current checkpoint
   * when it is hibernated (the writable layer is empty then), else from the writable layer,
   * with the processes frozen while it is read.
   */
  private async archiveDiff(s: Sandbox, scratch: string, tarPath: string): Promise<void> {
    const ck = s.checkpointId !== undefined ? this.store.getCheckpoint(s.checkpointId) : undefined;
    if (s.state === 'hibernated' && ck && ck.meta[FS_META] === 'tar') {
      await this.vault.restoreCheckpoint({ tenant: s.tenant, checkpointId: ck.id, destDir: scratch });
      await rename(join(scratch, FS_DIFF), tarPath);
      return;
    }
    const upper = this.runtime.upperDir(s.id);
    if (s.state !== 'running') {
      await packFilesystem(upper, tarPath);
      return;
    }
    await this.runtime.freeze(s.id);
    try {
      await packFilesystem(upper, tarPath);
    } finally {
      await this.runtime.thaw(s.id);
    }
  }

  async keepalive(id: string, tenant: string | undefined, untilMs: number): Promise<Sandbox> {
    const s = this.get(id, tenant);
    assertLegal('keepalive', s.state, id);
    this.store.updateSandbox(id, { lastActiveAt: Math.max(this.clock.now(), untilMs) });
    return this.get(id);
  }

  async remove(id: string, tenant?: string, reason = 'rm'): Promise<void> {
    await this.locks.run(id, async () => {
      const s = this.get(id, tenant);
      if (s.state !== 'deleting') this.store.transition(id, s.state, 'deleting', reason, this.clock.now());
      await this.runtime.destroy(id);
      for (const op of ['hibernate', 'resume', 'fork'] as const) this.timings.delete(`${op}:${id}`);
      // Crypto-shredding: without the sandbox's key its checkpoints cannot be read again.
      await this.vault.destroySandboxKey({ tenant: s.tenant, sandboxId: id });
      this.store.deleteSandbox(id, reason, this.clock.now());
    });
  }

  /**
   * After a daemon restart: every sandbox ends up in a resting state that matches what is
   * really there, and nothing is lost.
   */
  async reconcile(): Promise<{ id: string; from: SandboxState; to: SandboxState }[]> {
    const changes: { id: string; from: SandboxState; to: SandboxState }[] = [];
    for (const s of this.store.listSandboxes()) {
      await this.locks.run(s.id, async () => {
        if (s.lazyRestoreOf !== undefined && s.state !== 'deleting') {
          const to = await this.reconcileLazy(s);
          if (to !== s.state) changes.push({ id: s.id, from: s.state, to });
          return;
        }
        const to = await this.reconcileOne(s).catch(() => 'failed' as const);
        if (to === 'deleting') {
          // An rm that a crash interrupted: finished now.
          this.store.deleteSandbox(s.id, 'rm finished after restart', this.clock.now());
          changes.push({ id: s.id, from: s.state, to });
        } else if (to !== s.state) {
          this.store.transition(s.id, s.state, to, 'reconcile after restart', this.clock.now());
          changes.push({ id: s.id, from: s.state, to });
        }
      });
    }
    await this.dropUnrecordedCheckpoints();
    return changes;
  }

  /**
   * A crash between storing a checkpoint in the vault and recording it in the database leaves
   * a checkpoint nobody knows of; the database is the record, so the vault's copy goes (gc
   * then reclaims its chunks). Runs at start, when no hibernate is in flight.
   */
  private async dropUnrecordedCheckpoints(): Promise<void> {
    const live = new Set(this.store.listCheckpoints().map((c) => c.id));
    for (const c of await this.vault.listCheckpoints().catch(() => [])) {
      if (live.has(c.checkpointId)) continue;
      await this.vault
        .deleteCheckpoint({ tenant: c.tenant, checkpointId: c.checkpointId })
        .catch(() => undefined);
    }
  }

  /**
   * A sandbox whose lazy restore was in flight when the daemon died: the daemon that fed it
   * its pages is gone (or orphaned), so pages may never arrive and its processes may wait on
   * them forever. They are ended and the sandbox is hibernated again on the checkpoint it was
   * restored from (kept in the vault all along), the reason recorded in its transition.
   */
  private async reconcileLazy(s: Sandbox): Promise<SandboxState> {
    const ckId = s.lazyRestoreOf!;
    const ck = this.store.getCheckpoint(ckId);
    const why = `reconcile after restart: the daemon died during a lazy restore from checkpoint ${ckId}, before every page was in; its processes were ended, back to its checkpoint`;
    let to: SandboxState;
    let lastError = why;
    try {
      await this.backToCheckpoint(s.id, ckId);
      // The checkpoint the restore came from (or, were it gone, the newest one).
      to = ck?.kind === 'memory' ? 'hibernated' : this.fallback(s);
    } catch (e) {
      to = 'failed';
      lastError = `${why}; ending its processes failed: ${asError(e).message}`;
    }
    const patch: Partial<Sandbox> = {
      lazyRestoreOf: undefined,
      lastError,
      memoryBytes: 0,
      ...(to === 'hibernated' && ck ? { checkpointId: ck.id } : {}),
    };
    if (to === s.state) {
      this.store.updateSandbox(s.id, patch);
      this.store.note(s.id, why, this.clock.now());
    } else this.store.transition(s.id, s.state, to, why, this.clock.now(), patch);
    return to;
  }

  private async reconcileOne(s: Sandbox): Promise<SandboxState> {
    const st = await this.runtime.state(s.id).catch((e: unknown) => {
      if (isDormantError(e, ErrorCode.RUNTIME_SANDBOX_NOT_FOUND)) return undefined;
      throw e;
    });
    const status = st?.status ?? 'absent';
    const committed = this.store
      .listCheckpoints({ sandboxId: s.id })
      .find((c) => c.kind === 'memory' && c.createdAt >= s.stateSince);
    switch (s.state) {
      case 'deleting':
        await this.runtime.destroy(s.id);
        await this.vault.destroySandboxKey({ tenant: s.tenant, sandboxId: s.id });
        return 'deleting';
      case 'creating':
        await this.runtime.destroy(s.id);
        if (s.spec.importedFrom !== undefined) {
          // An import cut short: nothing of it was promised, so nothing of it stays.
          await this.vault.destroySandboxKey({ tenant: s.tenant, sandboxId: s.id });
          return 'deleting';
        }
        return 'failed';
      case 'hibernating':
        if (committed) {
          this.store.updateSandbox(s.id, { checkpointId: committed.id });
          await this.runtime.stop(s.id);
          if (committed.meta[FS_META] === 'tar') await emptyFolder(this.runtime.upperDir(s.id));
          return 'hibernated';
        }
        if (status === 'paused') await this.runtime.thaw(s.id);
        return status === 'running' || status === 'paused' ? 'running' : this.fallback(s);
      case 'resuming':
        if (status === 'running') return 'running';
        if (status !== 'absent') await this.runtime.stop(s.id);
        return s.checkpointId ? 'hibernated' : 'archived';
      case 'running':
        // Frozen while recorded running: a hibernate or fork froze it and the daemon died.
        if (status === 'paused') await this.runtime.thaw(s.id);
        if (status === 'running' || status === 'paused') return 'running';
        if (status !== 'absent') await this.runtime.stop(s.id);
        return this.fallback(s);
      case 'paused':
        if (status === 'running' || status === 'paused') return status;
        if (status !== 'absent') await this.runtime.stop(s.id);
        return this.fallback(s);
      case 'archived':
        // An archive cut short after its record: the processes it meant to end, the
        // writable layer it meant to empty (its diff is in the vault).
        await this.runtime.stop(s.id);
        if (s.checkpointId !== undefined && this.store.getCheckpoint(s.checkpointId)?.meta[FS_META] === 'tar')
          await emptyFolder(this.runtime.upperDir(s.id));
        return 'archived';
      default:
        return s.state;
    }
  }

  /** Processes are gone (a reboot): the newest checkpoint if there is one, else the filesystem. */
  private fallback(s: Sandbox): SandboxState {
    return s.checkpointId && this.store.getCheckpoint(s.checkpointId)?.kind === 'memory'
      ? 'hibernated'
      : 'archived';
  }
}
