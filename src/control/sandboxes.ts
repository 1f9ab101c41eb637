/**
 * The lifecycle controller: the one place that moves sandboxes between states. It ties the
 * database of record, the runtime and the vault together, one operation per sandbox at a
 * time, and keeps the lifecycle's contract: a checkpoint is committed before the original
 * processes end, a failed hibernate leaves the sandbox as it was, a failed resume leaves the
 * checkpoint in place and says why, and a restart of the daemon reconciles every sandbox.
 *
 * Each operation lives in its own file under ops/, written against the context (context.ts:
 * the ports, the options and the helpers they share); this class takes the sandbox's lock
 * where an operation holds it throughout, and dispatches.
 */
import { AWAKE_STATES } from '../domain/node.js';
import { fenceNode, releaseForeign, reclaimLostNode, type Fenced, type Reclaimed } from './ops/nodes.js';
import { open, statfs } from 'node:fs/promises';
import { assertLegal, type Sandbox, type SandboxState } from '../domain/sandbox.js';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';
import type { OperationTimings } from '../domain/timings.js';
import type { Compression } from '../checkpoint/archive.js';
import type { GpuHolder } from '../sys/gpu.js';
import { LifecycleContext, invalid } from './context.js';
import { sandboxListens } from './listens.js';
import type { ControllerOptions } from './options.js';
import { archiveSandbox } from './ops/archive.js';
import { createSandbox, type CreateSandboxInput } from './ops/create.js';
import { sealStoredEnv } from './ops/env.js';
import { exportArchive } from './ops/export.js';
import { forkSandbox } from './ops/fork.js';
import { gpuHolders } from './ops/gpu.js';
import { hibernate } from './ops/hibernate.js';
import { importArchive, importUpload, type ImportArchiveInput } from './ops/import.js';
import { pauseSandbox } from './ops/pause.js';
import { reconcileAll } from './ops/reconcile.js';
import { removeSandbox } from './ops/remove.js';
import { resume } from './ops/resume.js';
import { updateEgress, updateSandbox, type SandboxUpdate } from './ops/update.js';
import { execCommand, withAgent, type ExecOptions, type ExecOutcome } from './ops/toolbox.js';
import { agentNotSupported, execThroughRuntime } from './ops/exec-runtime.js';
import {
  createTemplate,
  listTemplates,
  publishTemplate,
  removeTemplate,
  resolveTemplate,
  type CreateTemplateInput,
} from './ops/template.js';
import { createFromTemplate } from './ops/template-start.js';
import type { TemplateRecord } from '../state/templates.js';
import type { AgentClient } from '../runtime/agent-client.js';

export {
  systemClock,
  type CheckpointVault,
  type Clock,
  type ControllerOptions,
  type EnvSecrets,
} from './options.js';
export { DEFAULT_DISK_BYTES, type CreateSandboxInput } from './ops/create.js';
export type { ImportArchiveInput } from './ops/import.js';
export type { CreateTemplateInput, ReadyProbe } from './ops/template.js';
export type { PolicyPatch, SandboxUpdate } from './ops/update.js';
export type { ExecOptions, ExecOutcome } from './ops/toolbox.js';

export class SandboxController {
  private readonly ctx: LifecycleContext;

  constructor(opts: ControllerOptions) {
    this.ctx = new LifecycleContext(opts);
  }

  /** The step timings of the sandbox's last hibernate, resume or fork (as the fork's id). */
  lastTimings(id: string, op: OperationTimings['op']): OperationTimings | undefined {
    return this.ctx.timings.get(`${op}:${id}`);
  }

  /** The sandbox, if the tenant may see it (an admin passes undefined). Else SANDBOX_NOT_FOUND. */
  async get(id: string, tenant?: string): Promise<Sandbox> {
    return await this.ctx.get(id, tenant);
  }

  async list(tenant?: string): Promise<Sandbox[]> {
    return await this.ctx.store.listSandboxes(tenant);
  }

  /**
   * The sandboxes this node runs or answers for (in a fleet, those placed on it): what its
   * policy loop and meter go over.
   */
  async listOwn(): Promise<Sandbox[]> {
    return await this.ctx.own();
  }

  /** A lost node's awake sandboxes back to their checkpoints, now this node's (ops/nodes.ts). */
  async reclaimLostNode(name: string): Promise<Reclaimed[]> {
    return await reclaimLostNode(this.ctx, name);
  }

  /** Removes what this node still holds of sandboxes no longer its own (ops/nodes.ts). */
  async releaseForeign(): Promise<string[]> {
    return await releaseForeign(this.ctx);
  }

  /** Freezes this node's running sandboxes while it cannot renew its lease (ops/nodes.ts). */
  async fence(): Promise<Fenced> {
    return await fenceNode(this.ctx);
  }

