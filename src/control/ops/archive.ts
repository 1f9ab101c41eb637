/** Archive: only the sandbox's filesystem is kept, in the vault. */

import { randomBytes } from 'node:crypto';
import { mkdir, rename } from 'node:fs/promises';
import { arch } from 'node:os';
import { join } from 'node:path';
import { assertLegal, isNoop, newId, type Sandbox } from '../../domain/sandbox.js';
import type { CheckpointRecord } from '../../state/store.js';
import { FS_DIFF, FS_META } from '../../runtime/layer.js';
import { LifecycleContext } from '../context.js';

/**
 * Keep only the filesystem: its diff goes into the vault as a 'filesystem' checkpoint, the
 * processes end, the memory checkpoints are deleted and the writable layer is emptied.
 */
export async function archiveSandbox(
  ctx: LifecycleContext,
  id: string,
  tenant: string | undefined,
  reason: string,
): Promise<Sandbox> {
  const s = await ctx.get(id, tenant);
  assertLegal('archive', s.state, id);
  if (isNoop('archive', s.state)) return s;
  const ckId = newId('ck', randomBytes);
  const dir = ctx.staging(`${ckId}-archive`);
  let fsCk: CheckpointRecord;
  try {
    await mkdir(dir, { recursive: true, mode: 0o700 });
    const files = join(dir, 'files');
    await mkdir(files, { mode: 0o700 });
    await archiveDiff(ctx, s, join(dir, 'from'), join(files, FS_DIFF));
    const meta = { arch: arch(), kind: 'filesystem', [FS_META]: 'tar' };
    const put = await ctx.vault.putCheckpoint({
      tenant: s.tenant,
      sandboxId: id,
      checkpointId: ckId,
      srcDir: files,
      meta,
    });
    fsCk = {
      id: ckId,
      sandboxId: id,
      tenant: s.tenant,
      createdAt: ctx.clock.now(),
      kind: 'filesystem',
      logicalBytes: put.logicalBytes,
      storedBytes: put.storedBytes,
      meta,
    };
  } finally {
    await ctx.wipe(dir);
  }
  ctx.step('archive:stored');
  // The record goes in one transaction: archived, its diff the current checkpoint, the
  // others dropped. A crash before it leaves the sandbox as it was (the start-up sweep
  // deletes the unrecorded copy); after it, an archived sandbox whose processes reconcile
  // ends and whose old vault copies the sweep deletes.
  const old = await ctx.store.listCheckpoints({ sandboxId: id });
  const now = ctx.clock.now();
  await ctx.store.atomically(async (tx) => {
    // First, and checked: in a fleet another node may have woken it meanwhile (from the very
    // checkpoints this would drop); then nothing is recorded or deleted.
    if (
      !(await tx.transition(id, s.state, 'archived', reason, now, {
        memoryBytes: 0,
        checkpointId: fsCk.id,
      }))
    )
      throw await ctx.busy(id, s.state, tx);
    await tx.insertCheckpoint(fsCk);
    for (const c of old) await tx.deleteCheckpoint(c.id, now);
  });
  ctx.step('archive:recorded');
  await ctx.endProcesses(id);
  await ctx.runtime.emptyLayer(id);
  ctx.step('archive:ended');
  for (const c of old) await ctx.vault.deleteCheckpoint({ tenant: s.tenant, checkpointId: c.id });
  return await ctx.get(id);
}

/**
 * Writes sandbox `s`'s filesystem diff as the tar `tarPath`: from its current checkpoint
 * when it is hibernated (the writable layer is empty then), else from the writable layer,
 * with the processes frozen while it is read.
 */
async function archiveDiff(
  ctx: LifecycleContext,
  s: Sandbox,
  scratch: string,
  tarPath: string,
): Promise<void> {
  const ck = s.checkpointId !== undefined ? await ctx.store.getCheckpoint(s.checkpointId) : undefined;
  if (s.state === 'hibernated' && ck && ck.meta[FS_META] === 'tar') {
    await ctx.vault.restoreCheckpoint({ tenant: s.tenant, checkpointId: ck.id, destDir: scratch });
    await rename(join(scratch, FS_DIFF), tarPath);
    return;
  }
  if (s.state !== 'running') {
    await ctx.runtime.packLayer(s.id, tarPath);
    return;
  }
  await ctx.runtime.freeze(s.id);
  try {
    await ctx.runtime.packLayer(s.id, tarPath);
  } finally {
    await ctx.runtime.thaw(s.id);
  }
}
