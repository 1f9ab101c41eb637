/**
 * What every lifecycle operation works with: the database of record, the runtime, the vault,
 * the clock and options, the per-sandbox lock, and the small helpers the operations share.
 */

import { realpath, rm, stat } from 'node:fs/promises';
import { arch } from 'node:os';
import { isAbsolute, join } from 'node:path';
import { DormantError, ErrorCode, asError, errnoCode } from '../domain/errors.js';
import { ID_PATTERN, type Sandbox } from '../domain/sandbox.js';
import type { CheckpointRecord } from '../state/store.js';
import type { StatePort, VaultPort } from './ports.js';
import type { Runtime, SandboxSpec as RuntimeSpec } from '../runtime/runtime.js';
import { wipeStaged } from '../runtime/staging.js';
import { KeyedMutex } from './mutex.js';
import { FS_DIFF } from '../runtime/layer.js';
import type { PlatformFacts } from '../domain/compat.js';
import { systemGpuNode, type GpuNode } from './gpu.js';
import { StepTimer, type OperationTimings } from '../domain/timings.js';
import { sandboxProfile, type SandboxProfile } from '../checkpoint/profile-check.js';
import { assertWithinProfile } from '../checkpoint/profile-check-io.js';
import { SANDBOX_CAPABILITIES } from '../runtime/oci.js';
import { systemClock, type ControllerOptions, type Clock } from './options.js';

