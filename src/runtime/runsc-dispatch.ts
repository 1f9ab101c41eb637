/**
 * One Runtime over both adapters, so the controller stays one: each call goes to the adapter
 * of its sandbox. A spec names its runtime (`SandboxSpec.runtime`, runc when absent); any
 * other call finds the sandbox's adapter by whether gVisor's state folder holds it (each
 * adapter has a state folder of its own), remembered after the first look.
 */
import { DormantError, ErrorCode } from '../domain/errors.js';
import type { EgressPolicy } from '../domain/egress.js';
import type { AgentAddress } from './agent-client.js';
import { copyFolder } from './layer.js';
import type { RuncRuntime } from './runc.js';
import type { RunscRuntime } from './runsc.js';
import type {
  CallOptions,
  CheckpointOptions,
  CheckpointResult,
  ExecOptions,
  ExecResult,
  PrepareOptions,
  RestoreOptions,
  RestoreResult,
  Runtime,
  RuntimeKind,
  SandboxSpec,
  SandboxState,
} from './runtime.js';

export class RuntimeDispatch implements Runtime {
  private readonly kinds = new Map<string, RuntimeKind>();

  /** `runsc` absent: this node has no gVisor, and a sandbox asking for it is refused. */
  constructor(
    readonly runc: RuncRuntime,
    readonly runsc?: RunscRuntime,
  ) {}

  /** The runtimes sandboxes can be created on here. */
  kindsAvailable(): RuntimeKind[] {
    return this.runsc ? ['runc', 'runsc'] : ['runc'];
  }

  private forSpec(spec: SandboxSpec): RuncRuntime {
    if (spec.runtime !== 'runsc') return this.runc;
    if (!this.runsc)
      throw new DormantError(
        ErrorCode.INVALID_ARGUMENT,
        `sandbox ${spec.id}: runtime runsc (gVisor) is not available on this node`,
        { status: 400, hint: 'scripts/setup.sh installs runsc; `dormant doctor` says what works here' },
      );
    this.kinds.set(spec.id, 'runsc');
    return this.runsc;
  }

  /** The adapter that holds sandbox `id` (runc for one neither knows: it says so). */
  async of(id: string): Promise<RuncRuntime> {
    let kind = this.kinds.get(id);
    if (kind === undefined) {
      kind = this.runsc && (await this.runsc.holds(id)) ? 'runsc' : 'runc';
      this.kinds.set(id, kind);
    }
    return kind === 'runsc' && this.runsc ? this.runsc : this.runc;
  }

  prepare(spec: SandboxSpec, opts?: PrepareOptions): Promise<SandboxState> {
    return this.forSpec(spec).prepare(spec, opts);
  }

  create(spec: SandboxSpec, opts?: CallOptions): Promise<SandboxState> {
    return this.forSpec(spec).create(spec, opts);
  }

  async start(id: string, opts?: CallOptions): Promise<void> {
    return (await this.of(id)).start(id, opts);
  }

  async state(id: string, opts?: CallOptions): Promise<SandboxState> {
    return (await this.of(id)).state(id, opts);
  }

  async exec(id: string, args: readonly string[], opts?: ExecOptions): Promise<ExecResult> {
    return (await this.of(id)).exec(id, args, opts);
  }

  async pids(id: string): Promise<number[]> {
    return (await this.of(id)).pids(id);
  }

  /** gVisor's sandboxes are asked inside; runc's are read from the host's tables (undefined). */
  async listening(id: string, port: number): Promise<boolean | undefined> {
    const rt = await this.of(id);
    return rt === this.runsc ? this.runsc.listening(id, port) : undefined;
  }

  /** Both adapters put a sandbox in the same cgroup path: the files do not depend on which. */
  procsFiles(id: string): string[] {
    return this.runc.procsFiles(id);
  }

  checkEgress(policy: EgressPolicy): Promise<void> {
    return this.runc.checkEgress(policy);
  }

  async setEgress(id: string, policy: EgressPolicy): Promise<void> {
    return (await this.of(id)).setEgress(id, policy);
  }

  async egressBytes(): Promise<Map<string, number>> {
    const all = await this.runc.egressBytes();
    if (this.runsc) for (const [id, n] of await this.runsc.egressBytes()) all.set(id, n);
    return all;
  }

  async freeze(id: string, opts?: CallOptions): Promise<void> {
    return (await this.of(id)).freeze(id, opts);
  }

  async thaw(id: string, opts?: CallOptions): Promise<void> {
    return (await this.of(id)).thaw(id, opts);
  }

  async checkpoint(id: string, opts: CheckpointOptions): Promise<CheckpointResult> {
    return (await this.of(id)).checkpoint(id, opts);
  }

  async restore(id: string, opts: RestoreOptions): Promise<RestoreResult> {
    return (await this.of(id)).restore(id, opts);
  }

  async stop(id: string, opts?: CallOptions): Promise<void> {
    return (await this.of(id)).stop(id, opts);
  }

  async endProcesses(id: string, opts?: CallOptions): Promise<void> {
    return (await this.of(id)).endProcesses(id, opts);
  }

  async packLayer(id: string, tarPath: string, opts?: CallOptions): Promise<void> {
    return (await this.of(id)).packLayer(id, tarPath, opts);
  }

  async applyLayer(id: string, tarPath: string, opts?: CallOptions): Promise<void> {
    return (await this.of(id)).applyLayer(id, tarPath, opts);
  }

  async emptyLayer(id: string): Promise<void> {
    return (await this.of(id)).emptyLayer(id);
  }

  /** A fork's layer: from its origin's adapter's folder into its own's (both keep the same layout). */
  async copyLayer(fromId: string, toId: string): Promise<void> {
    await copyFolder((await this.of(fromId)).upperDir(fromId), (await this.of(toId)).upperDir(toId));
  }

  /** Lazy restores are runc's (CRIU lazy-pages); gVisor restores eagerly. */
  endLazyPages(workDir: string): Promise<number[]> {
    return this.runc.endLazyPages(workDir);
  }

  async kill(id: string, signal?: NodeJS.Signals, opts?: CallOptions): Promise<void> {
    return (await this.of(id)).kill(id, signal, opts);
  }

  async destroy(id: string, opts?: CallOptions): Promise<void> {
    await (await this.of(id)).destroy(id, opts);
    this.kinds.delete(id);
  }

  async list(): Promise<string[]> {
    return [...(await this.runc.list()), ...(this.runsc ? await this.runsc.list() : [])].sort();
  }

  async ensureAgent(id: string, token: string, opts?: CallOptions): Promise<AgentAddress> {
    return (await this.of(id)).ensureAgent(id, token, opts);
  }

  restoreLogPath(id: string): string {
    // Synchronous in the port: the kind is known once any call has looked the sandbox up.
    return (this.kinds.get(id) === 'runsc' && this.runsc ? this.runsc : this.runc).restoreLogPath(id);
  }
}
