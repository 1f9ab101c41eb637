/**
 * A fleet's node loss: seen from the nodes that stay (the lost node's sandboxes taken back), and
 * from the node cut off (its sandboxes frozen before its lease runs out, ended once it learns it
 * was marked lost).
 */

import { AWAKE_STATES } from '../../domain/node.js';
import { asError } from '../../domain/errors.js';
import type { Sandbox, SandboxState } from '../../domain/sandbox.js';
import type { StateStore } from '../../state/store.js';
import { LifecycleContext } from '../context.js';

export interface Reclaimed {
  id: string;
  from: SandboxState;
  to: SandboxState;
  checkpointId?: string;
}

/**
 * Node `lost` stopped renewing its lease and the lease ran out: it is marked lost, and each of
 * its awake sandboxes goes back to what survives it, in one transaction with the mark (of
 * several nodes finding it, the one whose mark lands does this; the others change nothing):
 * - its newest memory checkpoint: hibernated there (what ran after it is gone, and the
 *   transition says so);
 * - else its newest filesystem checkpoint: archived;
 * - else failed (nothing of it was ever saved).
 * Each becomes this node's to answer for (any node may wake it: placement decides); the lost
 * node's sleeping sandboxes become this node's too, in the same statement as the mark.
 */
export async function reclaimLostNode(ctx: LifecycleContext, lost: string): Promise<Reclaimed[]> {
  const me = ctx.node;
  const store = ctx.store as StateStore;
  if (me === undefined || store.fleet === undefined || lost === me) return [];
  const now = ctx.clock.now();
  return store.atomically(async (tx) => {
    if (!(await tx.fleet!.markNodeLost(lost, me, now))) return [];
    const out: Reclaimed[] = [];
    const awake = await tx.querySandboxes({
      node: lost,
      states: AWAKE_STATES,
      limit: Number.MAX_SAFE_INTEGER,
    });
    for (const s of awake) {
      const r = await disposition(tx, s);
      const why =
        r.to === 'failed'
          ? `node ${lost} was lost (its lease ran out) while the sandbox was ${s.state}, and nothing of it was saved`
          : `node ${lost} was lost (its lease ran out) while the sandbox was ${s.state}: back to checkpoint ${r.checkpointId} of ${new Date(r.at!).toISOString()}; what ran after it is gone`;
      const patch: Partial<Sandbox> = {
        node: me,
        memoryBytes: 0,
        lazyRestoreOf: undefined,
        lastError: why,
        ...(r.checkpointId !== undefined ? { checkpointId: r.checkpointId } : {}),
      };
      if (await tx.transition(s.id, s.state, r.to, why, now, patch))
        out.push({
          id: s.id,
          from: s.state,
          to: r.to,
          ...(r.checkpointId ? { checkpointId: r.checkpointId } : {}),
        });
    }
    return out;
  });
}

async function disposition(
  tx: StateStore,
  s: Sandbox,
): Promise<{ to: SandboxState; checkpointId?: string; at?: number }> {
  // A create or an rm cut short: nothing to go back to (an rm is asked again).
  if (s.state === 'creating' || s.state === 'deleting') return { to: 'failed' };
  const cks = (await tx.listCheckpoints({ sandboxId: s.id })).sort((a, b) => b.createdAt - a.createdAt);
  const memory = cks.find((c) => c.kind === 'memory');
  if (memory) return { to: 'hibernated', checkpointId: memory.id, at: memory.createdAt };
  const files = cks.find((c) => c.kind === 'filesystem');
  if (files) return { to: 'archived', checkpointId: files.id, at: files.createdAt };
  return { to: 'failed' };
}

/**
 * What this node's runtime still holds of sandboxes that are no longer its own: one that woke
 * on another node (its writable layer, mounts, address and network here are leftovers), one
 * removed through another node, and, after this node was marked lost while it still ran (cut
 * off past its lease, or restarted after the others gave up on it), the processes of one
 * already taken back, which may be awake elsewhere by now: those are ended first (fencing:
 * the other copy is the sandbox now). Everything is removed from this node only: in a fleet
 * the address and network namespace are this node's own (runtime/network.ts). Answers the
 * ids released. A sandbox with no node (from before the fleet) is left alone.
 */
export async function releaseForeign(ctx: LifecycleContext): Promise<string[]> {
  const me = ctx.node;
  if (me === undefined) return [];
  const released: string[] = [];
  // One query for what is this node's, so a pass over its runtime reads the database only for
  // the (few) others; each of those is read again under its lock before anything is removed.
  const mine = new Set((await ctx.own()).map((s) => s.id));
  for (const id of await ctx.runtime.list()) {
    // One this node is working on is its own (a resume claims it first): never waited for.
    if (mine.has(id) || ctx.locks.busy(id)) continue;
    await ctx.locks.run(id, async () => {
      const s = await ctx.store.getSandbox(id);
      if (s && (s.node === me || s.node === undefined)) return;
      try {
        // Not thawed first: a frozen copy (fenced, or paused) is ended while frozen (the
        // runtime kills its tasks, then thaws them), so none of its code runs again beside the
        // copy that is the sandbox now.
        await ctx.runtime.destroy(id);
        released.push(id);
      } catch (e) {
        ctx.opts.warn?.(`could not release sandbox ${id}, no longer this node's: ${asError(e).message}`);
      }
    });
  }
  return released;
}

