/**
 * The toolbox: commands and files inside a sandbox, through the small agent that runs in it
 * (runtime/agent-client.ts speaks its protocol; the runtime starts it on the first call). A
 * toolbox call wakes a sleeping sandbox first, as the wake proxy does, and counts as activity.
 */
import { createHmac, randomBytes } from 'node:crypto';
import { DormantError, ErrorCode, asError } from '../../domain/errors.js';
import type { Sandbox } from '../../domain/sandbox.js';
import {
  AgentClient,
  AgentError,
  type AgentAddress,
  type ProcessHandle,
} from '../../runtime/agent-client.js';
import type { LifecycleContext } from '../context.js';

/**
 * Without the daemon's secrets (an embedding, a test of another part) the tokens come from a
 * key of this process: good for its life, which is all such a caller has.
 */
const processKey = randomBytes(32);

/**
 * The token of a sandbox's agent: HMAC-SHA256 over "agent:" + seed, never stored. The key
 * comes from the master key (EnvSecrets.agentTokenKey: HKDF with a label of its own), so a
 * token tells nothing of the vault's keys, one sandbox's token says nothing of another's, and
 * the daemon derives the same token after a restart (a hibernated agent keeps the one it was
 * started with). A fork's seed is its origin's: its memory holds a copy of that agent.
 */
export function agentToken(ctx: LifecycleContext, s: Sandbox): string {
  const key = ctx.opts.secrets?.agentTokenKey?.() ?? processKey;
  try {
    return createHmac('sha256', key)
      .update(`agent:${s.spec.agentSeed ?? s.id}`)
      .digest('hex');
  } finally {
    if (key !== processKey) key.fill(0);
  }
}

/** Agents known to be up, per sandbox, for the state they were found in. */
const known = new WeakMap<LifecycleContext, Map<string, { since: number; address: Promise<AgentAddress> }>>();

/** The agent's address in running sandbox `s`, started if need be (once for concurrent calls). */
async function ensureAgent(ctx: LifecycleContext, s: Sandbox): Promise<AgentAddress> {
  let byId = known.get(ctx);
  if (!byId) known.set(ctx, (byId = new Map<string, { since: number; address: Promise<AgentAddress> }>()));
  // Any state change (a resume, an archive and restart) may have taken the agent along: ask
  // the runtime again then. Between changes the address holds.
  const hit = byId.get(s.id);
  if (hit?.since === s.stateSince) return hit.address;
  const rt = ctx.runtime;
  if (!rt.ensureAgent) {
    throw new DormantError(ErrorCode.TOOLBOX_UNAVAILABLE, 'this runtime has no toolbox agent');
  }
  const address = rt.ensureAgent(s.id, agentToken(ctx, s)).catch((e: unknown) => {
    byId.delete(s.id);
    // Whatever stopped it (no binary, no network, a port taken), the toolbox is unavailable.
    if (!(e instanceof AgentError)) throw e;
    throw new DormantError(
      ErrorCode.TOOLBOX_UNAVAILABLE,
      `the toolbox agent of sandbox ${s.id} cannot start or answer (${e.code.slice(0, 20)}): ${e.message.slice(0, 300)}`,
      { cause: e },
    );
  });
  byId.set(s.id, { since: s.stateSince, address });
  return address;
}

/** Forgets the agent of `id` (it refused a connection: it is started again next time). */
function forgetAgent(ctx: LifecycleContext, id: string): void {
  known.get(ctx)?.delete(id);
}

/**
 * Runs `fn` with the agent of sandbox `id` (tenant scoped), waking the sandbox first with
 * `wake` if it sleeps. An agent that refuses the connection (it died, or the sandbox was
 * restarted under it) is started again and `fn` retried once: nothing had reached it.
 */
