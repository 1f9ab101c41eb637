/**
 * One client connection to the wake proxy's HTTP port, relayed to a sandbox byte for byte.
 *
 * Every request head is parsed, routed by Host and checked for a token on its own; the head
 * is rewritten (the dormant token scrubbed, X-Forwarded-* added) and the body relayed
 * untouched, measured by its Content-Length or chunks so the next head is found. Responses
 * are relayed untouched too, measured the same way (which response ends when is what lets a
 * request for another sandbox, or one that is refused, wait for the earlier answers and then
 * be re-routed or answered by the proxy in order). A 101 to an upgrade request turns the
 * connection into a tunnel. While the route stays the same, a request costs one parse and
 * one write each way: no new sockets, no header objects, no per-request streams.
 */
import { STATUS_CODES } from 'node:http';
import { connect, type OnReadOpts, type Socket } from 'node:net';
import { DormantError, ErrorCode, asError, errnoCode } from '../domain/errors.js';
import type { ProxiedSandbox, Upstream } from './proxy.js';
import { extractCredentials, setsTokenCookie, TOKEN_COOKIE, type Credentials } from './routing.js';
import {
  BodyTracker,
  HttpParseError,
  MAX_HEAD_BYTES,
  headEnd,
  parseRequestHead,
  parseResponseHead,
  type RequestHead,
} from './http1.js';

/** An answer of the proxy's own: a code of the table (which gives its status and default hint). */
export class ProxyError extends DormantError {
  constructor(
    code: ErrorCode,
    message: string,
    hint?: string,
    /** Seconds for a Retry-After header. */
    readonly retryAfterS?: number,
  ) {
    super(code, message, hint === undefined ? {} : { hint });
    this.name = 'ProxyError';
  }
}

/** Where a request goes. */
export interface Routed {
  s: ProxiedSandbox;
  port: number;
  /** The request's token is an admin's (another node's proxy sends one with its hops). */
  admin?: boolean;
}

/** What a relay needs of the proxy. */
export interface RelayHost {
  /**
   * The sandbox and port a request is for, if the caller may reach it: at once when the proxy
   * has it at hand, else a promise. `hopTo`: the id another node's proxy named (HOP_TO_HEADER),
   * used instead of the Host's sandbox only with an admin token. Throws (or rejects with)
   * ProxyError.
   */
  route(host: string | undefined, creds: Credentials, hopTo?: string): Routed | Promise<Routed>;
  /**
   * Where the request goes once the sandbox runs (waking it): its address, or the proxy of the
   * node it runs on. `hopped`: the request came from another node's proxy. Throws ProxyError.
   */
  ready(s: ProxiedSandbox, port: number, via: string, hopped: boolean): Promise<Upstream>;
  /** Counts a request relayed to another node's proxy (`out`) or from one. */
  hopped(out: boolean): void;
  /** The sandbox as it is now. */
  find(id: string): Promise<ProxiedSandbox | undefined>;
  /** Counts a request in flight or an open tunnel; the returned function ends it. */
  begin(id: string): () => void;
  touch(id: string): void;
  track(s: Socket): void;
  /** The relay's connection is over. */
  gone(r: HttpRelay): void;
  /** How long a request head may take to arrive. */
  readonly headTimeoutMs: number;
}

interface Sent {
  method: string;
  upgrade: boolean;
  /** Set-Cookie to add to the response (a token that came in the query string). */
  cookie: string | undefined;
  /**
   * The rewritten head of a bodyless request, without its blank line (`ended` adds it), to send
   * again if the sandbox fell asleep under it.
   */
  resend: string | undefined;
}

const BODYLESS = new Set(['GET', 'HEAD', 'OPTIONS']);
const RETRYABLE = new Set(['ECONNRESET', 'ECONNREFUSED', 'EHOSTUNREACH', 'EPIPE']);
/** Marks a request one node's proxy relays to another's (the sandbox never sees it). */
export const HOP_HEADER = 'x-dormant-hop';
/**
 * The id of the sandbox a hop is for: the node that hops has resolved the Host (which may name
 * the sandbox by its name, and names are per tenant) with the client's token; the next node
 * routes by this id instead, believed only with the hop's admin token. The Host goes as it came.
 */
