/**
 * In-memory stand-ins for the controller's ports, so every lifecycle operation and each of its
 * steps can be made to fail in a unit test without root, runc or CRIU:
 *
 * - `FakeRuntime`: sandboxes whose "processes" are a key-value memory (set and read with
 *   `exec`), frozen or not, checkpointed into a small image file and restored from it; the
 *   writable layer is a real folder under a temp dir (tarred as the runc adapter does).
 * - `FakeVault`: checkpoints kept in memory per tenant, their files copied in and out.
 * - `faultyStore`: the real SQLite store on `:memory:` (opens in a few ms without root, and its
 *   compare-and-set transitions, transactions and newest-first checkpoint order are what the
 *   controller relies on: a fake would have to copy them), with every write made faultable.
 *
 * All three report their calls to one `Faults`, which can make a chosen call fail, hang until
 * aborted, or "crash" the daemon: from that call on, every call made through these fakes
 * hangs forever (store calls reject), as if the process had died there. A restarted daemon
 * gets new fakes over the same `FakeHost`, vault data and database.
 */
import { mkdir, readFile, readdir, rm, writeFile } from 'node:fs/promises';
import { dirname, join, relative } from 'node:path';
import { DormantError, ErrorCode } from '../../domain/errors.js';
import type { StateStore } from '../../state/store.js';
import { SqliteStateStore } from '../../state/sqlite.js';
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
  SandboxSpec,
  SandboxState,
  SandboxStatus,
} from '../../runtime/runtime.js';
import { copyFolder, emptyFolder, packFilesystem, unpackFilesystem } from '../../runtime/layer.js';
import type { VaultPort } from '../ports.js';
import type { GpuNode } from '../gpu.js';

/** What an injected fault does to the call it hits. */
export type FaultAction =
  /** The call throws (before it does anything, or with `after`, once its effect is done). */
  | { kind: 'fail'; error?: Error; after?: boolean }
  /** The call never returns, until its signal (if any) aborts. */
  | { kind: 'hang' }
  /** The daemon dies at this call: it and every later call hang (store calls reject). */
  | { kind: 'crash' };

interface Rule {
  /** Port and method, `runtime.checkpoint`; or a predicate on it and the call's index. */
  match: (name: string, index: number) => boolean;
  action: FaultAction;
  /** Calls of the matched name to let through first. */
  skip: number;
  used: boolean;
}

/** Thrown by an injected fault. */
export class InjectedFault extends Error {
  constructor(readonly call: string) {
    super(`injected fault at ${call}`);
  }
}

/** Thrown by a store call of a daemon that has crashed. */
export class Crashed extends Error {
  constructor(readonly call: string) {
    super(`the daemon crashed (at ${call})`);
  }
}

export class Faults {
  /** Every faultable call, in order, as `port.method`. */
  readonly calls: string[] = [];
  private readonly rules: Rule[] = [];
  private crashedAt: string | undefined;
  /** Calls parked by a hang or a crash, still waiting. */
  parked = 0;

  /** The `nth` (1-based) call of `name` from now on does `action`. */
  on(name: string, action: FaultAction = { kind: 'fail' }, nth = 1): this {
    this.rules.push({ match: (n) => n === name, action, skip: nth - 1, used: false });
    return this;
  }

  /** The call at position `index` of `calls` (counting from 0, from the first call ever) does `action`. */
  atCall(index: number, action: FaultAction = { kind: 'fail' }): this {
    this.rules.push({ match: (_n, i) => i === index, action, skip: 0, used: false });
    return this;
  }

  get crashed(): boolean {
    return this.crashedAt !== undefined;
  }

  /** The rule a call hits, if any (one-shot). */
  private rule(name: string): FaultAction | undefined {
    const index = this.calls.length;
    this.calls.push(name);
    for (const r of this.rules) {
      if (r.used || !r.match(name, index)) continue;
      if (r.skip > 0) {
        r.skip--;
        continue;
      }
      r.used = true;
      return r.action;
    }
    return undefined;
  }

  private park(signal?: AbortSignal): Promise<never> {
    this.parked++;
    return new Promise<never>((_resolve, reject) => {
      signal?.addEventListener('abort', () => {
        this.parked--;
        reject(signal.reason instanceof Error ? signal.reason : new Error('aborted'));
      });
    });
  }

