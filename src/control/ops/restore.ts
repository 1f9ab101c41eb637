/** Restoring a hibernated sandbox's processes from a checkpoint in the vault. */

import { mkdir } from 'node:fs/promises';
import { join } from 'node:path';
import { DormantError } from '../../domain/errors.js';
import type { Sandbox } from '../../domain/sandbox.js';
import type { CheckpointRecord } from '../../state/store.js';
import { FS_META } from '../../runtime/layer.js';
import { checkpointFacts, restoreProblems } from '../../domain/compat.js';
import { gpuRestoreProblems } from '../../domain/gpu.js';
import { checkpointUnsupported } from '../gpu.js';
import { StepTimer } from '../../domain/timings.js';
import { isPagesImage } from '../../criu/page-server.js';
import { LifecycleContext } from '../context.js';
import type { CheckpointReaderPort } from '../ports.js';
import { cudaRestore, gpuMetaOf } from './gpu.js';

/** Checkpoints up to this size are staged for a lazy resume, bigger ones served from the vault. */
const PAGES_FROM_VAULT_ABOVE_BYTES = 256 * 1024 * 1024;

/** Refuses a restore this node cannot do, naming why. */
export async function checkCompatible(
  ctx: LifecycleContext,
  sandboxId: string,
  ck: CheckpointRecord | undefined,
): Promise<void> {
  if (!ck) return;
  const m = ck.meta;
  const from = checkpointFacts(m);
  const node = await ctx.platform();
  // Only what this node knows about itself is compared.
  const problems = restoreProblems(
    {
      ...(from.arch !== undefined ? { arch: from.arch } : {}),
      ...(from.criuVersion !== undefined && node.criuVersion !== undefined
        ? { criuVersion: from.criuVersion }
        : {}),
      ...(from.cpuFlags !== undefined && node.cpuFlags !== undefined ? { cpuFlags: from.cpuFlags } : {}),
    },
    { arch: node.arch, criuVersion: node.criuVersion ?? '0', cpuFlags: node.cpuFlags ?? [] },
  );
  const gpuMeta = gpuMetaOf(m);
  if (gpuMeta !== undefined) {
    const why = checkpointUnsupported(await ctx.gpu.support());
    if (why !== undefined) problems.push(`the checkpoint holds CUDA state and ${why}`);
    else
      // The node's CUDA facts unknown (no driver answers): the checkpoint's own are held to none.
      problems.push(...gpuRestoreProblems(gpuMeta, await ctx.gpu.checkpointFacts().catch(() => undefined)));
  }
  if (problems.length > 0) {
    throw new DormantError(
      'RESTORE_INCOMPATIBLE',
      `checkpoint ${ck.id} of sandbox ${sandboxId} cannot be restored here: ${problems.join('; ')}`,
      {
        hint: 'resume it on a node of the same kind (dormant doctor shows this one), or archive it and start it afresh',
      },
    );
  }
}

/**
 * Restores the sandbox from checkpoint `ckId`. With lazy restore, returns the promise of
 * its pages arriving; the staging folder must stay until it settles (afterLazyRestore).
 */
