/** Hibernate: a running or paused sandbox becomes a checkpoint in the vault, its processes ended. */

import { randomBytes } from 'node:crypto';
import { mkdir } from 'node:fs/promises';
import { release } from 'node:os';
import { join } from 'node:path';
import { DormantError, ErrorCode, asError, isDormantError } from '../../domain/errors.js';
import { assertLegal, isNoop, newId, type Sandbox } from '../../domain/sandbox.js';
import type { CheckpointRecord } from '../../state/store.js';
import { FS_DIFF, FS_META } from '../../runtime/layer.js';
import { StepTimer } from '../../domain/timings.js';
import { LifecycleContext } from '../context.js';
import { gpuGate, cudaUndo, type GpuMeta } from './gpu.js';
import { processesGone } from './reconcile.js';

export async function hibernate(
  ctx: LifecycleContext,
  id: string,
  tenant: string | undefined,
  reason: string,
  answer: (s: Sandbox) => void,
): Promise<void> {
  const s = await ctx.get(id, tenant);
  assertLegal('hibernate', s.state, id);
  if (isNoop('hibernate', s.state)) {
    answer(s);
    return;
  }
  const before = s.state;
  // Refusals happen here, before anything changes: the sandbox stays as it is.
  const holders = await gpuGate(ctx, s, 'hibernate');
  const gpuFacts = holders.length > 0 ? await ctx.gpu.checkpointFacts() : undefined;
  const ckId = newId('ck', randomBytes);
  const dir = ctx.staging(ckId);
  await ctx.store.transition(id, before, 'hibernating', reason, ctx.clock.now());
  const t = ctx.timer();
  let committed = false;
  let reported = false;
  const cudaDone: { pid: number; step: 'lock' | 'checkpoint' }[] = [];
  try {
    try {
      await mkdir(dir, { recursive: true, mode: 0o700 });
      let gpuMeta: GpuMeta | undefined;
      if (gpuFacts !== undefined) {
        // The driver's lock and checkpoint need the processes running: thaw a paused sandbox.
        if (before === 'paused') await ctx.runtime.thaw(id);
        for (const h of holders) {
          await ctx.gpu.step('lock', h.pid);
          cudaDone.push({ pid: h.pid, step: 'lock' });
          await ctx.gpu.step('checkpoint', h.pid);
          cudaDone[cudaDone.length - 1]!.step = 'checkpoint';
        }
        gpuMeta = { ...gpuFacts, nsPids: holders.map((h) => h.nsPid) };
        ctx.step('hibernate:gpu-checkpointed');
      }
      await t.time('freeze', () => ctx.runtime.freeze(id, { timer: t }));
      ctx.step('hibernate:frozen');
      // The images are wiped with the rest of the staging folder once the checkpoint is
      // committed, beside the end of the processes: not on the way to the commit.
      const rec = await dumpToVault(ctx, s, ckId, dir, 'hibernate', t, false, gpuMeta);
      await t.time('commit', async () => {
        await ctx.store.insertCheckpoint(rec);
        await ctx.store.updateSandbox(id, { checkpointId: ckId });
      });
      committed = true;
      ctx.step('hibernate:committed');
    } catch (e) {
      await ctx.wipe(dir);
      if (committed) throw e;
      // A runtime may end the sandbox whose save failed (gVisor does): nothing to thaw.
      if (await processesEnded(ctx, id)) return await afterEndedHibernate(ctx, s, e);
      // Not committed: the sandbox goes back to what it was, running or paused, its CUDA
      // state back on the GPU.
      let undo = '';
      if (before === 'running' || cudaDone.length > 0)
        await ctx.runtime.thaw(id).catch((x: unknown) => ctx.warnCleanup(id, 'thaw', x));
      if (cudaDone.length > 0) {
        undo = await cudaUndo(ctx, cudaDone);
        if (before === 'paused')
          await ctx.runtime.freeze(id).catch((x: unknown) => ctx.warnCleanup(id, 'freeze again', x));
      }
      await ctx.store.transition(id, 'hibernating', before, 'hibernate failed', ctx.clock.now(), {
        lastError: `${asError(e).message}${undo}`,
      });
      throw new DormantError(
        'HIBERNATE_FAILED',
        `hibernate of sandbox ${id} failed; it is ${before} again: ${asError(e).message}${undo}`,
        { cause: e, hint: 'dormant doctor shows what this node supports' },
      );
    }
    // Committed: the processes end (and the writable layer, whose diff is in the
    // checkpoint, is emptied) while the staging folder is wiped and older checkpoints are
    // pruned; none of the three waits for another. The caller is answered once the
    // processes are gone; the container's remains go after that.
    const [ended, ...rest] = await Promise.allSettled([
      t.time('end processes', async () => {
        if (ctx.runtime.endProcesses) await ctx.runtime.endProcesses(id, { timer: t });
        else await ctx.endProcesses(id, t);
        await ctx.runtime.emptyLayer(id);
      }),
      t.time('wipe staging', () => ctx.wipe(dir)),
      t.time('prune', () => ctx.pruneCheckpoints(id, s.tenant)),
    ]);
    if (ended.status === 'rejected') await afterUnendedHibernate(ctx, id, ckId, ended.reason);
    await ctx.store.transition(id, 'hibernating', 'hibernated', reason, ctx.clock.now(), { memoryBytes: 0 });
    for (const r of rest) if (r.status === 'rejected') throw r.reason;
    // The timings are those the caller waited for; removing the container's remains is not.
    ctx.report(t.finish('hibernate', id, true));
    reported = true;
    answer(await ctx.get(id));
    if (ctx.runtime.endProcesses) {
      // runc's state; a failure here leaves a hibernated sandbox whose remains the next
      // resume (or a restart's reconcile) removes anyway.
      await ctx.runtime.stop(id).catch(async (e: unknown) => {
        await ctx.store.note(
          id,
          `removing the container after hibernate failed: ${asError(e).message}`,
          ctx.clock.now(),
        );
      });
    }
  } finally {
    if (!reported) ctx.report(t.finish('hibernate', id, false));
  }
}

