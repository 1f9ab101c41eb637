/** GPU sandboxes: the devices they get, what their policy allows at hibernate and fork, and CUDA's checkpoint steps. */

import { DormantError, asError } from '../../domain/errors.js';
import type { Sandbox } from '../../domain/sandbox.js';
import { DEFAULT_GPU_POLICY, type GpuCheckpointFacts } from '../../domain/gpu.js';
import type { GpuHolder } from '../../sys/gpu.js';
import { checkpointUnsupported } from '../gpu.js';
import { LifecycleContext } from '../context.js';

/** What a GPU checkpoint records besides the node's GPUs: the processes whose CUDA state it holds. */
export type GpuMeta = GpuCheckpointFacts & { nsPids: number[] };

function describeHolders(holders: readonly GpuHolder[]): string {
  return holders
    .slice(0, 3)
    .map((h) => `pid ${h.nsPid}: ${h.evidence[0] ?? '?'}`)
    .concat(holders.length > 3 ? [`${holders.length - 3} more`] : [])
    .join('; ');
}

export function gpuMetaOf(m: Record<string, unknown>): GpuMeta | undefined {
  const g = m.gpu;
  if (typeof g !== 'object' || g === null) return undefined;
  const v = g as Partial<GpuMeta>;
  if (typeof v.driverApiVersion !== 'number' || !Array.isArray(v.devices) || !Array.isArray(v.nsPids))
    return undefined;
  return v as GpuMeta;
}

/** The device nodes of GPUs `gpus` on this node; refuses (409) when one is missing. */
export async function gpuDevices(
  ctx: LifecycleContext,
  gpus: string,
): Promise<{ path: string; major: number; minor: number }[]> {
  if (ctx.gpu.deviceNodes === undefined) return [];
  try {
    return await ctx.gpu.deviceNodes(gpus);
  } catch (e) {
    throw new DormantError(
      'GPU_UNAVAILABLE',
      `cannot create a sandbox with GPUs (${gpus}): ${asError(e).message}`,
      { cause: e, hint: 'ls /dev/nvidia* shows the GPUs this node has; --gpus all takes every one' },
    );
  }
}

/** Refuses GPUs on a node without an NVIDIA driver. */
export async function checkGpusAvailable(ctx: LifecycleContext, gpus: string): Promise<void> {
  const sup = await ctx.gpu.support();
  if (sup.driverVersion === undefined) {
    throw new DormantError(
      'GPU_UNAVAILABLE',
      `cannot create a sandbox with GPUs (${gpus}): this node has no NVIDIA driver (/proc/driver/nvidia/version is missing)`,
      { hint: 'create it without --gpus, or on a node where dormant doctor shows an NVIDIA driver' },
    );
  }
}

/** The sandbox's processes that hold GPU state now (none when it has no processes). */
export async function gpuHolders(ctx: LifecycleContext, id: string): Promise<GpuHolder[]> {
  // From the sandbox's cgroup: no `runc state` on every hibernate's path.
  const pids = await ctx.runtime.pids(id);
  return pids.length === 0 ? [] : ctx.gpu.holders(pids);
}

/**
 * What the sandbox's GPU policy allows before its processes are checkpointed: throws the
 * refusal (nothing has changed yet), or returns the processes whose CUDA state must be
 * checkpointed first (empty: CRIU alone is enough).
 */
export async function gpuGate(
  ctx: LifecycleContext,
  s: Sandbox,
  op: 'hibernate' | 'fork',
): Promise<GpuHolder[]> {
  const holders = await gpuHolders(ctx, s.id);
  if (holders.length === 0 && s.gpus === undefined) return [];
  const policy = s.gpuPolicy ?? DEFAULT_GPU_POLICY;
  const what =
    holders.length > 0
      ? `holds GPU state (${describeHolders(holders)})`
      : `was created with GPUs (${s.gpus ?? ''})`;
  if (op === 'fork' && holders.length > 0) {
    throw new DormantError('GPU_FORK_UNSUPPORTED', `cannot fork sandbox ${s.id}: it ${what}`, {
      hint: 'two copies of one CUDA process cannot share its GPU state; fork it while no process uses the GPU',
    });
  }
  if (op === 'fork') return [];
  if (policy === 'keep-running') {
    throw new DormantError(
      'GPU_KEEP_RUNNING',
      `sandbox ${s.id} ${what} and its GPU policy is keep-running: it is not hibernated`,
      {
        hint: `it keeps running; to stop it keeping only its files: dormant archive ${s.id}. GPU sandboxes created with --gpu-policy checkpoint hibernate where dormant doctor shows CUDA checkpointing`,
        details: { sandboxId: s.id, gpuPolicy: policy, pids: holders.map((h) => h.nsPid) },
      },
    );
  }
  if (policy === 'filesystem-only') {
    throw new DormantError(
      'GPU_FILESYSTEM_ONLY',
      `sandbox ${s.id} ${what} and its GPU policy is filesystem-only: its processes are not checkpointed`,
      {
        hint: `archive it instead (its files are kept, its processes end): dormant archive ${s.id}`,
        details: { sandboxId: s.id, gpuPolicy: policy, pids: holders.map((h) => h.nsPid) },
      },
    );
  }
  if (holders.length === 0) return [];
  const why = checkpointUnsupported(await ctx.gpu.support());
  if (why !== undefined) {
    throw new DormantError(
      'GPU_CHECKPOINT_UNSUPPORTED',
      `sandbox ${s.id} ${what} and its GPU policy is checkpoint, but ${why}: it is not hibernated`,
      {
        hint: 'dormant doctor shows the GPU rows; the sandbox keeps running',
        details: { sandboxId: s.id, gpuPolicy: policy, pids: holders.map((h) => h.nsPid) },
      },
    );
  }
  return holders;
}

/** Puts CUDA state back after a failed hibernate; returns what could not be undone, if anything. */
export async function cudaUndo(
  ctx: LifecycleContext,
  done: readonly { pid: number; step: 'lock' | 'checkpoint' }[],
): Promise<string> {
  const failed: string[] = [];
  for (const d of done) {
    try {
      if (d.step === 'checkpoint') await ctx.gpu.step('restore', d.pid);
      await ctx.gpu.step('unlock', d.pid);
    } catch (e) {
      failed.push(`pid ${d.pid}: ${asError(e).message}`);
    }
  }
  return failed.length > 0 ? `; CUDA state could not be put back: ${failed.join('; ')}` : '';
}

/** After CRIU restored the processes: their device memory back onto the GPU, CUDA unlocked. */
export async function cudaRestore(ctx: LifecycleContext, id: string, meta: GpuMeta): Promise<void> {
  const st = await ctx.runtime.state(id);
  const procs = st.pid === undefined ? [] : await ctx.gpu.processes(st.pid);
  try {
    for (const nsPid of meta.nsPids) {
      const p = procs.find((x) => x.nsPid === nsPid);
      if (!p) throw new Error(`restored process ${nsPid} (pid inside the sandbox) is missing`);
      await ctx.gpu.step('restore', p.pid);
      await ctx.gpu.step('unlock', p.pid);
    }
    ctx.step('resume:gpu-restored');
  } catch (e) {
    // Half-restored GPU processes are of no use: end them; the checkpoint stays.
    await ctx.runtime.stop(id).catch((x: unknown) => ctx.warnCleanup(id, 'end half-restored processes', x));
    throw new DormantError(
      'GPU_RESTORE_FAILED',
      `CUDA restore of sandbox ${id} failed: ${asError(e).message}`,
      { cause: e },
    );
  }
}
