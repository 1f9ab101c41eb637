/**
 * A daemon's controller over the fakes of fakes.ts, and what a user would check after each
 * operation: every sandbox at rest in a state that matches what the node runs, each recorded
 * checkpoint in the vault (and nothing in the vault that no record names), staging empty, the
 * processes' memory and files still there.
 */
import assert from 'node:assert/strict';
import { mkdir, mkdtemp, readdir, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { RESTING_STATES, type Sandbox, type SandboxState } from '../../domain/sandbox.js';
import { SandboxController, type ControllerOptions } from '../sandboxes.js';
import type { SqliteStateStore } from '../../state/sqlite.js';
import {
  FakeHost,
  FakeRuntime,
  FakeVault,
  Faults,
  VaultData,
  faultyStore,
  memoryStore,
  noGpu,
} from './fakes.js';

export class World {
  readonly host: FakeHost;
  readonly vaultData = new VaultData();
  readonly db: SqliteStateStore;
  faults = new Faults();
  runtime: FakeRuntime;
  vault: FakeVault;
  controller: SandboxController;
  /** The sandboxes' rootfs (never written: the overlay's lower layer). */
  readonly rootfs: string;
  readonly stagingDir: string;
  /** Warnings the controller gave the operator. */
  readonly warnings: string[] = [];

  private constructor(
    readonly dir: string,
    private readonly extra: Partial<ControllerOptions>,
  ) {
    this.host = new FakeHost(dir);
    this.db = memoryStore();
    this.rootfs = join(dir, 'rootfs');
    this.stagingDir = join(dir, 'staging');
    this.runtime = new FakeRuntime(this.host, this.faults);
    this.vault = new FakeVault(this.vaultData, this.faults);
    this.controller = this.newController();
  }

  static async make(extra: Partial<ControllerOptions> = {}): Promise<World> {
    const dir = await mkdtemp(join(tmpdir(), 'dormant-fakes-'));
    const w = new World(dir, extra);
    await mkdir(w.rootfs);
    await mkdir(w.stagingDir, { mode: 0o700 });
    return w;
  }

  private newController(): SandboxController {
    return new SandboxController({
      store: faultyStore(this.db, this.faults),
      runtime: this.runtime,
      vault: this.vault,
      stagingDir: this.stagingDir,
      gpu: noGpu,
      lazyRestore: false,
      warn: (m) => this.warnings.push(m),
      ...this.extra,
    });
  }

  /**
   * The daemon dies and starts again: a new controller over new fakes (the old one's calls
   * stay parked wherever they were), staging wiped as the daemon's start does, then reconcile.
   */
  async restart(opts: { reboot?: boolean } = {}): Promise<{ id: string; from: string; to: string }[]> {
    // What the dead daemon still had in flight between two port calls reaches its next one.
    await quiet();
    this.faults = new Faults();
    this.runtime = new FakeRuntime(this.host, this.faults);
    this.vault = new FakeVault(this.vaultData, this.faults);
    if (opts.reboot) this.host.reboot();
    await rm(this.stagingDir, { recursive: true, force: true });
    await mkdir(this.stagingDir, { mode: 0o700 });
    this.controller = this.newController();
    return this.controller.reconcile();
  }

  /** A new Faults for the same daemon: counting starts again from 0. */
  resetFaults(): Faults {
    this.faults = new Faults();
    this.runtime.faults = this.faults;
    this.vault.faults = this.faults;
    this.controller = this.newController();
    return this.faults;
  }

  async createSandbox(name = 'box'): Promise<Sandbox> {
    return this.controller.create({ tenant: 't1', admin: true, name, rootfs: this.rootfs, command: ['sh'] });
  }

  /** Runs `args` in the sandbox; its stdout. */
  async exec(id: string, ...args: string[]): Promise<string> {
    // Straight to the runtime: the fake runtime runs no toolbox agent.
    const r = await this.runtime.exec((await this.controller.get(id)).id, args);
    assert.equal(r.exitCode, 0, `exec ${args.join(' ')} in ${id} exited ${r.exitCode}`);
    return r.stdout.trim();
  }

  /** Puts a value in the sandbox's memory and a file in its writable layer. */
  async remember(id: string, value = 'v1'): Promise<void> {
    await this.exec(id, 'set', 'k', value);
    await this.exec(id, 'write', 'notes/a.txt', `file ${value}`);
  }

  /** The sandbox runs and has what `remember` gave it. */
  async assertRemembers(id: string, value = 'v1', what = ''): Promise<void> {
    assert.equal((await this.controller.get(id)).state, 'running', `${what}: running`);
    assert.equal(await this.exec(id, 'get', 'k'), value, `${what}: memory kept`);
    assert.equal(await this.exec(id, 'cat', 'notes/a.txt'), `file ${value}`, `${what}: files kept`);
  }

  async stagingLeft(): Promise<string[]> {
    return readdir(this.stagingDir);
  }

  /**
   * Everything at rest and consistent. `orphansOk`: vault copies no record names are allowed
   * (the start-up sweep deletes them).
   */
  async assertConsistent(
    what: string,
    opts: { orphansOk?: boolean; transient?: SandboxState } = {},
  ): Promise<void> {
    // An operation's work after its answer (a hibernate removing the container) ends first.
    await this.controller.settle(5_000);
    const sandboxes = await this.db.listSandboxes();
    for (const s of sandboxes) {
      assert.ok(
        RESTING_STATES.includes(s.state) || s.state === opts.transient,
        `${what}: ${s.name} rests (it is ${s.state})`,
      );
      // A remove cut short: what is left of it is for the retried remove to take.
      if (s.state === 'deleting') continue;
      const h = this.host.sandboxes.get(s.id);
      const status = h?.status ?? 'none';
      if (s.state === 'running' || s.state === 'paused')
        assert.equal(status, s.state, `${what}: ${s.name} is ${s.state} and so are its processes`);
      else
        assert.ok(
          status === 'absent' || status === 'none' || status === 'stopped',
          `${what}: ${s.name} is ${s.state}, but its container is ${status}`,
        );
      if (s.state === 'hibernated' || s.state === 'archived') {
        assert.equal(h?.mounted ?? false, false, `${what}: ${s.name} is ${s.state}: rootfs unmounted`);
        // An archived sandbox without a checkpoint (its processes lost to a reboot before it
        // had one) keeps its files in its writable layer.
        if (s.state === 'archived' && s.checkpointId === undefined) continue;
        const ck = s.checkpointId !== undefined ? await this.db.getCheckpoint(s.checkpointId) : undefined;
        assert.ok(ck, `${what}: ${s.name} is ${s.state} with a recorded checkpoint`);
        if (s.state === 'hibernated') assert.equal(ck.kind, 'memory', `${what}: a memory checkpoint`);
        if (ck.meta.fs === 'tar') {
          const upper = await readdir(this.runtime.upperDir(s.id)).catch(() => []);
          assert.deepEqual(upper, [], `${what}: ${s.name}'s files live only in the vault while ${s.state}`);
        }
      }
      assert.equal(s.lazyRestoreOf, undefined, `${what}: ${s.name} has no lazy restore marker`);
    }
    const ids = new Set(sandboxes.map((s) => s.id));
    for (const id of this.host.sandboxes.keys())
      assert.ok(ids.has(id), `${what}: the node holds nothing of sandbox ${id}, which is not recorded`);
    const inVault = new Set(this.vaultData.checkpoints().map((c) => c.checkpointId));
    const removing = new Set(sandboxes.filter((s) => s.state === 'deleting').map((s) => s.id));
    const recorded = (await this.db.listCheckpoints()).filter((c) => !removing.has(c.sandboxId));
    for (const c of recorded)
      assert.ok(
        inVault.has(c.id),
        `${what}: recorded checkpoint ${c.id} (of ${c.sandboxId}) is in the vault`,
      );
    if (!opts.orphansOk) {
      const live = new Set((await this.db.listCheckpoints()).map((c) => c.id));
      const orphans = [...inVault].filter((id) => !live.has(id));
      assert.deepEqual(orphans, [], `${what}: no vault checkpoint that no record names`);
    }
    assert.deepEqual(await this.stagingLeft(), [], `${what}: staging is empty`);
  }

  async close(): Promise<void> {
    await this.controller.settle(5_000);
    await this.db.close();
    await rm(this.dir, { recursive: true, force: true });
  }
}

/** Lets what is in flight (timers, file I/O, child processes) reach its next await. */
export async function quiet(ms = 30): Promise<void> {
  await new Promise((r) => setTimeout(r, ms));
}

/** The error `p` rejects with (fails when it resolves). */
export async function rejection(p: Promise<unknown>): Promise<Error & { code?: string }> {
  try {
    await p;
  } catch (e) {
    return e as Error & { code?: string };
  }
  assert.fail('expected the operation to fail');
}
