/**
 * Interactive terminals inside a sandbox, shaped like E2B's `sandbox.pty`. A PTY is a
 * background command (`/bin/sh -i` on a new pseudo-terminal) whose output arrives as raw bytes
 * on its output stream; keys go in through the stdin route and a resize through its own. All
 * plain HTTP, so the SDK needs no WebSocket client (Node 20 has none built in); the daemon's
 * WebSocket route serves clients that have one. Its id is its `pid`, as in E2B.
 *
 * @example
 * ```ts
 * const term = await sb.pty.create({ cols: 80, rows: 24, onData: (b) => process.stdout.write(b) });
 * await sb.pty.sendInput(term.pid, new TextEncoder().encode('ls\n'));
 * await sb.pty.resize(term.pid, { cols: 120, rows: 40 });
 * await sb.pty.kill(term.pid);
 * ```
 */
import type { CallOptions } from './client.js';
import type { CommandHandle, Commands } from './commands.js';

/** How to open a terminal. */
export interface PtyCreateOptions extends CallOptions {
  cols: number;
  rows: number;
  /** The terminal's output, raw bytes (escape sequences included). */
  onData: (data: Uint8Array) => void | Promise<void>;
  /** Working directory; default: the sandbox's. */
  cwd?: string;
  /** Added to the environment; `TERM` defaults to `xterm-256color`. */
  envs?: Record<string, string>;
  /** The shell is killed after this long; 0 = never. Default 60 000, as in E2B. */
  timeoutMs?: number;
}

/** `sandbox.pty`. */
export class Pty {
  /** @internal */
  constructor(private readonly commands: Commands) {}

  /** Starts a shell on a new terminal; the handle's `pid` names it for the calls below. */
  create(opts: PtyCreateOptions): Promise<CommandHandle> {
    return this.commands.run('exec /bin/sh -i', {
      background: true,
      pty: { cols: opts.cols, rows: opts.rows },
      envs: { TERM: 'xterm-256color', ...opts.envs },
      timeoutMs: opts.timeoutMs ?? 60_000,
      onStdoutBytes: opts.onData,
      tag: 'pty',
      ...(opts.cwd !== undefined ? { cwd: opts.cwd } : {}),
      ...(opts.signal ? { signal: opts.signal } : {}),
    });
  }

  /** Types into the terminal (raw bytes: `\x03` is Ctrl-C). */
  sendInput(pid: number, data: Uint8Array, opts?: CallOptions): Promise<void> {
    return this.commands.sendStdin(pid, data, opts);
  }

  /** Changes the terminal's size (the shell gets SIGWINCH). */
  resize(pid: number, size: { cols: number; rows: number }, opts?: CallOptions): Promise<void> {
    return this.commands.resize(pid, size, opts);
  }

  /** Ends the terminal's shell (SIGKILL); false when it had already ended. */
  kill(pid: number, opts?: CallOptions): Promise<boolean> {
    return this.commands.kill(pid, opts);
  }
}