  /**
   * For an async method: runs `effect` unless a fault says otherwise. The fault hits before
   * the effect, or after it with `after`.
   */
  async call<T>(name: string, effect: () => Promise<T> | T, signal?: AbortSignal): Promise<T> {
    if (this.crashed) {
      this.calls.push(name);
      return this.park();
    }
    const a = this.rule(name);
    if (a === undefined) return effect();
    switch (a.kind) {
      case 'fail':
        if (a.after) await effect();
        throw a.error ?? new InjectedFault(name);
      case 'hang':
        return this.park(signal);
      case 'crash':
        this.crashedAt = name;
        return this.park();
    }
  }

  /**
   * For a store method: a crash rejects with `Crashed` here and after (a dead daemon's open
   * transaction rolls back; a hang would hold the store's transaction open for ever, so none
   * can be injected).
   */
  async callStore<T>(name: string, effect: () => Promise<T>): Promise<T> {
    if (this.crashed) {
      this.calls.push(name);
      throw new Crashed(this.crashedAt!);
    }
    const a = this.rule(name);
    if (a === undefined) return effect();
    if (a.kind === 'crash') {
      this.crashedAt = name;
      throw new Crashed(name);
    }
    if (a.kind === 'fail') {
      if (a.after) await effect();
      throw a.error ?? new InjectedFault(name);
    }
    throw new Error(`a hang cannot be injected into the store call ${name}`);
  }
}

// ---- runtime ------------------------------------------------------------------------

/** One sandbox as the fake node holds it. */
interface HostSandbox {
  spec: SandboxSpec;
  address: string;
  /** 'absent': no container; else the container's status. */
  status: SandboxStatus;
  /** The rootfs overlay is mounted (a container runs on it, or prepare mounted it). */
  mounted: boolean;
  /** The processes' memory: what `exec set` wrote; gone with the processes. */
  memory: Record<string, string>;
}

/**
 * The fake node: sandboxes that outlive a daemon (as runc's containers do), and a folder for
 * their writable layers. Several `FakeRuntime`s (one per daemon lifetime) share one.
 */
export class FakeHost {
  readonly sandboxes = new Map<string, HostSandbox>();
  private nextAddress = 2;
  /**
   * How a lazy restore's pages arrive: at once ('ok'), never ('hang'), or the lazy-pages
   * daemon fails ('fail'). Checked: the images folder must still be there when they are in.
   */
  lazyPages: 'ok' | 'hang' | 'fail' = 'ok';
  /** Pending lazy restores' pages, to settle by hand when `lazyPages` is 'hang'. */
  readonly pendingPages: { id: string; settle: (e?: Error) => void }[] = [];

  constructor(readonly dir: string) {}

  address(): string {
    return `10.77.0.${this.nextAddress++}`;
  }

  /** A reboot: every process ends and every container goes; layers, networks and logs stay. */
  reboot(): void {
    for (const s of this.sandboxes.values()) {
      s.status = 'absent';
      s.mounted = false;
      s.memory = {};
    }
  }
}

function notFound(id: string): DormantError {
  return new DormantError(ErrorCode.RUNTIME_SANDBOX_NOT_FOUND, `sandbox ${id} does not exist on this node`);
}

function invalidState(id: string, op: string, status: SandboxStatus): DormantError {
  return new DormantError(ErrorCode.RUNTIME_INVALID_STATE, `cannot ${op} sandbox ${id}: it is ${status}`);
}

/** The checkpoint image the fake writes: the processes' memory. */
const CORE_IMAGE = 'core-1.img';
/** A pages image, so the images folder looks like CRIU's and has some bulk. */
const PAGES_IMAGE = 'pages-1.img';

/**
 * The Runtime port in memory. Exec understands `set KEY VALUE` (into the processes' memory),
 * `get KEY` (prints it; exit 1 when unset), `write PATH TEXT` and `cat PATH` (a file in the
 * writable layer), and `exit N`.
 */
export class FakeRuntime implements Runtime {
  constructor(
    readonly host: FakeHost,
    public faults: Faults,
  ) {}

  private sb(id: string): HostSandbox {
    const s = this.host.sandboxes.get(id);
    if (!s) throw notFound(id);
    return s;
  }