  /**
   * In a fleet, refuses work on a sandbox that is awake on another node: its processes are
   * there (the API forwards such requests; this stops whatever reaches the controller
   * directly: the E2B front, a forged forwarding header, a node forwarding to itself).
   */
  private async here(id: string, tenant?: string): Promise<void> {
    if (this.ctx.node === undefined) return;
    // Not found and the like: the operation says so itself.
    const s = await this.ctx.get(id, tenant).catch(() => undefined);
    if (s?.node !== undefined && s.node !== this.ctx.node && AWAKE_STATES.includes(s.state))
      throw new DormantError(
        ErrorCode.NODE_UNAVAILABLE,
        `sandbox ${s.id} is ${s.state} on node ${s.node}, not on this node (${this.ctx.node})`,
        { hint: `send the request to node ${s.node} (dormant node ls shows its URL)` },
      );
  }

  /** This node's name in a fleet; undefined on a node alone. */
  get node(): string | undefined {
    return this.ctx.node;
  }

  /** The sandbox with `memoryBytes` read from its cgroup now (0 unless running or paused). */
  async withUsage(s: Sandbox): Promise<Sandbox> {
    const usage = this.ctx.opts.usage;
    if ((s.state !== 'running' && s.state !== 'paused') || !usage) return { ...s, memoryBytes: 0 };
    // Another node's: its cgroup is there; what that node last recorded.
    if (s.node !== undefined && s.node !== this.ctx.node) return s;
    // No cgroup (its processes just ended): it holds no memory.
    const u = await usage(s.id).catch(() => undefined);
    return { ...s, memoryBytes: u?.memoryBytes ?? 0 };
  }

  /** Resource use of the sandbox's cgroup now; undefined when it has no processes. */
  async usage(id: string): Promise<{ memoryBytes: number; cpuUsageUsec: number } | undefined> {
    // No cgroup (its processes just ended): no usage, as the return type says.
    return this.ctx.opts.usage ? this.ctx.opts.usage(id).catch(() => undefined) : undefined;
  }

  /** Records activity on the sandbox (API call, proxied traffic): the idle clock restarts. */
  async touch(id: string): Promise<void> {
    await this.ctx.markActive(id);
  }

  /**
   * Seals every environment value still stored in clear (rows from before sealing); returns
   * how many sandboxes changed (ops/env.ts).
   */
  async sealStoredEnv(isSealed: (env: Readonly<Record<string, string>>) => boolean): Promise<number> {
    return sealStoredEnv(this.ctx, isSealed);
  }

  async create(input: CreateSandboxInput): Promise<Sandbox> {
    // From a template: the caller hears once it runs (its pages may still be coming in).
    const template = input.template;
    if (template !== undefined)
      return new Promise<Sandbox>((answer, refuse) => {
        createFromTemplate(this.ctx, { ...input, template }, answer).catch(refuse);
      });
    return createSandbox(this.ctx, input);
  }

  /** A template from a running sandbox, or from a builder sandbox (ops/template.ts). */
  async createTemplate(input: CreateTemplateInput): Promise<TemplateRecord> {
    return createTemplate(this.ctx, input);
  }

  /** The templates `tenant` sees (its own and the public ones); an admin passes undefined. */
  async listTemplates(tenant?: string): Promise<TemplateRecord[]> {
    return listTemplates(this.ctx, tenant);
  }

  /** The template `ref` (id or name) as `tenant` sees it, or TEMPLATE_NOT_FOUND. */
  async getTemplate(ref: string, tenant?: string): Promise<TemplateRecord> {
    return resolveTemplate(this.ctx, ref, tenant);
  }

  async removeTemplate(ref: string, tenant?: string): Promise<void> {
    return removeTemplate(this.ctx, ref, tenant);
  }

  /** Every tenant sees the template (admin only), or only its own tenant again. */
  async publishTemplate(ref: string, isPublic: boolean): Promise<TemplateRecord> {
    return publishTemplate(this.ctx, ref, isPublic);
  }

  /**
   * Runs a command in the sandbox to its end through its toolbox agent (ops/toolbox.ts),
   * waking the sandbox first if it sleeps.
   */
  async exec(
    id: string,
    tenant: string | undefined,
    args: string[],
    opts: ExecOptions = {},
  ): Promise<ExecOutcome> {
    if (args.length === 0) throw invalid('exec needs a command');
    await this.here(id, tenant);
    try {
      return await this.toolbox(id, tenant, (agent, s) => execCommand(agent, s.id, args, opts));
    } catch (e) {
      // A runtime without an agent (gVisor): the sandbox is awake now; its runtime runs it.
      if (!agentNotSupported(e)) throw e;
      const s = await this.ctx.get(id, tenant);
      try {
        return await execThroughRuntime(this.ctx, s.id, args, opts);
      } finally {
        await this.ctx.markActive(s.id);
      }
    }
  }