export const HOP_TO_HEADER = 'x-dormant-hop-to';

const DROP = new Set([
  'x-dormant-token',
  HOP_HEADER,
  HOP_TO_HEADER,
  'x-forwarded-for',
  'x-forwarded-host',
  'x-forwarded-proto',
  'proxy-authorization',
  'proxy-connection',
]);

/** Bytes of the buffer a connection into a sandbox reads into. */
const READ_BYTES = 64 * 1024;

/**
 * `onread` for a connection into a sandbox: its reads land in one buffer, reused while nothing
 * written from it waits in `to`'s queue (a write the kernel took at once keeps no reference to
 * it), else replaced by a fresh one. Per read this saves a buffer allocated and shrunk, a
 * Readable push and a 'data' event. `deliver` sees a view that is valid during the call only:
 * it writes it on or copies what it keeps. 'end', 'close', pause() and resume() work as usual.
 */
export function reusedReads(
  to: Pick<Socket, 'writableLength'>,
  deliver: (chunk: Buffer) => void,
): OnReadOpts {
  let buf: Buffer | undefined;
  return {
    buffer: () => {
      if (buf === undefined || to.writableLength > 0) buf = Buffer.allocUnsafe(READ_BYTES);
      return buf;
    },
    callback: (n, b) => {
      deliver((b as Buffer).subarray(0, n));
      return true;
    },
  };
}

/** `dormant_token` in any case, as bytes: the cheap first look for a planted cookie. */
const TOKEN_NAME_RE = /dormant_token/i;

/** Whether the response head `b[from, to)` may set dormant's cookie (a Set-Cookie naming it). */
function hasTokenSetCookie(b: Buffer, from: number, to: number): boolean {
  const text = b.toString('latin1', from, to);
  if (!TOKEN_NAME_RE.test(text)) return false;
  return text.split('\r\n').some((line) => {
    const colon = line.indexOf(':');
    return (
      colon > 0 &&
      line.slice(0, colon).trim().toLowerCase() === 'set-cookie' &&
      setsTokenCookie(line.slice(colon + 1))
    );
  });
}

/** The response head without the Set-Cookie lines that set dormant's cookie (and their folded continuations). */
function withoutTokenSetCookies(head: Buffer): Buffer {
  const lines = head.toString('latin1').split('\r\n');
  const out: string[] = [];
  let dropping = false;
  for (const line of lines) {
    if (dropping && (line.startsWith(' ') || line.startsWith('\t'))) continue;
    dropping = false;
    const colon = line.indexOf(':');
    if (
      colon > 0 &&
      line.slice(0, colon).trim().toLowerCase() === 'set-cookie' &&
      setsTokenCookie(line.slice(colon + 1))
    ) {
      dropping = true;
      continue;
    }
    out.push(line);
  }
  return Buffer.from(out.join('\r\n'), 'latin1');
}

/** A proxy error as an HTTP/1.1 response that closes the connection. */
export function errorResponse(e: unknown): string {
  const pe =
    e instanceof ProxyError
      ? e
      : new ProxyError(ErrorCode.PROXY_UPSTREAM, `the sandbox did not answer: ${asError(e).message}`);
  const body = JSON.stringify({
    error: { code: pe.code, message: pe.message, ...(pe.hint !== undefined ? { hint: pe.hint } : {}) },
  });
  return (
    `HTTP/1.1 ${pe.status} ${STATUS_CODES[pe.status] ?? pe.code}\r\ncontent-type: application/json\r\n` +
    `content-length: ${Buffer.byteLength(body)}\r\n` +
    `${pe.retryAfterS !== undefined ? `retry-after: ${pe.retryAfterS}\r\n` : ''}connection: close\r\n\r\n${body}`
  );
}