/** A tenant named a host path outside the operator's allowed folders (403). */
function hostPathForbidden(what: string, path: string, roots: readonly string[] = []): DormantError {
  const shown = path.slice(0, 200).replace(/\0/g, '\\0');
  return new DormantError(
    ErrorCode.HOST_PATH_FORBIDDEN,
    roots.length === 0
      ? `${what} ${shown}: a tenant token cannot name host paths on this node`
      : `${what} ${shown} is outside the allowed folders`,
    {
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

/** What `get` reads a sandbox through: the store, or a transaction's `tx`. */
type SandboxReader = Pick<StatePort, 'getSandbox' | 'listSandboxes'>;

export function invalid(message: string, hint?: string): DormantError {
  return new DormantError(ErrorCode.INVALID_ARGUMENT, message, { ...(hint ? { hint } : {}) });
}

export class LifecycleContext {
  readonly store: StatePort;
  readonly runtime: Runtime;
  readonly vault: VaultPort;
  readonly clock: Clock;
  readonly locks = new KeyedMutex();
  readonly opts: ControllerOptions;
  readonly gpu: GpuNode;
  /** This node's name in a fleet (ControllerOptions.node). */
  readonly node: string | undefined;
  readonly timings = new Map<string, OperationTimings>();
  /** Resolves true when resumes restore lazily on this node (asked once). */
  readonly lazy: Promise<boolean>;
  /** Lazy restores whose pages are still coming in (or being undone). */
  readonly lazyInFlight = new Set<Promise<boolean>>();

  constructor(opts: ControllerOptions) {
    this.opts = opts;
    this.gpu = opts.gpu ?? systemGpuNode();
    this.store = opts.store;
    this.node = opts.node;
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

  /** The field a sandbox this node makes or wakes gets: this node's name, in a fleet. */
  placed(): { node?: string } {
    return this.node !== undefined ? { node: this.node } : {};
  }

  /** The sandboxes this node answers for: its own in a fleet, every one on a node alone. */
  async own(): Promise<Sandbox[]> {
    if (this.node === undefined) return this.store.listSandboxes();
    return this.store.querySandboxes({ node: this.node, limit: Number.MAX_SAFE_INTEGER });
  }

  /**
   * SANDBOX_BUSY for a compare-and-set from `from` that another request or node won: what the
   * sandbox is now (read through `via`), and where.
   */
  async busy(id: string, from: string, via: SandboxReader = this.store): Promise<DormantError> {
    const now = await via.getSandbox(id);
    const where = now?.node !== undefined && now.node !== this.node ? ` on node ${now.node}` : '';
    return new DormantError(
      'SANDBOX_BUSY',
      `sandbox ${id} is no longer ${from}: it is ${now?.state ?? 'gone'}${where}`,
      {
        hint: 'another request (or node) got to it first; dormant get ID shows where it is now',
      },
    );
  }

  step(name: string): void {
    this.opts.failAt?.(name);
  }

  timer(): StepTimer {
    return new StepTimer(() => performance.now());
  }

  report(t: OperationTimings): void {
    this.timings.set(`${t.op}:${t.sandboxId}`, t);
    try {
      this.opts.onTimings?.(t);
    } catch {
      // A listener's failure is not the operation's.
    }
  }

  /**
   * The sandbox, if the tenant may see it (an admin passes undefined). Else SANDBOX_NOT_FOUND.
   * Read through `via`: inside a transaction, its `tx`.
   */
  async get(id: string, tenant?: string, via: SandboxReader = this.store): Promise<Sandbox> {
    // An id, or a name within the tenant (names are unique per tenant; an admin, who sees every
    // tenant, may meet the same name twice, and is then told which sandboxes bear it).
    let s = await via.getSandbox(id);
    if (!s && !ID_PATTERN.test(id)) {
      const named = (await via.listSandboxes(tenant)).filter((x) => x.name === id);
      if (named.length > 1)
        throw new DormantError(
          'SANDBOX_NAME_AMBIGUOUS',
          `${named.length} sandboxes are named ${id.slice(0, 80)}: ${named
            .slice(0, 10)
            .map((x) => `${x.id} (tenant ${x.tenant})`)
            .join(', ')}`,
        );
      s = named[0];
    }
    if (!s || (tenant !== undefined && s.tenant !== tenant)) {
      throw new DormantError('SANDBOX_NOT_FOUND', `no sandbox ${id.slice(0, 80)}`, {
        hint: 'dormant ls shows the sandboxes you can see',
      });
    }
    return s;
  }

  /**
   * Activity now; a lease (lastActiveAt in the future, from keepalive) is never shortened. Read
   * and write in one transaction: a keepalive landing between them would be undone.
   */
  async markActive(id: string): Promise<void> {
    await this.store.atomically(async (tx) => {
      const cur = await tx.getSandbox(id);
      if (cur) await tx.updateSandbox(id, { lastActiveAt: Math.max(cur.lastActiveAt, this.clock.now()) });
    });
  }

  /** The environment as the database keeps it: values sealed when secrets are configured. */
  async sealEnv(tenant: string, id: string, env: Record<string, string>): Promise<Record<string, string>> {
    return this.opts.secrets ? this.opts.secrets.seal(tenant, id, env) : env;
  }

  /** The sandbox's environment in clear: only for its runtime spec (and an export). */
  async openEnv(s: Sandbox): Promise<Record<string, string>> {
    return this.opts.secrets ? this.opts.secrets.open(s.tenant, s.id, s.spec.env) : s.spec.env;
  }

  async runtimeSpec(s: Sandbox): Promise<RuntimeSpec> {
    const src = s.spec.source;
    return {
      id: s.id,
      rootfs: src.kind === 'rootfs' ? src.path : src.rootfs,
      ...(s.spec.cwd !== undefined ? { cwd: s.spec.cwd } : {}),
      args: s.spec.command,
      env: await this.openEnv(s),
      hostname: s.spec.hostname ?? s.name,
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
      ...(s.spec.engineBinds !== undefined && s.spec.engineBinds.length > 0
        ? { engineBinds: s.spec.engineBinds }
        : {}),
      ...(s.spec.cgroupNamespace === false ? { cgroupNamespace: false } : {}),
      ...(s.spec.egress !== undefined ? { egress: s.spec.egress } : {}),
      ...(s.spec.runtime !== undefined ? { runtime: s.spec.runtime } : {}),
    };
  }

  /**
   * A source path must be absolute, without `..` or NUL, and, where allowed folders are set,
   * inside one of them after symlinks are resolved (a link inside an allowed folder must not
   * lead out of it). Returns the resolved path.
   */
  async checkPath(path: string, what: string, admin: boolean): Promise<string> {
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

  staging(ckId: string): string {
    return join(this.opts.stagingDir, ckId);
  }

  async wipe(dir: string): Promise<void> {
    // A mount left below (CRIU's cgroup yard in a restore's work dir) would make rm fail.
    await wipeStaged(dir);
  }

  /** A cleanup step that failed after a failed operation: said to the operator, not thrown over the first error. */
  warnCleanup(id: string, what: string, e: unknown): void {
    this.opts.warn?.(`sandbox ${id}: cleanup (${what}) failed: ${asError(e).message.split('\n')[0] ?? ''}`);
  }

  /** The node's facts; without a `platform` option only the architecture is known. */
  async platform(): Promise<Partial<PlatformFacts> & { arch: string }> {
    return this.opts.platform ? this.opts.platform() : { arch: arch() };
  }

  /** Ends a sandbox's processes and removes its container; its filesystem and network stay. */
  async endProcesses(id: string, t?: StepTimer): Promise<void> {
    // stop() is a no-op for a sandbox without a container: no `runc state` first.
    await this.runtime.stop(id, t ? { timer: t } : {});
  }

  async pruneCheckpoints(id: string, tenant: string): Promise<void> {
    const keep = this.opts.keepCheckpoints ?? 2;
    const all = await this.store.listCheckpoints({ sandboxId: id });
    const memory = all.filter((c) => c.kind === 'memory');
    // An archive's diff is superseded by the first memory checkpoint after it.
    const stale = all.filter((c) => c.kind === 'filesystem' && memory.length > 0);
    for (const old of [...memory.slice(keep), ...stale]) {
      await this.vault.deleteCheckpoint({ tenant, checkpointId: old.id });
      await this.store.deleteCheckpoint(old.id, this.clock.now());
    }
  }

  /**
   * Puts a checkpoint folder's filesystem diff (if it carries one) into sandbox `id`'s
   * writable layer, replacing what is there, and removes it from the folder. Returns whether
   * there was one. Call while the sandbox's overlay is not mounted.
   */
  async applyFilesystem(id: string, folder: string): Promise<boolean> {
    const tar = join(folder, FS_DIFF);
    if (
      !(await stat(tar).then(
        (st) => st.isFile(),
        () => false,
      ))
    )
      return false;
    await this.runtime.applyLayer(id, tar);
    await rm(tar, { force: true });
    return true;
  }

  /** The profile an imported checkpoint is held to: what this node gives its sandboxes. */
  checkpointProfile(admin: boolean): SandboxProfile {
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
  async checkImported(images: string, ck: CheckpointRecord | undefined): Promise<void> {
    if (ck?.meta.importedFrom === undefined) return;
    await assertWithinProfile(
      images,
      this.checkpointProfile(ck.meta.importedBy === 'admin'),
      `checkpoint ${ck.id}`,
    );
  }

  /** CHECKPOINT_DAMAGED for checkpoint `used` of sandbox `id`, naming an older one to resume from. */
  async damaged(
    id: string,
    used: string | undefined,
    e: DormantError,
    outcome: string,
  ): Promise<DormantError> {
    const older = (await this.store.listCheckpoints({ sandboxId: id })).find(
      (c) => c.kind === 'memory' && c.id !== used,
    );
    return new DormantError(
      'CHECKPOINT_DAMAGED',
      `checkpoint ${used ?? '?'} of sandbox ${id} cannot be read (${e.code}): ${e.message.split('\n')[0] ?? ''}; ${outcome}`,
      {
        cause: e,
        hint: older
          ? `resume from the previous checkpoint (losing what changed since): dormant resume ${id} --from ${older.id}`
          : 'no older checkpoint of this sandbox is kept; dormant vault verify shows what is damaged',
      },
    );
  }
}
