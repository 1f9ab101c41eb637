/**
 * What the toolbox tests share: raw HTTP calls to a test daemon (the toolbox routes stream,
 * so they are read as they come), ndjson reading, and the CLI run as a child process.
 */
import { execFile } from 'node:child_process';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import WebSocket from 'ws';
import type { Daemon } from '../../daemon/daemon.js';

export const BIN = join(dirname(fileURLToPath(import.meta.url)), '..', '..', '..', 'bin', 'dormant');

/** One call with the admin token; a JSON body is sent as JSON, a Buffer raw. */
export async function call(
  daemon: Daemon,
  method: string,
  path: string,
  body?: unknown,
  signal?: AbortSignal,
): Promise<Response> {
  const headers: Record<string, string> = { authorization: `Bearer ${daemon.adminToken}` };
  let payload: Buffer | string | undefined;
  if (Buffer.isBuffer(body)) {
    headers['content-type'] = 'application/octet-stream';
    payload = body;
  } else if (body !== undefined) {
    headers['content-type'] = 'application/json';
    payload = JSON.stringify(body);
  }
  return fetch(`${daemon.url}${path}`, {
    method,
    headers,
    ...(payload !== undefined ? { body: payload } : {}),
    ...(signal ? { signal } : {}),
  });
}

/** The JSON answer of a call; fails on an unexpected status. */
export async function json<T = Record<string, unknown>>(res: Response, status = 200): Promise<T> {
  const text = await res.text();
  if (res.status !== status) throw new Error(`HTTP ${res.status} (wanted ${status}): ${text}`);
  return JSON.parse(text) as T;
}

export interface Line {
  type: string;
  data?: string;
  at: number;
  [k: string]: unknown;
}

/** Every ndjson line of a streamed answer, each with the time it arrived. */
export async function* lines(res: Response): AsyncGenerator<Line> {
  let pending = '';
  const dec = new TextDecoder();
  for await (const chunk of res.body as unknown as AsyncIterable<Uint8Array>) {
    pending += dec.decode(chunk, { stream: true });
    let nl: number;
    while ((nl = pending.indexOf('\n')) >= 0) {
      const line = pending.slice(0, nl);
      pending = pending.slice(nl + 1);
      if (line !== '') yield { ...(JSON.parse(line) as Line), at: Date.now() };
    }
  }
}

/** All lines of a stream, and the stdout and stderr bytes they carried. */
export async function drain(res: Response): Promise<{ lines: Line[]; stdout: Buffer; stderr: Buffer }> {
  const all: Line[] = [];
  for await (const l of lines(res)) all.push(l);
  const of = (t: string): Buffer =>
    Buffer.concat(all.filter((l) => l.type === t).map((l) => Buffer.from(l.data ?? '', 'base64')));
  return { lines: all, stdout: of('stdout'), stderr: of('stderr') };
}

/** The CLI against `daemon`, with `input` on its stdin; its exit code and output as bytes. */
export function dormant(
  daemon: Daemon,
  args: string[],
  input?: Buffer,
): Promise<{ code: number; stdout: Buffer; stderr: string }> {
  return new Promise((resolve) => {
    const child = execFile(
      process.execPath,
      [BIN, ...args],
      {
        env: { ...process.env, DORMANT_URL: daemon.url, DORMANT_TOKEN: daemon.adminToken, NO_COLOR: '1' },
        timeout: 60_000,
        encoding: 'buffer',
        maxBuffer: 64 * 1024 * 1024,
      },
      (err, stdout, stderr) => {
        const code = err ? (typeof err.code === 'number' ? err.code : -1) : 0;
        resolve({ code, stdout, stderr: stderr.toString('utf8') });
      },
    );
    if (input !== undefined) child.stdin!.end(input);
    else child.stdin!.end();
  });
}

/** A command's terminal over its WebSocket: what it printed, its events, and ways to drive it. */
export interface Terminal {
  /** The terminal's output so far (binary frames). */
  screen(): string;
  /** The command's events (text frames): start, then end with its exit code. */
  events: { type: string; exitCode?: number }[];
  /** Keys typed into it. */
  type(text: string): void;
  resize(cols: number, rows: number): void;
  /** Resolves once the server closed it. */
  closed: Promise<unknown>;
}

/** Opens `/v1/sandboxes/{id}/commands/{cid}/ws` at `apiUrl` (http or https) with `token`. */
export async function openTerminal(apiUrl: string, path: string, token: string): Promise<Terminal> {
  const ws = new WebSocket(`${apiUrl.replace(/^http/, 'ws')}${path}`, {
    headers: { authorization: `Bearer ${token}` },
  });
  let screen = '';
  const events: Terminal['events'] = [];
  ws.on('message', (data: Buffer, binary: boolean) => {
    if (binary) screen += data.toString('utf8');
    else events.push(JSON.parse(data.toString('utf8')) as Terminal['events'][number]);
  });
  const closed = new Promise((r) => ws.once('close', r));
  await new Promise((r, j) => ws.once('open', r).once('error', j));
  return {
    screen: () => screen,
    events,
    type: (text) => ws.send(Buffer.from(text), { binary: true }),
    resize: (cols, rows) => ws.send(JSON.stringify({ type: 'resize', cols, rows })),
    closed,
  };
}
