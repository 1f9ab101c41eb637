/**
 * The lifecycle controller: the one place that moves sandboxes between states. It ties the
 * database of record, the runtime and the vault together, one operation per sandbox at a
 * time, and keeps the contract of DESIGN.md: a checkpoint is committed before the original
 * processes end, a failed hibernate leaves the sandbox as it was, a failed resume leaves the
 * checkpoint in place and says why, and a restart of the daemon reconciles every sandbox.
 */
import { randomBytes } from 'node:crypto';
import { mkdir, open, realpath, rm, stat } from 'node:fs/promises';
import { arch, release } from 'node:os';
import { isAbsolute, join } from 'node:path';
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
import type { CheckpointRecord, StateStore } from '../state/store.js';
import type { Runtime, SandboxSpec as RuntimeSpec } from '../runtime/runtime.js';
import { parseImageRef, unpackImage, type ImageConfig } from '../runtime/image.js';
import { run } from '../sys/exec.js';
import { KeyedMutex } from './mutex.js';
import { restoreProblems, type PlatformFacts } from '../domain/compat.js';
import { StepTimer, type OperationTimings } from '../domain/timings.js';

/** What the controller needs of the vault (vault/index.ts implements it). */
export interface CheckpointVault {
  putCheckpoint(o: {
    tenant: string;
    sandboxId: string;
    checkpointId: string;
    srcDir: string;
    meta?: Record<string, string>;
    signal?: AbortSignal;
  }): Promise<{ logicalBytes: number; storedBytes: number }>;
  restoreCheckpoint(o: {
    tenant: string;
    checkpointId: string;
    destDir: string;
    signal?: AbortSignal;
  }): Promise<unknown>;
  deleteCheckpoint(o: { tenant: string; checkpointId: string }): Promise<unknown>;
  /** Crypto-shreds the sandbox's key and deletes its checkpoints. */
  destroySandboxKey(o: { tenant: string; sandboxId: string }): Promise<unknown>;
  listCheckpoints(o?: {
    tenant?: string;
    sandboxId?: string;
  }): Promise<{ tenant: string; checkpointId: string }[]>;
}

export interface Clock {
  now(): number;
}

export const systemClock: Clock = { now: () => Date.now() };

export interface ControllerOptions {
  store: StateStore;
  runtime: Runtime;
  vault: CheckpointVault;
  /** Memory-backed folder for CRIU images in flight (never persistent disk). */
  stagingDir: string;
  /** Folders a sandbox's rootfs may come from. Empty: any absolute folder. */
  allowedSourceRoots?: readonly string[];
  /** Committed checkpoints kept per sandbox (older ones are deleted). Default 2. */
  keepCheckpoints?: number;
  clock?: Clock;
  /** Where OCI images are unpacked (one folder per manifest digest). Default: under stagingDir. */
  imageCacheDir?: string;
  /** Read-only host folders mounted into every sandbox (e.g. /usr for python3 in tests). */
  readonlyBinds?: RuntimeSpec['readonlyBinds'];
  /** Fault injection for crash tests: throw at the named step. */
  failAt?: (step: string) => void;
  /**
   * Resume with CRIU's lazy pages (userfaultfd): the sandbox runs as soon as its processes are
   * back and its memory is copied in behind it. Default false (eager).
   */
  lazyRestore?: boolean;
  /** This node's architecture, CRIU version and CPU flags, recorded in checkpoints and checked before restores. */
  platform?: () => Promise<PlatformFacts>;
  /**
   * Called after every hibernate, resume from a checkpoint and fork (also failed ones) with the
   * wall time of each step: the debug log and the benchmark print them.
   */
  onTimings?: (t: OperationTimings) => void;
  /** Resource use of a sandbox's cgroup right now (undefined: no processes). */
  usage?: (sandboxId: string) => Promise<{ memoryBytes: number; cpuUsageUsec: number } | undefined>;
}

export interface CreateSandboxInput {
  tenant: string;
  name?: string;
  rootfs?: string;
  image?: string;
  command: string[];
  env?: Record<string, string>;
  ports?: (number | PortSpec)[];
  memoryBytes?: number;
  cpus?: number;
  policy?: SandboxPolicy;
  onResume?: string[];
}

const DEFAULT_MEMORY = 512 * 1024 ** 2;

function invalid(message: string, hint?: string): DormantError {
  return new DormantError(ErrorCode.INVALID_ARGUMENT, message, { status: 400, ...(hint ? { hint } : {}) });
}

export class SandboxController {
  private readonly store: StateStore;
  private readonly runtime: Runtime;
  private readonly vault: CheckpointVault;
  private readonly clock: Clock;
  private readonly locks = new KeyedMutex();
  private readonly opts: ControllerOptions;
  private readonly timings = new Map<string, OperationTimings>();

