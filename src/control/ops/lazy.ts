/** Lazy restores: the pages that come in after the sandbox runs, and the undo when they do not. */

import { join } from 'node:path';
import { asError, isDormantError } from '../../domain/errors.js';
import type { Sandbox } from '../../domain/sandbox.js';
import { FS_META } from '../../runtime/layer.js';
import { LifecycleContext } from '../context.js';

/**
 * Waits for a lazy restore's pages, then clears the sandbox's in-flight marker. If they fail
 * to arrive (the lazy-pages daemon died or failed) the sandbox is unusable but its checkpoint
 * is not: its processes are ended and it is hibernated again on that checkpoint.
 * True when every page arrived.
 */
export async function afterLazyRestore(
  ctx: LifecycleContext,
  s: Sandbox,
  pagesLoaded: Promise<void>,
): Promise<boolean> {
  const p = afterLazyRestoreNow(ctx, s, pagesLoaded);
  ctx.lazyInFlight.add(p);
  try {
    return await p;
  } finally {
    ctx.lazyInFlight.delete(p);
  }
}

async function afterLazyRestoreNow(
  ctx: LifecycleContext,
  s: Sandbox,
  pagesLoaded: Promise<void>,
): Promise<boolean> {
  const images = ctx.staging(`${s.id}-restore`);
  const failure = await pagesLoaded.then(
    () => undefined,
    (e: unknown) => asError(e),
  );
  if (failure === undefined) {
    // The runtime stopped the page server (its keepers first) before it reported the pages
    // in, so before the marker goes: a daemon that dies in between leaves a healthy sandbox recorded
    // mid-restore (reconcile puts it back on its checkpoint), never a sandbox recorded
    // running whose processes its keeper ended.
    await ctx.store.updateSandbox(s.id, { lazyRestoreOf: undefined });
    await ctx.wipe(images);
    return true;
  }
  // Best effort, as it must not leave the sandbox recorded running: a restore later
  // refuses to run over processes that are still there.
  const undo = await backToCheckpoint(ctx, s.id, s.lazyRestoreOf ?? s.checkpointId).then(
    () => '',
    (u: unknown) => ` (ending it: ${asError(u).message.split('\n')[0] ?? ''})`,
  );
  // A page that did not authenticate (served from the vault): the checkpoint is damaged, and
  // the operator learns which older one may still restore, as a resume that fails at once says.
  const ckId = s.lazyRestoreOf ?? s.checkpointId;
  const cause =
    isDormantError(failure) && failure.code.startsWith('VAULT_')
      ? ((d) => `${d.message} (${d.hint ?? ''})`)(
          await ctx.damaged(s.id, ckId, failure, 'its processes were ended'),
        )
      : failure.message;
  const why = `lazy restore failed, back to its checkpoint: ${cause}${undo}`;
  // The runtime stops the page server once the tasks are ended (stop, endLazyPages); again
  // here in case the undo failed before it got there.
  await ctx.runtime
    .endLazyPages?.(join(images, 'work'))
    .catch((e: unknown) => ctx.warnCleanup(s.id, 'page server', e));
  // Seen hibernated only once no image of it is left in staging.
  await ctx.wipe(images).catch((e: unknown) => ctx.warnCleanup(s.id, 'staging', e));
  await ctx.store.transition(s.id, 'running', 'hibernated', why, ctx.clock.now(), {
    lastError: why,
    memoryBytes: 0,
    lazyRestoreOf: undefined,
  });
  return false;
}

/**
 * Undoes a lazy restore from checkpoint `ckId`: ends the sandbox's processes (they may be
 * waiting on pages that will never come), any lazy-pages daemon still serving them, and,
 * when the checkpoint carries the filesystem diff, empties the writable layer (the diff
 * lives on in the vault; without one the layer is the only copy and stays).
 */
export async function backToCheckpoint(
  ctx: LifecycleContext,
  id: string,
  ckId: string | undefined,
): Promise<void> {
  await ctx.runtime.stop(id);
  await ctx.runtime.endLazyPages?.(join(ctx.staging(`${id}-restore`), 'work'));
  const ck = ckId !== undefined ? await ctx.store.getCheckpoint(ckId) : undefined;
  if (ck?.meta[FS_META] === 'tar') await ctx.runtime.emptyLayer(id);
}
