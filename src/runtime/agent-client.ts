/**
 * The client of dormant-agent, the toolbox agent that runs inside a sandbox (native/agent/,
 * docs/ARCHITECTURE.md "The toolbox agent"). One TCP connection per request: a `Q` frame
 * (token, op, key=value fields), then op-specific frames both ways.
 *
 * Everything the agent sends is untrusted: a sandbox may run its own program on the agent's
 * port. Frames are bounded (1 MiB, which also bounds every JSON result), listings are bounded
 * (100 000 entries), and a malformed answer is an AgentError('EPROTO'), never a crash.
 */
import { connect, type Socket } from 'node:net';
import { Readable } from 'node:stream';

export interface AgentAddress {
  host: string;
  port: number;
  token: string;
}

/** The agent's `!` code (ENOENT, EACCES, EAUTH, ...), or ECONNREFUSED, ETIMEDOUT, EPROTO. */
export class AgentError extends Error {
  constructor(
    readonly code: string,
    message: string,
  ) {
    super(message);
    this.name = 'AgentError';
  }
}

export interface RunSpec {
  args: string[];
  cwd?: string;
  env?: Record<string, string>;
  /** 0 or absent: none. The agent kills the process group at the deadline. */
  timeoutMs?: number;
  /** Keep a stdin pipe open for write()/closeStdin(); else stdin is /dev/null. */
  stdin?: boolean;
  pty?: { cols: number; rows: number };
  tag?: string;
}

export interface ExitInfo {
  exitCode: number | null;
  signal: string | null;
  durationMs: number;
  timedOut: boolean;
}

/** One connection following one process (run or attach). */
export interface ProcessHandle {
  id: string;
  pid: number;
  /** The output offset this handle started at (attach may start later than asked: lost). */
  from: number;
  /** Output bytes the agent no longer had when this handle asked for them (L frames). */
  lostBytes: number;
  /** Output is buffered until a callback is set. A PTY's output is all 'stdout'. */
  onOutput(cb: (stream: 'stdout' | 'stderr', data: Buffer) => void): void;
  /** Rejects with an AgentError when the connection breaks (or detach()) before the exit. */
  exited: Promise<ExitInfo>;
  write(data: Buffer): void;
  closeStdin(): void;
  signal(sig: number): void;
  resize(cols: number, rows: number): void;
  /** Closes the connection only: the process keeps running. */
  detach(): void;
}

export interface ProcessInfo {
  id: string;
  pid: number;
  args: string[];
  cwd: string;
  tag: string | null;
  pty: boolean;
  running: boolean;
  exitCode: number | null;
  signal: string | null;
  startedAt: number;
  outputBytes: number;
}

export interface FileInfo {
  name: string;
  path: string;
  type: 'file' | 'dir' | 'symlink' | 'other';
  size: number;
  mode: number;
  mtimeMs: number;
  symlinkTarget?: string;
}

export interface WatchEvent {
  type: 'create' | 'write' | 'remove' | 'rename' | 'chmod';
  path: string;
  isDir: boolean;
}

export const AGENT_PORT = 49983;
const MAX_FRAME = 1 << 20;
const MAX_ENTRIES = 100_000;
/** Size of the D and I frames the client sends. */
const SEND_CHUNK = 256 << 10;
/** Received bytes queued before the socket is paused (read()'s backpressure). */
const HIGH_WATER = 4 << 20;
/**
 * A file read's socket reads into buffers of this size (net's onread), not Node's fixed
 * 64 KiB: a raw read's bytes then cross into JavaScript in about 16 times fewer callbacks,
 * each of them a stream push and an HTTP write (docs/BENCHMARKS.md "Toolbox").
 */
const READ_BUFFER = 1 << 20;
/** A read this short is copied out, and its big buffer used again (no 1 MiB held per 4 KiB). */
const READ_KEEP_MIN = READ_BUFFER / 4;

interface Frame {
  type: string;
  data: Buffer;
}

function protoError(message: string): AgentError {
  return new AgentError('EPROTO', `agent: ${message}`);
}

function socketError(e: NodeJS.ErrnoException): AgentError {
  return e instanceof AgentError ? e : new AgentError(e.code ?? 'EPROTO', `agent: ${e.message}`);
}

