/**
 * GPU state of processes, and the CUDA checkpoint helper (native/cuda-ckpt.c).
 *
 * A process holds GPU state when it has an NVIDIA device file open (/dev/nvidia0,
 * /dev/nvidiactl, /dev/nvidia-uvm...) or mapped, or has the CUDA driver library (libcuda.so)
 * mapped: CRIU alone cannot save that state, so such a sandbox must not be hibernated blindly.
 */
import { access, constants, readFile, readdir, readlink, stat } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { DormantError, errnoCode } from '../domain/errors.js';
import { run } from './exec.js';

export interface GpuHolder {
  /** Host pid. */
  pid: number;
  /** The pid inside the sandbox's pid namespace (stable across a CRIU restore). */
  nsPid: number;
  /** What gave it away: `fd 5 -> /dev/nvidiactl`, `maps /usr/lib/.../libcuda.so.1`. */
  evidence: string[];
}

const DEVICE = /^\/dev\/nvidia/;
const MAPPED = /(?:^|\/)libcuda\.so/;

/** Contents of a /proc file, or undefined when the process went away meanwhile. */
async function procText(path: string): Promise<string | undefined> {
  try {
    return await readFile(path, 'utf8');
  } catch (e) {
    const c = errnoCode(e);
    if (c === 'ENOENT' || c === 'ESRCH' || c === 'EACCES') return undefined;
    throw e;
  }
}

/** The GPU evidence of one process; empty when it holds none (or is gone). */
export async function gpuEvidence(pid: number): Promise<string[]> {
  const evidence: string[] = [];
  let fds: string[] = [];
  try {
    fds = await readdir(`/proc/${pid}/fd`);
  } catch (e) {
    if (!['ENOENT', 'ESRCH', 'EACCES'].includes(errnoCode(e) ?? '')) throw e;
  }
  for (const fd of fds) {
    const target = await readlink(`/proc/${pid}/fd/${fd}`).catch(() => undefined);
    if (target !== undefined && DEVICE.test(target)) evidence.push(`fd ${fd} -> ${target}`);
  }
  const maps = (await procText(`/proc/${pid}/maps`)) ?? '';
  const seen = new Set<string>();
  for (const line of maps.split('\n')) {
    // address perms offset dev inode path (the path may contain spaces)
    const m = /^\S+\s+\S+\s+\S+\s+\S+\s+\d+\s+(.+)$/.exec(line);
    const path = m?.[1]?.replace(/ \(deleted\)$/, '');
    if (path === undefined || seen.has(path)) continue;
    if (DEVICE.test(path) || MAPPED.test(path)) {
      seen.add(path);
      evidence.push(`maps ${path}`);
    }
  }
  return evidence;
}

/** The innermost pid of a process (the last NSpid field), or its host pid on old kernels. */
export async function nsPidOf(pid: number): Promise<number | undefined> {
  const status = await procText(`/proc/${pid}/status`);
  if (status === undefined) return undefined;
  const f = /^NSpid:\s+(.*)$/m.exec(status)?.[1]?.trim().split(/\s+/);
  return f && f.length > 0 ? Number(f[f.length - 1]) : pid;
}

/** Every live process in the pid namespace of `pid1` (a sandbox's init), host pids, sorted. */
export async function pidsInNamespaceOf(pid1: number): Promise<number[]> {
  const ns = await readlink(`/proc/${pid1}/ns/pid`).catch(() => undefined);
  if (ns === undefined) return [];
  const out: number[] = [];
  for (const d of await readdir('/proc')) {
    if (!/^\d+$/.test(d)) continue;
    if ((await readlink(`/proc/${d}/ns/pid`).catch(() => undefined)) === ns) out.push(Number(d));
  }
  return out.sort((a, b) => a - b);
}

