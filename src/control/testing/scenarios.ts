/**
 * Every lifecycle operation as a scenario for the fault sweeps of the *.unit.test.ts files:
 * how to bring a sandbox to where the operation starts, the operation, the state it leaves
 * the sandbox in when it succeeds and when it fails, and how to check that nothing the user
 * had was lost.
 */
import assert from 'node:assert/strict';
import type { SandboxState } from '../../domain/sandbox.js';
import type { ControllerOptions } from '../sandboxes.js';
import { World } from './world.js';

export interface Scenario {
  name: string;
  /** Brings a sandbox (or none: undefined) to where the operation starts. */
  setup(w: World): Promise<string | undefined>;
  /** The operation; the id of the sandbox it leaves to check. */
  op(w: World, id: string | undefined): Promise<string>;
  /** State before the operation (for a failure: the state it must be in again), and after. */
  from: SandboxState | 'none';
  to: SandboxState;
  /**
   * Error codes a failed operation may give, besides none (the injected fault itself, thrown
   * by a step before the operation changed anything, or by one it does not wrap).
   */
  codes: readonly string[];
  /** A failure may leave it here too, for the user to retry (rm: 'deleting'). */
  retryFrom?: SandboxState;
  /** The processes' memory does not survive it (a resume from an archive starts afresh). */
  freshStart?: boolean;
  /** Controller options of its world (lazy restore). */
  options?: Partial<ControllerOptions>;
  /** Finds the sandbox to check after a failure (create: by name). */
  find?(w: World): Promise<string | undefined>;
  /** Brings a sandbox at rest back to running with what it had, for the user's check. */
  recover?(w: World, id: string): Promise<boolean>;
}

async function running(w: World): Promise<string> {
  const s = await w.createSandbox();
  await w.remember(s.id);
  return s.id;
}

async function hibernated(w: World): Promise<string> {
  const id = await running(w);
  await w.controller.hibernate(id);
  return id;
}

async function archived(w: World): Promise<string> {
  const id = await running(w);
  await w.controller.archive(id);
  return id;
}

/** Gets the sandbox running again from wherever it rests; false when it cannot have its memory. */
export async function backToRunning(w: World, id: string): Promise<'memory' | 'files' | 'none'> {
  const s = await w.controller.get(id);
  switch (s.state) {
    case 'running':
      return 'memory';
    case 'paused':
    case 'hibernated':
      await w.controller.resume(id);
      await w.controller.settle(5_000);
      return 'memory';
    case 'archived':
      await w.controller.resume(id);
      return 'files';
    default:
      return 'none';
  }
}