export class HttpRelay {
  private inbuf: Buffer | undefined;
  /** The body of the request being relayed. */
  private body: BodyTracker | undefined;
  private up: Socket | undefined;
  private upKey = '';
  private upId = '';
  private upPort = 0;
  /** The upstream is another node's proxy: requests carry this node's token and the hop mark. */
  private upHop: { node: string; token: string } | undefined;
  /** The requests on the current upstream came from another node's proxy. */
  private upHopped = false;
  /** A response completed on the current upstream connection (it was reused). */
  private upReused = false;
  private readonly sent: Sent[] = [];
  private rbuf: Buffer | undefined;
  private rbody: BodyTracker | undefined;
  /** Bytes of the oldest outstanding response have arrived. */
  private answering = false;
  private tunnel = false;
  /** An async step (routing to another sandbox, waking, connecting) holds the client. */
  private busy = false;
  /** An upgrade request went out: hold the client's bytes until its answer. */
  private awaitingUpgrade = false;
  private retried = false;
  /** Reading paused until the other side drains. */
  private clientHeld = false;
  private upHeld = false;
  private clientClose = false;
  private done = false;
  private active: (() => void) | undefined;
  private activeId = '';
  private idleWaiters: (() => void)[] = [];

  constructor(
    private readonly host: RelayHost,
    private readonly client: Socket,
  ) {
    host.track(client);
    this.armHeadTimer();
    client.on('data', (d: Buffer) => this.onClientData(d));
    client.on('end', () => this.onClientEnd());
    client.on('error', () => this.finish());
    client.on('close', () => this.finish());
  }

  /** Reads and writes so far: the proxy's sweep closes connections idle between two looks. */
  io = 0;
  private ioSeen = -1;

  /** Closes the connection if nothing moved on it since the last call and nothing is pending. */
  sweep(): void {
    if (this.io === this.ioSeen && this.sent.length === 0 && !this.tunnel && !this.busy) this.finish();
    this.ioSeen = this.io;
  }

  /**
   * A request head must be whole within `headTimeoutMs` of its first byte (or of the
   * connection, for the first): a client that sends a head a byte at a time cannot hold a
   * connection, nor, with many, the proxy.
   */
  private headTimer: NodeJS.Timeout | undefined;

  private armHeadTimer(): void {
    if (this.headTimer !== undefined || this.done) return;
    const ms = this.host.headTimeoutMs;
    this.headTimer = setTimeout(() => {
      this.headTimer = undefined;
      if (this.done || this.busy || this.tunnel || this.body) return;
      this.refuse(
        new HttpParseError(
          `the request head did not arrive within ${String(Math.round(ms / 1000))} s`,
          'REQUEST_TIMEOUT',
        ),
      );
    }, ms);
    this.headTimer.unref();
  }

  private clearHeadTimer(): void {
    if (this.headTimer !== undefined) clearTimeout(this.headTimer);
    this.headTimer = undefined;
  }

  private finish(): void {
    if (this.done) return;
    this.clearHeadTimer();
    this.done = true;
    this.host.gone(this);
    this.client.destroy();
    this.up?.destroy();
    this.setActive(false);
    for (const w of this.idleWaiters.splice(0)) w();
  }

  private setActive(on: boolean): void {
    if (on && this.active && this.activeId === this.upId) return;
    if (this.active) {
      this.active();
      this.active = undefined;
    }
    if (on && !this.done && this.upId !== '') {
      this.activeId = this.upId;
      this.active = this.host.begin(this.upId);
    }
  }

  private onClientEnd(): void {
    if (this.tunnel) this.up?.end();
    else if (this.sent.length === 0 && !this.busy) this.finish();
    else this.clientClose = true;
  }

  private onClientData(d: Buffer): void {
    this.io++;
    if (this.upId !== '') this.host.touch(this.upId);
    if (this.tunnel && this.up) {
      this.toUp(d);
      return;
    }
    this.inbuf = this.inbuf ? Buffer.concat([this.inbuf, d]) : d;
    this.pump();
  }

  /** Strings are heads, latin1 as they were read. */
  private toUp(b: Buffer | string): void {
    const up = this.up!;
    if (!(typeof b === 'string' ? up.write(b, 'latin1') : up.write(b)) && !this.busy && !this.clientHeld) {
      this.clientHeld = true;
      this.client.pause();
      up.once('drain', () => {
        this.clientHeld = false;
        if (!this.busy) this.client.resume();
      });
    }
  }

  private toClient(b: Buffer | string): void {
    const up = this.up;
    if (!this.client.write(b) && up && !this.upHeld) {
      this.upHeld = true;
      up.pause();
      this.client.once('drain', () => {
        this.upHeld = false;
        this.up?.resume();
      });
    }
  }