  private view(id: string): SandboxState {
    const s = this.sb(id);
    return {
      id,
      status: s.status,
      pid: s.status === 'absent' || s.status === 'stopped' ? undefined : 1000,
      network: {
        netns: `dormant-${id}`,
        address: s.address,
        hostAddress: '10.77.0.1',
        prefixLength: 30,
        hostInterface: `veth-${id.slice(-8)}`,
      },
      logPath: join(this.host.dir, 'sandboxes', id, 'log'),
      upperDir: this.upperDir(id),
    };
  }

  private async prepareNow(spec: SandboxSpec, mount: boolean): Promise<SandboxState> {
    let s = this.host.sandboxes.get(spec.id);
    if (!s) {
      s = { spec, address: this.host.address(), status: 'absent', mounted: false, memory: {} };
      this.host.sandboxes.set(spec.id, s);
    }
    s.spec = spec;
    await mkdir(this.upperDir(spec.id), { recursive: true, mode: 0o700 });
    if (mount) s.mounted = true;
    return this.view(spec.id);
  }

  prepare(spec: SandboxSpec, opts: PrepareOptions = {}): Promise<SandboxState> {
    return this.faults.call(
      'runtime.prepare',
      () => this.prepareNow(spec, opts.mountRootfs !== false),
      opts.signal,
    );
  }

  upperDir(id: string): string {
    return join(this.host.dir, 'sandboxes', id, 'upper');
  }

  create(spec: SandboxSpec, opts: CallOptions = {}): Promise<SandboxState> {
    return this.faults.call(
      'runtime.create',
      async () => {
        await this.prepareNow(spec, true);
        const s = this.sb(spec.id);
        if (s.status !== 'absent' && s.status !== 'stopped') return this.view(spec.id);
        s.status = 'created';
        s.memory = {};
        return this.view(spec.id);
      },
      opts.signal,
    );
  }

  start(id: string, opts: CallOptions = {}): Promise<void> {
    return this.faults.call(
      'runtime.start',
      () => {
        const s = this.sb(id);
        if (s.status !== 'created') throw invalidState(id, 'start', s.status);
        s.status = 'running';
      },
      opts.signal,
    );
  }

  state(id: string, opts: CallOptions = {}): Promise<SandboxState> {
    return this.faults.call('runtime.state', () => this.view(id), opts.signal);
  }

  exec(id: string, args: readonly string[], opts: ExecOptions = {}): Promise<ExecResult> {
    return this.faults.call(
      'runtime.exec',
      async () => {
        const s = this.sb(id);
        if (s.status !== 'running') throw invalidState(id, 'exec in', s.status);
        const [cmd, a = '', b = ''] = args;
        const out = (stdout: string, exitCode = 0): ExecResult => ({
          stdout,
          stderr: '',
          exitCode,
          durationMs: 1,
        });
        switch (cmd) {
          case 'set':
            s.memory[a] = b;
            return out('');
          case 'get':
            return a in s.memory ? out(`${s.memory[a]}\n`) : out('', 1);
          case 'write':
            await mkdir(dirname(join(this.upperDir(id), a)), { recursive: true });
            await writeFile(join(this.upperDir(id), a), b);
            return out('');
          case 'cat':
            return readFile(join(this.upperDir(id), a), 'utf8').then(
              (t) => out(t),
              () => out('', 1),
            );
          case 'exit':
            return out('', Number(a));
          default:
            return out('', 127);
        }
      },
      opts.signal,
    );
  }

  pids(id: string): Promise<number[]> {
    // No process here holds GPU state: the GPU gate never asks the GPU node about them.
    return this.faults.call('runtime.pids', () => {
      this.sb(id);
      return [];
    });
  }

  freeze(id: string, opts: CallOptions = {}): Promise<void> {
    return this.faults.call(
      'runtime.freeze',
      () => {
        const s = this.sb(id);
        if (s.status !== 'running' && s.status !== 'paused') throw invalidState(id, 'freeze', s.status);
        s.status = 'paused';
      },
      opts.signal,
    );
  }

  thaw(id: string, opts: CallOptions = {}): Promise<void> {
    return this.faults.call(
      'runtime.thaw',
      () => {
        const s = this.sb(id);
        if (s.status !== 'running' && s.status !== 'paused') throw invalidState(id, 'thaw', s.status);
        s.status = 'running';
      },
      opts.signal,
    );
  }