/**
 * How a fence ends: `thaw` when the node renewed its lease in time (its sandboxes are still
 * its own and go on); `end` when the fleet marked it lost (each copy no longer this node's is
 * ended while still frozen and locked: nothing queued behind the fence runs on it, and none of
 * its code runs again; one still its own is thawed); `keep` when the daemon closes (frozen,
 * for the next start to settle).
 */
export type FenceEnd = 'thaw' | 'end' | 'keep';

/** What a fence holds: the sandboxes it froze, and how it ends. */
export interface Fenced {
  /** The sandboxes frozen so far (one busy when the fence came is frozen once it is free). */
  readonly ids: readonly string[];
  lift(how: FenceEnd): Promise<void>;
}

/**
 * Self-fencing: this node could not renew its lease, and soon another node may take its
 * sandboxes back and wake them from their checkpoints. Before that can happen, each sandbox
 * running here is frozen, so that no copy of it goes on beside the one woken elsewhere. Each
 * stays under its lock while fenced: no operation starts on it. One that an operation holds
 * when the fence comes (a hibernate, a resume) is frozen as soon as that operation lets go.
 * Nothing is written to the database, which is out of reach.
 */
export async function fenceNode(ctx: LifecycleContext): Promise<Fenced> {
  let decide!: (how: FenceEnd) => void;
  let decided: FenceEnd | undefined;
  const gate = new Promise<FenceEnd>((r) => (decide = r));
  const frozen: string[] = [];
  const entered: Promise<void>[] = [];
  /** Each sandbox's hold, and whether it has begun (one queued behind an operation has not). */
  const held: { id: string; begun: boolean; done: Promise<void> }[] = [];
  const warn = (what: string, id: string, e: unknown): void =>
    ctx.opts.warn?.(`fencing: could not ${what} sandbox ${id}: ${asError(e).message}`);
  for (const id of await ctx.runtime.list()) {
    const busy = ctx.locks.busy(id);
    let inside!: () => void;
    const entry = new Promise<void>((r) => (inside = r));
    // A busy one is not waited for: the fence must not wait on an operation.
    if (!busy) entered.push(entry);
    const hold = { id, begun: false, done: Promise.resolve() };
    held.push(hold);
    hold.done = ctx.locks.run(id, async () => {
      hold.begun = true;
      let froze = false;
      try {
        // Not once the fence is decided (a busy one that comes free after it).
        if (decided === undefined) {
          const st = await ctx.runtime.state(id).catch(() => undefined);
          if (st?.status === 'running') {
            await ctx.runtime.freeze(id);
            froze = true;
            frozen.push(id);
          }
        }
      } catch (e) {
        warn('freeze', id, e);
      } finally {
        inside();
      }
      const how = await gate;
      if (how === 'keep') return;
      // Taken back (or removed) meanwhile: ended while still frozen (the runtime kills a
      // frozen sandbox's tasks before it thaws them).
      if (how === 'end' && (await notMine(ctx, id))) {
        await ctx.runtime.destroy(id).catch((e: unknown) => warn('end', id, e));
        return;
      }
      if (froze) await ctx.runtime.thaw(id).catch((e: unknown) => warn('thaw', id, e));
    });
  }
  // Never left unhandled (those queued behind an operation are not awaited by lift).
  for (const h of held) h.done = h.done.catch((e: unknown) => warn('hold', h.id, e));
  await Promise.all(entered);
  return {
    ids: frozen,
    async lift(how: FenceEnd) {
      decided = how;
      decide(how);
      // Not those still queued behind an operation: a renewal never waits on one. Each runs
      // once its operation lets go, freezes nothing (the fence is decided), and ends its
      // sandbox if that is no longer this node's.
      await Promise.allSettled(held.filter((h) => h.begun).map((h) => h.done));
    },
  };
}

/**
 * Whether sandbox `id`, found in this node's runtime, is no longer this node's: removed, or on
 * another node (as releaseForeign judges). A database that does not answer says no.
 */
async function notMine(ctx: LifecycleContext, id: string): Promise<boolean> {
  try {
    const s = await ctx.store.getSandbox(id);
    return s === undefined || (s.node !== undefined && s.node !== ctx.node);
  } catch {
    return false;
  }
}