/** Whether the sandbox's processes are gone: its container stopped, or no container at all. */
async function processesEnded(ctx: LifecycleContext, id: string): Promise<boolean> {
  const st = await ctx.runtime
    .state(id)
    .catch((e: unknown) =>
      isDormantError(e, ErrorCode.RUNTIME_SANDBOX_NOT_FOUND) ? ('absent' as const) : undefined,
    );
  // A state that cannot be read says nothing: the usual undo (thaw) is tried.
  const status = st === 'absent' ? st : st?.status;
  return status === 'stopped' || status === 'absent';
}

/**
 * The checkpoint failed and took the processes with it (gVisor ends a sandbox whose save
 * failed): what they held in memory since the last checkpoint is lost. The sandbox is
 * recorded as reconcile records one found dead: back to its previous checkpoint (hibernated)
 * if it has one, else archived on its files; never running. Always throws HIBERNATE_FAILED.
 */
async function afterEndedHibernate(ctx: LifecycleContext, s: Sandbox, cause: unknown): Promise<never> {
  const id = s.id;
  // The stopped container's remains, as reconcile removes them.
  await ctx.runtime.stop(id).catch((x: unknown) => ctx.warnCleanup(id, 'remove the ended container', x));
  const to = await processesGone(ctx, s);
  const back =
    to === 'hibernated'
      ? `it is hibernated on its previous checkpoint ${s.checkpointId ?? ''}, which a resume restores (what it did since is lost)`
      : 'it is archived on its files: a resume starts its command afresh';
  const why = `the sandbox ended when its checkpoint failed (its processes are gone); ${back}: ${asError(cause).message}`;
  await ctx.store.transition(id, 'hibernating', to, 'hibernate failed: the sandbox ended', ctx.clock.now(), {
    lastError: why,
    memoryBytes: 0,
  });
  throw new DormantError('HIBERNATE_FAILED', `hibernate of sandbox ${id} failed: ${why}`, {
    cause,
    hint: `dormant resume ${id}`,
  });
}

