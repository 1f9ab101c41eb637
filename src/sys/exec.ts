/**
 * The one place the project runs external commands (criu, runc, ip, iptables, ...).
 *
 * Every call has a timeout and may take an AbortSignal; a command that outlives either is
 * sent SIGTERM, then SIGKILL after a grace period, together with every process in its
 * process group, so nothing in dormant can hang on a stuck child. Output is kept (bounded)
 * so that an error can say what the command printed.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { access, constants } from 'node:fs/promises';
import { join } from 'node:path';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';
import { launch, type Launched } from './launcher.js';

export interface RunOptions {
  /** Hard limit for the whole run. Required in spirit: the default is 60 s, never infinite. */
  timeoutMs?: number;
  signal?: AbortSignal;
  /** Variables added to (or, with `inheritEnv: false`, replacing) the parent's environment. */
  env?: Record<string, string | undefined>;
  inheritEnv?: boolean;
  cwd?: string;
  /** Bytes written to the child's stdin, which is then closed. Default: stdin is /dev/null. */
  input?: string | Buffer;
  /** Exit codes that count as success. Default [0]. */
  okExitCodes?: readonly number[];
  /** Keep at most this many bytes of stdout and of stderr (the tail is kept). Default 16 MiB. */
  maxOutputBytes?: number;
  /** After SIGTERM, wait this long before SIGKILL. Default 2 s. */
  killGraceMs?: number;
  /** Called with each chunk of output as it arrives (progress, live logs). */
  onStdout?: (chunk: Buffer) => void;
  onStderr?: (chunk: Buffer) => void;
}

export interface RunResult {
  command: string;
  args: readonly string[];
  exitCode: number | null;
  signal: NodeJS.Signals | null;
  stdout: string;
  stderr: string;
  durationMs: number;
  /** True when a byte limit cut the front of stdout or stderr. */
  truncated: boolean;
}

const DEFAULT_TIMEOUT_MS = 60_000;
const DEFAULT_MAX_OUTPUT = 16 * 1024 * 1024;
/** How much output an error message carries. */
const ERROR_TAIL_BYTES = 4000;

/** A bounded buffer that keeps the tail of what it is given. */
class TailBuffer {
  private chunks: Buffer[] = [];
  private size = 0;
  truncated = false;
  constructor(private readonly limit: number) {}
  push(b: Buffer): void {
    this.chunks.push(b);
    this.size += b.length;
    while (this.size > this.limit && this.chunks.length > 0) {
      const first = this.chunks[0]!;
      const excess = this.size - this.limit;
      if (first.length <= excess) {
        this.chunks.shift();
        this.size -= first.length;
      } else {
        this.chunks[0] = first.subarray(excess);
        this.size -= excess;
      }
      this.truncated = true;
    }
  }
  toString(): string {
    return Buffer.concat(this.chunks).toString('utf8');
  }
}

function tail(text: string, bytes = ERROR_TAIL_BYTES): string {
  const t = text.trimEnd();
  return t.length <= bytes ? t : `...${t.slice(t.length - bytes)}`;
}