export async function withAgent<T>(
  ctx: LifecycleContext,
  id: string,
  tenant: string | undefined,
  wake: (id: string) => Promise<Sandbox>,
  fn: (agent: AgentClient, s: Sandbox) => Promise<T>,
): Promise<T> {
  let s = await ctx.get(id, tenant);
  // resume answers what it cannot leave (deleting, failed) with its own error.
  if (s.state !== 'running') s = await wake(s.id);
  await ctx.markActive(s.id);
  const env = await ctx.openEnv(s);
  for (let attempt = 0; ; attempt++) {
    const agent = new AgentClient(await ensureAgent(ctx, s), { env });
    try {
      return await fn(agent, s);
    } catch (e) {
      if (e instanceof AgentError && e.code === 'ECONNREFUSED' && attempt === 0) {
        forgetAgent(ctx, s.id);
        continue;
      }
      throw toolboxError(e, s.id);
    }
  }
}

/** The agent's errno-like codes as the API's. */
const AGENT_CODES: Readonly<Record<string, ErrorCode>> = {
  ENOENT: ErrorCode.FILE_NOT_FOUND,
  EEXIST: ErrorCode.FILE_EXISTS,
  ENOTDIR: ErrorCode.NOT_A_DIRECTORY,
  EISDIR: ErrorCode.IS_A_DIRECTORY,
  ENOTEMPTY: ErrorCode.DIRECTORY_NOT_EMPTY,
  EACCES: ErrorCode.FILE_PERMISSION_DENIED,
  EPERM: ErrorCode.FILE_PERMISSION_DENIED,
  EROFS: ErrorCode.FILE_PERMISSION_DENIED,
  ESRCH: ErrorCode.PROCESS_NOT_FOUND,
  EINVAL: ErrorCode.INVALID_ARGUMENT,
  ENAMETOOLONG: ErrorCode.INVALID_ARGUMENT,
  E2BIG: ErrorCode.INVALID_ARGUMENT,
};

/**
 * An agent's failure as a DormantError. The agent's message is the sandbox's own text (it may
 * run anything on the agent's port): bounded, and shown only as the sandbox's say.
 */
export function toolboxError(e: unknown, id: string): unknown {
  if (!(e instanceof AgentError)) return e;
  const message = e.message.replace(/[^\x20-\x7e]/g, '?').slice(0, 300);
  const code = AGENT_CODES[e.code];
  if (code !== undefined) return new DormantError(code, `in sandbox ${id}: ${message}`);
  return new DormantError(
    ErrorCode.TOOLBOX_UNAVAILABLE,
    `the toolbox agent of sandbox ${id} failed (${e.code.slice(0, 20)}): ${message}`,
    { cause: e },
  );
}

export interface ExecOptions {
  timeoutMs?: number;
  input?: Buffer;
  /** Bytes kept of each of stdout and stderr; the rest is counted as cut. Default 16 MiB. */
  maxOutputBytes?: number;
  cwd?: string;
  env?: Record<string, string>;
  signal?: AbortSignal;
}

export interface ExecOutcome {
  exitCode: number;
  stdout: Buffer;
  stderr: Buffer;
  durationMs: number;
  truncated: { stdout: boolean; stderr: boolean };
  outputLimitBytes: number;
}

export const DEFAULT_EXEC_TIMEOUT_MS = 60_000;
export const DEFAULT_MAX_OUTPUT_BYTES = 16 * 1024 * 1024;
/** How long past its deadline the daemon waits for the agent's own kill before its own. */
const DEADLINE_GRACE_MS = 100;

/** Output kept up to a limit, and whether any was cut. */
class Capped {
  private readonly parts: Buffer[] = [];
  private kept = 0;
  cut = false;
  constructor(private readonly limit: number) {}
  add(b: Buffer): void {
    const room = this.limit - this.kept;
    if (b.length > room) this.cut = true;
    if (room <= 0) return;
    const part = b.length > room ? b.subarray(0, room) : b;
    this.parts.push(part);
    this.kept += part.length;
  }
  bytes(): Buffer {
    return Buffer.concat(this.parts);
  }
}

/**
 * One command run to its end, its output collected: the exec route. It ends when the
 * command's own process ends (a job it left in the background does not hold it); past
 * `timeoutMs` it is killed and COMMAND_TIMEOUT answered with what it wrote.
 */
