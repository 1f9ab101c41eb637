/** Fork: a new sandbox restored from another's newest checkpoint. */

import { randomBytes } from 'node:crypto';
import { mkdir } from 'node:fs/promises';
import { join } from 'node:path';
import { DormantError, asError } from '../../domain/errors.js';
import { assertLegal, newId, validateLabels, validateName, type Sandbox } from '../../domain/sandbox.js';
import { FS_META } from '../../runtime/layer.js';
import { LifecycleContext } from '../context.js';
import { gpuGate } from './gpu.js';
import { dumpToVault } from './hibernate.js';

/**
 * A new sandbox restored from `id`'s newest checkpoint (a running or paused sandbox is
 * checkpointed first and keeps running), with a copy of its filesystem. The fork has its own
 * network address; listening sockets bound to all addresses listen again there.
 */
export async function forkSandbox(
  ctx: LifecycleContext,
  id: string,
  tenant: string | undefined,
  opts: { name?: string; labels?: Record<string, string> },
): Promise<Sandbox> {
  const src = await ctx.get(id, tenant);
  assertLegal('fork', src.state, src.id);
  const forkId = newId('sb', randomBytes);
  const name = validateName(opts.name ?? forkId);
  if ((await ctx.store.listSandboxes(src.tenant)).some((x) => x.name === name)) {
    throw new DormantError('SANDBOX_NAME_TAKEN', `a sandbox named ${name} already exists`);
  }
  const now = ctx.clock.now();
  const sandbox: Sandbox = {
    ...src,
    // On this node, wherever the source lives.
    node: ctx.node,
    // Sealed again: a sealed value names the sandbox it belongs to.
    spec: {
      ...src.spec,
      env: await ctx.sealEnv(src.tenant, forkId, await ctx.openEnv(src)),
      // The parent's labels, unless the fork is given its own.
      ...(opts.labels !== undefined ? { labels: validateLabels(opts.labels) } : {}),
      agentSeed: src.spec.agentSeed ?? src.id,
    },
    id: forkId,
    name,
    state: 'creating',
    createdAt: now,
    stateSince: now,
    lastActiveAt: now,
    memoryBytes: 0,
  };
  delete sandbox.checkpointId;
  delete sandbox.lastError;
  delete sandbox.address;
  const dir = ctx.staging(`${forkId}-fork`);
  await mkdir(dir, { recursive: true, mode: 0o700 });
  const t = ctx.timer();
  let ok = false;
  try {
    // Under the source's lock: a consistent checkpoint and filesystem copy of the source.
    const ckId = await ctx.locks.run(src.id, async () => {
      const cur = await ctx.get(src.id);
      assertLegal('fork', cur.state, src.id);
      let ck = cur.checkpointId;
      if (cur.state === 'running' || cur.state === 'paused') {
        await gpuGate(ctx, cur, 'fork');
        ck = newId('ck', randomBytes);
        await ctx.runtime.freeze(src.id);
        try {
          const rec = await dumpToVault(ctx, cur, ck, dir, 'fork', t);
          await ctx.store.insertCheckpoint(rec);
          await ctx.store.updateSandbox(src.id, { checkpointId: ck });
          await ctx.store.insertSandbox(sandbox, `fork of ${src.id}`);
        } finally {
          if (cur.state === 'running') await ctx.runtime.thaw(src.id);
        }
        await ctx.pruneCheckpoints(src.id, src.tenant);
      } else {
        await ctx.store.insertSandbox(sandbox, `fork of ${src.id}`);
        // A checkpoint from before diffs went into the vault: the diff is on disk.
        const rec = ck !== undefined ? await ctx.store.getCheckpoint(ck) : undefined;
        if (rec?.meta[FS_META] !== 'tar') await copyFilesystem(ctx, src.id, forkId);
      }
      if (ck === undefined)
        throw new DormantError('NO_CHECKPOINT', `sandbox ${src.id} has no checkpoint to fork`);
      return ck;
    });
    return await ctx.locks.run(forkId, async () => {
      const images = join(dir, 'images');
      await t.time('vault fetch', () =>
        ctx.vault.restoreCheckpoint({ tenant: src.tenant, checkpointId: ckId, destDir: images }),
      );
      await ctx.checkImported(images, await ctx.store.getCheckpoint(ckId));
      // The checkpoint's diff (the source's files when it was dumped) is the fork's start,
      // written before its overlay is mounted (restore mounts it), after prepare has made
      // (and mounted) its writable layer's disk image.
      await ctx.runtime.prepare(await ctx.runtimeSpec(await ctx.get(forkId)), {
        timer: t,
        mountRootfs: false,
      });
      await t.time('unpack filesystem', () => ctx.applyFilesystem(forkId, images));
      const st = await t.time('restore', () =>
        ctx.runtime
          .restore(forkId, { imagesDir: images, workDir: join(dir, 'work'), timer: t })
          .then(() => ctx.runtime.state(forkId)),
      );
      await ctx.store.transition(forkId, 'creating', 'running', `fork of ${src.id}`, ctx.clock.now(), {
        address: st.network.address,
      });
      ok = true;
      return await ctx.get(forkId);
    });
  } catch (e) {
    if (await ctx.store.getSandbox(forkId)) {
      await ctx.runtime.destroy(forkId).catch((x: unknown) => ctx.warnCleanup(forkId, 'destroy', x));
      await ctx.store.transition(forkId, 'creating', 'failed', 'fork failed', ctx.clock.now(), {
        lastError: asError(e).message,
      });
    }
    throw e;
  } finally {
    await ctx.wipe(dir);
    ctx.report(t.finish('fork', forkId, ok));
  }
}

/** Prepares the fork's runtime side and copies the source's writable layer into it. */
async function copyFilesystem(ctx: LifecycleContext, srcId: string, forkId: string): Promise<void> {
  const fork = (await ctx.store.getSandbox(forkId))!;
  await ctx.runtime.prepare(await ctx.runtimeSpec(fork));
  await ctx.runtime.copyLayer(srcId, forkId);
}
