/**
 * Driving the criu binary: finding it, learning what it can do on this node, and running
 * dump and restore with the environment this node needs.
 *
 * Every call goes through sys/exec (timeout, abort, output kept). On machines where
 * hardware breakpoints do not fire (some VMs), criu's dump can hang waiting for a trap;
 * CRIU_FAULT=130 (FI_NO_BREAKPOINTS) makes it use PTRACE_SYSCALL instead, and
 * `criuEnvironment()` adds it to every call, including the ones runc makes for us.
 */
import { readFile, mkdir } from 'node:fs/promises';
import { join } from 'node:path';
import { DormantError, ErrorCode, errnoCode, isDormantError } from '../domain/errors.js';
import { versionAtLeast } from '../domain/version.js';
import { run, which, type RunOptions } from '../sys/exec.js';

/** The oldest CRIU that works here: 4.1 cannot dump inet sockets on kernels >= 6.16. */
export const MIN_CRIU_VERSION = '4.2';

export const CRIU_INSTALL_HINT =
  'run scripts/setup.sh as root (it installs CRIU >= 4.2 into /opt/dormant/criu and a criu wrapper on PATH), or set DORMANT_CRIU to a criu binary';

/** What `criu check` said about this node. */
export interface CriuCheck {
  ok: boolean;
  /** The whole output of `criu check`, for the doctor and for error messages. */
  output: string;
  hardwareBreakpointsWork: boolean;
}

export interface CriuInfo {
  path: string;
  version: string;
  check: CriuCheck;
  /** Environment every criu call needs on this node (CRIU_FAULT=130 where breakpoints fail). */
  env: Record<string, string>;
}

const BREAKPOINT_WARNING = /Hardware breakpoints don't seem to work/;

/** Where criu is: $DORMANT_CRIU, else `criu` on PATH. */
export async function locateCriu(env: NodeJS.ProcessEnv = process.env): Promise<string | undefined> {
  const configured = env.DORMANT_CRIU;
  if (configured !== undefined && configured !== '') return which(configured, env.PATH);
  return which('criu', env.PATH);
}

export async function criuVersion(path: string, opts: RunOptions = {}): Promise<string> {
  const r = await run(path, ['--version'], { timeoutMs: 10_000, ...opts });
  const m = /Version:\s*(\S+)/.exec(r.stdout);
  if (!m)
    throw new DormantError(
      ErrorCode.COMMAND_FAILED,
      `${path} --version printed no version: ${r.stdout.trim()}`,
    );
  return m[1]!;
}

/** Runs `criu check` (never throws for a failed check; the doctor reports it). */
export async function criuCheck(path: string, opts: RunOptions = {}): Promise<CriuCheck> {
  try {
    const r = await run(path, ['check'], { timeoutMs: 30_000, okExitCodes: [0, 1], ...opts });
    const output = `${r.stdout}${r.stderr}`.trim();
    return {
      ok: r.exitCode === 0 && /Looks good/.test(output),
      output,
      hardwareBreakpointsWork: !BREAKPOINT_WARNING.test(output),
    };
  } catch (e) {
    if (isDormantError(e)) {
      const output = typeof e.details?.output === 'string' ? e.details.output : e.message;
      return { ok: false, output, hardwareBreakpointsWork: !BREAKPOINT_WARNING.test(output) };
    }
    throw e;
  }
}

/** `criu check --feature NAME`: true when criu says it is supported. */
export async function criuFeature(path: string, feature: string, opts: RunOptions = {}): Promise<boolean> {
  try {
    const r = await run(path, ['check', '--feature', feature], {
      timeoutMs: 30_000,
      okExitCodes: [0, 1],
      ...opts,
    });
    return r.exitCode === 0 && !/not supported|is OFF|Error/i.test(`${r.stdout}${r.stderr}`);
  } catch (e) {
    if (isDormantError(e, ErrorCode.COMMAND_FAILED)) return false;
    throw e;
  }
}

/** The environment every criu call needs on a node with these check results. */
export function criuEnvironment(check: Pick<CriuCheck, 'hardwareBreakpointsWork'>): Record<string, string> {
  return check.hardwareBreakpointsWork ? {} : { CRIU_FAULT: '130' };
}

let cached: Promise<CriuInfo> | undefined;

/**
 * Finds criu and learns this node's needs once per process. Throws CRIU_NOT_FOUND or
 * CRIU_TOO_OLD with the install hint.
 */
export function getCriu(env: NodeJS.ProcessEnv = process.env): Promise<CriuInfo> {
  cached ??= (async () => {
    const path = await locateCriu(env);
    if (path === undefined) {
      throw new DormantError(
        ErrorCode.CRIU_NOT_FOUND,
        env.DORMANT_CRIU
          ? `DORMANT_CRIU=${env.DORMANT_CRIU} is not an executable file`
          : 'criu is not on PATH',
        { hint: CRIU_INSTALL_HINT },
      );
    }
    const version = await criuVersion(path);
    if (!versionAtLeast(version, MIN_CRIU_VERSION)) {
      throw new DormantError(
        ErrorCode.CRIU_TOO_OLD,
        `${path} is CRIU ${version}; dormant needs ${MIN_CRIU_VERSION} or newer (older ones cannot dump TCP sockets on this kernel)`,
        { hint: CRIU_INSTALL_HINT },
      );
    }
    const check = await criuCheck(path);
    return { path, version, check, env: criuEnvironment(check) };
  })();
  cached.catch(() => {
    cached = undefined;
  });
  return cached;
}

