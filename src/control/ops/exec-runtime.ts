/**
 * exec without the toolbox agent: for a sandbox whose runtime starts none (gVisor's runsc,
 * runtime/runsc.ts), a command runs through the runtime's own exec (`runsc exec`) instead.
 * Output is text (the runtime's exec reads it as UTF-8), at most 16 MiB of each stream.
 */
import { DormantError, ErrorCode, isDormantError } from '../../domain/errors.js';
import { AgentError } from '../../runtime/agent-client.js';
import type { LifecycleContext } from '../context.js';
import {
  DEFAULT_EXEC_TIMEOUT_MS,
  DEFAULT_MAX_OUTPUT_BYTES,
  type ExecOptions,
  type ExecOutcome,
} from './toolbox.js';

/** Whether `e` says the sandbox's runtime has no agent at all (not that one failed to start). */
export function agentNotSupported(e: unknown): boolean {
  return (
    isDormantError(e, ErrorCode.TOOLBOX_UNAVAILABLE) &&
    e.cause instanceof AgentError &&
    e.cause.code === 'ENOTSUP'
  );
}

/** Runs `args` in running sandbox `id` with the runtime's exec, answered as the agent's exec is. */
export async function execThroughRuntime(
  ctx: LifecycleContext,
  id: string,
  args: string[],
  opts: ExecOptions,
): Promise<ExecOutcome> {
  if (opts.signal?.aborted) throw new DormantError(ErrorCode.COMMAND_ABORTED, `exec in ${id}: aborted`);
  const r = await ctx.runtime.exec(id, args, {
    timeoutMs: opts.timeoutMs ?? DEFAULT_EXEC_TIMEOUT_MS,
    ...(opts.signal !== undefined ? { signal: opts.signal } : {}),
    ...(opts.cwd !== undefined ? { cwd: opts.cwd } : {}),
    ...(opts.env !== undefined ? { env: opts.env } : {}),
    ...(opts.input !== undefined ? { input: opts.input } : {}),
  });
  const limit = opts.maxOutputBytes ?? DEFAULT_MAX_OUTPUT_BYTES;
  const stdout = Buffer.from(r.stdout);
  const stderr = Buffer.from(r.stderr);
  return {
    exitCode: r.exitCode,
    stdout: stdout.subarray(0, limit),
    stderr: stderr.subarray(0, limit),
    durationMs: r.durationMs,
    truncated: { stdout: stdout.length > limit, stderr: stderr.length > limit },
    outputLimitBytes: limit,
  };
}