  /** Relays what the client sent, as far as it can go without waiting. */
  private pump(): void {
    try {
      while (this.inbuf && !this.busy && !this.done) {
        const b = this.inbuf;
        if (this.tunnel) {
          this.inbuf = undefined;
          this.toUp(b);
          break;
        }
        if (this.body) {
          const end = this.body.scan(b, 0);
          if (end < 0) {
            this.inbuf = undefined;
            this.toUp(b);
            break;
          }
          this.body = undefined;
          this.inbuf = end < b.length ? b.subarray(end) : undefined;
          if (end > 0) this.toUp(b.subarray(0, end));
          continue;
        }
        if (this.awaitingUpgrade || this.clientClose) break;
        const e = headEnd(b);
        // A head is at most MAX_HEAD_BYTES, its blank line included, however it arrives.
        if (e < 0) {
          if (b.length >= MAX_HEAD_BYTES)
            this.refuse(new HttpParseError('request head too large', 'REQUEST_HEAD_TOO_LARGE'));
          else this.armHeadTimer();
          break;
        }
        if (e > MAX_HEAD_BYTES) {
          this.refuse(new HttpParseError('request head too large', 'REQUEST_HEAD_TOO_LARGE'));
          break;
        }
        this.clearHeadTimer();
        this.inbuf = e < b.length ? b.subarray(e) : undefined;
        this.request(parseRequestHead(b.subarray(0, e)));
      }
    } catch (err) {
      this.refuse(err);
    }
  }

  /** Answers the proxy's own error once earlier responses are out, and closes. */
  private refuse(err: unknown): void {
    const e =
      err instanceof HttpParseError
        ? new ProxyError(err.code, err.message)
        : err instanceof ProxyError
          ? err
          : new ProxyError(ErrorCode.PROXY_UPSTREAM, asError(err).message);
    this.busy = true;
    this.inbuf = undefined;
    this.client.pause();
    void this.whenIdle().then(() => {
      if (this.done) return;
      this.client.end(errorResponse(e));
      this.up?.destroy();
      this.setActive(false);
    });
  }

  private whenIdle(): Promise<void> {
    if (this.sent.length === 0 || this.done) return Promise.resolve();
    return new Promise((r) => this.idleWaiters.push(r));
  }

  private request(req: RequestHead): void {
    const creds = extractCredentials(req.target, credentialHeaders(req));
    const routed = this.host.route(req.host, creds, hopTo(req));
    if (!(routed instanceof Promise)) {
      this.routed(req, creds, routed);
      return;
    }
    // Looked up in the database: what the client had sent already waits in inbuf (pump
    // stops while busy) and is relayed in order once this request is; the client is paused
    // meanwhile, so a slow database cannot make it buffer without bound.
    this.busy = true;
    this.client.pause();
    routed.then(
      (r) => {
        this.busy = false;
        if (this.done) return;
        try {
          this.routed(req, creds, r);
        } catch (e) {
          this.refuse(e);
          return;
        }
        // routed() may have begun a reconnect (busy, paused until it is up).
        if (!this.busy && !this.clientHeld) this.client.resume();
        this.pump();
      },
      (e: unknown) => {
        this.busy = false;
        this.refuse(e);
      },
    );
  }

  private routed(req: RequestHead, creds: Credentials, { s, port, admin }: Routed): void {
    if (req.method === 'CONNECT')
      throw new ProxyError(ErrorCode.METHOD_NOT_ALLOWED, 'CONNECT is not proxied');
    // The hop mark counts only with an admin token in x-dormant-token, as another node's
    // proxy sends it: from anyone else it is dropped and changes nothing.
    const hop = hopped(req) && admin === true && creds.from === 'header';
    const key = upKeyOf(s.id, port, s.elsewhere !== undefined && !hop ? s.elsewhere : undefined, s.address);
    if (this.up && key === this.upKey && s.state === 'running' && hop === this.upHopped) {
      this.forward(req, creds, hop);
      return;
    }
    // Another sandbox or port, or one that sleeps: wait for earlier answers, then (re)connect.
    this.busy = true;
    this.client.pause();
    void this.reroute(s, port, req, creds, hop);
  }