  checkpoint(id: string, opts: CheckpointOptions): Promise<CheckpointResult> {
    return this.faults.call(
      'runtime.checkpoint',
      async () => {
        const s = this.sb(id);
        if (s.status !== 'running' && s.status !== 'paused') throw invalidState(id, 'checkpoint', s.status);
        await mkdir(opts.imagesDir, { recursive: true, mode: 0o700 });
        await mkdir(opts.workDir, { recursive: true, mode: 0o700 });
        await writeFile(join(opts.imagesDir, CORE_IMAGE), JSON.stringify({ memory: s.memory }));
        await writeFile(join(opts.imagesDir, PAGES_IMAGE), Buffer.alloc(4096, 7));
        if (opts.leaveRunning !== true) this.stopNow(id);
        return { durationMs: 1, logPath: join(opts.workDir, 'dump.log') };
      },
      opts.signal,
    );
  }

  // Never given `pages`: FakeVault opens no checkpoint for random reads, so lazy resumes
  // stage their pages images.
  restore(id: string, opts: RestoreOptions): Promise<RestoreResult> {
    return this.faults.call(
      'runtime.restore',
      async () => {
        const s = this.sb(id);
        if (s.status !== 'absent' && s.status !== 'stopped') throw invalidState(id, 'restore', s.status);
        const core = JSON.parse(await readFile(join(opts.imagesDir, CORE_IMAGE), 'utf8')) as {
          memory: Record<string, string>;
        };
        await mkdir(opts.workDir, { recursive: true, mode: 0o700 });
        s.status = 'running';
        s.mounted = true;
        s.memory = core.memory;
        return {
          durationMs: 1,
          pid: 1000,
          logPath: join(opts.workDir, 'restore.log'),
          pagesLoaded: this.pages(id, opts),
        };
      },
      opts.signal,
    );
  }

  /** A lazy restore's pages, as `host.lazyPages` says they arrive. */
  private pages(id: string, opts: RestoreOptions): Promise<void> {
    if (opts.lazyPages !== true) return Promise.resolve();
    // CRIU's lazy-pages daemon reads the pages images until the last page is in.
    const inPlace = async (): Promise<void> => {
      await readFile(join(opts.imagesDir, PAGES_IMAGE)).catch(() => {
        throw new Error(`lazy-pages: the pages images of ${id} were removed before every page was in`);
      });
    };
    switch (this.host.lazyPages) {
      case 'ok':
        return new Promise<void>((r) => setImmediate(r)).then(inPlace);
      case 'fail':
        return new Promise<void>((r) => setImmediate(r)).then(() => {
          throw new Error(`lazy-pages daemon of ${id} exited with 1`);
        });
      case 'hang':
        return new Promise<void>((resolve, reject) => {
          this.host.pendingPages.push({
            id,
            settle: (e) => (e ? reject(e) : resolve(inPlace())),
          });
        });
    }
  }

  private stopNow(id: string): void {
    const s = this.sb(id);
    s.status = 'absent';
    s.mounted = false;
    s.memory = {};
  }

  stop(id: string, opts: CallOptions = {}): Promise<void> {
    return this.faults.call('runtime.stop', () => this.stopNow(id), opts.signal);
  }

  endProcesses(id: string, opts: CallOptions = {}): Promise<void> {
    return this.faults.call(
      'runtime.endProcesses',
      () => {
        const s = this.sb(id);
        // runc's record of the container stays until stop().
        if (s.status !== 'absent') s.status = 'stopped';
        s.mounted = false;
        s.memory = {};
      },
      opts.signal,
    );
  }

  // The writable layer is a real folder, packed and applied with the real tar of
  // runtime/layer.ts. Not faultable yet: the sweeps' call indices (and the known gaps
  // numbered by them in testing/scenarios.ts) do not count these calls.
  packLayer(id: string, tarPath: string, opts: CallOptions = {}): Promise<void> {
    return packFilesystem(this.upperDir(id), tarPath, opts.signal);
  }

  applyLayer(id: string, tarPath: string, opts: CallOptions = {}): Promise<void> {
    return unpackFilesystem(tarPath, this.upperDir(id), opts.signal);
  }

