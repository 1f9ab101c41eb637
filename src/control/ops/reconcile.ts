/** Reconcile: after a daemon restart, every sandbox's record matches what is really there. */

import { ErrorCode, asError, isDormantError } from '../../domain/errors.js';
import type { Sandbox, SandboxState } from '../../domain/sandbox.js';
import { FS_META } from '../../runtime/layer.js';
import { LifecycleContext } from '../context.js';
import { backToCheckpoint } from './lazy.js';

/**
 * After a daemon restart: every sandbox ends up in a resting state that matches what is
 * really there, and nothing is lost.
 */
export async function reconcileAll(
  ctx: LifecycleContext,
): Promise<{ id: string; from: SandboxState; to: SandboxState }[]> {
  const changes: { id: string; from: SandboxState; to: SandboxState }[] = [];
  // In a fleet, the sandboxes placed on this node: the others' runtimes are not this one.
  for (const s of await ctx.own()) {
    await ctx.locks.run(s.id, async () => {
      if (s.lazyRestoreOf !== undefined && s.state !== 'deleting') {
        const to = await reconcileLazy(ctx, s);
        if (to !== s.state) changes.push({ id: s.id, from: s.state, to });
        return;
      }
      const to = await reconcileOne(ctx, s).catch(() => 'failed' as const);
      if (to === 'deleting') {
        // An rm that a crash interrupted: finished now.
        await ctx.store.deleteSandbox(s.id, 'rm finished after restart', ctx.clock.now());
        changes.push({ id: s.id, from: s.state, to });
      } else if (to !== s.state) {
        await ctx.store.transition(s.id, s.state, to, 'reconcile after restart', ctx.clock.now());
        changes.push({ id: s.id, from: s.state, to });
      }
    });
  }
  await dropUnrecordedCheckpoints(ctx);
  return changes;
}

/**
 * A crash between storing a checkpoint in the vault and recording it in the database leaves
 * a checkpoint nobody knows of; the database is the record, so the vault's copy goes (gc
 * then reclaims its chunks). Runs at start, when no hibernate is in flight.
 */
async function dropUnrecordedCheckpoints(ctx: LifecycleContext): Promise<void> {
  const live = new Set((await ctx.store.listCheckpoints()).map((c) => c.id));
  const stored = await ctx.vault.listCheckpoints().catch((e: unknown) => {
    ctx.warnCleanup('*', 'list the vault for orphaned checkpoints', e);
    return [];
  });
  for (const c of stored) {
    if (live.has(c.checkpointId)) continue;
    await ctx.vault
      .deleteCheckpoint({ tenant: c.tenant, checkpointId: c.checkpointId })
      .catch((e: unknown) => ctx.warnCleanup(c.checkpointId, 'delete an orphaned checkpoint', e));
  }
}

/**
 * A sandbox whose lazy restore was in flight when the daemon died: the daemon that fed it
 * its pages is gone (or orphaned), so pages may never arrive and its processes may wait on
 * them forever. They are ended and the sandbox is hibernated again on the checkpoint it was
 * restored from (kept in the vault all along), the reason recorded in its transition.
 */
async function reconcileLazy(ctx: LifecycleContext, s: Sandbox): Promise<SandboxState> {
  const ckId = s.lazyRestoreOf!;
  const ck = await ctx.store.getCheckpoint(ckId);
  const why = `reconcile after restart: the daemon died during a lazy restore from checkpoint ${ckId}, before every page was in; its processes were ended, back to its checkpoint`;
  let to: SandboxState;
  let lastError = why;
  try {
    await backToCheckpoint(ctx, s.id, ckId);
    // The checkpoint the restore came from (or, were it gone, the newest one).
    to = ck?.kind === 'memory' ? 'hibernated' : await fallback(ctx, s);
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
    await ctx.store.updateSandbox(s.id, patch);
    await ctx.store.note(s.id, why, ctx.clock.now());
  } else await ctx.store.transition(s.id, s.state, to, why, ctx.clock.now(), patch);
  return to;
}

