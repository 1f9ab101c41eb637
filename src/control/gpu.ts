/**
 * What the controller needs to know and do about GPUs on this node: whether there is a
 * driver, whether it can checkpoint CUDA state, which of a sandbox's processes hold GPU state,
 * and the CUDA checkpoint steps themselves (through the native helper). One interface so that
 * tests can describe a node they are not running on.
 */
import { DormantError } from '../domain/errors.js';
import type { GpuCheckpointFacts } from '../domain/gpu.js';
import {
  cudaInfo,
  cudaStep,
  gpuHolders,
  locateCudaHelper,
  nsPidOf,
  nvidiaDeviceNodes,
  pidsInNamespaceOf,
  type CudaStep,
  type GpuHolder,
  type HostDevice,
} from '../sys/gpu.js';
import { nvidiaFacts } from '../sys/node-facts.js';

export interface GpuSupport {
  /** Kernel module version; undefined: no NVIDIA driver. */
  driverVersion?: string;
  /** libcuda exports cuCheckpointProcess* and the driver is 570 or newer. */
  checkpointApi: boolean;
  /** The built dormant-cuda-ckpt helper, if any. */
  helper?: string;
}

export interface GpuNode {
  support(): Promise<GpuSupport>;
  /** This node's GPUs as a checkpoint records them; throws when there is no usable driver. */
  checkpointFacts(): Promise<GpuCheckpointFacts>;
  /** Which of the host processes `pids` (a sandbox's) hold GPU state. */
  holders(pids: readonly number[]): Promise<GpuHolder[]>;
  /** Every process in the pid namespace of `pid1`: host pid and pid inside. */
  processes(pid1: number): Promise<{ pid: number; nsPid: number }[]>;
  step(step: CudaStep, pid: number): Promise<void>;
  /**
   * The device nodes a sandbox declared with `gpus` ("all" or "0,1") gets; throws when one
   * is missing. Absent: the sandbox gets no device nodes (a node described by a test).
   */
  deviceNodes?(gpus: string): Promise<HostDevice[]>;
}

/** Why this node cannot checkpoint CUDA state, or undefined when it can. */
export function checkpointUnsupported(s: GpuSupport): string | undefined {
  if (s.driverVersion === undefined) return 'this node has no NVIDIA driver';
  const major = Number.parseInt(s.driverVersion, 10);
  if (!s.checkpointApi || major < 570)
    return `NVIDIA driver ${s.driverVersion} has no CUDA checkpoint API (cuCheckpointProcess*, driver 570 or newer)`;
  if (s.helper === undefined)
    return 'the dormant-cuda-ckpt helper is not built (npm run build, or scripts/setup.sh installs it in /opt/dormant/bin)';
  return undefined;
}

/** The node as it is: /proc/driver/nvidia, libcuda, and the helper on disk. */
export function systemGpuNode(env: NodeJS.ProcessEnv = process.env): GpuNode {
  const helper = async (): Promise<string> => {
    const h = await locateCudaHelper(env);
    if (h === undefined)
      throw new DormantError('GPU_CHECKPOINT_UNSUPPORTED', 'the dormant-cuda-ckpt helper is not built', {
        hint: 'npm run build, or scripts/setup.sh, builds it',
      });
    return h;
  };
  return {
    async support() {
      const [f, h] = await Promise.all([nvidiaFacts(), locateCudaHelper(env)]);
      const major = f.driverVersion === undefined ? 0 : Number.parseInt(f.driverVersion, 10);
      return {
        ...(f.driverVersion !== undefined ? { driverVersion: f.driverVersion } : {}),
        checkpointApi: f.checkpointApi && major >= 570,
        ...(h !== undefined ? { helper: h } : {}),
      };
    },
    async checkpointFacts() {
      const [info, f] = await Promise.all([helper().then(cudaInfo), nvidiaFacts()]);
      return {
        driverApiVersion: info.driverApiVersion,
        ...(f.driverVersion !== undefined ? { driverVersion: f.driverVersion } : {}),
        devices: info.devices.map((d) => ({ name: d.name, memoryBytes: d.memoryBytes })),
      };
    },
    async holders(pids) {
      return gpuHolders(pids);
    },
    async processes(pid1) {
      const out: { pid: number; nsPid: number }[] = [];
      for (const pid of await pidsInNamespaceOf(pid1)) {
        const nsPid = await nsPidOf(pid);
        if (nsPid !== undefined) out.push({ pid, nsPid });
      }
      return out;
    },
    async step(step, pid) {
      await cudaStep(await helper(), step, pid);
    },
    async deviceNodes(gpus) {
      return nvidiaDeviceNodes(gpus);
    },
  };
}