function encodeFrame(type: string, data: Buffer | string): Buffer {
  const payload = typeof data === 'string' ? Buffer.from(data) : data;
  const head = Buffer.alloc(5);
  head.write(type, 0, 'latin1');
  head.writeUInt32BE(payload.length, 1);
  return Buffer.concat([head, payload]);
}

/** Token, op and key=value fields, NUL-separated; a NUL inside a value cannot be said. */
function encodeRequest(token: string, op: string, fields: [string, string | number][]): Buffer {
  const parts = [token, op, ...fields.map(([k, v]) => `${k}=${v}`)];
  for (const p of parts)
    if (p.includes('\0')) throw new AgentError('EINVAL', 'agent: a request field cannot contain a NUL byte');
  const payload = Buffer.from(parts.join('\0'));
  if (payload.length > MAX_FRAME) throw new AgentError('E2BIG', 'agent: the request is larger than 1 MiB');
  return encodeFrame('Q', payload);
}

function parseJson(f: Frame): unknown {
  try {
    return JSON.parse(f.data.toString('utf8')) as unknown;
  } catch {
    throw protoError(`malformed JSON in a ${f.type} frame`);
  }
}

function asRecord(v: unknown, what: string): Record<string, unknown> {
  if (typeof v !== 'object' || v === null || Array.isArray(v)) throw protoError(`${what} is not an object`);
  return v as Record<string, unknown>;
}

function num(r: Record<string, unknown>, key: string): number {
  const v = r[key];
  if (typeof v !== 'number' || !Number.isFinite(v)) throw protoError(`"${key}" is not a number`);
  return v;
}

function str(r: Record<string, unknown>, key: string): string {
  const v = r[key];
  if (typeof v !== 'string') throw protoError(`"${key}" is not a string`);
  return v;
}

function optStr(r: Record<string, unknown>, key: string): string | null {
  return r[key] === null || r[key] === undefined ? null : str(r, key);
}

function toExit(f: Frame): ExitInfo {
  const r = asRecord(parseJson(f), 'an exit');
  return {
    exitCode: r.exitCode === null ? null : num(r, 'exitCode'),
    signal: optStr(r, 'signal'),
    durationMs: num(r, 'durationMs'),
    timedOut: r.timedOut === true,
  };
}

function toFileInfo(f: Frame): FileInfo {
  const r = asRecord(parseJson(f), 'a file entry');
  const type = str(r, 'type');
  if (type !== 'file' && type !== 'dir' && type !== 'symlink' && type !== 'other')
    throw protoError(`bad file type ${type}`);
  const info: FileInfo = {
    name: str(r, 'name'),
    path: str(r, 'path'),
    type,
    size: num(r, 'size'),
    mode: num(r, 'mode'),
    mtimeMs: num(r, 'mtimeMs'),
  };
  if (r.symlinkTarget !== undefined) info.symlinkTarget = str(r, 'symlinkTarget');
  return info;
}

function toProcessInfo(v: unknown): ProcessInfo {
  const r = asRecord(v, 'a process');
  const args = r.args;
  if (!Array.isArray(args) || !args.every((a) => typeof a === 'string'))
    throw protoError('"args" is not a string list');
  return {
    id: str(r, 'id'),
    pid: num(r, 'pid'),
    args,
    cwd: str(r, 'cwd'),
    tag: optStr(r, 'tag'),
    pty: r.pty === true,
    running: r.running === true,
    exitCode: r.exitCode === null ? null : num(r, 'exitCode'),
    signal: optStr(r, 'signal'),
    startedAt: num(r, 'startedAt'),
    outputBytes: num(r, 'outputBytes'),
  };
}

function toWatchEvent(f: Frame): WatchEvent {
  const r = asRecord(parseJson(f), 'a watch event');
  const type = str(r, 'type');
  if (!['create', 'write', 'remove', 'rename', 'chmod'].includes(type))
    throw protoError(`bad event type ${type}`);
  return { type: type as WatchEvent['type'], path: str(r, 'path'), isDir: r.isDir === true };
}

/** The `!` frame as the error it names; any other unexpected frame is EPROTO. */
function frameError(f: Frame | undefined, expected: string): AgentError {
  if (!f) return protoError(`the connection closed where a ${expected} frame was expected`);
  if (f.type !== '!')
    return protoError(`a ${JSON.stringify(f.type)} frame where a ${expected} frame was expected`);
  const r = asRecord(parseJson(f), 'an error');
  return new AgentError(
    typeof r.code === 'string' ? r.code.slice(0, 64) : 'EPROTO',
    `agent: ${typeof r.message === 'string' ? r.message.slice(0, 4096) : 'error'}`,
  );
}