async function reconcileOne(ctx: LifecycleContext, s: Sandbox): Promise<SandboxState> {
  const st = await ctx.runtime.state(s.id).catch((e: unknown) => {
    if (isDormantError(e, ErrorCode.RUNTIME_SANDBOX_NOT_FOUND)) return undefined;
    throw e;
  });
  const status = st?.status ?? 'absent';
  const committed = (await ctx.store.listCheckpoints({ sandboxId: s.id })).find(
    (c) => c.kind === 'memory' && c.createdAt >= s.stateSince,
  );
  switch (s.state) {
    case 'deleting':
      await ctx.runtime.destroy(s.id);
      await ctx.vault.destroySandboxKey({ tenant: s.tenant, sandboxId: s.id });
      return 'deleting';
    case 'creating':
      await ctx.runtime.destroy(s.id);
      if (s.spec.importedFrom !== undefined) {
        // An import cut short: nothing of it was promised, so nothing of it stays.
        await ctx.vault.destroySandboxKey({ tenant: s.tenant, sandboxId: s.id });
        return 'deleting';
      }
      return 'failed';
    case 'hibernating':
      if (committed) {
        await ctx.store.updateSandbox(s.id, { checkpointId: committed.id });
        await ctx.runtime.stop(s.id);
        if (committed.meta[FS_META] === 'tar') await ctx.runtime.emptyLayer(s.id);
        return 'hibernated';
      }
      if (status === 'paused') await ctx.runtime.thaw(s.id);
      return status === 'running' || status === 'paused' ? 'running' : fallback(ctx, s);
    case 'resuming':
      if (status === 'running') return 'running';
      if (status !== 'absent') await ctx.runtime.stop(s.id);
      // Back to what it resumed from: a memory checkpoint, or (an archived sandbox whose fresh
      // start was cut short) its filesystem: a files-only checkpoint is never 'hibernated'.
      return processesGone(ctx, s);
    case 'running':
      // Frozen while recorded running: a hibernate or fork froze it and the daemon died.
      if (status === 'paused') await ctx.runtime.thaw(s.id);
      if (status === 'running' || status === 'paused') return 'running';
      if (status !== 'absent') await ctx.runtime.stop(s.id);
      return processesGone(ctx, s);
    case 'paused':
      if (status === 'running' || status === 'paused') return status;
      if (status !== 'absent') await ctx.runtime.stop(s.id);
      return processesGone(ctx, s);
    case 'archived':
      // An archive cut short after its record: the processes it meant to end, the
      // writable layer it meant to empty (its diff is in the vault).
      await ctx.runtime.stop(s.id);
      if (
        s.checkpointId !== undefined &&
        (await ctx.store.getCheckpoint(s.checkpointId))?.meta[FS_META] === 'tar'
      )
        await ctx.runtime.emptyLayer(s.id);
      return 'archived';
    default:
      return s.state;
  }
}

/**
 * Its processes are gone (a reboot, a resume cut short): back to its checkpoint. Where that
 * holds the filesystem (a tar diff in the vault), the writable layer is emptied as hibernate
 * and archive empty it: the files live in the vault, never in plaintext on the host, and the
 * next resume unpacks the checkpoint's files, not those mixed with what came after it.
 */
export async function processesGone(ctx: LifecycleContext, s: Sandbox): Promise<SandboxState> {
  const ck = s.checkpointId !== undefined ? await ctx.store.getCheckpoint(s.checkpointId) : undefined;
  if (ck?.meta[FS_META] === 'tar') await ctx.runtime.emptyLayer(s.id);
  return fallback(ctx, s);
}

/** Processes are gone (a reboot): the newest checkpoint if there is one, else the filesystem. */
async function fallback(ctx: LifecycleContext, s: Sandbox): Promise<SandboxState> {
  return s.checkpointId && (await ctx.store.getCheckpoint(s.checkpointId))?.kind === 'memory'
    ? 'hibernated'
    : 'archived';
}