export const SCENARIOS: Scenario[] = [
  {
    name: 'create',
    from: 'none',
    to: 'running',
    codes: [],
    setup: async () => undefined,
    op: async (w) => (await w.createSandbox()).id,
    find: async (w) => (await w.db.listSandboxes()).find((s) => s.name === 'box')?.id,
  },
  {
    name: 'pause',
    from: 'running',
    to: 'paused',
    codes: [],
    setup: running,
    op: async (w, id) => (await w.controller.pause(id!)).id,
  },
  {
    name: 'hibernate (running)',
    from: 'running',
    to: 'hibernated',
    codes: ['HIBERNATE_FAILED'],
    setup: running,
    op: async (w, id) => (await w.controller.hibernate(id!)).id,
  },
  {
    name: 'hibernate (paused)',
    from: 'paused',
    to: 'hibernated',
    codes: ['HIBERNATE_FAILED'],
    setup: async (w) => {
      const id = await running(w);
      await w.controller.pause(id);
      return id;
    },
    op: async (w, id) => (await w.controller.hibernate(id!)).id,
  },
  {
    name: 'resume (paused)',
    from: 'paused',
    to: 'running',
    codes: [],
    setup: async (w) => {
      const id = await running(w);
      await w.controller.pause(id);
      return id;
    },
    op: async (w, id) => (await w.controller.resume(id!)).id,
  },
  {
    name: 'resume (hibernated, eager)',
    from: 'hibernated',
    to: 'running',
    codes: ['RESUME_FAILED'],
    setup: hibernated,
    op: async (w, id) => (await w.controller.resume(id!)).id,
  },
  {
    name: 'resume (hibernated, lazy)',
    options: { lazyRestore: true },
    from: 'hibernated',
    to: 'running',
    codes: ['RESUME_FAILED'],
    setup: hibernated,
    op: async (w, id) => (await w.controller.resume(id!)).id,
  },
  {
    name: 'resume (archived)',
    freshStart: true,
    from: 'archived',
    to: 'running',
    codes: ['RESUME_FAILED'],
    setup: archived,
    op: async (w, id) => (await w.controller.resume(id!)).id,
  },
  {
    name: 'archive (running)',
    from: 'running',
    to: 'archived',
    codes: [],
    setup: running,
    op: async (w, id) => (await w.controller.archive(id!)).id,
  },
  {
    name: 'archive (hibernated)',
    from: 'hibernated',
    to: 'archived',
    codes: [],
    setup: hibernated,
    op: async (w, id) => (await w.controller.archive(id!)).id,
  },
  {
    name: 'fork (running)',
    from: 'none',
    to: 'running',
    codes: [],
    setup: running,
    op: async (w, id) => (await w.controller.fork(id!, undefined, { name: 'copy' })).id,
    find: async (w) => (await w.db.listSandboxes()).find((s) => s.name === 'copy')?.id,
  },
  {
    name: 'fork (hibernated)',
    from: 'none',
    to: 'running',
    codes: [],
    setup: hibernated,
    op: async (w, id) => (await w.controller.fork(id!, undefined, { name: 'copy' })).id,
    find: async (w) => (await w.db.listSandboxes()).find((s) => s.name === 'copy')?.id,
  },
  {
    name: 'rm (running)',
    from: 'running',
    to: 'deleting',
    retryFrom: 'deleting',
    codes: [],
    setup: running,
    op: async (w, id) => {
      await w.controller.remove(id!);
      return id!;
    },
  },
  {
    name: 'rm (hibernated)',
    from: 'hibernated',
    to: 'deleting',
    retryFrom: 'deleting',
    codes: [],
    setup: hibernated,
    op: async (w, id) => {
      await w.controller.remove(id!);
      return id!;
    },
  },
];

/** The sandbox is gone, and so is everything of it. */
export async function assertGone(w: World, id: string, what: string): Promise<void> {
  assert.equal(await w.db.getSandbox(id), undefined, `${what}: no record`);
  assert.equal(w.host.sandboxes.has(id), false, `${what}: nothing on the node`);
  assert.deepEqual(
    w.vaultData.checkpoints().filter((c) => c.sandboxId === id),
    [],
    `${what}: nothing in the vault`,
  );
}

/** A run of a scenario's operation, settled: the sandbox it is about, and its error if it failed. */
export interface Outcome {
  id: string | undefined;
  error: (Error & { code?: string }) | undefined;
}

/** Runs the operation and waits for what it does after its answer. */
export async function runOp(w: World, sc: Scenario, id: string | undefined): Promise<Outcome> {
  try {
    const got = await sc.op(w, id);
    await w.controller.settle(5_000);
    return { id: got, error: undefined };
  } catch (e) {
    await w.controller.settle(5_000);
    return { id: sc.find ? await sc.find(w) : id, error: e as Error & { code?: string } };
  }
}

/**
 * What the user finds: a sandbox that still exists runs again with its memory and files
 * (or its files only, from an archive); a removed one left nothing; a source of a fork still
 * has what it had.
 */
export async function assertUserData(
  w: World,
  sc: Scenario,
  source: string | undefined,
  id: string | undefined,
  what: string,
): Promise<void> {
  if (source !== undefined && source !== id && (await w.db.getSandbox(source))) {
    assert.equal(await backToRunning(w, source), 'memory', `${what}: the source keeps its memory`);
    await w.assertRemembers(source, 'v1', `${what} (source)`);
  }
  if (id === undefined) return;
  const s = await w.db.getSandbox(id);
  if (!s) {
    await assertGone(w, id, what);
    return;
  }
  // A sandbox made by the operation (create) has no memory yet: it is given some now.
  if (sc.name === 'create') {
    if (s.state === 'running') await w.remember(id);
    return;
  }
  const back = await backToRunning(w, id);
  const got = sc.freshStart && back === 'memory' ? 'files' : back;
  if (got === 'memory') await w.assertRemembers(id, 'v1', what);
  else if (got === 'files')
    assert.equal(await w.exec(id, 'cat', 'notes/a.txt'), 'file v1', `${what}: files kept`);
  else assert.equal(s.state, 'failed', `${what}: only a failed sandbox may lose its memory`);
}
