/**
 * Commands inside a sandbox, shaped like E2B's `sandbox.commands`: `run` streams output as it
 * comes (the ndjson route `POST /v1/sandboxes/{id}/commands`), a background command gives a
 * {@link CommandHandle} to wait on, feed, kill or leave, and `connect` follows a command
 * started earlier (its output is replayed from the start, then followed). A command's id is
 * its `pid` inside the sandbox, as in E2B. Every call wakes a sleeping sandbox first.
 *
 * @example
 * ```ts
 * const r = await sb.commands.run('ls -l /', { onStdout: (d) => process.stdout.write(d) });
 * const server = await sb.commands.run('python3 -m http.server 8080', { background: true });
 * await server.kill();
 * ```
 */
import type { CallOptions, DormantClient } from './client.js';
import { apiError, DormantApiError } from './errors.js';
import { fromBase64, readNdjson } from './ndjson.js';
import type { CommandEvent, CommandInfo } from './contract.gen.js';

/** What a finished command did. */
export interface CommandResult {
  /** The exit code; -1 when a signal ended it (then `error` says which). */
  exitCode: number;
  stdout: string;
  stderr: string;
  /** Why it did not exit by itself: `killed by SIGKILL`, `timed out after 1000 ms`. */
  error?: string;
}

/**
 * A command ended with a non-zero exit code, or by a signal or its timeout, as E2B's
 * `CommandExitError`: it carries the whole result.
 * @example
 * ```ts
 * try { await sb.commands.run('exit 3'); } catch (e) { if (e instanceof CommandExitError) e.exitCode; }
 * ```
 */
export class CommandExitError extends Error implements CommandResult {
  override readonly name = 'CommandExitError';
  readonly exitCode: number;
  readonly stdout: string;
  readonly stderr: string;
  readonly error: string | undefined;
  /** The signal that ended it (`SIGKILL`), or null. */
  readonly signal: string | null;
  /** True when its `timeoutMs` ended it. */
  readonly timedOut: boolean;
  constructor(r: CommandResult & { signal: string | null; timedOut: boolean }) {
    super(r.error ?? `command exited with code ${r.exitCode}${r.stderr ? `: ${r.stderr.slice(-500)}` : ''}`);
    this.exitCode = r.exitCode;
    this.stdout = r.stdout;
    this.stderr = r.stderr;
    this.error = r.error;
    this.signal = r.signal;
    this.timedOut = r.timedOut;
  }
}

/** Where a command's output goes as it arrives. */
export interface OutputCallbacks {
  /** Standard output, decoded as UTF-8 (a character split between chunks is kept whole). */
  onStdout?: (data: string) => void | Promise<void>;
  onStderr?: (data: string) => void | Promise<void>;
  /** Standard output as raw bytes (a PTY's output). */
  onStdoutBytes?: (data: Uint8Array) => void | Promise<void>;
}

/** How to run one command. */
export interface CommandStartOptions extends OutputCallbacks, CallOptions {
  /** Resolve at once with a {@link CommandHandle} instead of waiting for the end. */
  background?: boolean;
  /** Working directory inside the sandbox; default: the sandbox's. */
  cwd?: string;
  /** Added to the sandbox's environment for this command. */
  envs?: Record<string, string>;
  /** Killed (SIGKILL) after this long; 0 = never. Default 60 000, as in E2B. */
  timeoutMs?: number;
  /**
   * `true` keeps standard input open for {@link Commands.sendStdin} (E2B's meaning). Bytes or
   * text are written to it once the command starts, then it is closed (NUL bytes are fine).
   */
  stdin?: boolean | string | Uint8Array;
  /** Free text kept in {@link Commands.list}. */
  tag?: string;
  /** Run on a PTY of this size (what `sandbox.pty` uses). */
  pty?: { cols: number; rows: number };
}

const path = (sandboxId: string, rest = '') =>
  `/v1/sandboxes/${encodeURIComponent(sandboxId)}/commands${rest}`;
const asBytes = (d: string | Uint8Array): Uint8Array =>
  typeof d === 'string' ? new TextEncoder().encode(d) : d;

/**
 * A running command followed over one output stream. Output accumulates in `stdout` and
 * `stderr` (and goes to the callbacks) until the command ends or {@link disconnect} is called.
 */
export class CommandHandle {
  /** The command's pid inside the sandbox: its id for `commands.kill/sendStdin/connect`. */
  readonly pid: number;
  private out = '';
  private err = '';
  private result: (CommandResult & { signal: string | null; timedOut: boolean }) | undefined;
  private readonly done: Promise<CommandResult & { signal: string | null; timedOut: boolean }>;
  private readonly stop = new AbortController();

  /** @internal Made by {@link Commands}; `events` is the stream after its `start` line. */
  constructor(
    private readonly commands: Commands,
    pid: number,
    events: AsyncGenerator<CommandEvent>,
    cb: OutputCallbacks,
    private readonly streamSignal: AbortController,
    private readonly callerSignal?: AbortSignal,
  ) {
    this.pid = pid;
    this.done = this.pump(events, cb);
    // A caller that never waits must not see an unhandled rejection.
    this.done.catch(() => undefined);
  }

