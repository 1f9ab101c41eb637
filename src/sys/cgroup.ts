/**
 * What a cgroup uses right now: memory held (the working set: usage less inactive file
 * cache, as the kernel could drop that) and CPU time so far. Works on cgroup v1 (memory and
 * cpuacct controllers) and v2 (memory.current, cpu.stat).
 */
import { readFile } from 'node:fs/promises';
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