/**
 * One connection: frames in (parsed, bounded, queued until pulled by next()) and out. The
 * socket is paused while more than HIGH_WATER bytes wait to be pulled.
 */
class Channel {
  private chunks: Buffer[] = [];
  private have = 0;
  private frames: Frame[] = [];
  private queued = 0;
  private end: AgentError | null | undefined; // null: clean EOF
  private waiter: (() => void) | undefined;
  /** Set by holdAfterFrame: bytes after the next frame stay unparsed (a raw read's data). */
  private holding: 'no' | 'armed' | 'held' = 'no';
  /** Where received bytes go: the frame parser, or a raw read's stream (rawStream). */
  private sink = (b: Buffer): void => this.onData(b);

  constructor(readonly socket: Socket) {
    socket.on('data', (b: Buffer) => this.sink(b));
    socket.on('end', () => this.finish(null));
    socket.on('close', () => this.finish(null));
    socket.on('error', (e) => this.finish(socketError(e)));
  }

  /** Bytes read by the socket's own buffers (open's bigReads), in place of 'data' events. */
  receive(b: Buffer): void {
    this.sink(b);
  }

  private onData(b: Buffer): void {
    // The chunks as they came, joined only when a frame spans them: one copy per frame at
    // most (joining on every chunk copied a 256 KiB frame's bytes about three times).
    this.chunks.push(b);
    this.have += b.length;
    while (this.have >= 5 && this.holding !== 'held') {
      const len = this.bytes(5, false).readUInt32BE(1);
      if (len > MAX_FRAME) {
        this.finish(protoError('a frame larger than 1 MiB'));
        this.socket.destroy();
        return;
      }
      if (this.have < 5 + len) break;
      const whole = this.bytes(5 + len, true);
      this.frames.push({ type: String.fromCharCode(whole[0]!), data: whole.subarray(5) });
      this.queued += len;
      if (this.holding === 'armed') {
        this.holding = 'held';
        this.socket.pause();
      }
    }
    if (this.queued > HIGH_WATER) this.socket.pause();
    this.wake();
  }

  /** The first `n` received bytes (n <= have), removed from the queue when `take`. */
  private bytes(n: number, take: boolean): Buffer {
    const first = this.chunks[0]!;
    let out: Buffer;
    if (first.length >= n) out = first.subarray(0, n);
    else {
      out = Buffer.allocUnsafe(n);
      let at = 0;
      for (const c of this.chunks) {
        at += c.copy(out, at, 0, Math.min(c.length, n - at));
        if (at === n) break;
      }
    }
    if (take) {
      this.have -= n;
      let left = n;
      while (left > 0) {
        const c = this.chunks[0]!;
        if (c.length <= left) {
          this.chunks.shift();
          left -= c.length;
        } else {
          this.chunks[0] = c.subarray(left);
          left = 0;
        }
      }
    }
    return out;
  }

  private finish(e: AgentError | null): void {
    if (this.end === undefined || (this.end === null && e)) this.end = e;
    this.wake();
  }

  private wake(): void {
    const w = this.waiter;
    this.waiter = undefined;
    w?.();
  }

  /** The next frame; undefined at the end of the connection; rejects if it broke. */
  async next(): Promise<Frame | undefined> {
    for (;;) {
      const f = this.frames.shift();
      if (f) {
        this.queued -= f.data.length;
        if (this.socket.isPaused() && this.queued < HIGH_WATER / 2) this.socket.resume();
        return f;
      }
      if (this.end === null) return undefined;
      if (this.end) throw this.end;
      await new Promise<void>((resolve) => (this.waiter = resolve));
    }
  }

  /**
   * Parses only the next frame; the bytes after it are left for rawStream (or for frames
   * again, with resumeFrames). Call before any answer can have arrived.
   */
  holdAfterFrame(): void {
    this.holding = 'armed';
  }

  /** Goes back to parsing frames after holdAfterFrame (the agent did not switch to raw). */
  resumeFrames(): void {
    this.holding = 'no';
    this.onData(Buffer.alloc(0));
    if (this.queued <= HIGH_WATER) this.socket.resume();
  }

