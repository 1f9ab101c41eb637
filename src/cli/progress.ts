/**
 * Progress for operations that take seconds (create, hibernate, resume, ...): on a terminal,
 * one line on stderr with a spinner, the phase and the time so far; the phase is the
 * sandbox's state as the daemon's event stream reports it (running -> hibernating ->
 * hibernated). When done, the line says how long it took and, for a checkpoint, its sizes.
 * Nothing is drawn with --json or when stderr is not a terminal.
 */
import pc from 'picocolors';
import { formatBytes, formatDurationMs } from '../domain/units.js';
import type { DormantClient, SandboxInfo } from '../sdk/client.js';

const FRAMES = ['⠋', '⠙', '⠹', '⠸', '⠼', '⠴', '⠦', '⠧', '⠇', '⠏'];

export interface ProgressWatch {
  client: DormantClient;
  /** The sandbox's id or name, whose transitions give the phase. */
  sandbox?: string;
}

export interface ProgressOptions {
  /** Where to draw; default process.stderr. */
  stream?: NodeJS.WriteStream;
  /** Draw even when the stream is not a terminal (tests). */
  force?: boolean;
  now?: () => number;
}

function isSandbox(v: unknown): v is SandboxInfo {
  return typeof v === 'object' && v !== null && 'state' in v && 'id' in v && 'checkpointId' in v;
}

/** What to say after the operation: the checkpoint's sizes when one was written or read. */
async function summary(
  result: unknown,
  watch: ProgressWatch | undefined,
  signal: AbortSignal,
): Promise<string> {
  if (!watch || !isSandbox(result) || result.checkpointId === null) return '';
  if (result.state !== 'hibernated' && result.state !== 'running') return '';
  try {
    const ck = (await watch.client.listCheckpoints(result.id, { signal })).find(
      (c) => c.id === result.checkpointId,
    );
    if (!ck) return '';
    const sizes = `${formatBytes(ck.logicalBytes)} (${formatBytes(ck.storedBytes)} stored)`;
    return result.state === 'hibernated' ? ` · checkpoint ${sizes}` : ` · restored ${sizes}`;
  } catch {
    return ''; // The summary is a courtesy; the operation itself succeeded.
  }
}

export async function withProgress<T>(
  label: string,
  json: boolean,
  fn: () => Promise<T>,
  watch?: ProgressWatch,
  opts: ProgressOptions = {},
): Promise<T> {
  const out = opts.stream ?? process.stderr;
  if (json || (!out.isTTY && !opts.force)) return fn();
  const now = opts.now ?? Date.now;
  const started = now();
  let phase = '';
  let frame = 0;
  const draw = (): void => {
    const f = FRAMES[frame++ % FRAMES.length]!;
    out.write(
      `\r\x1b[2K${pc.cyan(f)} ${label}${phase ? ` · ${pc.bold(phase)}` : ''} · ${formatDurationMs(now() - started)}`,
    );
  };
  const ac = new AbortController();
  if (watch?.sandbox !== undefined) {
    const client = watch.client;
    const ref = watch.sandbox;
    // Events give each phase as it happens; a slow poll covers the transition made before the
    // stream was connected (the stream starts at the newest transition).
    void (async () => {
      try {
        const id = (await client.getSandbox(ref, { signal: ac.signal })).id;
        void (async () => {
          while (!ac.signal.aborted) {
            await new Promise((r) => setTimeout(r, 500));
            if (ac.signal.aborted) return;
            const s = await client.getSandbox(id, { signal: ac.signal });
            if (!ac.signal.aborted) phase = s.state;
          }
        })().catch(() => undefined);
        for await (const t of client.events({ signal: ac.signal })) if (t.sandboxId === id) phase = t.to;
      } catch {
        // No phase then: the spinner and the clock still run.
      }
    })();
  }
  draw();
  const timer = setInterval(draw, 100);
  try {
    const result = await fn();
    clearInterval(timer);
    const more = await summary(result, watch, ac.signal);
    const state = isSandbox(result) ? result.state : 'done';
    out.write(
      `\r\x1b[2K${pc.green('✔')} ${label}: ${state} in ${formatDurationMs(now() - started)}${more}\n`,
    );
    return result;
  } catch (e) {
    clearInterval(timer);
    out.write(`\r\x1b[2K${pc.red('✖')} ${label}: failed after ${formatDurationMs(now() - started)}\n`);
    throw e;
  } finally {
    clearInterval(timer);
    ac.abort();
  }
}
