/**
 * What a cgroup uses right now: memory held (the working set: usage less inactive file
 * cache, as the kernel could drop that) and CPU time so far. Works on cgroup v1 (memory and
 * cpuacct controllers) and v2 (memory.current, cpu.stat).
 */
import { readFile, readdir, rmdir, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { errnoCode } from '../domain/errors.js';

export interface CgroupUsage {
  memoryBytes: number;
  cpuUsageUsec: number;
}

async function readNumber(path: string): Promise<number | undefined> {
  try {
    const n = Number((await readFile(path, 'utf8')).trim());
    return Number.isFinite(n) ? n : undefined;
  } catch (e) {
    if (errnoCode(e) === 'ENOENT' || errnoCode(e) === 'ENODEV') return undefined;
    throw e;
  }
}

async function readStat(path: string): Promise<Map<string, number>> {
  const m = new Map<string, number>();
  try {
    for (const line of (await readFile(path, 'utf8')).split('\n')) {
      const [k, v] = line.split(' ');
      if (k && v) m.set(k, Number(v));
    }
  } catch (e) {
    if (errnoCode(e) !== 'ENOENT' && errnoCode(e) !== 'ENODEV') throw e;
  }
  return m;
}

/**
 * Usage of the cgroup at `relPath` (e.g. `/dormant/sb-...`), or undefined when it does not
 * exist (the sandbox has no processes). `root` is where cgroups are mounted.
 */
export async function cgroupUsage(
  relPath: string,
  root = '/sys/fs/cgroup',
): Promise<CgroupUsage | undefined> {
  // cgroup v1: separate memory and cpuacct hierarchies.
  const v1mem = await readNumber(join(root, 'memory', relPath, 'memory.usage_in_bytes'));
  if (v1mem !== undefined) {
    const st = await readStat(join(root, 'memory', relPath, 'memory.stat'));
    const inactive = st.get('total_inactive_file') ?? 0;
    const cpuNs = (await readNumber(join(root, 'cpuacct', relPath, 'cpuacct.usage'))) ?? 0;
    return { memoryBytes: Math.max(0, v1mem - inactive), cpuUsageUsec: Math.round(cpuNs / 1000) };
  }
  const v2mem = await readNumber(join(root, relPath, 'memory.current'));
  if (v2mem !== undefined) {
    const st = await readStat(join(root, relPath, 'memory.stat'));
    const cpu = await readStat(join(root, relPath, 'cpu.stat'));
    return {
      memoryBytes: Math.max(0, v2mem - (st.get('inactive_file') ?? 0)),
      cpuUsageUsec: cpu.get('usage_usec') ?? 0,
    };
  }
  return undefined;
}

/**
 * Where every cgroup hierarchy is mounted, from /proc/self/mountinfo: one folder per v1
 * controller (or group of them) plus the v2 tree (/sys/fs/cgroup/unified on a hybrid host,
 * /sys/fs/cgroup itself on a pure v2 one). Mounts below others (CRIU's cgroup yard in a work
 * dir, a container's) are the same hierarchies again and are left out.
 */
export async function cgroupMounts(): Promise<string[]> {
  const points: string[] = [];
  for (const line of (await readFile('/proc/self/mountinfo', 'utf8')).split('\n')) {
    const f = line.split(' ');
    const sep = f.indexOf('-');
    const fstype = sep > 0 ? f[sep + 1] : undefined;
    if ((fstype === 'cgroup' || fstype === 'cgroup2') && f[4] !== undefined) points.push(f[4]);
  }
  const top = points.filter((p) => !points.some((q) => q !== p && p.startsWith(`${q}/`)));
  return [...new Set(top)];
}

/** Every folder of the cgroup at `dir` and below it, children first. */
async function subtree(dir: string): Promise<string[]> {
  let entries;
  try {
    entries = await readdir(dir, { withFileTypes: true });
  } catch (e) {
    if (errnoCode(e) === 'ENOENT' || errnoCode(e) === 'ENOTDIR') return [];
    throw e;
  }
  const below: string[] = [];
  for (const d of entries) if (d.isDirectory()) below.push(...(await subtree(join(dir, d.name))));
  return [...below, dir];
}

async function procsOf(dir: string): Promise<number[]> {
  try {
    return (await readFile(join(dir, 'cgroup.procs'), 'utf8'))
      .split('\n')
      .filter((l) => /^\d+$/.test(l))
      .map(Number);
  } catch (e) {
    if (errnoCode(e) === 'ENOENT' || errnoCode(e) === 'ENODEV') return [];
    throw e;
  }
}

/**
 * Removes the cgroup at `relPath` (e.g. `/dormant/sb-...`) and every cgroup below it, in every
 * hierarchy (each v1 controller, the v2 tree). Processes still in them are SIGKILLed first (a
 * frozen v1 freezer group is thawed so they can die), for at most `timeoutMs`. Returns the
 * folders that could not be removed (empty when the cgroup is gone everywhere).
 */
export async function removeCgroupEverywhere(
  relPath: string,
  opts: { timeoutMs?: number; mounts?: readonly string[] } = {},
): Promise<string[]> {
  if (!relPath.startsWith('/') || relPath.split('/').includes('..') || relPath === '/')
    throw new Error(`removeCgroupEverywhere: ${relPath} is not a cgroup below the root`);
  const mounts = opts.mounts ?? (await cgroupMounts());
  const deadline = Date.now() + (opts.timeoutMs ?? 10_000);
  let left: string[] = [];
  for (let wait = 5; ; wait = Math.min(wait * 2, 100)) {
    const dirs = (await Promise.all(mounts.map((m) => subtree(join(m, relPath))))).flat();
    let pids = 0;
    for (const d of dirs) {
      const procs = await procsOf(d);
      pids += procs.length;
      for (const pid of procs) {
        try {
          process.kill(pid, 'SIGKILL');
        } catch (e) {
          if (errnoCode(e) !== 'ESRCH') throw e;
        }
      }
      // A frozen task dies only once thawed (v1 freezer; v2's cgroup.freeze).
      if (procs.length > 0)
        for (const [file, value] of [
          ['freezer.state', 'THAWED'],
          ['cgroup.freeze', '0'],
        ] as const)
          await writeFile(join(d, file), value, { flag: 'r+' }).catch((e: unknown) => {
            if (errnoCode(e) !== 'ENOENT') throw e;
          });
    }
    left = [];
    if (pids === 0)
      for (const d of dirs) {
        try {
          await rmdir(d);
        } catch (e) {
          const code = errnoCode(e);
          if (code === 'ENOENT') continue;
          if (code !== 'EBUSY' && code !== 'ENOTEMPTY') throw e;
          left.push(d);
        }
      }
    else left = dirs;
    if (left.length === 0 || Date.now() > deadline) return left;
    await new Promise((r) => setTimeout(r, wait));
  }
}