  emptyLayer(id: string): Promise<void> {
    return emptyFolder(this.upperDir(id));
  }

  copyLayer(fromId: string, toId: string): Promise<void> {
    return copyFolder(this.upperDir(fromId), this.upperDir(toId));
  }

  endLazyPages(_workDir: string): Promise<number[]> {
    return this.faults.call('runtime.endLazyPages', () => []);
  }

  kill(id: string, _signal?: NodeJS.Signals, opts: CallOptions = {}): Promise<void> {
    return this.faults.call(
      'runtime.kill',
      () => {
        const s = this.sb(id);
        if (s.status === 'absent') throw invalidState(id, 'kill', s.status);
        s.status = 'stopped';
        s.memory = {};
      },
      opts.signal,
    );
  }

  destroy(id: string, opts: CallOptions = {}): Promise<void> {
    return this.faults.call(
      'runtime.destroy',
      async () => {
        this.host.sandboxes.delete(id);
        await rm(join(this.host.dir, 'sandboxes', id), { recursive: true, force: true });
      },
      opts.signal,
    );
  }

  list(): Promise<string[]> {
    return this.faults.call('runtime.list', () => [...this.host.sandboxes.keys()]);
  }
}

// ---- vault --------------------------------------------------------------------------

interface StoredCheckpoint {
  tenant: string;
  sandboxId: string;
  files: Map<string, Buffer>;
  meta: Record<string, string>;
  /** Its data no longer authenticates (a test damaged it). */
  damaged: boolean;
}

/** The vault's contents, shared by the `FakeVault` of every daemon lifetime. */
export class VaultData {
  /** By tenant, then checkpoint id, oldest first. */
  readonly tenants = new Map<string, Map<string, StoredCheckpoint>>();

  checkpoints(): (StoredCheckpoint & { checkpointId: string })[] {
    return [...this.tenants.values()].flatMap((m) =>
      [...m].map(([checkpointId, c]) => ({ ...c, checkpointId })),
    );
  }

  /** Makes checkpoint `id` fail to authenticate from now on. */
  damage(id: string): void {
    for (const m of this.tenants.values()) {
      const c = m.get(id);
      if (c) c.damaged = true;
    }
  }
}

async function filesUnder(dir: string): Promise<Map<string, Buffer>> {
  const out = new Map<string, Buffer>();
  for (const e of await readdir(dir, { withFileTypes: true, recursive: true })) {
    if (!e.isFile()) continue;
    const p = join(e.parentPath, e.name);
    out.set(relative(dir, p), await readFile(p));
  }
  return out;
}

/** The vault port in memory: no encryption, no dedup; the same errors for the same mistakes. */
export class FakeVault implements VaultPort {
  constructor(
    readonly data: VaultData,
    public faults: Faults,
  ) {}

  private find(tenant: string, checkpointId: string): StoredCheckpoint {
    const c = this.data.tenants.get(tenant)?.get(checkpointId);
    if (!c)
      throw new DormantError(
        ErrorCode.CHECKPOINT_NOT_FOUND,
        `no checkpoint ${checkpointId} of tenant ${tenant}`,
      );
    return c;
  }

  putCheckpoint(o: Parameters<VaultPort['putCheckpoint']>[0]): ReturnType<VaultPort['putCheckpoint']> {
    return this.faults.call(
      'vault.putCheckpoint',
      async () => {
        const m = this.data.tenants.get(o.tenant) ?? new Map<string, StoredCheckpoint>();
        if (m.has(o.checkpointId))
          throw new DormantError(ErrorCode.CHECKPOINT_EXISTS, `checkpoint ${o.checkpointId} exists`);
        // The real vault reads the folder while it grows, and fails with the writer.
        await o.growing;
        const files = await filesUnder(o.srcDir);
        const bytes = [...files.values()].reduce((n, b) => n + b.length, 0);
        m.set(o.checkpointId, {
          tenant: o.tenant,
          sandboxId: o.sandboxId,
          files,
          meta: { ...o.meta },
          damaged: false,
        });
        this.data.tenants.set(o.tenant, m);
        return { logicalBytes: bytes, storedBytes: bytes };
      },
      o.signal,
    );
  }