export async function execCommand(
  agent: AgentClient,
  id: string,
  args: string[],
  opts: ExecOptions,
): Promise<ExecOutcome> {
  const timeoutMs = opts.timeoutMs ?? DEFAULT_EXEC_TIMEOUT_MS;
  const limit = opts.maxOutputBytes ?? DEFAULT_MAX_OUTPUT_BYTES;
  const h = await agent.run({
    args,
    timeoutMs,
    stdin: opts.input !== undefined,
    tag: 'exec',
    ...(opts.cwd !== undefined ? { cwd: opts.cwd } : {}),
    ...(opts.env !== undefined ? { env: opts.env } : {}),
  });
  const out = new Capped(limit);
  const err = new Capped(limit);
  h.onOutput((stream, data) => (stream === 'stdout' ? out : err).add(data));
  if (opts.input !== undefined) {
    if (opts.input.length > 0) h.write(opts.input);
    h.closeStdin();
  }
  const exit = await untilExit(h, timeoutMs, opts.signal);
  const what = `exec in ${id}: ${args.map((a) => (a.length > 80 ? `${a.slice(0, 80)}...` : a)).join(' ')}`;
  if (exit.timedOut) {
    const output = Buffer.concat([out.bytes(), err.bytes()]).toString('utf8').slice(-2000);
    throw new DormantError(
      ErrorCode.COMMAND_TIMEOUT,
      `${what.slice(0, 400)}: killed after ${timeoutMs} ms timeout`,
      {
        ...(output !== '' ? { details: { output } } : {}),
      },
    );
  }
  return {
    // A signal's death reads as the shell shows it: 128 + the signal's number.
    exitCode: exit.exitCode ?? 128 + signalNumber(exit.signal ?? 'SIGKILL'),
    stdout: out.bytes(),
    stderr: err.bytes(),
    durationMs: exit.durationMs,
    truncated: { stdout: out.cut, stderr: err.cut },
    outputLimitBytes: limit,
  };
}

/**
 * The process's end. The agent kills it at its deadline; should its answer not come by then
 * (a frozen agent, a lost frame) the daemon kills it and answers a timeout itself. An abort
 * (the caller left) kills it too.
 */
async function untilExit(
  h: ProcessHandle,
  timeoutMs: number,
  signal: AbortSignal | undefined,
): Promise<{ exitCode: number | null; signal: string | null; durationMs: number; timedOut: boolean }> {
  const started = Date.now();
  let timer: NodeJS.Timeout | undefined;
  const kill = (): void => {
    try {
      h.signal(9);
    } catch {
      // The connection is already gone: the agent's own deadline ends the process.
    }
  };
  signal?.addEventListener('abort', kill, { once: true });
  try {
    return await Promise.race([
      h.exited,
      ...(timeoutMs > 0
        ? [
            new Promise<never>((_, reject) => {
              timer = setTimeout(() => {
                kill();
                h.detach();
                reject(new Error('deadline'));
              }, timeoutMs + DEADLINE_GRACE_MS);
            }).catch(() => ({
              exitCode: null,
              signal: 'SIGKILL',
              durationMs: Date.now() - started,
              timedOut: true,
            })),
          ]
        : []),
    ]);
  } catch (e) {
    if (signal?.aborted) throw new DormantError(ErrorCode.COMMAND_ABORTED, 'exec aborted: the caller left');
    throw asError(e);
  } finally {
    clearTimeout(timer);
    signal?.removeEventListener('abort', kill);
  }
}

const SIGNALS: Readonly<Record<string, number>> = {
  SIGHUP: 1,
  SIGINT: 2,
  SIGQUIT: 3,
  SIGKILL: 9,
  SIGUSR1: 10,
  SIGSEGV: 11,
  SIGUSR2: 12,
  SIGPIPE: 13,
  SIGALRM: 14,
  SIGTERM: 15,
  SIGCONT: 18,
  SIGSTOP: 19,
  SIGTSTP: 20,
  SIGWINCH: 28,
};

/** The signals a caller may name (the kill route, the WebSocket). */
export const SIGNAL_NAMES = Object.keys(SIGNALS) as [string, ...string[]];

/** A signal's number on Linux (x86-64 and arm64 agree on these). */
export function signalNumber(name: string): number {
  const n = SIGNALS[name];
  if (n === undefined)
    throw new DormantError(ErrorCode.INVALID_ARGUMENT, `unknown signal ${name.slice(0, 20)}`);
  return n;
}