  /**
   * Runs `fn` with the toolbox agent of the sandbox (ops/toolbox.ts): the sandbox is woken
   * first if it sleeps, and the call counts as activity when it starts and when it ends.
   */
  async toolbox<T>(
    id: string,
    tenant: string | undefined,
    fn: (agent: AgentClient, s: Sandbox) => Promise<T>,
  ): Promise<T> {
    await this.here(id, tenant);
    const wake = (sid: string): Promise<Sandbox> => this.resume(sid, undefined, 'toolbox');
    let sid: string | undefined;
    try {
      return await withAgent(this.ctx, id, tenant, wake, (agent, s) => {
        sid = s.id;
        return fn(agent, s);
      });
    } finally {
      if (sid !== undefined) await this.ctx.markActive(sid);
    }
  }

  /**
   * The log of the sandbox's last failed restore (CRIU's), at most its last `maxBytes`; undefined
   * when no restore of it has failed (or the runtime keeps no such log).
   */
  async restoreLog(id: string, tenant?: string, maxBytes = 4 << 20): Promise<string | undefined> {
    await this.ctx.get(id, tenant);
    const path = this.ctx.runtime.restoreLogPath?.(id);
    if (path === undefined) return undefined;
    let fh;
    try {
      fh = await open(path, 'r');
    } catch (e) {
      if (errnoCode(e) === 'ENOENT') return undefined;
      throw e;
    }
    try {
      const { size } = await fh.stat();
      const len = Math.min(size, maxBytes);
      const buf = Buffer.alloc(len);
      await fh.read(buf, 0, len, size - len);
      return (size > len ? `[... the first ${size - len} bytes left out]\n` : '') + buf.toString('utf8');
    } finally {
      await fh.close();
    }
  }

  /** The sandbox's output log, across hibernations. */
  async logPath(id: string, tenant?: string): Promise<string> {
    await this.ctx.get(id, tenant);
    return (await this.ctx.runtime.state(id)).logPath;
  }

  /**
   * Whether running sandbox `id` has a listener on TCP `port`, from its network namespace's
   * socket tables (no connection made); undefined when it has no process or they cannot be read.
   */
  async listensOn(id: string, port: number): Promise<boolean | undefined> {
    return sandboxListens(this.ctx.runtime, id, port);
  }

  async pause(id: string, tenant?: string, reason = 'pause'): Promise<Sandbox> {
    await this.here(id, tenant);
    return this.ctx.locks.run(id, () => pauseSandbox(this.ctx, id, tenant, reason));
  }

  /**
   * Hibernate: freeze, dump with the processes left in place (frozen), store the images in
   * the vault, commit the checkpoint, and only then end the processes. Any failure before the
   * commit thaws the sandbox back to where it was.
   */
  async hibernate(id: string, tenant?: string, reason = 'hibernate'): Promise<Sandbox> {
    await this.here(id, tenant);
    // The caller gets the sandbox once it is hibernated (checkpoint committed, processes gone,
    // memory freed); the container's remains are removed after that, the lock still held.
    return this.answerEarly(id, (answer) => hibernate(this.ctx, id, tenant, reason, answer));
  }

  /**
   * Runs `work` under the sandbox's lock and settles with the first value it passes to
   * `answer`, while it goes on with what the caller need not wait for (the lock is held until
   * it ends). A failure before the answer rejects; one after it is `work`'s to record.
   */
  private answerEarly(id: string, work: (answer: (s: Sandbox) => void) => Promise<void>): Promise<Sandbox> {
    return new Promise<Sandbox>((answer, refuse) => {
      this.ctx.locks.run(id, () => work(answer)).catch(refuse);
    });
  }

  /** The sandbox's processes that hold GPU state now (none when it has no processes). */
  async gpuHolders(id: string): Promise<GpuHolder[]> {
    return gpuHolders(this.ctx, id);
  }

  /** Records an event on the sandbox without changing its state (why the idle policy skipped it). */
  async note(id: string, reason: string): Promise<void> {
    await this.ctx.store.note(id, reason, this.ctx.clock.now());
  }

  /**
   * A new sandbox restored from `id`'s newest checkpoint (a running or paused sandbox is
   * checkpointed first and keeps running), with a copy of its filesystem. The fork has its own
   * network address; listening sockets bound to all addresses listen again there.
   */
  async fork(
    id: string,
    tenant: string | undefined,
    opts: { name?: string; labels?: Record<string, string> } = {},
  ): Promise<Sandbox> {
    await this.here(id, tenant);
    return forkSandbox(this.ctx, id, tenant, opts);
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
    const t = this.ctx.timer();
    return this.answerEarly(id, (answer) => resume(this.ctx, id, tenant, reason, opts, t, answer));
  }