  /**
   * The rest of the connection as plain bytes, after a held frame: exactly `size` of them.
   * Fewer (the agent reset the connection, or ended it early) is an error, never a short file.
   */
  rawStream(size: number): Readable {
    const socket = this.socket;
    const leftover = this.chunks;
    this.chunks = [];
    this.have = 0;
    socket.removeAllListeners('end');
    let got = 0;
    const stream = new Readable({
      // a few of the socket's 1 MiB reads (READ_BUFFER) in flight, so that the socket is not
      // stopped and started again after every one of them
      highWaterMark: 4 << 20,
      read: () => socket.resume(),
      destroy: (err, cb) => {
        socket.destroy();
        cb(err);
      },
    });
    const take = (b: Buffer): void => {
      got += b.length;
      if (got > size) {
        stream.destroy(protoError(`more than the ${size} bytes announced`));
        return;
      }
      if (!stream.push(b)) socket.pause();
    };
    const ended = (): void => {
      if (got === size) stream.push(null);
      else
        stream.destroy(
          protoError(`the file ended after ${got} of ${size} bytes (it shrank, or the agent failed)`),
        );
    };
    for (const b of leftover) take(b);
    if (this.end === null)
      ended(); // the whole answer had already arrived
    else if (this.end) stream.destroy(this.end);
    else {
      this.sink = take;
      socket.on('end', ended);
      socket.on('error', (e) => stream.destroy(socketError(e)));
    }
    return stream;
  }

  /** The next frame, which must be of the type given (`!` becomes its AgentError). */
  async expect(type: string): Promise<Frame> {
    const f = await this.next();
    if (f?.type === type) return f;
    throw frameError(f, type);
  }

  /** Whether a frame or the end has arrived (the agent answered before the client finished). */
  answered(): boolean {
    return this.frames.length > 0 || this.end !== undefined;
  }

  send(type: string, data: Buffer | string = Buffer.alloc(0)): boolean {
    if (this.socket.destroyed) return false;
    return this.socket.write(encodeFrame(type, data));
  }

  /** Sends data as frames of at most SEND_CHUNK, waiting while the socket's buffer is full. */
  async sendData(type: string, data: Buffer): Promise<void> {
    for (let off = 0; off < data.length; off += SEND_CHUNK)
      if (!this.send(type, data.subarray(off, off + SEND_CHUNK))) await this.drained();
  }

  private drained(): Promise<void> {
    return new Promise((resolve, reject) => {
      if (this.end !== undefined) return reject(this.end ?? protoError('the connection closed'));
      const done = (): void => {
        this.socket.off('drain', done);
        this.socket.off('close', done);
        if (this.socket.destroyed && this.end !== null)
          reject(this.end ?? protoError('the connection closed'));
        else resolve();
      };
      this.socket.on('drain', done);
      this.socket.on('close', done);
    });
  }

  close(): void {
    this.socket.destroy();
  }
}

/**
 * Streams chunks as `type` frames, then `last` (an empty frame). When the agent answers early
 * (an error, say EACCES, before it read the data) the sending stops, and a send that broke
 * because the agent closed reports the agent's own error instead.
 */
async function sendAll(
  ch: Channel,
  type: string,
  chunks: Iterable<Buffer> | AsyncIterable<Buffer>,
  last?: string,
): Promise<void> {
  try {
    for await (const chunk of chunks) {
      if (ch.answered()) return;
      await ch.sendData(type, Buffer.isBuffer(chunk) ? chunk : Buffer.from(chunk));
    }
    if (last && !ch.answered()) ch.send(last);
  } catch (e) {
    const f = await ch.next().catch(() => undefined);
    throw f?.type === '!' ? frameError(f, 'R') : e;
  }
}

class FollowedProcess implements ProcessHandle {
  lostBytes = 0;
  readonly exited: Promise<ExitInfo>;
  private cb: ((stream: 'stdout' | 'stderr', data: Buffer) => void) | undefined;
  private buffered: ['stdout' | 'stderr', Buffer][] = [];
  private detached = false;

  constructor(
    private readonly ch: Channel,
    readonly id: string,
    readonly pid: number,
    readonly from: number,
  ) {
    this.exited = this.pump();
    this.exited.catch(() => {}); // a caller that only detaches need not await it
  }