/**
 * A hibernate committed its checkpoint but could not end the processes. If they still exist
 * they carry on: the sandbox is running again (thawed), the checkpoint kept as a restore
 * point, and the error is thrown. If they are gone after all, it returns and the sandbox is
 * hibernated.
 */
async function afterUnendedHibernate(
  ctx: LifecycleContext,
  id: string,
  ckId: string,
  cause: unknown,
): Promise<void> {
  // No state (the container is gone): nothing runs that could need thawing.
  const st = await ctx.runtime.state(id).catch(() => undefined);
  if (st?.status !== 'running' && st?.status !== 'paused') return;
  await ctx.runtime.thaw(id).catch((e: unknown) => ctx.warnCleanup(id, 'thaw', e));
  const why = `checkpoint ${ckId} is stored, but the processes could not be ended: ${asError(cause).message}`;
  await ctx.store.transition(
    id,
    'hibernating',
    'running',
    'hibernate could not end the processes',
    ctx.clock.now(),
    {
      lastError: why,
    },
  );
  throw new DormantError(
    'HIBERNATE_FAILED',
    `hibernate of sandbox ${id} failed; it is running again: ${why}`,
    { cause, hint: `the checkpoint stays; dormant hibernate ${id} tries again` },
  );
}

/**
 * Dumps a frozen sandbox with its processes left in place and stores the images in the
 * vault. Returns the checkpoint record, not yet committed to the database.
 */
export async function dumpToVault(
  ctx: LifecycleContext,
  s: Sandbox,
  ckId: string,
  dir: string,
  stepPrefix: string,
  t: StepTimer,
  wipeImages = true,
  gpuMeta?: GpuMeta,
  /** Whose checkpoint it is in the vault and the database: a template's id keeps it apart from the sandbox's own. */
  owner: string = s.id,
): Promise<CheckpointRecord> {
  const images = join(dir, 'images');
  const platform = await ctx.platform();
  const meta: Record<string, string> = {
    arch: platform.arch,
    kernel: release(),
    kind: 'memory',
    [FS_META]: 'tar',
    ...(platform.criuVersion !== undefined ? { criuVersion: platform.criuVersion } : {}),
    ...(gpuMeta !== undefined ? { gpu: JSON.stringify(gpuMeta) } : {}),
  };
  // The vault reads CRIU's page images while CRIU writes them (the dump is mostly the
  // kernel copying pages, on one core): storing overlaps the dump instead of following it.
  const written = (async () => {
    await t.time('checkpoint', () =>
      ctx.runtime.checkpoint(s.id, {
        imagesDir: images,
        workDir: join(dir, 'work'),
        leaveRunning: true,
        timer: t,
      }),
    );
    ctx.step(`${stepPrefix}:dumped`);
    // The processes are still frozen: the diff is consistent with the memory just dumped.
    await ctx.runtime.packLayer(s.id, join(images, FS_DIFF));
  })();
  const storing = t.time('vault put', () =>
    ctx.vault.putCheckpoint({
      tenant: s.tenant,
      sandboxId: owner,
      checkpointId: ckId,
      srcDir: images,
      meta,
      growing: written,
    }),
  );
  const [dumped, stored] = await Promise.allSettled([written, storing]);
  // A failed dump is the reason (the put then fails with it too).
  if (dumped.status === 'rejected') throw dumped.reason;
  if (stored.status === 'rejected') throw stored.reason;
  const put = stored.value;
  ctx.step(`${stepPrefix}:stored`);
  if (wipeImages) await t.time('wipe images', () => ctx.wipe(images));
  return {
    id: ckId,
    sandboxId: owner,
    tenant: s.tenant,
    createdAt: ctx.clock.now(),
    kind: 'memory',
    logicalBytes: put.logicalBytes,
    storedBytes: put.storedBytes,
    meta: {
      ...meta,
      ...(platform.cpuFlags !== undefined ? { cpuFlags: platform.cpuFlags } : {}),
      ...(gpuMeta !== undefined ? { gpu: gpuMeta } : {}),
    },
  };
}
