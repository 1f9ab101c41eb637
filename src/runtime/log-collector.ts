/**
 * The log collector: a tiny process group, independent of the daemon, that owns a pipe
 * and appends whatever comes through it to the sandbox's log file on the host.
 *
 *   sh (session leader, pid in collector.pid)
 *    ├─ keeper: `sleep` holding the pipe's write end as its stdout (pid in keeper.pid)
 *    └─ cat >> output.log, reading the pipe
 *
 * Why a pipe, and why this shape:
 * - CRIU cannot dump a container whose stdio is a host file outside its mounts, and runc
 *   records the container's stdio in descriptors.json: for `pipe:[inode]` entries, runc
 *   1.1.5's restore passes CRIU `--inherit-fd fd[i]:pipe:[inode]`, mapping the old pipe onto
 *   whatever runc restore's own fd i is. So the sandbox's stdout/stderr must be a real pipe
 *   (not Node's socketpairs, which CRIU would call an external unix socket).
 * - Node cannot make a pipe(2), but a shell pipeline can, and `/proc/<keeper>/fd/1` opened
 *   for writing is that same pipe. runc create and runc restore get it as stdout/stderr, so
 *   the sandbox writes into one pipe for its whole life, across any number of checkpoints.
 * - The keeper holds a write end, so `cat` never sees end-of-file while the sandbox is
 *   hibernated; if the collector is gone (a reboot), restore starts a new one and CRIU
 *   maps the old pipe onto the new pipe.
 * - It runs in its own session (setsid), so a daemon restart does not take it down.
 */
import { readFile, readlink, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';
import { run } from '../sys/exec.js';

const COLLECTOR_SCRIPT = [
  'exec </dev/null >/dev/null 2>&1',
  'dir=$1',
  'echo $$ > "$dir/collector.pid.tmp" && mv "$dir/collector.pid.tmp" "$dir/collector.pid"',
  // The keeper writes its own pid, then becomes a long sleep holding the pipe's write end.
  `sh -c 'echo $$ > "$1/keeper.pid.tmp" && mv "$1/keeper.pid.tmp" "$1/keeper.pid" && exec sleep 2147483647' keeper "$dir" | cat >> "$dir/output.log"`,
].join('\n');

export interface Collector {
  /** Session leader of the collector's process group. */
  pid: number;
  /** The keeper; `/proc/<keeperPid>/fd/1` is the pipe to give the sandbox as stdout. */
  keeperPid: number;
  /** Path to open for writing to get the pipe. */
  pipePath: string;
}

async function readPid(path: string): Promise<number | undefined> {
  try {
    const n = Number((await readFile(path, 'utf8')).trim());
    return Number.isInteger(n) && n > 0 ? n : undefined;
  } catch (e) {
    if (errnoCode(e) === 'ENOENT') return undefined;
    throw e;
  }
}

async function parentOf(pid: number): Promise<number | undefined> {
  try {
    const stat = await readFile(`/proc/${pid}/stat`, 'utf8');
    // Fields after the command name, which is in parentheses and may contain spaces.
    const rest = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    return Number(rest[1]);
  } catch (e) {
    if (errnoCode(e) === 'ENOENT') return undefined;
    throw e;
  }
}

/** The running collector for `logDir`, if it is alive and still the one we started. */
export async function findCollector(logDir: string): Promise<Collector | undefined> {
  const pid = await readPid(join(logDir, 'collector.pid'));
  const keeperPid = await readPid(join(logDir, 'keeper.pid'));
  if (pid === undefined || keeperPid === undefined) return undefined;
  try {
    // Guard against pid reuse: the leader's command line names this log folder, the keeper
    // is its child, and the keeper's stdout is a pipe.
    const cmdline = (await readFile(`/proc/${pid}/cmdline`, 'utf8')).split('\0');
    if (!cmdline.includes(logDir)) return undefined;
    if ((await parentOf(keeperPid)) !== pid) return undefined;
    const out = await readlink(`/proc/${keeperPid}/fd/1`);
    if (!out.startsWith('pipe:')) return undefined;
  } catch (e) {
    if (errnoCode(e) === 'ENOENT') return undefined;
    throw e;
  }
  return { pid, keeperPid, pipePath: `/proc/${keeperPid}/fd/1` };
}

/** Starts a collector for `logDir` unless one is running; returns it. */
export async function ensureCollector(logDir: string, signal?: AbortSignal): Promise<Collector> {
  const existing = await findCollector(logDir);
  if (existing) return existing;
  // Stale pid files would let findCollector() below answer before the new one is up.
  for (const f of ['collector.pid', 'keeper.pid']) await rm(join(logDir, f), { force: true });
  await run('setsid', ['-f', 'sh', '-c', COLLECTOR_SCRIPT, 'dormant-log-collector', logDir], {
    timeoutMs: 5000,
    signal,
  });
  const deadline = Date.now() + 5000;
  while (Date.now() < deadline) {
    const c = await findCollector(logDir);
    if (c) return c;
    await new Promise((r) => setTimeout(r, 20));
  }
  throw new DormantError(ErrorCode.RUNTIME_LOG_FAILED, `the log collector in ${logDir} did not start`, {
    hint: 'check that sh, setsid, sleep and cat are on PATH',
  });
}

/** Ends the collector's process group (ours: it leads its own session). */
export async function stopCollector(logDir: string): Promise<void> {
  const c = await findCollector(logDir);
  if (!c) return;
  try {
    process.kill(-c.pid, 'SIGTERM');
  } catch (e) {
    if (errnoCode(e) !== 'ESRCH') throw e;
    return;
  }
  const deadline = Date.now() + 2000;
  while (Date.now() < deadline) {
    try {
      process.kill(c.pid, 0);
    } catch (e) {
      if (errnoCode(e) === 'ESRCH') return;
      throw e;
    }
    await new Promise((r) => setTimeout(r, 20));
  }
  try {
    process.kill(-c.pid, 'SIGKILL');
  } catch (e) {
    if (errnoCode(e) !== 'ESRCH') throw e;
  }
}