  private async reroute(
    s: ProxiedSandbox,
    port: number,
    req: RequestHead,
    creds: Credentials,
    hop: boolean,
  ): Promise<void> {
    try {
      await this.whenIdle();
      if (this.done) return;
      this.dropUp();
      this.upId = s.id;
      this.setActive(true);
      const via = req.upgrade ? 'upgrade' : `${req.method} request`;
      this.upHopped = hop;
      const to = await this.host.ready(s, port, via, hop);
      await this.connectUp(s, port, to, via, hop);
      if (this.done) return;
      this.busy = false;
      this.forward(req, creds, hop);
      this.client.resume();
      this.pump();
    } catch (e) {
      this.busy = false;
      this.refuse(e);
    }
  }

  /** Connects to the sandbox; a refusal because it fell asleep meanwhile wakes it once more. */
  private async connectUp(
    s: ProxiedSandbox,
    port: number,
    to: Upstream,
    via: string,
    hop: boolean,
  ): Promise<void> {
    for (let attempt = 0; ; attempt++) {
      try {
        const up = await new Promise<Socket>((resolve, reject) => {
          const c: Socket = connect({
            host: to.host,
            port: to.port,
            onread: reusedReads(this.client, (d) => this.onUpData(c, d)),
          });
          c.once('connect', () => {
            c.off('error', reject);
            resolve(c);
          });
          c.once('error', reject);
        });
        if (this.done) {
          up.destroy();
          return;
        }
        this.attach(up, upKeyOf(s.id, port, to.hop?.node, to.host), s.id, port);
        this.upHop = to.hop;
        return;
      } catch (e) {
        const now = await this.host.find(s.id);
        if (attempt > 0 || !RETRYABLE.has(errnoCode(e) ?? '') || !now || now.state === 'running') {
          throw new ProxyError(
            ErrorCode.PROXY_UPSTREAM,
            to.hop
              ? `node ${to.hop.node}'s proxy at ${to.host}:${String(to.port)} did not answer: ${asError(e).message}`
              : `the sandbox did not answer: ${asError(e).message}`,
          );
        }
        to = await this.host.ready(now, port, via, hop);
      }
    }
  }

  private attach(up: Socket, key: string, id: string, port: number): void {
    this.host.track(up);
    this.up = up;
    this.upKey = key;
    this.upId = id;
    this.upPort = port;
    this.upReused = false;
    this.answering = false;
    this.rbuf = undefined;
    this.rbody = undefined;
    up.on('end', () => this.onUpGone(up, undefined, true));
    up.on('error', (e) => this.onUpGone(up, e, false));
    up.on('close', () => this.onUpGone(up, undefined, false));
  }

  private dropUp(): void {
    const up = this.up;
    this.up = undefined;
    this.upKey = '';
    this.upHop = undefined;
    up?.destroy();
  }

  private forward(req: RequestHead, creds: Credentials, hop: boolean): void {
    let head = `${req.method} ${creds.path} ${req.version}\r\n`;
    const xff: string[] = [];
    for (const h of req.headers) {
      if (DROP.has(h.name)) {
        if (h.name === 'x-forwarded-for') xff.push(h.value);
        continue;
      }
      if ((h.name === 'authorization' || h.name === 'cookie') && creds.rewrite.includes(h.name)) continue;
      head += `${h.name}: ${h.value}\r\n`;
    }
    if (creds.rewrite.includes('cookie') && creds.headers.cookie !== undefined) {
      head += `cookie: ${creds.headers.cookie}\r\n`;
    }
    xff.push(this.client.remoteAddress ?? '');
    head += `x-forwarded-for: ${xff.join(', ')}\r\nx-forwarded-host: ${req.host ?? ''}\r\nx-forwarded-proto: http\r\n`;
    if (this.upHop) this.host.hopped(true);
    else if (hop) this.host.hopped(false);
    const bodyless = req.body.kind === 'none' && BODYLESS.has(req.method);
    this.sent.push({
      method: req.method,
      upgrade: req.upgrade,
      cookie:
        creds.from === 'query' && creds.token !== undefined
          ? `${TOKEN_COOKIE}=${encodeURIComponent(creds.token)}; Path=/; Secure; HttpOnly; SameSite=Lax`
          : undefined,
      resend: bodyless ? head : undefined,
    });
    if (this.sent.length === 1) {
      this.answering = false;
      this.setActive(true);
    }
    this.toUp(this.ended(head));
    if (req.body.kind !== 'none') this.body = new BodyTracker(req.body);
    if (req.upgrade) this.awaitingUpgrade = true;
    if (req.close) this.clientClose = true;
  }