  constructor(opts: ControllerOptions) {
    this.opts = opts;
    this.store = opts.store;
    this.runtime = opts.runtime;
    this.vault = opts.vault;
    this.clock = opts.clock ?? systemClock;
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

  private runtimeSpec(s: Sandbox): RuntimeSpec {
    const src = s.spec.source;
    return {
      id: s.id,
      rootfs: src.kind === 'rootfs' ? src.path : src.rootfs,
      ...(s.spec.cwd !== undefined ? { cwd: s.spec.cwd } : {}),
      args: s.spec.command,
      env: s.spec.env,
      hostname: s.name,
      ports: s.spec.ports.map((p) => p.port),
      limits: { memoryBytes: s.spec.memoryBytes, cpus: s.spec.cpus, pids: 512 },
      ...(this.opts.readonlyBinds ? { readonlyBinds: this.opts.readonlyBinds } : {}),
    };
  }

  /**
   * A source path must be absolute, without `..` or NUL, and, where allowed folders are set,
   * inside one of them after symlinks are resolved (a link inside an allowed folder must not
   * lead out of it). Returns the resolved path.
   */
  private async checkPath(path: string, what: string): Promise<string> {
    if (!isAbsolute(path) || path.split('/').includes('..') || path.includes('\0')) {
      throw invalid(
        `${what} "${path.slice(0, 200).replace(/\0/g, '\\0')}" must be an absolute path without ".."`,
      );
    }
    let real: string;
    try {
      real = await realpath(path);
    } catch (e) {
      if (errnoCode(e) === 'ENOENT' || errnoCode(e) === 'ENOTDIR')
        throw invalid(`${what} ${path} does not exist`);
      throw e;
    }
    const roots = this.opts.allowedSourceRoots ?? [];
    if (roots.length > 0) {
      const realRoots = await Promise.all(roots.map((r) => realpath(r).catch(() => r)));
      if (!realRoots.some((r) => real === r || real.startsWith(`${r.replace(/\/$/, '')}/`))) {
        throw invalid(
          `${what} ${path}${real !== path ? ` (${real})` : ''} is outside the allowed folders (${roots.join(', ')})`,
        );
      }
    }
    return real;
  }

  private async validateSource(
    input: CreateSandboxInput,
  ): Promise<{ source: SandboxSpec['source']; image?: ImageConfig }> {
    if (input.image !== undefined) {
      if (input.rootfs !== undefined) throw invalid('give --rootfs or --image, not both');
      const { layout } = parseImageRef(input.image);
      await this.checkPath(layout, 'image');
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
    const real = await this.checkPath(path, 'rootfs');
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
    const now = this.clock.now();
    const sandbox: Sandbox = {
      id,
      tenant: input.tenant,
      name,
      state: 'creating',
      spec: {
        source,
        command,
        env: { ...image?.env, ...input.env },
        ...(image?.workingDir !== undefined ? { cwd: image.workingDir } : {}),
        ports,
        memoryBytes: input.memoryBytes ?? DEFAULT_MEMORY,
        cpus: input.cpus ?? 1,
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
        const st = await this.runtime.create(this.runtimeSpec(sandbox));
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
    await rm(dir, { recursive: true, force: true });
  }

  /**
   * Hibernate: freeze, dump with the processes left in place (frozen), store the images in
   * the vault, commit the checkpoint, and only then end the processes. Any failure before the
   * commit thaws the sandbox back to where it was.
   */
  async hibernate(id: string, tenant?: string, reason = 'hibernate'): Promise<Sandbox> {
    return this.locks.run(id, async () => {
      const s = this.get(id, tenant);
      assertLegal('hibernate', s.state, id);
      if (isNoop('hibernate', s.state)) return s;
      const before = s.state;
      const ckId = newId('ck', randomBytes);
      const dir = this.staging(ckId);
      this.store.transition(id, before, 'hibernating', reason, this.clock.now());
      const t = this.timer();
      let committed = false;
      let ok = false;
      try {
        try {
          await mkdir(dir, { recursive: true, mode: 0o700 });
          await t.time('freeze', () => this.runtime.freeze(id, { timer: t }));
          this.step('hibernate:frozen');
          // The images are wiped with the rest of the staging folder once the checkpoint is
          // committed, beside the end of the processes: not on the way to the commit.
          const rec = await this.dumpToVault(s, ckId, dir, 'hibernate', t, false);
          await t.time('commit', async () => {
            this.store.insertCheckpoint(rec);
            this.store.updateSandbox(id, { checkpointId: ckId });
          });
          committed = true;
          this.step('hibernate:committed');
        } catch (e) {
          await this.wipe(dir);
          if (committed) throw e;
          // Not committed: the sandbox goes back to what it was, running or paused.
          if (before === 'running') await this.runtime.thaw(id).catch(() => undefined);
          this.store.transition(id, 'hibernating', before, 'hibernate failed', this.clock.now(), {
            lastError: asError(e).message,
          });
          throw new DormantError(
            'HIBERNATE_FAILED',
            `hibernate of sandbox ${id} failed; it is ${before} again: ${asError(e).message}`,
            {
              status: 500,
              cause: e,
              hint: 'dormant doctor shows what this node supports',
            },
          );
        }
        // Committed: the processes end while the staging folder (CRIU's log and work files) is
        // wiped and older checkpoints are pruned; none of the three waits for another.
        const [ended, ...rest] = await Promise.allSettled([
          t.time('end processes', () => this.endProcesses(id, t)),
          t.time('wipe staging', () => this.wipe(dir)),
          t.time('prune', () => this.pruneCheckpoints(id, s.tenant)),
        ]);
        if (ended.status === 'rejected') throw ended.reason;
        this.store.transition(id, 'hibernating', 'hibernated', reason, this.clock.now(), { memoryBytes: 0 });
        for (const r of rest) if (r.status === 'rejected') throw r.reason;
        ok = true;
        return this.get(id);
      } finally {
        this.report(t.finish('hibernate', id, ok));
      }
    });
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
  ): Promise<CheckpointRecord> {
    const images = join(dir, 'images');
    await t.time('checkpoint', () =>
      this.runtime.checkpoint(s.id, {
        imagesDir: images,
        workDir: join(dir, 'work'),
        leaveRunning: true,
        timer: t,
      }),
    );
    this.step(`${stepPrefix}:dumped`);
    const platform = await this.platform();
    const meta: Record<string, string> = {
      arch: platform.arch,
      kernel: release(),
      kind: 'memory',
      ...(platform.criuVersion !== undefined ? { criuVersion: platform.criuVersion } : {}),
    };
    const put = await t.time('vault put', () =>
      this.vault.putCheckpoint({
        tenant: s.tenant,
        sandboxId: s.id,
        checkpointId: ckId,
        srcDir: images,
        meta,
      }),
    );
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
      meta: { ...meta, ...(platform.cpuFlags !== undefined ? { cpuFlags: platform.cpuFlags } : {}) },
    };
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
        const upper = (await this.runtime.state(src.id)).upperDir;
        let ck = cur.checkpointId;
        if (cur.state === 'running' || cur.state === 'paused') {
          ck = newId('ck', randomBytes);
          await this.runtime.freeze(src.id);
          try {
            const rec = await this.dumpToVault(cur, ck, dir, 'fork', t);
            this.store.insertCheckpoint(rec);
            this.store.updateSandbox(src.id, { checkpointId: ck });
            this.store.insertSandbox(sandbox, `fork of ${src.id}`);
            await this.copyFilesystem(upper, forkId);
          } finally {
            if (cur.state === 'running') await this.runtime.thaw(src.id);
          }
          await this.pruneCheckpoints(src.id, src.tenant);
        } else {
          this.store.insertSandbox(sandbox, `fork of ${src.id}`);
          await this.copyFilesystem(upper, forkId);
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
    const st = await this.runtime.prepare(this.runtimeSpec(fork));
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
    const all = this.store.listCheckpoints({ sandboxId: id }).filter((c) => c.kind === 'memory');
    for (const old of all.slice(keep)) {
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
    let answer!: (s: Sandbox) => void;
    let refuse!: (e: unknown) => void;
    const answered = new Promise<Sandbox>((res, rej) => {
      answer = res;
      refuse = rej;
    });
    // Steps are recorded only on a restore from a checkpoint (a thaw has none to show).
    const t = this.timer();
    this.locks
      .run(id, async () => {
        let ok = false;
        try {
          const r = await this.resumeLocked(id, tenant, reason, opts, t);
          if (t.steps().length > 0) t.mark('running');
          answer(r.sandbox);
          ok = r.pagesLoaded
            ? await t.time('pages loaded', () => this.afterLazyRestore(r.sandbox, r.pagesLoaded!))
            : true;
        } finally {
          if (t.steps().length > 0) this.report(t.finish('resume', this.store.getSandbox(id)?.id ?? id, ok));
        }
      })
      .catch(refuse);
    return answered;
  }

  /**
   * A lazy restore's pages failed to arrive: the sandbox is unusable, its checkpoint is not.
   * True when every page arrived.
   */
  private async afterLazyRestore(s: Sandbox, pagesLoaded: Promise<void>): Promise<boolean> {
    try {
      await pagesLoaded;
      return true;
    } catch (e) {
      await this.runtime.stop(s.id).catch(() => undefined);
      this.store.transition(s.id, 'running', 'hibernated', 'lazy restore failed', this.clock.now(), {
        lastError: `lazy restore failed, back to its checkpoint: ${asError(e).message}`,
        memoryBytes: 0,
      });
      return false;
    } finally {
      await this.wipe(this.staging(`${s.id}-restore`));
    }
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
        });
        if (isDormantError(e, 'RESTORE_INCOMPATIBLE')) throw e;
        if (isDormantError(e) && e.code.startsWith('VAULT_') && from === 'hibernated') {
          // A damaged checkpoint: say so, and name the older one that may still restore.
          const used = opts.from ?? s.checkpointId;
          const older = this.store
            .listCheckpoints({ sandboxId: id })
            .find((c) => c.kind === 'memory' && c.id !== used);
          throw new DormantError(
            'CHECKPOINT_DAMAGED',
            `checkpoint ${used ?? '?'} of sandbox ${id} cannot be read (${e.code}): ${e.message.split('\n')[0] ?? ''}; the sandbox stays hibernated`,
            {
              status: 409,
              cause: e,
              hint: older
                ? `resume from the previous checkpoint (losing what changed since): dormant resume ${id} --from ${older.id}`
                : 'no older checkpoint of this sandbox is kept; dormant vault verify shows what is damaged',
            },
          );
        }
        throw new DormantError(
          'RESUME_FAILED',
          `resume of sandbox ${id} failed; it is still ${from}${from === 'hibernated' ? ' and its checkpoint is intact' : ''}: ${asError(e).message}`,
          {
            status: 500,
            cause: e,
            hint: 'dormant doctor shows what this node supports; dormant logs ID shows its output',
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
    const lazy = this.opts.lazyRestore === true;
    let keep = false;
    try {
      await t.time('compatibility', () => this.checkCompatible(s.id, this.store.getCheckpoint(ckId)));
      await mkdir(dir, { recursive: true, mode: 0o700 });
      const images = join(dir, 'images');
      // The sandbox's host side (network, log collector, rootfs mount) does not need the images:
      // it is set up while they come out of the vault.
      const [fetched, prepared] = await Promise.allSettled([
        t.time('vault fetch', () =>
          this.vault.restoreCheckpoint({ tenant: s.tenant, checkpointId: ckId, destDir: images }),
        ),
        t.time('prepare', () => this.runtime.prepare(this.runtimeSpec(s), { timer: t })),
      ]);
      if (fetched.status === 'rejected') {
        // A hibernated sandbox's rootfs stays unmounted (archivable, nothing holding it).
        if (prepared.status === 'fulfilled') await this.runtime.stop(s.id).catch(() => undefined);
        throw fetched.reason;
      }
      if (prepared.status === 'rejected') throw prepared.reason;
      this.step('resume:fetched');
      const r = await t.time('restore', () =>
        this.runtime.restore(s.id, {
          imagesDir: images,
          workDir: join(dir, 'work'),
          lazyPages: lazy,
          timer: t,
        }),
      );
      if (ckId !== s.checkpointId) this.store.updateSandbox(s.id, { checkpointId: ckId });
      keep = lazy;
      // Wrapped: awaiting a returned promise directly would wait for the pages too.
      return { pagesLoaded: lazy ? r.pagesLoaded : undefined };
    } finally {
      if (!keep) await this.wipe(dir);
    }
  }

  private async freshStart(s: Sandbox): Promise<void> {
    const st = await this.runtime.state(s.id).catch(() => undefined);
    if (st && st.status !== 'absent') await this.runtime.stop(s.id);
    await this.runtime.create(this.runtimeSpec(s));
    await this.runtime.start(s.id);
  }

  /** Keep only the filesystem: processes end, memory checkpoints are deleted. */
  async archive(id: string, tenant?: string, reason = 'archive'): Promise<Sandbox> {
    return this.locks.run(id, async () => {
      const s = this.get(id, tenant);
      assertLegal('archive', s.state, id);
      if (isNoop('archive', s.state)) return s;
      await this.endProcesses(id);
      for (const c of this.store.listCheckpoints({ sandboxId: id })) {
        await this.vault.deleteCheckpoint({ tenant: s.tenant, checkpointId: c.id });
        this.store.deleteCheckpoint(c.id, this.clock.now());
      }
      this.store.transition(id, s.state, 'archived', reason, this.clock.now(), {
        memoryBytes: 0,
        checkpointId: undefined,
      });
      return this.get(id);
    });
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
        return 'failed';
      case 'hibernating':
        if (committed) {
          this.store.updateSandbox(s.id, { checkpointId: committed.id });
          if (status !== 'absent') await this.runtime.stop(s.id);
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
      default:
        return s.state;
    }
  }

  /** Processes are gone (a reboot): the newest checkpoint if there is one, else the filesystem. */
  private fallback(s: Sandbox): SandboxState {
    return s.checkpointId && this.store.getCheckpoint(s.checkpointId) ? 'hibernated' : 'archived';
  }
}
