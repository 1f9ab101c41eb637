/** A fleet's node loss, seen from the nodes that stay: sandboxes taken back, and the lost node fenced. */

import { AWAKE_STATES } from '../../domain/node.js';
import { asError, isDormantError, ErrorCode } from '../../domain/errors.js';
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
        const st = await ctx.runtime.state(id).catch((e: unknown) => {
          if (isDormantError(e, ErrorCode.RUNTIME_SANDBOX_NOT_FOUND)) return undefined;
          throw e;
        });
        if (st?.status === 'paused') await ctx.runtime.thaw(id);
        await ctx.runtime.destroy(id);
        released.push(id);
      } catch (e) {
        ctx.opts.warn?.(`could not release sandbox ${id}, no longer this node's: ${asError(e).message}`);
      }
    });
  }
  return released;
}
