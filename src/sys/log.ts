/**
 * The daemon's log: one JSON object a line (pino, the logger Fastify itself uses), or readable
 * text when stderr is a terminal. Every line written while an API request is being served
 * carries that request's id (`reqId`), whichever layer writes it: the id travels in an
 * AsyncLocalStorage that the API enters for each request, so the controller and the runtime
 * need not pass it along. Under systemd the lines go to the journal, which rotates them;
 * elsewhere LogFile writes them to a file of their own, rotated by size.
 */
import { AsyncLocalStorage } from 'node:async_hooks';
import {
  closeSync,
  fchmodSync,
  fstatSync,
  mkdirSync,
  openSync,
  renameSync,
  rmSync,
  writeSync,
} from 'node:fs';
import { dirname } from 'node:path';
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

export interface LogFileOptions {
  path: string;
  /** Rotate before a line would take the file past this many bytes; 0: never (logrotate's job). */
  maxBytes: number;
  /** Rotated files kept beside it (`PATH.1` newest ... `PATH.N`); older ones are removed. */
  keep: number;
}

/**
 * The log as a file of its own, mode 0600 (lines name sandboxes, tenants and host paths), for a
 * daemon without the journal. Written synchronously, like pino's own stderr: a line logged
 * before a crash is on disk. Rotated by size in-process, numbered like logrotate's (`PATH.1` is
 * the newest), so nothing else needs installing; reopen() lets an external logrotate move the
 * file instead (`dormant serve` reopens on SIGHUP).
 */
export class LogFile implements LogSink {
  private fd = -1;
  private size = 0;
  private failing = false;

  constructor(private readonly opts: LogFileOptions) {
    mkdirSync(dirname(opts.path), { recursive: true, mode: 0o700 });
    this.open();
  }

  write(line: string): void {
    const bytes = Buffer.from(line);
    try {
      if (this.opts.maxBytes > 0 && this.size > 0 && this.size + bytes.length > this.opts.maxBytes)
        this.rotate();
      let done = 0;
      while (done < bytes.length) done += writeSync(this.fd, bytes, done);
      this.size += bytes.length;
      this.failing = false;
    } catch (e) {
      // A full disk must not end the daemon (and its sandboxes' helpers) over a log line:
      // said once on stderr, and the file is tried again with the next line.
      if (!this.failing)
        process.stderr.write(`dormant: writing ${this.opts.path}: ${(e as Error).message}\n`);
      this.failing = true;
      if (this.fd < 0) this.tryOpen();
    }
  }

  /** Opens the path again: after logrotate has renamed the file, the next line starts a new one. */
  reopen(): void {
    this.closeFd();
    this.open();
  }

  close(): void {
    this.closeFd();
  }

  private open(): void {
    this.fd = openSync(this.opts.path, 'a', 0o600);
    // A file that was there before (made by hand, or by an older version) is made private too.
    fchmodSync(this.fd, 0o600);
    this.size = fstatSync(this.fd).size;
  }

  private tryOpen(): void {
    try {
      this.open();
    } catch {
      // Still failing: the next line tries again.
    }
  }

  private closeFd(): void {
    if (this.fd >= 0) closeSync(this.fd);
    this.fd = -1;
  }

  private rotate(): void {
    this.closeFd();
    const { path, keep } = this.opts;
    if (keep > 0) {
      rmSync(`${path}.${keep}`, { force: true });
      for (let i = keep - 1; i >= 1; i--) renameIfThere(`${path}.${i}`, `${path}.${i + 1}`);
      renameIfThere(path, `${path}.1`);
    } else {
      rmSync(path, { force: true });
    }
    this.open();
  }
}

function renameIfThere(from: string, to: string): void {
  try {
    renameSync(from, to);
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code !== 'ENOENT') throw e;
  }
}