  /**
   * A head's end for the current upstream. To another node's proxy it is let in with this
   * node's token (the client's was checked here, and scrubbed) and marked so that it goes no
   * further; a sandbox never sees either.
   */
  private ended(head: string): string {
    return this.upHop
      ? `${head}x-dormant-token: ${this.upHop.token}\r\n${HOP_HEADER}: 1\r\n${HOP_TO_HEADER}: ${this.upId}\r\n\r\n`
      : `${head}\r\n`;
  }

  private onUpData(up: Socket, d: Buffer): void {
    if (up !== this.up || this.done) return;
    this.io++;
    this.host.touch(this.upId);
    if (this.tunnel) {
      this.toClient(d);
      return;
    }
    const b = this.rbuf ? Buffer.concat([this.rbuf, d]) : d;
    this.rbuf = undefined;
    // Bytes from `from` to `pos` go to the client as they are, in one write where possible.
    let from = 0;
    let pos = 0;
    try {
      while (pos < b.length) {
        if (this.rbody) {
          const end = this.rbody.scan(b, pos);
          if (end < 0) {
            pos = b.length;
            break;
          }
          pos = end;
          this.rbody = undefined;
          this.answered();
          continue;
        }
        const sent = this.sent[0];
        if (!sent) throw new HttpParseError('the sandbox sent bytes nobody asked for', 'PROXY_UPSTREAM');
        const e = headEnd(b, pos);
        if (e < 0) {
          if (b.length - pos > MAX_HEAD_BYTES)
            throw new HttpParseError('response head too large', 'PROXY_UPSTREAM');
          // A copy: `b` may be the reused read buffer.
          this.rbuf = Buffer.from(b.subarray(pos));
          break;
        }
        const res = parseResponseHead(b.subarray(pos, e), sent.method);
        if (res.status === 101 && sent.upgrade) {
          pos = b.length;
          this.flushToClient(b, from, pos);
          from = pos;
          this.startTunnel();
          return;
        }
        const plants = hasTokenSetCookie(b, pos, e);
        if (plants || (res.status >= 200 && sent.cookie !== undefined)) {
          // The head is rewritten: without any Set-Cookie of dormant's own cookie the sandbox
          // sent (it would sign the browser in as someone else, or reach sibling hosts), and
          // with ours when the token came in the query string.
          this.flushToClient(b, from, pos);
          const head = plants ? withoutTokenSetCookies(b.subarray(pos, e)) : b.subarray(pos, e);
          this.toClient(
            res.status >= 200 && sent.cookie !== undefined
              ? Buffer.concat([
                  head.subarray(0, head.length - 2),
                  Buffer.from(`set-cookie: ${sent.cookie}\r\n\r\n`, 'latin1'),
                ])
              : head,
          );
          from = e;
        }
        pos = e;
        // An interim answer (100 Continue) goes through; the real one follows.
        if (res.status < 200) continue;
        if (res.body.kind === 'none') this.answered();
        else this.rbody = new BodyTracker(res.body);
      }
      this.flushToClient(b, from, pos);
      this.answering = this.rbody !== undefined || this.rbuf !== undefined;
    } catch {
      // The sandbox broke HTTP: nothing sensible can follow on this connection.
      this.finish();
    }
  }

  private flushToClient(b: Buffer, from: number, to: number): void {
    if (to > from) this.toClient(from === 0 && to === b.length ? b : b.subarray(from, to));
  }

  /** The oldest outstanding response is complete. */
  private answered(): void {
    const sent = this.sent.shift();
    this.answering = false;
    this.upReused = true;
    this.retried = false;
    if (sent?.upgrade) {
      this.awaitingUpgrade = false;
      queueMicrotask(() => this.pump());
    }
    if (this.sent.length === 0) {
      this.setActive(false);
      for (const w of this.idleWaiters.splice(0)) w();
      // After what this chunk still has for the client has been written.
      if (this.clientClose && !this.inbuf) queueMicrotask(() => this.client.end());
    }
  }