  private async pump(): Promise<ExitInfo> {
    try {
      for (;;) {
        const f = await this.ch.next();
        if (f?.type === 'O' || f?.type === 'E') this.output(f.type === 'O' ? 'stdout' : 'stderr', f.data);
        else if (f?.type === 'L') this.lostBytes += num(asRecord(parseJson(f), 'a lost notice'), 'lostBytes');
        else if (f?.type === 'X') return toExit(f);
        else if (this.detached) throw new AgentError('EDETACHED', 'agent: detached before the process ended');
        else throw frameError(f, 'X');
      }
    } finally {
      this.ch.close();
    }
  }

  private output(stream: 'stdout' | 'stderr', data: Buffer): void {
    if (this.cb) this.cb(stream, data);
    else this.buffered.push([stream, data]);
  }

  onOutput(cb: (stream: 'stdout' | 'stderr', data: Buffer) => void): void {
    this.cb = cb;
    for (const [s, d] of this.buffered.splice(0)) cb(s, d);
  }

  write(data: Buffer): void {
    for (let off = 0; off < data.length; off += SEND_CHUNK)
      this.ch.send('I', data.subarray(off, off + SEND_CHUNK));
  }

  closeStdin(): void {
    this.ch.send('C');
  }

  signal(sig: number): void {
    this.ch.send('S', String(Math.trunc(sig)));
  }

  resize(cols: number, rows: number): void {
    this.ch.send('T', `${Math.trunc(cols)} ${Math.trunc(rows)}`);
  }

  detach(): void {
    this.detached = true;
    this.ch.close();
  }
}

export class AgentClient {
  private readonly connectTimeoutMs: number;
  private readonly env: Readonly<Record<string, string>>;

  /**
   * `env`: the environment every command gets under its own `env` (the sandbox's current
   * one, as `runc exec` gave from its config: the agent's own is only what it was started
   * with, and a restored agent keeps that).
   */
  constructor(
    readonly addr: AgentAddress,
    opts: { connectTimeoutMs?: number; env?: Readonly<Record<string, string>> } = {},
  ) {
    this.connectTimeoutMs = opts.connectTimeoutMs ?? 2000;
    this.env = opts.env ?? {};
  }

  /**
   * Connects and sends the request; the caller owns the channel. `bigReads`: the socket reads
   * into READ_BUFFER-sized buffers (for a file's bytes), handed on without a copy when a read
   * filled much of one.
   */
  private open(
    op: string,
    fields: [string, string | number][] = [],
    opts: { bigReads?: boolean } = {},
  ): Promise<Channel> {
    const q = encodeRequest(this.addr.token, op, fields);
    return new Promise((resolve, reject) => {
      let ch: Channel | undefined;
      let spare: Buffer | undefined;
      const onread = {
        buffer: (): Buffer => (spare ??= Buffer.allocUnsafe(READ_BUFFER)),
        callback: (n: number, buf: Uint8Array): boolean => {
          const b = buf as Buffer;
          let chunk: Buffer;
          if (n >= READ_KEEP_MIN) {
            chunk = b.subarray(0, n);
            spare = undefined; // handed on: the next read gets a new buffer
          } else {
            chunk = Buffer.allocUnsafe(n);
            b.copy(chunk, 0, 0, n);
          }
          ch?.receive(chunk);
          return true;
        },
      };
      const socket = connect({
        host: this.addr.host,
        port: this.addr.port,
        ...(opts.bigReads ? { onread } : {}),
      });
      socket.setNoDelay(true);
      const timer = setTimeout(() => {
        socket.destroy();
        reject(
          new AgentError(
            'ETIMEDOUT',
            `agent: no connection to ${this.addr.host}:${this.addr.port} within ${this.connectTimeoutMs} ms`,
          ),
        );
      }, this.connectTimeoutMs);
      const failed = (e: Error): void => {
        clearTimeout(timer);
        reject(socketError(e));
      };
      socket.once('error', failed);
      socket.once('connect', () => {
        clearTimeout(timer);
        socket.off('error', failed);
        ch = new Channel(socket);
        ch.send('Q', q.subarray(5));
        resolve(ch);
      });
    });
  }

  /** One request, one R frame. */
  private async call(op: string, fields: [string, string | number][] = []): Promise<unknown> {
    const ch = await this.open(op, fields);
    try {
      return parseJson(await ch.expect('R'));
    } finally {
      ch.close();
    }
  }

