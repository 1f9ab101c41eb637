/**
 * GPU sandboxes: which GPUs a sandbox asked for, what dormant may do with it when it idles,
 * and whether a GPU checkpoint can be restored on this node. No I/O here.
 */
import { DormantError } from './errors.js';

/**
 * What hibernate does with a sandbox whose processes hold GPU state:
 * - keep-running: never hibernate it (the idle policy skips it and says why);
 * - filesystem-only: the idle policy archives it instead (processes end, files stay);
 * - checkpoint: CUDA checkpoint (device memory into host memory) then CRIU, where the node supports it.
 */
export const GPU_POLICIES = ['keep-running', 'filesystem-only', 'checkpoint'] as const;
export type GpuPolicy = (typeof GPU_POLICIES)[number];
export const DEFAULT_GPU_POLICY: GpuPolicy = 'keep-running';

export function parseGpuPolicy(v: string): GpuPolicy {
  if ((GPU_POLICIES as readonly string[]).includes(v)) return v as GpuPolicy;
  throw new DormantError(
    'INVALID_ARGUMENT',
    `invalid GPU policy "${v.slice(0, 40)}": use ${GPU_POLICIES.join(', ')}`,
  );
}

/**
 * GPUs asked for: `all`, or device indexes like `0,1`. Returned in a canonical form (`all`,
 * or sorted unique indexes joined by commas); `none` and the empty string mean no GPUs.
 */
export function parseGpus(v: string): string | undefined {
  const t = v.trim();
  if (t === '' || t === 'none') return undefined;
  if (t === 'all') return 'all';
  const parts = t.split(',').map((p) => p.trim());
  if (parts.some((p) => !/^\d{1,3}$/.test(p))) {
    throw new DormantError(
      'INVALID_ARGUMENT',
      `invalid GPU list "${v.slice(0, 40)}": use all, or device indexes like 0 or 0,1`,
    );
  }
  return [...new Set(parts.map(Number))].sort((a, b) => a - b).join(',');
}

/** The indexes a canonical GPU list names, given the node's device count. */
export function gpuIndexes(gpus: string, deviceCount: number): number[] {
  return gpus === 'all' ? Array.from({ length: deviceCount }, (_, i) => i) : gpus.split(',').map(Number);
}

/** What a GPU checkpoint records about the node it was made on. */
export interface GpuCheckpointFacts {
  /** cuDriverGetVersion (12080 = CUDA 12.8). */
  driverApiVersion: number;
  /** Kernel module version from /proc/driver/nvidia/version (570.86.15). */
  driverVersion?: string;
  devices: { name: string; memoryBytes: number }[];
}

/**
 * Problems that forbid restoring a GPU checkpoint made on `from` onto a node with `to`
 * (undefined: no usable NVIDIA driver). The driver restores device memory onto the same kind
 * of GPU with the same driver: another model, another driver version or less memory is refused.
 */
export function gpuRestoreProblems(from: GpuCheckpointFacts, to: GpuCheckpointFacts | undefined): string[] {
  if (to === undefined) return ['the checkpoint holds GPU state and this node has no usable NVIDIA driver'];
  const problems: string[] = [];
  if (from.driverVersion !== undefined && to.driverVersion !== undefined) {
    if (from.driverVersion !== to.driverVersion)
      problems.push(
        `the checkpoint was made with NVIDIA driver ${from.driverVersion}, this node has ${to.driverVersion}`,
      );
  } else if (from.driverApiVersion !== to.driverApiVersion) {
    problems.push(
      `the checkpoint was made with CUDA driver API ${from.driverApiVersion}, this node has ${to.driverApiVersion}`,
    );
  }
  if (to.devices.length < from.devices.length) {
    problems.push(`the checkpoint used ${from.devices.length} GPU(s), this node has ${to.devices.length}`);
  }
  from.devices.forEach((d, i) => {
    const here = to.devices[i];
    if (here === undefined) return;
    if (here.name !== d.name) problems.push(`GPU ${i} was a ${d.name}, here it is a ${here.name}`);
    else if (here.memoryBytes < d.memoryBytes)
      problems.push(`GPU ${i} had ${d.memoryBytes} bytes of memory, here it has ${here.memoryBytes}`);
  });
  return problems;
}
