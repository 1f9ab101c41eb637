/**
 * The daemon's log: one JSON object a line (pino, the logger Fastify itself uses), or readable
 * text when stderr is a terminal. Every line written while an API request is being served
 * carries that request's id (`reqId`), whichever layer writes it: the id travels in an
 * AsyncLocalStorage that the API enters for each request, so the controller and the runtime
 * need not pass it along. Under systemd the lines go to the journal, which rotates them.
 */
import { AsyncLocalStorage } from 'node:async_hooks';
import { pino, type Logger } from 'pino';

export type { Logger } from 'pino';

export type LogFormat = 'json' | 'text';
export type LogLevel = 'debug' | 'info' | 'warn' | 'error';

/** What is known about the work in progress: the API request it serves, if any. */
export interface LogContext {
  reqId: string;
}

export const logContext = new AsyncLocalStorage<LogContext>();

/** A line's destination: anything with write(string). */
export interface LogSink {
  write(line: string): void;
}

const LEVEL_NAMES: Record<number, string> = {
  10: 'TRACE',
  20: 'DEBUG',
  30: 'INFO',
  40: 'WARN',
  50: 'ERROR',
  60: 'FATAL',
};

/** One pino JSON line as text: `12:34:56.789 WARN message key=value ...`. */
export function textLine(json: string): string {
  let o: Record<string, unknown>;
  try {
    o = JSON.parse(json) as Record<string, unknown>;
  } catch {
    return json;
  }
  const { time, level, msg, pid: _pid, hostname: _host, ...rest } = o;
  const at = typeof time === 'number' ? new Date(time).toISOString().slice(11, 23) : '';
  const lvl = (typeof level === 'number' ? LEVEL_NAMES[level] : undefined) ?? String(level);
  const fields = Object.entries(rest)
    .map(([k, v]) => `${k}=${typeof v === 'string' ? v : JSON.stringify(v)}`)
    .join(' ');
  return `${at} ${lvl.padEnd(5)} ${typeof msg === 'string' ? msg : ''}${fields ? `  ${fields}` : ''}\n`;
}

/**
 * A logger writing to `sink` (default stderr). `format` defaults to text on a terminal and
 * JSON elsewhere (a file, a pipe, the journal).
 */
export function createLogger(opts: { level?: LogLevel; format?: LogFormat; sink?: LogSink } = {}): Logger {
  const sink = opts.sink ?? process.stderr;
  const format = opts.format ?? (process.stderr.isTTY && opts.sink === undefined ? 'text' : 'json');
  const dest: LogSink = format === 'text' ? { write: (line) => sink.write(textLine(line)) } : sink;
  return pino(
    {
      level: opts.level ?? 'info',
      base: undefined, // no pid and hostname on every line: the journal has them
      // The request being served, on every line written on its behalf.
      // (Fastify's own request lines carry it already, as a binding of their child logger.)
      mixin: (_obj, _level, logger) => {
        const c = logContext.getStore();
        return c && !('reqId' in logger.bindings()) ? { reqId: c.reqId } : {};
      },
    },
    dest,
  );
}