  async ping(): Promise<{ version: number; pid: number }> {
    const r = asRecord(await this.call('ping'), 'ping');
    return { version: num(r, 'version'), pid: num(r, 'pid') };
  }

  /**
   * Starts a command and follows it. An abort (before or after the start) kills the command's
   * process group; after the start, `exited` then reports the kill.
   */
  async run(spec: RunSpec, opts: { signal?: AbortSignal } = {}): Promise<ProcessHandle> {
    if (spec.args.length === 0) throw new AgentError('EINVAL', 'agent: run needs a command');
    opts.signal?.throwIfAborted();
    const fields: [string, string | number][] = spec.args.map((a) => ['arg', a]);
    if (spec.cwd !== undefined) fields.push(['cwd', spec.cwd]);
    for (const [k, v] of Object.entries({ ...this.env, ...spec.env })) fields.push(['env', `${k}=${v}`]);
    if (spec.timeoutMs) fields.push(['timeout_ms', Math.max(1, Math.ceil(spec.timeoutMs))]);
    if (spec.stdin) fields.push(['stdin', 1]);
    if (spec.pty) fields.push(['pty', `${Math.trunc(spec.pty.cols)} ${Math.trunc(spec.pty.rows)}`]);
    if (spec.tag !== undefined) fields.push(['tag', spec.tag]);
    const ch = await this.open('run', fields);
    let handle: ProcessHandle | undefined;
    // The connection is never cut early: a kill sent before the agent's answer is read by the
    // agent right after it, and an abort must not leave a command running unseen.
    const onAbort = (): void => void ch.send('S', '9');
    if (opts.signal?.aborted)
      onAbort(); // while connecting
    else opts.signal?.addEventListener('abort', onAbort, { once: true });
    try {
      const r = asRecord(parseJson(await ch.expect('R')), 'run');
      handle = new FollowedProcess(ch, str(r, 'id'), num(r, 'pid'), 0);
    } catch (e) {
      ch.close();
      opts.signal?.removeEventListener('abort', onAbort);
      throw e;
    }
    void handle.exited.finally(() => opts.signal?.removeEventListener('abort', onAbort)).catch(() => {});
    return handle;
  }

  /** Follows a running or exited process from output offset `from` (replay, then live). */
  async attach(id: string, from = 0): Promise<ProcessHandle> {
    const ch = await this.open('attach', [
      ['id', id],
      ['from', Math.max(0, Math.trunc(from))],
    ]);
    try {
      const r = asRecord(parseJson(await ch.expect('R')), 'attach');
      const handle = new FollowedProcess(ch, str(r, 'id'), num(r, 'pid'), num(r, 'from'));
      return handle;
    } catch (e) {
      ch.close();
      throw e;
    }
  }

  async list(): Promise<ProcessInfo[]> {
    const r = await this.call('list');
    if (!Array.isArray(r) || r.length > MAX_ENTRIES)
      throw protoError('the process list is not a bounded array');
    return r.map(toProcessInfo);
  }

  /** False when the process had already ended. */
  async signal(id: string, sig: number): Promise<boolean> {
    const r = asRecord(
      await this.call('signal', [
        ['id', id],
        ['sig', Math.trunc(sig)],
      ]),
      'signal',
    );
    return r.delivered === true;
  }

  /** Writes to a process's stdin over its own connection; `close` ends the input after. */
  async stdin(id: string, data: Buffer | AsyncIterable<Buffer>, close = false): Promise<void> {
    const ch = await this.open('stdin', [['id', id]]);
    try {
      await sendAll(ch, 'I', Buffer.isBuffer(data) ? [data] : data, close ? 'C' : undefined);
      ch.socket.end(); // the agent answers once our side ends
      await ch.expect('R');
    } finally {
      ch.close();
    }
  }

  async resize(id: string, cols: number, rows: number): Promise<void> {
    await this.call('resize', [
      ['id', id],
      ['cols', Math.trunc(cols)],
      ['rows', Math.trunc(rows)],
    ]);
  }

  async stat(path: string): Promise<FileInfo> {
    const ch = await this.open('stat', [['path', path]]);
    try {
      return toFileInfo(await ch.expect('R'));
    } finally {
      ch.close();
    }
  }

