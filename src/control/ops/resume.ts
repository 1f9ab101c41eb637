/** Resume: a paused sandbox thawed, a hibernated one restored from its checkpoint, an archived one started afresh. */

import { mkdir, open } from 'node:fs/promises';
import { join } from 'node:path';
import { DormantError, ErrorCode, asError, isDormantError } from '../../domain/errors.js';
import { assertLegal, isNoop, type Sandbox } from '../../domain/sandbox.js';
import { FS_META } from '../../runtime/layer.js';
import { StepTimer } from '../../domain/timings.js';
import { LifecycleContext } from '../context.js';
import { restoreFromVault } from './restore.js';
import { afterLazyRestore } from './lazy.js';

/**
 * Back to running. From hibernated it restores the newest checkpoint, or `opts.from` (an
 * older one of the same sandbox, when the newest is damaged).
 */
export async function resume(
  ctx: LifecycleContext,
  id: string,
  tenant: string | undefined,
  reason: string,
  opts: { from?: string },
  t: StepTimer,
  answer: (s: Sandbox) => void,
): Promise<void> {
  let ok = false;
  try {
    const r = await resumeLocked(ctx, id, tenant, reason, opts, t);
    if (t.steps().length > 0) t.mark('running');
    answer(r.sandbox);
    if (r.pagesLoaded) ctx.step('resume:pages-pending');
    ok = r.pagesLoaded
      ? await t.time('pages loaded', () => afterLazyRestore(ctx, r.sandbox, r.pagesLoaded!))
      : true;
  } finally {
    if (t.steps().length > 0) ctx.report(t.finish('resume', (await ctx.store.getSandbox(id))?.id ?? id, ok));
  }
}

async function resumeLocked(
  ctx: LifecycleContext,
  id: string,
  tenant: string | undefined,
  reason: string,
  opts: { from?: string },
  t: StepTimer,
): Promise<{ sandbox: Sandbox; pagesLoaded?: Promise<void> }> {
  {
    const s = await ctx.get(id, tenant);
    if (
      (s.state === 'resuming' || s.state === 'hibernating') &&
      s.node !== undefined &&
      s.node !== ctx.node
    ) {
      // Another node's operation in flight (two nodes woke it at once; this one lost).
      throw new DormantError('SANDBOX_BUSY', `sandbox ${id} is ${s.state} on node ${s.node}`, {
        hint: 'another node got to it first; retry once it has settled (dormant get ID)',
      });
    }
    assertLegal('resume', s.state, id);
    if (opts.from !== undefined) {
      const ck = await ctx.store.getCheckpoint(opts.from);
      if (!ck || ck.sandboxId !== s.id || ck.kind !== 'memory') {
        throw new DormantError(
          'CHECKPOINT_NOT_FOUND',
          `sandbox ${s.id} has no checkpoint ${opts.from.slice(0, 80)}`,
          { hint: `dormant checkpoint ls ${s.id} lists its checkpoints` },
        );
      }
      if (s.state !== 'hibernated') {
        throw new DormantError(
          'ILLEGAL_TRANSITION',
          `cannot resume sandbox ${s.id} from a checkpoint: it is ${s.state}`,
          { hint: 'only a hibernated sandbox resumes from a checkpoint' },
        );
      }
    }
    if (isNoop('resume', s.state)) return { sandbox: s };
    if (s.state === 'paused') {
      await ctx.runtime.thaw(id);
      await ctx.store.transition(id, 'paused', 'running', reason, ctx.clock.now(), {
        lastActiveAt: Math.max(s.lastActiveAt, ctx.clock.now()),
      });
      return { sandbox: await ctx.get(id) };
    }
    const from = s.state;
    // A compare-and-set, and in a fleet the claim: the sandbox becomes this node's. Of two
    // nodes waking it at once, one gets it; the other changes nothing.
    if (!(await ctx.store.transition(id, from, 'resuming', reason, ctx.clock.now(), ctx.placed())))
      throw await ctx.busy(id, from);
    let pagesLoaded: Promise<void> | undefined;
    // Its address as this node's runtime made it: another one than before when it woke on
    // another node (each node has its own addresses).
    let address: string;
    try {
      if (from === 'hibernated')
        ({ pagesLoaded, address } = await restoreFromVault(ctx, s, opts.from ?? s.checkpointId, t));
      else address = await freshStart(ctx, s);
    } catch (e) {
      // Back where it was, on the node that answered for it (a node that cannot restore it
      // must not keep it: placement would send every later wake back here).
      await ctx.store.transition(id, 'resuming', from, 'resume failed', ctx.clock.now(), {
        lastError: asError(e).message,
        lazyRestoreOf: undefined,
        ...(ctx.node !== undefined ? { node: s.node } : {}),
      });
      if (
        isDormantError(e, 'RESTORE_INCOMPATIBLE') ||
        isDormantError(e, ErrorCode.CHECKPOINT_OUTSIDE_PROFILE)
      )
        throw e;
      if (isDormantError(e) && e.code.startsWith('VAULT_') && from === 'hibernated') {
        // A damaged checkpoint: say so, and name the older one that may still restore.
        throw await ctx.damaged(id, opts.from ?? s.checkpointId, e, 'the sandbox stays hibernated');
      }
      // The runtime keeps the CRIU log of a failed restore for the node's admin.
      const criuLog = isDormantError(e) ? e.details?.criuLog : undefined;
      throw new DormantError(
        'RESUME_FAILED',
        `resume of sandbox ${id} failed; it is still ${from}${from === 'hibernated' ? ' and its checkpoint is intact' : ''}: ${asError(e).message}`,
        {
          cause: e,
          hint: `dormant doctor shows what this node supports; dormant logs ID shows its output${typeof criuLog === 'string' ? `; dormant logs --restore ID shows criu's log of the failed restore: ${criuLog}` : ''}`,
          ...(typeof criuLog === 'string' ? { details: { criuLog } } : {}),
        },
      );
    }
    let why = reason;
    if (s.spec.onResume && s.spec.onResume.length > 0)
      why = `${reason}; ${await t.time('on-resume hook', () => runResumeHook(ctx, s))}`;
    const now = ctx.clock.now();
    if (
      !(await ctx.store.transition(id, 'resuming', 'running', why, now, {
        lastActiveAt: Math.max(s.lastActiveAt, now),
        lastError: undefined,
        address,
      }))
    ) {
      // Taken from this node while it restored (its lease ran out meanwhile): the copy here
      // is not the sandbox; the node's release of what is no longer its own ends it.
      throw new DormantError(
        'SANDBOX_BUSY',
        `sandbox ${id} was taken over by another node during its resume`,
        {
          hint: 'dormant get ID shows where it is now',
        },
      );
    }
    // The marker (set by restoreFromVault) stays until afterLazyRestore has every page.
    return { sandbox: await ctx.get(id), ...(pagesLoaded ? { pagesLoaded } : {}) };
  }
}