export async function restoreFromVault(
  ctx: LifecycleContext,
  s: Sandbox,
  ckId: string | undefined,
  t: StepTimer,
  /** The tenant whose vault holds the checkpoint: another's for a public template. */
  vaultTenant: string = s.tenant,
  /**
   * Puts the checkpoint's images, every page included, into the folder it is given (a
   * template's, from the cache in memory: template-cache.ts) in place of the vault's fetch.
   */
  fetchImages?: (destDir: string) => Promise<unknown>,
): Promise<{
  pagesLoaded: Promise<void> | undefined;
  /** The sandbox's address, as its prepare made it (no runtime state to ask afterwards). */
  address: string;
}> {
  if (ckId === undefined) throw new DormantError('NO_CHECKPOINT', `sandbox ${s.id} has no checkpoint`);
  // One restore per sandbox at a time (its lock), so the sandbox names the folder.
  const dir = ctx.staging(`${s.id}-restore`);
  let keep = false;
  let unpacked = false;
  let restored = false;
  let preparing = false;
  // Opened here, handed to the runtime's restore, which owns it from then on.
  let reader: CheckpointReaderPort | undefined;
  try {
    const ck = await ctx.store.getCheckpoint(ckId);
    await t.time('compatibility', () => checkCompatible(ctx, s.id, ck));
    const gpuMeta = ck ? gpuMetaOf(ck.meta) : undefined;
    // CUDA's restore reads the whole host copy of device memory at once: no lazy pages for
    // a GPU checkpoint, nor for a sandbox given GPUs (its device mappings restore eagerly).
    const lazy = gpuMeta === undefined && s.gpus === undefined && (await ctx.lazy);
    // Lazy pages come straight from the vault (the page images never reach staging) for a
    // big checkpoint, whose fetch to staging would hold up the resume.
    const fromVault =
      lazy &&
      fetchImages === undefined &&
      ctx.opts.servePagesFromVault !== false &&
      ctx.vault.openCheckpoint !== undefined &&
      (ck?.logicalBytes ?? Number.POSITIVE_INFINITY) >
        (ctx.opts.pagesFromVaultAboveBytes ?? PAGES_FROM_VAULT_ABOVE_BYTES);
    // A checkpoint with its diff: the writable layer is filled before the overlay is mounted.
    const hasDiff = ck?.meta[FS_META] === 'tar';
    await mkdir(dir, { recursive: true, mode: 0o700 });
    const images = join(dir, 'images');
    // The sandbox's host side (network, log collector, rootfs mount) does not need the images:
    // it is set up while they come out of the vault.
    preparing = true;
    const [fetched, prepared] = await Promise.allSettled([
      t.time('vault fetch', () =>
        fetchImages
          ? fetchImages(images)
          : ctx.vault.restoreCheckpoint({
              tenant: vaultTenant,
              checkpointId: ckId,
              destDir: images,
              ...(fromVault ? { skip: isPagesImage } : {}),
            }),
      ),
      t.time('prepare', async () =>
        ctx.runtime.prepare(await ctx.runtimeSpec(s), { timer: t, mountRootfs: !hasDiff }),
      ),
    ]);
    if (fetched.status === 'rejected') {
      // A hibernated sandbox's rootfs stays unmounted (archivable, nothing holding it).
      if (prepared.status === 'fulfilled')
        await ctx.runtime.stop(s.id).catch((e: unknown) => ctx.warnCleanup(s.id, 'unmount', e));
      throw fetched.reason;
    }
    if (prepared.status === 'rejected') throw prepared.reason;
    await ctx.checkImported(images, ck).catch(async (e: unknown) => {
      await ctx.runtime.stop(s.id).catch((x: unknown) => ctx.warnCleanup(s.id, 'unmount', x));
      throw e;
    });
    ctx.step('resume:fetched');
    unpacked = await t.time('unpack filesystem', () => ctx.applyFilesystem(s.id, images));
    if (fromVault)
      reader = await t.time('open checkpoint', () =>
        ctx.vault.openCheckpoint!({ tenant: vaultTenant, checkpointId: ckId }),
      );
    // Durable before the pages start to move: a daemon that dies before they are all in
    // leaves the marker for reconcile (the sandbox goes back to this checkpoint).
    if (lazy) await ctx.store.updateSandbox(s.id, { lazyRestoreOf: ckId });
    const source = reader;
    reader = undefined;
    // From the vault, the runtime writes the eager pages and serves the lazy ones itself.
    const r = await t.time('restore', () =>
      ctx.runtime.restore(s.id, {
        imagesDir: images,
        workDir: join(dir, 'work'),
        lazyPages: lazy,
        ...(source ? { pages: { source, what: `sandbox ${s.id} (checkpoint ${ckId})` } } : {}),
        timer: t,
      }),
    );
    if (gpuMeta !== undefined) await cudaRestore(ctx, s.id, gpuMeta);
    restored = true;
    ctx.step('resume:restored');
    if (ckId !== s.checkpointId) await ctx.store.updateSandbox(s.id, { checkpointId: ckId });
    keep = lazy;
    // Wrapped: awaiting a returned promise directly would wait for the pages too.
    return { pagesLoaded: keep ? r.pagesLoaded : undefined, address: prepared.value.network.address };
  } finally {
    // Each step runs whatever the others do, and none replaces the restore's own error.
    await reader?.close().catch((e: unknown) => ctx.warnCleanup(s.id, 'checkpoint reader', e));
    if (!keep) {
      await ctx.wipe(dir).catch((e: unknown) => ctx.warnCleanup(s.id, 'staging', e));
    }
    // A failed restore stays hibernated: its diff goes back to living only in the vault,
    // and its rootfs is not mounted (prepare mounted it when there was no diff).
    if (unpacked && !restored) await unmountAndEmpty(ctx, s.id);
    else if (preparing && !restored)
      await ctx.runtime.stop(s.id).catch((e: unknown) => ctx.warnCleanup(s.id, 'unmount', e));
  }
}

/** Ends what runs of `id` (unmounting its overlay) and empties its writable layer. */
export async function unmountAndEmpty(ctx: LifecycleContext, id: string): Promise<void> {
  await ctx.runtime.stop(id).catch((e: unknown) => ctx.warnCleanup(id, 'unmount', e));
  await ctx.runtime.emptyLayer(id).catch((e: unknown) => ctx.warnCleanup(id, 'empty the writable layer', e));
}
