/** Facts about this node that the doctor and restore-time compatibility checks read. */
import { mkdir, readFile, rmdir, statfs, writeFile, access, open } from 'node:fs/promises';
import { arch, cpus, release } from 'node:os';
import { dirname, join } from 'node:path';
import { errnoCode } from '../domain/errors.js';

export interface CgroupFacts {
  /** 'v2' (unified only), 'v1' (no cgroup2 mount) or 'hybrid' (v1 controllers plus a cgroup2 mount). */
  mode: 'v1' | 'v2' | 'hybrid';
  unifiedMount: string | undefined;
  v1Controllers: string[];
}

export interface FreezerFacts {
  /** Which freezer dormant can use: the v1 freezer controller or cgroup v2's cgroup.freeze. */
  kind: 'v1' | 'v2' | undefined;
  /** A test cgroup was created, frozen, thawed and removed. */
  tested: boolean;
  detail: string;
}

interface MountEntry {
  mountPoint: string;
  fsType: string;
  options: string[];
}

async function mounts(): Promise<MountEntry[]> {
  const text = await readFile('/proc/self/mounts', 'utf8');
  return text
    .split('\n')
    .filter(Boolean)
    .map((line) => {
      const f = line.split(' ');
      return {
        mountPoint: (f[1] ?? '').replace(/\\040/g, ' '),
        fsType: f[2] ?? '',
        options: (f[3] ?? '').split(','),
      };
    });
}

export async function cgroupFacts(): Promise<CgroupFacts> {
  const all = await mounts();
  const v2 = all.find((m) => m.fsType === 'cgroup2');
  const v1 = all.filter((m) => m.fsType === 'cgroup');
  const v1Controllers = v1.flatMap((m) =>
    m.options.filter(
      (o) => !['rw', 'ro', 'relatime', 'nosuid', 'nodev', 'noexec'].includes(o) && !o.startsWith('name='),
    ),
  );
  const mode = v1.length === 0 ? 'v2' : v2 ? 'hybrid' : 'v1';
  return { mode, unifiedMount: v2?.mountPoint, v1Controllers: [...new Set(v1Controllers)].sort() };
}

/** Where the v1 freezer controller is mounted, if it is. */
async function v1FreezerMount(): Promise<string | undefined> {
  const all = await mounts();
  return all.find((m) => m.fsType === 'cgroup' && m.options.includes('freezer'))?.mountPoint;
}

/**
 * Proves the freezer works by freezing an empty test cgroup and thawing it again. runc uses
 * the v1 freezer whenever the freezer controller is mounted as v1, so that one is tried first.
 */
export async function probeFreezer(): Promise<FreezerFacts> {
  const name = `dormant-doctor-${process.pid}`;
  const v1 = await v1FreezerMount();
  if (v1 !== undefined) {
    const dir = join(v1, name);
    try {
      await mkdir(dir);
      await writeFile(join(dir, 'freezer.state'), 'FROZEN');
      const frozen = (await readFile(join(dir, 'freezer.state'), 'utf8')).trim();
      await writeFile(join(dir, 'freezer.state'), 'THAWED');
      return {
        kind: 'v1',
        tested: frozen === 'FROZEN',
        detail: `v1 freezer at ${v1} (froze and thawed a test cgroup)`,
      };
    } catch (e) {
      return {
        kind: 'v1',
        tested: false,
        detail: `v1 freezer at ${v1}, but a test cgroup failed: ${String(e)}`,
      };
    } finally {
      await rmdir(dir).catch(() => undefined);
    }
  }
  const { unifiedMount } = await cgroupFacts();
  if (unifiedMount !== undefined) {
    const dir = join(unifiedMount, name);
    try {
      await mkdir(dir);
      await writeFile(join(dir, 'cgroup.freeze'), '1');
      const events = await readFile(join(dir, 'cgroup.events'), 'utf8');
      await writeFile(join(dir, 'cgroup.freeze'), '0');
      return {
        kind: 'v2',
        tested: /frozen 1/.test(events),
        detail: `cgroup v2 cgroup.freeze at ${unifiedMount} (froze and thawed a test cgroup)`,
      };
    } catch (e) {
      return {
        kind: 'v2',
        tested: false,
        detail: `cgroup v2 at ${unifiedMount}, but a test cgroup failed: ${String(e)}`,
      };
    } finally {
      await rmdir(dir).catch(() => undefined);
    }
  }
  return {
    kind: undefined,
    tested: false,
    detail: 'no freezer: neither a v1 freezer controller nor a cgroup2 mount',
  };
}