/**
 * Runs the sandbox's post-resume hook (reconnect databases, refresh tokens). Its outcome goes
 * to the sandbox's log and into the transition's reason, so the events show it too.
 */
async function runResumeHook(ctx: LifecycleContext, s: Sandbox): Promise<string> {
  let outcome: string;
  let output = '';
  try {
    const r = await ctx.runtime.exec(s.id, s.spec.onResume ?? [], { timeoutMs: 60_000 });
    outcome = `on-resume hook exited ${r.exitCode}`;
    output = `${r.stdout}${r.stderr}`;
  } catch (e) {
    outcome = `on-resume hook failed: ${asError(e).message.split('\n')[0] ?? ''}`;
  }
  try {
    const path = (await ctx.runtime.state(s.id)).logPath;
    const fh = await open(path, 'a');
    try {
      await fh.write(`${output}${output === '' || output.endsWith('\n') ? '' : '\n'}[dormant] ${outcome}\n`);
    } finally {
      await fh.close();
    }
  } catch {
    // The log is best effort; the outcome is still in the transition.
  }
  return outcome;
}

/** Starts the sandbox afresh on its filesystem; its address. */
async function freshStart(ctx: LifecycleContext, s: Sandbox): Promise<string> {
  // Ends anything left and unmounts the overlay, so the writable layer is at rest.
  await ctx.endProcesses(s.id);
  // An archive keeps the diff in the vault: back into the writable layer first.
  const ck = s.checkpointId !== undefined ? await ctx.store.getCheckpoint(s.checkpointId) : undefined;
  if (ck && ck.meta[FS_META] === 'tar') {
    const dir = ctx.staging(`${s.id}-restore`);
    try {
      await mkdir(dir, { recursive: true, mode: 0o700 });
      const files = join(dir, 'files');
      await ctx.vault.restoreCheckpoint({ tenant: s.tenant, checkpointId: ck.id, destDir: files });
      await ctx.applyFilesystem(s.id, files);
    } finally {
      await ctx.wipe(dir);
    }
  }
  const st = await ctx.runtime.create(await ctx.runtimeSpec(s));
  await ctx.runtime.start(s.id);
  return st.network.address;
}