  /**
   * Waits (at most `timeoutMs`) for every lazy restore in flight to have all its pages in or
   * to be undone. Call before shutting down: a page server that goes away with the process
   * leaves CRIU's lazy-pages daemon filling the missing pages with zeros.
   */
  async settleLazyRestores(timeoutMs = 30_000): Promise<void> {
    if (this.ctx.lazyInFlight.size === 0) return;
    let timer: NodeJS.Timeout | undefined;
    await Promise.race([
      Promise.allSettled([...this.ctx.lazyInFlight]),
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
    await Promise.race([this.ctx.locks.idle(), new Promise((r) => (timer = setTimeout(r, timeoutMs)))]);
    clearTimeout(timer);
  }

  /** `dormant checkpoint import` of an archive on this node (ops/import.ts). */
  async importArchive(input: ImportArchiveInput): Promise<Sandbox> {
    return importArchive(this.ctx, input);
  }

  /** `dormant checkpoint import` of an uploaded archive (ops/import.ts). */
  async importUpload(
    input: Omit<ImportArchiveInput, 'archive'> & { fileName?: string },
    body: NodeJS.ReadableStream,
    maxBytes: number,
  ): Promise<Sandbox> {
    return importUpload(this.ctx, input, body, maxBytes);
  }

  /**
   * A checkpoint of the vault written as a podman / CRI-O archive, into a private staging file
   * (ops/export.ts). The caller streams it out and calls `close()`.
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
    return exportArchive(this.ctx, ckId, tenant, opts);
  }

  /**
   * Keep only the filesystem: its diff goes into the vault as a 'filesystem' checkpoint, the
   * processes end, the memory checkpoints are deleted and the writable layer is emptied.
   */
  async archive(id: string, tenant?: string, reason = 'archive'): Promise<Sandbox> {
    await this.here(id, tenant);
    return this.ctx.locks.run(id, () => archiveSandbox(this.ctx, id, tenant, reason));
  }

  async keepalive(id: string, tenant: string | undefined, untilMs: number): Promise<Sandbox> {
    // The state checked is the state the lease is written against (one transaction).
    return await this.ctx.store.atomically(async (tx) => {
      const s = await this.ctx.get(id, tenant, tx);
      assertLegal('keepalive', s.state, s.id);
      await tx.updateSandbox(s.id, { lastActiveAt: Math.max(this.ctx.clock.now(), untilMs) });
      return await this.ctx.get(s.id, undefined, tx);
    });
  }

  /** New labels and idle policy values (ops/update.ts); the policy loop acts on them at once. */
  async update(id: string, tenant: string | undefined, u: SandboxUpdate): Promise<Sandbox> {
    return updateSandbox(this.ctx, id, tenant, u);
  }

  /** A new egress policy (ops/update.ts): the firewall follows at once, or at the next resume. */
  async updateEgress(id: string, tenant: string | undefined, egress: string | string[]): Promise<Sandbox> {
    await this.here(id, tenant);
    return this.ctx.locks.run(id, () => updateEgress(this.ctx, id, tenant, egress));
  }

  /** Each sandbox's writable layer folder: it never moves, and asking the runtime runs runc. */
  private readonly upperDirs = new Map<string, string>();

  /** Each sandbox's egress counter (MeterSource.egressBytes), when the runtime counts it. */
  async egressBytes(): Promise<Map<string, number>> {
    return (await this.ctx.runtime.egressBytes?.()) ?? new Map();
  }

  /**
   * Bytes in use on the sandbox's writable layer: with a disk quota the layer is a filesystem
   * of its own, so one statfs answers (no walk of its files). Undefined without a quota, or
   * when the answer cannot be the layer's (it is larger than the quota: not mounted).
   */
  async diskUsage(id: string): Promise<number | undefined> {
    const quota = (await this.ctx.store.getSandbox(id))?.spec.diskBytes;
    if (quota === undefined) return undefined;
    let dir = this.upperDirs.get(id);
    if (dir === undefined) {
      // Bounded: entries of removed sandboxes are dropped with the rest now and then.
      if (this.upperDirs.size >= 4096) this.upperDirs.clear();
      dir = (await this.ctx.runtime.state(id)).upperDir;
      this.upperDirs.set(id, dir);
    }
    const st = await statfs(dir).catch(() => undefined);
    if (!st || st.blocks * st.bsize > quota * 1.1) return undefined;
    return (st.blocks - st.bfree) * st.bsize;
  }

  async remove(id: string, tenant?: string, reason = 'rm'): Promise<void> {
    await this.here(id, tenant);
    await this.ctx.locks.run(id, () => removeSandbox(this.ctx, id, tenant, reason));
  }

  /**
   * After a daemon restart: every sandbox ends up in a resting state that matches what is
   * really there, and nothing is lost.
   */
  async reconcile(): Promise<{ id: string; from: SandboxState; to: SandboxState }[]> {
    return reconcileAll(this.ctx);
  }
}