/** A one-line rendering of a command for messages; arguments are shown, environment is not. */
export function describeCommand(command: string, args: readonly string[]): string {
  const quote = (a: string): string => (/^[\w@%+=:,./-]+$/.test(a) ? a : `'${a.replace(/'/g, `'\\''`)}'`);
  return [command, ...args].map(quote).join(' ');
}

function killGroup(pid: number | undefined, child: ChildProcess | undefined, sig: NodeJS.Signals): void {
  if (pid === undefined) return;
  try {
    // The child leads its own process group (detached), so this reaches its helpers too.
    process.kill(-pid, sig);
  } catch (e) {
    if (errnoCode(e) !== 'ESRCH') {
      try {
        if (child) child.kill(sig);
        else process.kill(pid, sig);
      } catch {
        // Already gone: nothing left to signal.
      }
    }
  }
}

/**
 * Runs `command args...` and resolves with its output. Rejects with a DormantError:
 * COMMAND_NOT_FOUND, COMMAND_TIMEOUT, COMMAND_ABORTED, or COMMAND_FAILED (a non-ok exit),
 * each carrying the command line and the tail of its output in the message and `details`.
 */
export function run(command: string, args: readonly string[], options: RunOptions = {}): Promise<RunResult> {
  const timeoutMs = options.timeoutMs ?? DEFAULT_TIMEOUT_MS;
  const okExitCodes = options.okExitCodes ?? [0];
  const graceMs = options.killGraceMs ?? 2000;
  const limit = options.maxOutputBytes ?? DEFAULT_MAX_OUTPUT;
  const cmdline = describeCommand(command, args);
  const started = performance.now();

  if (options.signal?.aborted) {
    return Promise.reject(
      new DormantError(ErrorCode.COMMAND_ABORTED, `${cmdline}: aborted before it started`, {
        cause: options.signal.reason,
      }),
    );
  }

  const env: Record<string, string> = {};
  if (options.inheritEnv !== false) {
    for (const [k, v] of Object.entries(process.env)) if (v !== undefined) env[k] = v;
  }
  for (const [k, v] of Object.entries(options.env ?? {})) {
    if (v === undefined) Reflect.deleteProperty(env, k);
    else env[k] = v;
  }

  return new Promise<RunResult>((resolve, reject) => {
    /** The command's pid once known (its process group's id: it leads one). */
    let pid: number | undefined;
    let child: ChildProcess | undefined;
    let launched: Launched | undefined = undefined;
    const out = new TailBuffer(limit);
    const err = new TailBuffer(limit);
    let stopReason: 'timeout' | 'abort' | undefined;
    let killTimer: NodeJS.Timeout | undefined;
    let graceOver = false;
    let settled = false;

    /** Ends the call's own bookkeeping, once: false when it had already ended. */
    const settle = (): boolean => {
      if (settled) return false;
      settled = true;
      clearTimeout(timer);
      if (killTimer) clearTimeout(killTimer);
      options.signal?.removeEventListener('abort', onAbort);
      // A grandchild may still hold the pipes open; do not wait on it.
      child?.stdout?.destroy();
      child?.stderr?.destroy();
      launched?.done();
      return true;
    };
    const couldNotStart = (what: string, cause?: unknown): void => {
      if (!settle()) return;
      reject(
        new DormantError(ErrorCode.COMMAND_FAILED, `${cmdline}: could not start: ${what}`, {
          ...(cause !== undefined ? { cause } : {}),
        }),
      );
    };

    const stop = (why: 'timeout' | 'abort'): void => {
      if (stopReason !== undefined || settled) return;
      stopReason = why;
      killGroup(pid, child, 'SIGTERM');
      killTimer = setTimeout(() => {
        graceOver = true;
        killGroup(pid, child, 'SIGKILL');
      }, graceMs);
      killTimer.unref();
    };
    const timer = setTimeout(() => stop('timeout'), timeoutMs);
    const onAbort = (): void => stop('abort');
    options.signal?.addEventListener('abort', onAbort, { once: true });

    const onOut = (b: Buffer): void => {
      out.push(b);
      options.onStdout?.(b);
    };
    const onErr = (b: Buffer): void => {
      err.push(b);
      options.onStderr?.(b);
    };
    const notFound = (code: string | undefined, cause: unknown): boolean => {
      if ((code !== 'ENOENT' && code !== 'EACCES') || !settle()) return false;
      reject(
        new DormantError(ErrorCode.COMMAND_NOT_FOUND, `${command}: not found or not executable (${code})`, {
          cause,
          hint: `install ${command} or put it on PATH (scripts/setup.sh installs what dormant needs)`,
        }),
      );
      return true;
    };
    // 'close' normally follows 'exit' once the pipes drain, but it waits for every holder of
    // the pipes, and a daemonised grandchild (criu restore -d, runc) may hold them for ever:
    // then 'exit' plus a short drain settles it.
    const onExit = (code: number | null, sig: NodeJS.Signals | null): void => {
      setTimeout(() => finish(code, sig), 250);
    };
    const finish = (exitCode: number | null, sig: NodeJS.Signals | null): void => {
      if (!settle()) return;
      const result: RunResult = {
        command,
        args,
        exitCode,
        signal: sig,
        stdout: out.toString(),
        stderr: err.toString(),
        durationMs: Math.round(performance.now() - started),
        truncated: out.truncated || err.truncated,
      };
      const output = tail([result.stderr.trim(), result.stdout.trim()].filter(Boolean).join('\n'));
      const details = { command: cmdline, exitCode, signal: sig, output, durationMs: result.durationMs };
      if (stopReason === 'timeout') {
        reject(
          new DormantError(
            ErrorCode.COMMAND_TIMEOUT,
            `${cmdline}: killed after ${timeoutMs} ms timeout${output ? `; output:\n${output}` : ' (no output)'}`,
            { details },
          ),
        );
      } else if (stopReason === 'abort') {
        reject(
          new DormantError(
            ErrorCode.COMMAND_ABORTED,
            `${cmdline}: aborted${output ? `; output:\n${output}` : ''}`,
            {
              details,
              cause: options.signal?.reason,
            },
          ),
        );
      } else if (exitCode === null || !okExitCodes.includes(exitCode)) {
        const how = exitCode === null ? `killed by ${sig ?? 'a signal'}` : `exited with ${exitCode}`;
        reject(
          new DormantError(
            ErrorCode.COMMAND_FAILED,
            `${cmdline}: ${how}${output ? `; output:\n${output}` : ''}`,
            {
              details,
            },
          ),
        );
      } else {
        resolve(result);
      }
    };

    const request = { cmd: command, args, cwd: options.cwd, env, input: options.input };
    launched = launch(request, {
      pid: (p) => {
        pid = p;
        // Stopped before the pid came: stop it now (past the grace period: at once).
        if (stopReason !== undefined && !settled)
          killGroup(pid, undefined, graceOver ? 'SIGKILL' : 'SIGTERM');
      },
      out: (fd, b) => (fd === 1 ? onOut(b) : onErr(b)),
      error: (code, message) => {
        if (!notFound(code, new Error(message))) finish(null, null);
      },
      thrown: (message) => couldNotStart(message),
      exit: onExit,
      close: (code, sig) => finish(code, sig),
      lost: (killed) => {
        if (!settle()) return;
        reject(
          new DormantError(
            ErrorCode.COMMAND_FAILED,
            `${cmdline}: the command launcher died while it ran; ${killed ? 'the command was killed' : 'the command had not started or had ended'}`,
          ),
        );
      },
    });
    if (launched) return;

    // No launcher: this process spawns the command.
    try {
      child = spawn(command, [...args], {
        cwd: options.cwd,
        env,
        detached: true,
        stdio: [options.input === undefined ? 'ignore' : 'pipe', 'pipe', 'pipe'],
      });
    } catch (e) {
      couldNotStart(String(e), e);
      return;
    }
    pid = child.pid;
    child.stdout?.on('data', onOut);
    child.stderr?.on('data', onErr);
    if (options.input !== undefined && child.stdin) {
      child.stdin.on('error', () => {
        // The child may exit without reading its input (EPIPE); its exit status tells the story.
      });
      child.stdin.end(options.input);
    }
    child.on('error', (e) => {
      if (!notFound(errnoCode(e), e)) finish(null, null);
    });
    child.on('exit', onExit);
    child.on('close', (code: number | null, sig: NodeJS.Signals | null) => finish(code, sig));
  });
}

/** Looks a program up on PATH (or checks a path given with a slash). Undefined when absent. */
export async function which(program: string, pathEnv = process.env.PATH ?? ''): Promise<string | undefined> {
  const candidates = program.includes('/')
    ? [program]
    : pathEnv
        .split(':')
        .filter(Boolean)
        .map((d) => join(d, program));
  for (const c of candidates) {
    try {
      await access(c, constants.X_OK);
      return c;
    } catch {
      // Not here; try the next folder on PATH.
    }
  }
  return undefined;
}