  private startTunnel(): void {
    this.sent.length = 0;
    this.tunnel = true;
    this.awaitingUpgrade = false;
    this.setActive(true);
    const held = this.inbuf;
    this.inbuf = undefined;
    if (held) this.toUp(held);
  }

  private onUpGone(up: Socket, err: Error | undefined, ended: boolean): void {
    if (up !== this.up || this.done) return;
    if (this.tunnel) {
      if (ended) this.client.end();
      else this.finish();
      return;
    }
    if (ended && this.rbody?.kind.kind === 'close') {
      this.rbody = undefined;
      this.answered();
      this.up = undefined;
      this.client.end();
      return;
    }
    this.dropUp();
    if (this.sent.length === 0) {
      // An idle keep-alive connection the sandbox closed: the next request reconnects.
      if (this.clientClose) this.client.end();
      return;
    }
    // Requests were out. If none was answered in part, they are all bodyless and this is the
    // first failure, send them again (the sandbox may have been put to sleep just then).
    const code = err ? (errnoCode(err) ?? '') : 'ECONNRESET';
    const again =
      !this.answering && !this.retried && !this.body && this.sent.every((x) => x.resend !== undefined);
    if (!again || (!RETRYABLE.has(code) && !ended)) {
      if (this.answering) this.finish();
      else {
        this.sent.length = 0;
        this.refuse(new ProxyError(ErrorCode.PROXY_UPSTREAM, `the sandbox closed the connection (${code})`));
      }
      return;
    }
    this.retried = true;
    this.busy = true;
    this.client.pause();
    void this.resend();
  }

  private async resend(): Promise<void> {
    const wasReused = this.upReused;
    const port = this.upPort;
    try {
      const s = await this.host.find(this.upId);
      if (!s) throw new ProxyError(ErrorCode.SANDBOX_NOT_FOUND, `sandbox ${this.upId} is gone`);
      if (s.state === 'running' && s.address !== undefined && !wasReused)
        throw new ProxyError(ErrorCode.PROXY_UPSTREAM, 'the sandbox closed the connection');
      const hop = this.upHopped;
      await this.connectUp(s, port, await this.host.ready(s, port, 'request', hop), 'request', hop);
      if (this.done) return;
      this.setActive(true);
      this.busy = false;
      // Ended for the upstream it goes to now (the hop's lines only to another node's proxy).
      for (const x of this.sent) this.toUp(this.ended(x.resend!));
      this.client.resume();
      this.pump();
    } catch (e) {
      this.busy = false;
      this.sent.length = 0;
      this.refuse(e);
    }
  }
}

/** The headers extractCredentials looks at. */
function credentialHeaders(req: RequestHead): {
  authorization?: string;
  cookie?: string;
  'x-dormant-token'?: string | string[];
} {
  const out: { authorization?: string; cookie?: string; 'x-dormant-token'?: string | string[] } = {};
  for (const h of req.headers) {
    if (h.name === 'authorization') out.authorization ??= h.value;
    else if (h.name === 'cookie')
      out.cookie = out.cookie === undefined ? h.value : `${out.cookie}; ${h.value}`;
    else if (h.name === 'x-dormant-token') {
      const v = out['x-dormant-token'];
      out['x-dormant-token'] = v === undefined ? h.value : [...(Array.isArray(v) ? v : [v]), h.value];
    }
  }
  return out;
}

/** Whether another node's proxy relayed this request here. */
function hopped(req: RequestHead): boolean {
  return req.headers.some((h) => h.name === HOP_HEADER);
}

/** The sandbox id a hop names, when the request carries one. */
function hopTo(req: RequestHead): string | undefined {
  if (!hopped(req)) return undefined;
  const v = req.headers.find((h) => h.name === HOP_TO_HEADER)?.value.trim();
  return v !== undefined && /^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$/.test(v) ? v : undefined;
}

/** What identifies an upstream connection: a keep-alive request reuses it while this stays. */
function upKeyOf(id: string, port: number, node: string | undefined, address: string | undefined): string {
  return node !== undefined ? `${id}:${String(port)}:node:${node}` : `${id}:${String(port)}:${address ?? ''}`;
}