export interface CpuFacts {
  arch: string;
  model: string;
  cores: number;
  /** Flags from /proc/cpuinfo, which a restore compares with the checkpoint's. */
  flags: string[];
}

export async function cpuFacts(): Promise<CpuFacts> {
  let flags: string[] = [];
  try {
    const info = await readFile('/proc/cpuinfo', 'utf8');
    const line = /^(?:flags|Features)\s*:\s*(.*)$/m.exec(info);
    flags = line ? line[1]!.trim().split(/\s+/) : [];
  } catch (e) {
    if (errnoCode(e) !== 'ENOENT') throw e;
  }
  return { arch: arch(), model: cpus()[0]?.model ?? 'unknown', cores: cpus().length, flags };
}

export function kernelRelease(): string {
  return release();
}

export interface DiskFacts {
  /** The folder asked about, and the existing folder whose filesystem was measured. */
  path: string;
  measuredAt: string;
  freeBytes: number;
  totalBytes: number;
}

/** Free space for a folder that may not exist yet (measured at its nearest existing parent). */
export async function diskFacts(path: string): Promise<DiskFacts> {
  let p = path;
  for (;;) {
    try {
      const s = await statfs(p);
      return { path, measuredAt: p, freeBytes: s.bavail * s.bsize, totalBytes: s.blocks * s.bsize };
    } catch (e) {
      if (errnoCode(e) !== 'ENOENT' || p === '/') throw e;
      p = dirname(p);
    }
  }
}

export interface UffdFacts {
  available: boolean;
  detail: string;
}

/** userfaultfd, which CRIU's lazy restore needs: the syscall for root, or /dev/userfaultfd. */
export async function userfaultfdFacts(): Promise<UffdFacts> {
  const dev = await access('/dev/userfaultfd')
    .then(() => true)
    .catch(() => false);
  const sysctl = await readFile('/proc/sys/vm/unprivileged_userfaultfd', 'utf8').catch(() => undefined);
  if (sysctl === undefined && !dev) return { available: false, detail: 'kernel has no userfaultfd' };
  return { available: true, detail: dev ? '/dev/userfaultfd present' : 'userfaultfd syscall present' };
}

export interface NvidiaFacts {
  driverVersion: string | undefined;
  /** Path of libcuda, when found. */
  libcuda: string | undefined;
  /** libcuda exports cuCheckpointProcessLock (driver 570+). */
  checkpointApi: boolean;
}

const LIBCUDA_PATHS = [
  '/usr/lib/x86_64-linux-gnu/libcuda.so.1',
  '/usr/lib/aarch64-linux-gnu/libcuda.so.1',
  '/usr/lib64/libcuda.so.1',
  '/usr/local/cuda/lib64/stubs/libcuda.so',
];

async function fileContains(path: string, needle: string): Promise<boolean> {
  const fh = await open(path, 'r');
  try {
    const want = Buffer.from(needle);
    const buf = Buffer.alloc(1 << 20);
    let carry = Buffer.alloc(0);
    for (;;) {
      const { bytesRead } = await fh.read(buf, 0, buf.length, null);
      if (bytesRead === 0) return false;
      const hay = Buffer.concat([carry, buf.subarray(0, bytesRead)]);
      if (hay.includes(want)) return true;
      carry = hay.subarray(Math.max(0, hay.length - want.length));
    }
  } finally {
    await fh.close();
  }
}

export async function nvidiaFacts(): Promise<NvidiaFacts> {
  let driverVersion: string | undefined;
  try {
    const text = await readFile('/proc/driver/nvidia/version', 'utf8');
    driverVersion =
      /Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)+)/.exec(text)?.[1] ??
      /(\d{3}\.\d+(?:\.\d+)?)/.exec(text)?.[1];
  } catch (e) {
    if (errnoCode(e) !== 'ENOENT') throw e;
  }
  let libcuda: string | undefined;
  for (const p of LIBCUDA_PATHS) {
    if (
      await access(p)
        .then(() => true)
        .catch(() => false)
    ) {
      libcuda = p;
      break;
    }
  }
  const checkpointApi = libcuda !== undefined && (await fileContains(libcuda, 'cuCheckpointProcessLock'));
  return { driverVersion, libcuda, checkpointApi };
}