/** Reads the tail of a criu log file for an error message; empty when there is none. */
export async function readLogTail(file: string, bytes = 3000): Promise<string> {
  try {
    const text = await readFile(file, 'utf8');
    const lines = text.trimEnd();
    return lines.length <= bytes ? lines : `...${lines.slice(lines.length - bytes)}`;
  } catch (e) {
    if (errnoCode(e) === 'ENOENT') return '';
    throw e;
  }
}

export interface DumpOptions {
  /** Root of the process tree to dump. */
  pid: number;
  /**
   * Where the images go. Should be a private memory-backed folder: they are the process's
   * memory, unencrypted, and should not reach a disk.
   */
  imagesDir: string;
  /** Keep the processes running after the dump (a copy, not a move). Default false. */
  leaveRunning?: boolean;
  /** Dump established TCP connections so they can be restored (`--tcp-established`). */
  tcpEstablished?: boolean;
  /** The tree was started from a terminal or without a session of its own (`--shell-job`). */
  shellJob?: boolean;
  /** More criu options, e.g. `--ext-unix-sk`. */
  extraArgs?: readonly string[];
  timeoutMs?: number;
  signal?: AbortSignal;
}

export interface RestoreOptions {
  imagesDir: string;
  /** Folder for criu's log and pidfile; default: imagesDir. */
  workDir?: string;
  shellJob?: boolean;
  tcpEstablished?: boolean;
  /** A TCP connection that was established at dump time is closed on restore (`--tcp-close`). */
  tcpClose?: boolean;
  extraArgs?: readonly string[];
  timeoutMs?: number;
  signal?: AbortSignal;
}

/** Dumps a process tree with criu. On failure the error carries criu's log. */
export async function dumpProcess(opts: DumpOptions): Promise<{ durationMs: number; logFile: string }> {
  const criu = await getCriu();
  await mkdir(opts.imagesDir, { recursive: true, mode: 0o700 });
  const logName = 'dump.log';
  const args = ['dump', '-t', String(opts.pid), '-D', opts.imagesDir, '-o', logName, '-v4'];
  if (opts.leaveRunning) args.push('--leave-running');
  if (opts.tcpEstablished) args.push('--tcp-established');
  if (opts.shellJob) args.push('--shell-job');
  args.push(...(opts.extraArgs ?? []));
  const logFile = join(opts.imagesDir, logName);
  try {
    const r = await run(criu.path, args, {
      timeoutMs: opts.timeoutMs ?? 120_000,
      signal: opts.signal,
      env: criu.env,
    });
    return { durationMs: r.durationMs, logFile };
  } catch (e) {
    const log = await readLogTail(logFile);
    throw new DormantError(
      ErrorCode.CRIU_DUMP_FAILED,
      `criu dump of pid ${opts.pid} failed${log ? `; criu log:\n${log}` : ''}`,
      {
        cause: e,
        details: { log },
        hint: 'the process was left running; `dormant doctor` shows what this node supports',
      },
    );
  }
}

/**
 * Restores a dumped tree detached from us (`--restore-detached`): criu exits once the tree
 * runs. Returns the PID of the tree's root, which CRIU restores to the PID it had.
 */
export async function restoreProcess(opts: RestoreOptions): Promise<{ pid: number; durationMs: number }> {
  const criu = await getCriu();
  const workDir = opts.workDir ?? opts.imagesDir;
  await mkdir(workDir, { recursive: true, mode: 0o700 });
  const pidfile = join(workDir, 'restore.pid');
  const args = [
    'restore',
    '-D',
    opts.imagesDir,
    '-W',
    workDir,
    '-o',
    'restore.log',
    '-v4',
    '--restore-detached',
    '--pidfile',
    pidfile,
  ];
  if (opts.shellJob) args.push('--shell-job');
  if (opts.tcpEstablished) args.push('--tcp-established');
  if (opts.tcpClose) args.push('--tcp-close');
  args.push(...(opts.extraArgs ?? []));
  try {
    const r = await run(criu.path, args, {
      timeoutMs: opts.timeoutMs ?? 120_000,
      signal: opts.signal,
      env: criu.env,
    });
    const pid = Number.parseInt((await readFile(pidfile, 'utf8')).trim(), 10);
    if (!Number.isInteger(pid) || pid <= 0) {
      throw new DormantError(ErrorCode.CRIU_RESTORE_FAILED, `criu restore wrote no usable pid to ${pidfile}`);
    }
    return { pid, durationMs: r.durationMs };
  } catch (e) {
    if (isDormantError(e, ErrorCode.CRIU_RESTORE_FAILED)) throw e;
    const log = await readLogTail(join(workDir, 'restore.log'));
    throw new DormantError(
      ErrorCode.CRIU_RESTORE_FAILED,
      `criu restore from ${opts.imagesDir} failed${log ? `; criu log:\n${log}` : ''}`,
      {
        cause: e,
        details: { log },
        hint: 'the checkpoint images are left in place; `dormant doctor` shows what this node supports',
      },
    );
  }
}