  private async pump(
    events: AsyncGenerator<CommandEvent>,
    cb: OutputCallbacks,
  ): Promise<CommandResult & { signal: string | null; timedOut: boolean }> {
    const outText = new TextDecoder();
    const errText = new TextDecoder();
    try {
      for await (const ev of events) {
        if (ev.type === 'stdout' || ev.type === 'stderr') {
          const bytes = fromBase64(ev.data);
          if (ev.type === 'stdout') {
            const text = outText.decode(bytes, { stream: true });
            this.out += text;
            if (cb.onStdoutBytes) await cb.onStdoutBytes(bytes);
            if (cb.onStdout && text !== '') await cb.onStdout(text);
          } else {
            const text = errText.decode(bytes, { stream: true });
            this.err += text;
            if (cb.onStderr && text !== '') await cb.onStderr(text);
          }
        } else if (ev.type === 'end') {
          const error = ev.timedOut
            ? `timed out after ${ev.durationMs} ms`
            : ev.signal !== null
              ? `killed by ${ev.signal}`
              : undefined;
          this.result = {
            exitCode: ev.exitCode ?? -1,
            stdout: this.out,
            stderr: this.err,
            ...(error !== undefined ? { error } : {}),
            signal: ev.signal,
            timedOut: ev.timedOut,
          };
          return this.result;
        } else if (ev.type === 'error') {
          throw apiError(ev.code, ev.message, 0);
        }
      }
    } catch (e) {
      // The caller's abort (which, for a foreground command, killed it) rejects with its reason.
      if (this.callerSignal?.aborted) throw this.callerSignal.reason;
      if (this.stop.signal.aborted) throw new Error(`disconnected from command ${this.pid}`, { cause: e });
      if (e instanceof DormantApiError) throw e;
      throw apiError('DAEMON_UNREACHABLE', `the output stream of command ${this.pid} broke: ${String(e)}`, 0);
    }
    if (this.stop.signal.aborted) throw new Error(`disconnected from command ${this.pid}`);
    throw apiError(
      'DAEMON_UNREACHABLE',
      `the output stream of command ${this.pid} ended before the command`,
      0,
    );
  }

  /** Standard output so far. */
  get stdout(): string {
    return this.out;
  }
  /** Standard error so far. */
  get stderr(): string {
    return this.err;
  }
  /** The exit code once it ended, else undefined. */
  get exitCode(): number | undefined {
    return this.result?.exitCode;
  }
  /** Why it did not exit by itself, once it ended. */
  get error(): string | undefined {
    return this.result?.error;
  }

  /**
   * Resolves when the command ends; rejects with {@link CommandExitError} on a non-zero exit,
   * a signal or a timeout (as E2B does).
   * @example
   * ```ts
   * const h = await sb.commands.run('make', { background: true });
   * const { stdout } = await h.wait();
   * ```
   */
  async wait(): Promise<CommandResult> {
    const r = await this.done;
    if (r.exitCode !== 0 || r.signal !== null) throw new CommandExitError(r);
    return { exitCode: r.exitCode, stdout: r.stdout, stderr: r.stderr };
  }

  /** Sends SIGKILL; resolves true if it was running. */
  kill(opts?: CallOptions): Promise<boolean> {
    return this.commands.kill(this.pid, opts);
  }

  /** Writes to its standard input (it must have been started with `stdin: true`). */
  sendStdin(data: string | Uint8Array, opts: CallOptions & { eof?: boolean } = {}): Promise<void> {
    return this.commands.sendStdin(this.pid, data, opts);
  }

  /**
   * Stops following the output; the command keeps running (`commands.connect(pid)` follows it
   * again). `wait()` then rejects.
   */
  disconnect(): Promise<void> {
    this.stop.abort();
    this.streamSignal.abort();
    return Promise.resolve();
  }
}

/** `sandbox.commands`. */
export class Commands {
  /** @internal */
  constructor(
    private readonly client: DormantClient,
    private readonly sandboxId: string,
  ) {}