/** The processes among `pids` that hold GPU state. */
export async function gpuHolders(pids: readonly number[]): Promise<GpuHolder[]> {
  const out: GpuHolder[] = [];
  for (const pid of pids) {
    const evidence = await gpuEvidence(pid);
    if (evidence.length === 0) continue;
    const nsPid = await nsPidOf(pid);
    if (nsPid !== undefined) out.push({ pid, nsPid, evidence });
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// The helper

/** Where the helper may be: $DORMANT_CUDA_HELPER, setup.sh's install, `npm run build`'s output. */
export function cudaHelperCandidates(env: NodeJS.ProcessEnv = process.env): string[] {
  const here = dirname(fileURLToPath(import.meta.url));
  return [
    ...(env.DORMANT_CUDA_HELPER ? [env.DORMANT_CUDA_HELPER] : []),
    '/opt/dormant/bin/dormant-cuda-ckpt',
    join(here, '..', '..', 'build', 'native', 'dormant-cuda-ckpt'),
  ];
}

export async function locateCudaHelper(env: NodeJS.ProcessEnv = process.env): Promise<string | undefined> {
  for (const p of cudaHelperCandidates(env)) {
    if (
      await access(p, constants.X_OK)
        .then(() => true)
        .catch(() => false)
    )
      return p;
    // An explicit setting that does not work is not silently replaced by another helper.
    if (p === env.DORMANT_CUDA_HELPER) return undefined;
  }
  return undefined;
}

export interface CudaDevice {
  index: number;
  name: string;
  memoryBytes: number;
  uuid?: string;
}

export interface CudaInfo {
  /** cuDriverGetVersion: 12080 for CUDA 12.8. */
  driverApiVersion: number;
  checkpointApi: boolean;
  devices: CudaDevice[];
}

export type CudaStep = 'lock' | 'checkpoint' | 'restore' | 'unlock';

/** The helper's own error line (`{"error","code"}` on stderr), if it printed one. */
function helperError(stderr: string): { error: string; code: string } | undefined {
  for (const line of stderr.trim().split('\n').reverse()) {
    try {
      const v = JSON.parse(line) as { error?: unknown; code?: unknown };
      if (typeof v.error === 'string')
        return { error: v.error, code: typeof v.code === 'string' ? v.code : '' };
    } catch {
      // not a JSON line
    }
  }
  return undefined;
}

async function callHelper(helper: string, args: string[], timeoutMs: number): Promise<string> {
  const r = await run(helper, args, { timeoutMs, okExitCodes: [0, 1, 2, 64] });
  if (r.exitCode === 0) return r.stdout;
  const e = helperError(r.stderr);
  throw new DormantError(
    r.exitCode === 2 ? 'GPU_NO_DRIVER' : 'GPU_CHECKPOINT_FAILED',
    e?.error ?? `${helper} ${args.join(' ')} exited ${String(r.exitCode)}: ${r.stderr.trim().slice(-500)}`,
    {
      status: r.exitCode === 2 ? 409 : 500,
      details: { helper, args, exitCode: r.exitCode, cudaError: e?.code },
    },
  );
}

/** The driver's view of this node's GPUs; throws GPU_NO_DRIVER without a usable driver. */
export async function cudaInfo(helper: string): Promise<CudaInfo> {
  return JSON.parse(await callHelper(helper, ['info'], 60_000)) as CudaInfo;
}

/**
 * One step of the CUDA checkpoint protocol on host pid `pid`: lock (CUDA calls block),
 * checkpoint (device memory to host memory, GPU handles released), restore, unlock.
 */
export async function cudaStep(
  helper: string,
  step: CudaStep,
  pid: number,
  opts: { lockTimeoutMs?: number; timeoutMs?: number } = {},
): Promise<void> {
  const args = [step, String(pid)];
  if (step === 'lock') args.push(String(opts.lockTimeoutMs ?? 10_000));
  // Moving tens of GiB between device and host takes seconds; allow minutes.
  await callHelper(helper, args, opts.timeoutMs ?? 600_000);
}

/** A character device of the host to create inside a sandbox. */
export interface HostDevice {
  /** Path on the host and inside the sandbox, under /dev. */
  path: string;
  major: number;
  minor: number;
}

/** Linux dev_t split as glibc does (major: bits 8-19 and 32-43; minor: bits 0-7 and 20-31). */
function splitDev(rdev: number): { major: number; minor: number } {
  const hi = Math.floor(rdev / 2 ** 32);
  const lo = rdev >>> 0;
  return {
    major: ((lo >>> 8) & 0xfff) | ((hi & 0xfffff000) >>> 0),
    minor: (lo & 0xff) | ((lo >>> 12) & 0xfff00),
  };
}

/**
 * The NVIDIA device nodes a sandbox declared with `gpus` needs: the chosen GPUs
 * (`/dev/nvidiaN`; "all" or a comma list of indexes) and the control devices (nvidiactl,
 * nvidia-uvm, nvidia-uvm-tools, nvidia-modeset) that exist. Throws when a chosen GPU has no
 * device node.
 */
export async function nvidiaDeviceNodes(gpus: string, devDir = '/dev'): Promise<HostDevice[]> {
  const names = await readdir(devDir).catch(() => [] as string[]);
  const gpuNames = names
    .filter((n) => /^nvidia\d+$/.test(n))
    .sort((a, b) => Number(a.slice(6)) - Number(b.slice(6)));
  let chosen: string[];
  if (gpus === 'all') chosen = gpuNames;
  else {
    chosen = gpus.split(',').map((i) => `nvidia${i.trim()}`);
    const missing = chosen.filter((n) => !gpuNames.includes(n));
    if (missing.length > 0)
      throw new Error(`no device node ${missing.map((n) => `${devDir}/${n}`).join(', ')} on this node`);
  }
  if (chosen.length === 0) throw new Error(`no NVIDIA GPU device node (${devDir}/nvidiaN) on this node`);
  const control = ['nvidiactl', 'nvidia-uvm', 'nvidia-uvm-tools', 'nvidia-modeset'].filter((n) =>
    names.includes(n),
  );
  const out: HostDevice[] = [];
  for (const n of [...chosen, ...control]) {
    const st = await stat(join(devDir, n));
    if (!st.isCharacterDevice()) continue;
    out.push({ path: `/dev/${n}`, ...splitDev(st.rdev) });
  }
  return out;
}