  restoreCheckpoint(o: Parameters<VaultPort['restoreCheckpoint']>[0]): Promise<unknown> {
    return this.faults.call(
      'vault.restoreCheckpoint',
      async () => {
        const c = this.find(o.tenant, o.checkpointId);
        if (c.damaged)
          throw new DormantError(
            ErrorCode.VAULT_CORRUPT,
            `checkpoint ${o.checkpointId}: a chunk failed to authenticate`,
          );
        await mkdir(o.destDir, { recursive: true, mode: 0o700 });
        for (const [path, data] of c.files) {
          if (o.skip?.(path)) continue;
          await mkdir(dirname(join(o.destDir, path)), { recursive: true });
          await writeFile(join(o.destDir, path), data);
        }
        return { checkpointId: o.checkpointId };
      },
      o.signal,
    );
  }

  deleteCheckpoint(o: { tenant: string; checkpointId: string }): Promise<unknown> {
    return this.faults.call('vault.deleteCheckpoint', () => ({
      deleted: this.data.tenants.get(o.tenant)?.delete(o.checkpointId) ?? false,
    }));
  }

  destroySandboxKey(o: { tenant: string; sandboxId: string }): Promise<unknown> {
    return this.faults.call('vault.destroySandboxKey', () => {
      const m = this.data.tenants.get(o.tenant);
      let n = 0;
      for (const [id, c] of m ?? []) {
        if (c.sandboxId !== o.sandboxId) continue;
        m!.delete(id);
        n++;
      }
      return { checkpointsDeleted: n };
    });
  }

  listCheckpoints(
    o: { tenant?: string; sandboxId?: string } = {},
  ): Promise<{ tenant: string; checkpointId: string }[]> {
    return this.faults.call('vault.listCheckpoints', () =>
      this.data
        .checkpoints()
        .filter(
          (c) =>
            (o.tenant === undefined || c.tenant === o.tenant) &&
            (o.sandboxId === undefined || c.sandboxId === o.sandboxId),
        )
        .map((c) => ({ tenant: c.tenant, checkpointId: c.checkpointId })),
    );
  }
}

// ---- state store --------------------------------------------------------------------

/** The store's writes: a fault at one is a database write that fails (disk full, I/O error). */
const STORE_WRITES = new Set<string>([
  'insertSandbox',
  'atomically',
  'transition',
  'updateSandbox',
  'deleteSandbox',
  'note',
  'insertCheckpoint',
  'deleteCheckpoint',
]);

/** A fresh in-memory SQLite store. */
export function memoryStore(): SqliteStateStore {
  return new SqliteStateStore(':memory:');
}

/**
 * `db` seen through `faults`: each write is a faultable call named `store.METHOD` (reads are
 * not: they are counted only once the daemon has crashed, when they reject too). A
 * transaction's callback is handed its `tx` seen through the same faults, so a fault inside
 * it rejects the callback and the real store rolls the transaction back.
 */
export function faultyStore(db: StateStore, faults: Faults): StateStore {
  return new Proxy(db, {
    get(target, prop, receiver) {
      const v = Reflect.get(target, prop, receiver) as unknown;
      if (typeof v !== 'function' || typeof prop !== 'string') return v;
      const f = v as (...args: unknown[]) => unknown;
      const call = (args: unknown[]): Promise<unknown> => Promise.resolve(f.apply(target, args));
      if (prop === 'atomically')
        return (fn: (tx: StateStore) => Promise<unknown>) =>
          faults.callStore('store.atomically', () => call([(tx: StateStore) => fn(faultyStore(tx, faults))]));
      if (prop === 'templates') return (...args: unknown[]) => f.apply(target, args);
      return (...args: unknown[]) => {
        if (STORE_WRITES.has(prop) || faults.crashed)
          return faults.callStore(`store.${prop}`, () => call(args));
        return call(args);
      };
    },
  });
}

// ---- GPU ----------------------------------------------------------------------------

/** A node without GPUs: nothing to checkpoint, nothing to refuse. */
export const noGpu: GpuNode = {
  support: () => Promise.resolve({ checkpointApi: false }),
  checkpointFacts: () => Promise.reject(new Error('no NVIDIA driver')),
  holders: () => Promise.resolve([]),
  processes: () => Promise.resolve([]),
  step: () => Promise.reject(new Error('no NVIDIA driver')),
};