  /** Entries below path (depth 1: its children), sorted by path. */
  async ls(path: string, depth = 1): Promise<FileInfo[]> {
    const ch = await this.open('ls', [
      ['path', path],
      ['depth', Math.trunc(depth)],
    ]);
    try {
      const out: FileInfo[] = [];
      for (;;) {
        const f = await ch.next();
        if (f?.type === 'Z') return out;
        if (f?.type !== 'R') throw frameError(f, 'R');
        if (out.length === MAX_ENTRIES) throw protoError('more than 100000 entries');
        out.push(toFileInfo(f));
      }
    } finally {
      ch.close();
    }
  }

  /** The file's bytes as a stream; the agent is read only as fast as the stream is consumed. */
  async read(path: string): Promise<{ size: number; stream: Readable }> {
    // raw=1: the agent may send a regular file's bytes unframed after its answer (an agent of
    // before raw reads ignores the field and frames them as always).
    const ch = await this.open(
      'read',
      [
        ['path', path],
        ['raw', 1],
      ],
      { bigReads: true },
    );
    ch.holdAfterFrame();
    let size: number;
    let raw: boolean;
    try {
      const r = asRecord(parseJson(await ch.expect('R')), 'read');
      size = num(r, 'size');
      raw = r.raw === true;
    } catch (e) {
      ch.close();
      throw e;
    }
    if (raw) return { size, stream: ch.rawStream(size) };
    ch.resumeFrames();
    let pulling = false;
    const stream = new Readable({
      // A few of the agent's 256 KiB frames in flight, not one: the default 16 KiB mark
      // stopped the pull after every frame until the consumer asked again.
      highWaterMark: 1 << 20,
      read() {
        if (pulling) return;
        pulling = true;
        const pull = async (): Promise<void> => {
          for (;;) {
            const f = await ch.next();
            if (f?.type === 'Z') {
              ch.close();
              stream.push(null);
              return;
            }
            if (f?.type !== 'D') throw frameError(f, 'D');
            if (!stream.push(f.data)) return;
          }
        };
        pull().then(
          () => (pulling = false),
          (e: unknown) => stream.destroy(e as Error),
        );
      },
      destroy(err, cb) {
        ch.close();
        cb(err);
      },
    });
    return { size, stream };
  }

  /** Writes a whole file: the target is replaced atomically when the data is complete. */
  async write(
    path: string,
    data: Buffer | Readable | AsyncIterable<Buffer>,
    opts: { mode?: number; append?: boolean } = {},
  ): Promise<{ path: string; size: number }> {
    const fields: [string, string | number][] = [['path', path]];
    if (opts.mode !== undefined) fields.push(['mode', (opts.mode & 0o7777).toString(8)]);
    if (opts.append) fields.push(['append', 1]);
    const ch = await this.open('write', fields);
    try {
      await sendAll(ch, 'D', Buffer.isBuffer(data) ? [data] : data, 'F');
      const r = asRecord(parseJson(await ch.expect('R')), 'write');
      return { path: str(r, 'path'), size: num(r, 'size') };
    } finally {
      ch.close();
    }
  }

  /** Creates path and its parents; false when it already was a folder. */
  async mkdir(path: string): Promise<boolean> {
    return asRecord(await this.call('mkdir', [['path', path]]), 'mkdir').created === true;
  }

  /** Removes a file or a whole tree; ENOENT when it is not there. */
  async remove(path: string): Promise<void> {
    await this.call('remove', [['path', path]]);
  }

  async rename(from: string, to: string): Promise<void> {
    await this.call('rename', [
      ['from', from],
      ['to', to],
    ]);
  }

  /** Reports changes below path until close(); `closed` settles when the connection ends. */
  async watch(
    path: string,
    recursive: boolean,
    onEvent: (e: WatchEvent) => void,
  ): Promise<{ close(): void; closed: Promise<void> }> {
    const fields: [string, string | number][] = [['path', path]];
    if (recursive) fields.push(['recursive', 1]);
    const ch = await this.open('watch', fields);
    try {
      await ch.expect('R');
    } catch (e) {
      ch.close();
      throw e;
    }
    let closing = false;
    const closed = (async () => {
      try {
        for (;;) {
          const f = await ch.next();
          if (!f) return;
          if (f.type !== 'W') throw frameError(f, 'W');
          onEvent(toWatchEvent(f));
        }
      } catch (e) {
        if (!closing) throw e;
      } finally {
        ch.close();
      }
    })();
    closed.catch(() => {});
    return {
      close: () => {
        closing = true;
        ch.close();
      },
      closed,
    };
  }
}