  /**
   * Runs a command (through `/bin/sh -c`). Without `background`, resolves when it ends with
   * its output and rejects with {@link CommandExitError} on a non-zero exit; aborting
   * `signal` kills it. With `background: true`, resolves with a {@link CommandHandle} at once.
   *
   * @example
   * ```ts
   * const { stdout } = await sb.commands.run('echo $GREETING', { envs: { GREETING: 'hi' } });
   * await sb.commands.run('cat > /tmp/x', { stdin: new Uint8Array([0, 1, 2]) });
   * ```
   */
  run(cmd: string, opts: CommandStartOptions & { background: true }): Promise<CommandHandle>;
  run(cmd: string, opts?: CommandStartOptions & { background?: false }): Promise<CommandResult>;
  run(cmd: string, opts?: CommandStartOptions): Promise<CommandResult | CommandHandle>;
  async run(cmd: string, opts: CommandStartOptions = {}): Promise<CommandResult | CommandHandle> {
    const data =
      typeof opts.stdin === 'boolean' || opts.stdin === undefined ? undefined : asBytes(opts.stdin);
    const body = {
      cmd,
      ...(opts.cwd !== undefined ? { cwd: opts.cwd } : {}),
      ...(opts.envs !== undefined ? { envs: opts.envs } : {}),
      timeoutMs: opts.timeoutMs ?? 60_000,
      ...(opts.stdin !== undefined && opts.stdin !== false ? { stdin: true } : {}),
      ...(opts.tag !== undefined ? { tag: opts.tag } : {}),
      ...(opts.pty !== undefined ? { pty: opts.pty } : {}),
    };
    if (opts.background === true) {
      const info = await this.client.request<CommandInfo>(
        'POST',
        path(this.sandboxId),
        { ...body, background: true },
        opts.signal ? { signal: opts.signal } : {},
      );
      if (data !== undefined) await this.sendStdin(info.pid, data, { eof: true });
      return this.connect(info.pid, opts);
    }
    const handle = await this.follow('POST', path(this.sandboxId), opts, body);
    if (data !== undefined) await this.sendStdin(handle.pid, data, { eof: true });
    return handle.wait();
  }

  /**
   * Follows a command started earlier (by pid): its output from the start (the agent keeps
   * the last 4 MiB), then as it comes.
   * @example
   * ```ts
   * const h = await sb.commands.connect(pid, { onStdout: console.log });
   * ```
   */
  connect(pid: number, opts: OutputCallbacks & CallOptions = {}): Promise<CommandHandle> {
    return this.follow('GET', path(this.sandboxId, `/${pid}/output?from=0`), opts);
  }

  /** Opens an output stream and reads its `start` line; the rest goes to a handle. */
  private async follow(
    method: string,
    route: string,
    opts: OutputCallbacks & CallOptions,
    json?: unknown,
  ): Promise<CommandHandle> {
    // Its own controller, so that disconnect() closes this stream only.
    const stream = new AbortController();
    const signal = opts.signal ? AbortSignal.any([stream.signal, opts.signal]) : stream.signal;
    const res = await this.client.open(method, route, { signal, ...(json !== undefined ? { json } : {}) });
    if (!res.body) throw apiError('DAEMON_UNREACHABLE', `${method} ${route}: no body`, res.status);
    const events = readNdjson<CommandEvent>(res.body);
    const first = await events.next();
    if (first.done)
      throw apiError('DAEMON_UNREACHABLE', `${method} ${route}: empty output stream`, res.status);
    const ev = first.value;
    if (ev.type === 'error') throw apiError(ev.code, ev.message, 0);
    if (ev.type !== 'start')
      throw apiError('DAEMON_UNREACHABLE', `${method} ${route}: no start line`, res.status);
    return new CommandHandle(this, ev.pid, events, opts, stream, opts.signal);
  }

  /** The commands the sandbox's agent knows: running ones, and ones ended in the last 10 minutes. */
  async list(opts?: CallOptions): Promise<CommandInfo[]> {
    return (
      await this.client.request<{ commands: CommandInfo[] }>('GET', path(this.sandboxId), undefined, opts)
    ).commands;
  }

  /**
   * Sends a signal (`sig`, default SIGKILL) to the command's process group; resolves false
   * when the command had already ended (not an error).
   */
  async kill(pid: number, opts: CallOptions & { sig?: string } = {}): Promise<boolean> {
    const r = await this.client.request<{ killed: boolean }>(
      'POST',
      path(this.sandboxId, `/${pid}/kill`),
      { signal: opts.sig ?? 'SIGKILL' },
      opts.signal ? { signal: opts.signal } : {},
    );
    return r.killed;
  }

  /**
   * Writes bytes or text to a command's standard input; `eof: true` closes it after them.
   * @example
   * ```ts
   * const h = await sb.commands.run('cat', { background: true, stdin: true });
   * await sb.commands.sendStdin(h.pid, 'hello\n', { eof: true });
   * ```
   */
  async sendStdin(
    pid: number,
    data: string | Uint8Array,
    opts: CallOptions & { eof?: boolean } = {},
  ): Promise<void> {
    await this.client.request<unknown>(
      'POST',
      path(this.sandboxId, `/${pid}/stdin${opts.eof === true ? '?eof=true' : ''}`),
      undefined,
      { ...(opts.signal ? { signal: opts.signal } : {}), rawBody: asBytes(data) },
    );
  }

  /** Changes a PTY command's size. */
  async resize(pid: number, size: { cols: number; rows: number }, opts?: CallOptions): Promise<void> {
    await this.client.request<unknown>('POST', path(this.sandboxId, `/${pid}/resize`), size, opts);
  }
}
