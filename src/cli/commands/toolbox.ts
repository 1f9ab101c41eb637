/**
 * The toolbox commands: `dormant exec` (streamed output, stdin, a terminal, detached) and
 * `dormant cp` (files in and out of a sandbox), over the toolbox routes of the HTTP API.
 */
import type { Command } from '@commander-js/extra-typings';
import { createReadStream, createWriteStream } from 'node:fs';
import { stat } from 'node:fs/promises';
import { basename, join } from 'node:path';
import { Readable, type Writable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { DormantError, ErrorCode } from '../../domain/errors.js';
import { apiError } from '../../sdk/errors.js';
import type { CommandEvent, CommandInfo, FileInfo } from '../../sdk/contract.gen.js';
import { clientFromEnv, tokenFromEnv } from '../client.js';
import { httpFetch } from '../http-fetch.js';
import { daemonUrl } from '../env.js';
import { printJson } from '../output.js';

const collect = (v: string, prev: string[] = []): string[] => [...prev, v];

function usage(message: string): DormantError {
  return new DormantError(ErrorCode.INVALID_ARGUMENT, message);
}

/** Signal numbers for an exit code the way a shell shows a death by signal (128 + n). */
const SIGNAL_NUMBERS: Readonly<Record<string, number>> = { SIGHUP: 1, SIGINT: 2, SIGKILL: 9, SIGTERM: 15 };

/** One HTTP call to the daemon with the CLI's URL and token; an API error becomes the SDK's. */
async function call(
  method: string,
  path: string,
  body?: { json: unknown } | { raw: AsyncIterable<Uint8Array> },
  signal?: AbortSignal,
): Promise<Response> {
  const base = daemonUrl().replace(/\/+$/, '');
  const token = tokenFromEnv();
  const headers: Record<string, string> = token ? { authorization: `Bearer ${token}` } : {};
  let payload: RequestInit['body'];
  if (body && 'json' in body) {
    headers['content-type'] = 'application/json';
    payload = JSON.stringify(body.json);
  } else if (body) {
    headers['content-type'] = 'application/octet-stream';
    payload = body.raw;
  }
  let res: Response;
  try {
    res = await httpFetch(`${base}${path}`, {
      method,
      headers,
      ...(payload !== undefined ? { body: payload } : {}),
      // A streamed request body (stdin, a file) is sent as it is read.
      ...(body && 'raw' in body ? { duplex: 'half' } : {}),
      ...(signal ? { signal } : {}),
    });
  } catch (e) {
    if (signal?.aborted) throw e;
    const why = e instanceof Error && e.cause instanceof Error ? e.cause.message : String(e);
    throw apiError(
      'DAEMON_UNREACHABLE',
      `cannot reach dormant at ${base}: ${why}`,
      0,
      'start it with `dormant serve`, or set DORMANT_URL',
    );
  }
  if (!res.ok) {
    const text = await res.text().catch(() => '');
    let err: { code?: string; message?: string; hint?: string } = {};
    try {
      err = (JSON.parse(text) as { error?: typeof err }).error ?? {};
    } catch {
      // Not the API's JSON: the status says enough.
    }
    throw apiError(
      err.code ?? 'INTERNAL',
      err.message ?? `${method} ${path}: HTTP ${res.status}`,
      res.status,
      err.hint,
    );
  }
  return res;
}

const sandboxPath = (id: string, rest = ''): string => `/v1/sandboxes/${encodeURIComponent(id)}${rest}`;

/** The lines of an ndjson body, as they arrive. */
async function* ndjson(res: Response): AsyncGenerator<CommandEvent> {
  if (!res.body) return;
  let pending = '';
  const decoder = new TextDecoder();
  for await (const chunk of res.body as unknown as AsyncIterable<Uint8Array>) {
    pending += decoder.decode(chunk, { stream: true });
    let nl: number;
    while ((nl = pending.indexOf('\n')) >= 0) {
      const line = pending.slice(0, nl);
      pending = pending.slice(nl + 1);
      if (line.trim() !== '') yield JSON.parse(line) as CommandEvent;
    }
  }
}

/** Writes `data` to `out`, waiting while it is full (a slow pipe holds the stream back). */
async function writeOut(out: Writable, data: Buffer): Promise<void> {
  if (!out.write(data)) await new Promise((r) => out.once('drain', r));
}

function exitCodeOf(end: { exitCode: number | null; signal: string | null; timedOut: boolean }): number {
  if (end.timedOut) process.stderr.write('dormant: the command ran past its timeout and was killed\n');
  return end.exitCode ?? 128 + (SIGNAL_NUMBERS[end.signal ?? 'SIGKILL'] ?? 9);
}

/** Follows a command's ndjson stream to its end: output written as it comes; its exit code. */
async function followStream(res: Response, onStart?: (id: string) => void): Promise<number> {
  for await (const ev of ndjson(res)) {
    if (ev.type === 'start') onStart?.(ev.id);
    else if (ev.type === 'stdout') await writeOut(process.stdout, Buffer.from(ev.data, 'base64'));
    else if (ev.type === 'stderr') await writeOut(process.stderr, Buffer.from(ev.data, 'base64'));
    else if (ev.type === 'end') return exitCodeOf(ev);
    else throw apiError(ev.code, ev.message, 0);
  }
  throw apiError('TOOLBOX_UNAVAILABLE', 'the command stream ended before the command did', 0);
}

interface ExecFlags {
  interactive?: boolean;
  tty?: boolean;
  detach?: boolean;
  cwd?: string;
  env: string[];
  timeout?: string;
  json?: boolean;
}

function envOf(pairs: string[]): Record<string, string> | undefined {
  if (pairs.length === 0) return undefined;
  const out: Record<string, string> = {};
  for (const p of pairs) {
    const eq = p.indexOf('=');
    if (eq <= 0) throw usage(`--env wants K=V, not ${p}`);
    out[p.slice(0, eq)] = p.slice(eq + 1);
  }
  return out;
}

async function exec(id: string, args: string[], o: ExecFlags): Promise<number> {
  const envs = envOf(o.env);
  // A detached command or a terminal session runs until it ends unless told otherwise.
  const timeoutMs = o.timeout !== undefined ? Number(o.timeout) : o.detach || o.tty ? 0 : 60_000;
  if (!Number.isInteger(timeoutMs) || timeoutMs < 0) throw usage('--timeout is a number of milliseconds');
  const common = {
    args,
    timeoutMs,
    ...(o.cwd !== undefined ? { cwd: o.cwd } : {}),
    ...(envs ? { envs } : {}),
  };
  if (o.json) {
    // The whole result at once, as scripts read it.
    const r = await clientFromEnv().exec(id, args, { timeoutMs });
    printJson(r);
    return r.exitCode;
  }
  if (o.detach) {
    const res = await call('POST', sandboxPath(id, '/commands'), { json: { ...common, background: true } });
    process.stdout.write(`${((await res.json()) as CommandInfo).id}\n`);
    return 0;
  }
  if (o.tty) return terminal(id, common, o.interactive === true);
  const res = await call('POST', sandboxPath(id, '/commands'), {
    json: { ...common, ...(o.interactive ? { stdin: true } : {}) },
  });
  let feeding: Promise<unknown> | undefined;
  const code = await followStream(res, (cid) => {
    if (!o.interactive) return;
    // The CLI's stdin, streamed into the command as it is read; its end closes the command's.
    feeding = call('POST', sandboxPath(id, `/commands/${cid}/stdin?eof=true`), { raw: process.stdin }).catch(
      (e: unknown) => process.stderr.write(`dormant: stdin: ${String(e)}\n`),
    );
  });
  if (feeding) process.stdin.destroy();
  return code;
}

/**
 * A command on a terminal: started in the background on a PTY of this terminal's size, then
 * attached over the WebSocket (raw keystrokes in, the screen out, resizes as they happen).
 */
async function terminal(id: string, common: object, interactive: boolean): Promise<number> {
  const size = { cols: process.stdout.columns || 80, rows: process.stdout.rows || 24 };
  const res = await call('POST', sandboxPath(id, '/commands'), {
    json: { ...common, background: true, pty: size, ...(interactive ? { stdin: true } : {}) },
  });
  const info = (await res.json()) as CommandInfo;
  const token = tokenFromEnv();
  const url = `${daemonUrl().replace(/\/+$/, '').replace(/^http/, 'ws')}${sandboxPath(id, `/commands/${info.id}/ws`)}`;
  // Loaded for a terminal only: every other command starts without the WebSocket library.
  const { default: WebSocket } = await import('ws');
  const ws = new WebSocket(url, { headers: token ? { authorization: `Bearer ${token}` } : {} });
  const stdin = process.stdin;
  const raw = interactive && stdin.isTTY;
  const resize = (): void =>
    ws.send(JSON.stringify({ type: 'resize', cols: process.stdout.columns, rows: process.stdout.rows }));
  return new Promise<number>((resolve, reject) => {
    let code: number | undefined;
    const cleanup = (): void => {
      process.removeListener('SIGWINCH', resize);
      if (raw) stdin.setRawMode(false);
      stdin.pause();
    };
    ws.on('open', () => {
      if (raw) stdin.setRawMode(true);
      process.on('SIGWINCH', resize);
      if (!interactive) return;
      stdin.on('data', (d: Buffer) => ws.send(d, { binary: true }));
      stdin.on('end', () => ws.send(JSON.stringify({ type: 'eof' })));
      stdin.resume();
    });
    ws.on('message', (data: Buffer, binary: boolean) => {
      if (binary) return void process.stdout.write(data);
      const ev = JSON.parse(data.toString('utf8')) as CommandEvent;
      if (ev.type === 'stderr') process.stderr.write(Buffer.from(ev.data, 'base64'));
      else if (ev.type === 'end') code = exitCodeOf(ev);
      else if (ev.type === 'error') {
        cleanup();
        reject(apiError(ev.code, ev.message, 0));
      }
    });
    ws.on('error', (e) => {
      cleanup();
      reject(apiError('TOOLBOX_UNAVAILABLE', `the terminal session failed: ${e.message}`, 0));
    });
    ws.on('close', () => {
      cleanup();
      if (code !== undefined) resolve(code);
      else reject(apiError('TOOLBOX_UNAVAILABLE', 'the terminal session closed before the command ended', 0));
    });
  });
}

/** `ID:/path` names a path in a sandbox (as docker cp does); anything else is local, `-` stdio. */
function remoteOf(spec: string): { id: string; path: string } | undefined {
  const m = /^([A-Za-z0-9][A-Za-z0-9._-]*):(.+)$/.exec(spec);
  return m ? { id: m[1]!, path: m[2]! } : undefined;
}

async function copy(src: string, dst: string): Promise<void> {
  const from = remoteOf(src);
  const to = remoteOf(dst);
  if ((from === undefined) === (to === undefined))
    throw usage('cp copies between a sandbox (ID:/path) and here');
  if (from) {
    const res = await call('GET', `${sandboxPath(from.id, '/files')}?path=${encodeURIComponent(from.path)}`);
    const body = Readable.fromWeb(res.body!);
    if (dst === '-') return pipeline(body, process.stdout, { end: false });
    const isDir = await stat(dst).then(
      (s) => s.isDirectory(),
      () => false,
    );
    await pipeline(body, createWriteStream(isDir ? join(dst, basename(from.path)) : dst));
    return;
  }
  const target = to!;
  let path = target.path;
  // A folder as the target takes the file under its own name, as cp does.
  const there = await call(
    'GET',
    `${sandboxPath(target.id, '/files/stat')}?path=${encodeURIComponent(path)}`,
  ).then(
    async (r) => (await r.json()) as FileInfo,
    () => undefined,
  );
  if (there?.type === 'dir' || path.endsWith('/')) {
    if (src === '-') throw usage('name the file to write from stdin: ID:/folder/name');
    path = `${path.replace(/\/+$/, '')}/${basename(src)}`;
  }
  let mode = '';
  let body: AsyncIterable<Uint8Array> = process.stdin;
  if (src !== '-') {
    const st = await stat(src);
    if (st.isDirectory())
      throw usage(`${src} is a folder: cp copies files (tar it, or copy its files one by one)`);
    mode = `&mode=${(st.mode & 0o777).toString(8)}`;
    body = createReadStream(src);
  }
  await call('PUT', `${sandboxPath(target.id, '/files')}?path=${encodeURIComponent(path)}${mode}`, {
    raw: body,
  });
}

export function registerToolbox(program: Command): void {
  program
    .command('exec')
    .description('run a command inside; its output streams back and its exit code is the exit code')
    .argument('<id>')
    .argument('<command...>', 'after --')
    .option('-i, --interactive', "pass this terminal's stdin to the command (streamed)")
    .option('-t, --tty', 'run it on a terminal (with -i: an interactive shell)')
    .option('-d, --detach', 'run it in the background; prints its command id')
    .option('--cwd <dir>', 'working directory inside the sandbox')
    .option('--env <K=V>', 'an environment variable (repeatable)', collect, [])
    .option(
      '--timeout <ms>',
      'kill the command after this many milliseconds (default 60000; with -t or -d none)',
    )
    .option('--json', 'print { exitCode, stdout, stderr } as JSON once it ends')
    .addHelpText(
      'after',
      "\nExamples:\n  dormant exec agent -- ls /srv\n  dormant exec agent -- sh -c 'cd /srv && make test'   # exit code passed through\n  dormant exec -it agent -- sh                          # a shell\n  tar c src | dormant exec -i agent -- tar x -C /srv\n  dormant exec -d agent -- python3 -m http.server 8080  # prints the command id",
    )
    .action(async (id, command, o) => {
      process.exitCode = await exec(id, command, o);
    });

  program
    .command('cp')
    .description('copy a file into or out of a sandbox: ID:/path on one side, - for stdin/stdout')
    .argument('<src>')
    .argument('<dst>')
    .addHelpText(
      'after',
      '\nFiles only: a folder is refused (tar it: tar c dir | dormant exec -i ID -- tar x -C /dest).\n\nExamples:\n  dormant cp ./data.csv agent:/srv/data.csv\n  dormant cp agent:/srv/out.json .\n  dormant cp agent:/var/log/app.log - | tail',
    )
    .action(async (src, dst) => {
      await copy(src, dst);
    });
}
