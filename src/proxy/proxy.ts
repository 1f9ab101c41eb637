/**
 * The wake proxy: the address a sandbox's ports are reached at, whatever state the sandbox
 * sleeps in. HTTP requests (and WebSocket upgrades) are routed by Host, `PORT-REF.<domain>`;
 * plain TCP gets a host port per declared sandbox port. A connection to a sleeping sandbox is
 * held while it wakes, for a bounded time, then served; many connections arriving together
 * cause one wake. Requests in flight and open tunnels count as activity, so the policy never
 * puts a sandbox to sleep under a caller.
 *
 * The proxy sits below the controller: it knows sandboxes only through `WakeTarget`, which the
 * daemon implements with the controller and the token store.
 */
import { connect, createServer as createTcpServer, type Server as TcpServer, type Socket } from 'node:net';
import { open, readFile, rename } from 'node:fs/promises';
import { formatDurationMs } from '../domain/units.js';
import { ErrorCode, asError, errnoCode } from '../domain/errors.js';
import type { Sandbox } from '../domain/sandbox.js';
import { TOKEN_COOKIE, hostFor, parseHost, type Credentials, type Route } from './routing.js';
import { HttpRelay, ProxyError, errorResponse, reusedReads, type RelayHost, type Routed } from './relay.js';

/** A sandbox as the proxy needs it. */
export type ProxiedSandbox = Pick<Sandbox, 'id' | 'name' | 'tenant' | 'state' | 'address'> & {
  ports: readonly { port: number; public: boolean }[];
  /** In a fleet, the node it is awake on when that is another one: its proxy serves it. */
  elsewhere?: string;
};

/** Another node's wake proxy, and the token this node is let in with. */
export interface NodeProxy {
  host: string;
  port: number;
  token: string;
}

/**
 * Where an HTTP request for a sandbox goes: its own address on this node, or, in a fleet, the
 * proxy of the node it is awake on (`hop`), which relays it there.
 */
export interface Upstream {
  host: string;
  port: number;
  hop?: { node: string; token: string };
}

export interface ProxyPrincipal {
  tenant: string;
  admin: boolean;
}

/** A value at once, or a promise of it: what a target has at hand it answers without a turn of the event loop. */
export type Answer<T> = T | Promise<T>;

/**
 * What the proxy needs of the rest of dormant. Lookups may answer at once (from a cache) or
 * later (the database): a request whose route is known at once is relayed without waiting.
 */
export interface WakeTarget {
  /** Sandboxes whose id or name is `ref` (a name is unique within a tenant only). */
  find(ref: string): Answer<ProxiedSandbox[]>;
  /** Every sandbox (for the TCP listeners). */
  list(): Answer<ProxiedSandbox[]>;
  /** Brings the sandbox to running (one resume however often it is called); its address. */
  wake(id: string, reason: string): Promise<string>;
  /** Records activity now; a promise that rejects is a sandbox removed meanwhile. */
  touch(id: string): Promise<void> | undefined;
  /**
   * Whether the sandbox listens on `port`, found without connecting (undefined: cannot tell).
   * Optional: without it the proxy connects once to find out, which spends one of the server's
   * accepts.
   */
  listening?(id: string, port: number): Promise<boolean | undefined>;
  /** The principal of an API token; undefined when unknown or revoked. */
  authenticate(token: string): Answer<ProxyPrincipal | undefined>;
  /** In a fleet: node `name`'s proxy (undefined: it has none, or is not known). */
  nodeProxy?(name: string): Promise<NodeProxy | undefined>;
}

export interface ProxyOptions {
  target: WakeTarget;
  /** host:port; port 0 picks one. Default 127.0.0.1:7421. */
  listen?: string;
  /** Sandbox hosts are `PORT-REF.<domain>`. Default `dormant.localhost` (resolves to loopback). */
  domain?: string;
  /** How long a connection is held while its sandbox wakes. Default 30 s. */
  wakeTimeoutMs?: number;
  /** Seconds in the Retry-After of a 503 after a wake ran out of time. Default 5. */
  retryAfterS?: number;
  /** Activity is written at most this often per sandbox. Default 1 s. */
  touchEveryMs?: number;
  /** Token lookups are cached this long (a revoked token works at most this much longer). Default 5 s. */
  authCacheMs?: number;
  /**
   * Raw TCP forwarding carries no token: 'all' ports get a listener, 'public' only ports
   * declared public, 'off' none. Default 'public': any local user could otherwise reach every
   * tenant's private ports (the node's loopback is shared by all its users).
   */
  tcp?: 'all' | 'public' | 'off';
  /** A request head must arrive whole within this. Default 10 s. */
  headTimeoutMs?: number;
  /** Connections open at once from one client address; more are answered 503 and closed. Default 256. */
  maxConnectionsPerClient?: number;
  /** Connections open at once in all. Default 4096. */
  maxConnections?: number;
  /** Where TCP host ports are remembered across restarts (JSON). Default: not remembered. */
  tcpPortsFile?: string;
  /** An idle keep-alive HTTP connection is closed after one to two of these. Default 60 s. */
  idleConnectionMs?: number;
  /** How often TCP listeners follow created and removed sandboxes. Default 1 s. */
  tcpSyncMs?: number;
  /** Warnings (a background sync that failed). Default: stderr. */
  warn?: (message: string) => void;
}

export interface SandboxUrl {
  /** The HTTP URL through the proxy. */
  url: string;
  host: string;
  /** `host:port` of the raw TCP listener, if this port has one. */
  tcp: string | null;
  /** True when the port needs no token. */
  public: boolean;
}

function parseListen(listen: string): { host: string; port: number } {
  const m = /^(.*):(\d+)$/.exec(listen);
  if (!m) throw new Error(`proxy listen ${listen}: expected HOST:PORT`);
  return { host: m[1]!.replace(/^\[|\]$/g, ''), port: Number(m[2]) };
}

export class WakeProxy {
  readonly domain: string;
  readonly host: string;
  port = 0;
  private readonly opts: ProxyOptions;
  private readonly target: WakeTarget;
  private readonly server: TcpServer;
  private readonly relayHost: RelayHost;
  private readonly relays = new Set<HttpRelay>();
  private sweepTimer: NodeJS.Timeout | undefined;
  private readonly wakes = new Map<string, Promise<string>>();
  private readonly open = new Map<string, number>();
  private readonly touched = new Map<string, number>();
  private readonly trailing = new Map<string, NodeJS.Timeout>();
  private readonly auth = new Map<string, { p: ProxyPrincipal | undefined; at: number }>();
  private readonly routes = new Map<string, Route | undefined>();
  private readonly tcp = new Map<string, { server: TcpServer; port: number }>();
  private readonly sockets = new Set<Socket>();
  private tcpPorts = new Map<string, number>();
  private syncTimer: NodeJS.Timeout | undefined;
  private syncing: Promise<void> | undefined;
  private closed = false;
  /**
   * HTTP requests relayed to another node's proxy (`out`) and relayed here by one (`in`):
   * how much of this proxy's traffic crosses nodes.
   */
  readonly hops = { out: 0, in: 0 };

  private constructor(opts: ProxyOptions) {
    this.opts = opts;
    this.target = opts.target;
    this.domain = (opts.domain ?? 'dormant.localhost').toLowerCase();
    this.host = parseListen(opts.listen ?? '127.0.0.1:7421').host;
    this.relayHost = {
      route: (host, creds, hopTo) => this.resolve(host, creds, hopTo),
      ready: (s, port, via, hopped) => this.upstream(s, port, via, hopped),
      hopped: (out) => {
        if (out) this.hops.out++;
        else this.hops.in++;
      },
      find: async (id) => (await this.target.find(id)).find((x) => x.id === id),
      begin: (id) => this.begin(id),
      touch: (id) => this.touch(id),
      track: (s) => this.track(s),
      gone: (r) => this.relays.delete(r),
      headTimeoutMs: opts.headTimeoutMs ?? 10_000,
    };
    // HTTP is relayed on plain sockets: each request head is parsed, routed and checked, and
    // the bytes of a keep-alive connection flow through (see relay.ts).
    this.server = createTcpServer((c) => {
      if (!this.admit(c)) return;
      this.relays.add(new HttpRelay(this.relayHost, c));
    });
  }

  /** Starts listening (HTTP, then a TCP listener per declared port). */
  static async start(opts: ProxyOptions): Promise<WakeProxy> {
    const p = new WakeProxy(opts);
    const { host, port } = parseListen(opts.listen ?? '127.0.0.1:7421');
    await new Promise<void>((resolve, reject) => {
      p.server.once('error', reject);
      p.server.listen(port, host, () => {
        p.server.off('error', reject);
        resolve();
      });
    });
    const a = p.server.address();
    p.port = typeof a === 'object' && a ? a.port : port;
    if (opts.tcpPortsFile !== undefined) {
      try {
        const saved = JSON.parse(await readFile(opts.tcpPortsFile, 'utf8')) as Record<string, number>;
        p.tcpPorts = new Map(Object.entries(saved));
      } catch (e) {
        if (errnoCode(e) !== 'ENOENT' && !(e instanceof SyntaxError)) throw e;
      }
    }
    await p.sync();
    // Keep-alive connections with nothing pending and no bytes for one to two periods close.
    p.sweepTimer = setInterval(() => {
      for (const r of p.relays) r.sweep();
    }, opts.idleConnectionMs ?? 60_000);
    p.sweepTimer.unref();
    const every = opts.tcpSyncMs ?? 1000;
    if (every > 0) {
      const warn = opts.warn ?? ((m: string) => process.stderr.write(`dormant: warning: ${m}\n`));
      let failing = false;
      p.syncTimer = setInterval(
        () =>
          void p.sync().then(
            () => (failing = false),
            (e: unknown) => {
              // Retried every period: said once per run of failures, not once a second.
              if (!failing) warn(`wake proxy: following sandboxes' TCP ports failed: ${asError(e).message}`);
              failing = true;
            },
          ),
        every,
      );
      p.syncTimer.unref();
    }
    return p;
  }

  private get tcpMode(): 'all' | 'public' | 'off' {
    return this.opts.tcp ?? 'public';
  }

  /** Connections open now, by client address. */
  private readonly perClient = new Map<string, number>();
  private connections = 0;

  /**
   * Counts a new connection against the caps, or answers it 503 and closes it: a client (or
   * all of them) holding many half-sent heads cannot take the proxy's sockets and memory.
   */
  private admit(c: Socket): boolean {
    const who = c.remoteAddress ?? '';
    const mine = this.perClient.get(who) ?? 0;
    const perClient = this.opts.maxConnectionsPerClient ?? 256;
    const total = this.opts.maxConnections ?? 4096;
    if (mine >= perClient || this.connections >= total) {
      // A refused client that resets meanwhile is no news: it is being closed anyway.
      c.on('error', () => undefined);
      c.end(
        errorResponse(
          new ProxyError(
            ErrorCode.PROXY_BUSY,
            mine >= perClient
              ? `too many connections from ${who} (${String(perClient)})`
              : `too many connections (${String(total)})`,
            'close idle connections and try again',
            1,
          ),
        ),
      );
      return false;
    }
    this.perClient.set(who, mine + 1);
    this.connections++;
    c.once('close', () => {
      this.connections--;
      const n = (this.perClient.get(who) ?? 1) - 1;
      if (n <= 0) this.perClient.delete(who);
      else this.perClient.set(who, n);
    });
    return true;
  }

  /** Requests in flight and open tunnels to the sandbox. */
  openConnections(id: string): number {
    return this.open.get(id) ?? 0;
  }

  /** Where a sandbox port is reached through the proxy. */
  urlFor(s: ProxiedSandbox, port: number): SandboxUrl | undefined {
    const decl = s.ports.find((p) => p.port === port);
    if (!decl) return undefined;
    const host = hostFor(port, s.id, this.domain);
    const l = this.tcp.get(`${s.id}:${port}`);
    const h = this.host.includes(':') ? `[${this.host}]` : this.host;
    return {
      url: `http://${host}:${this.port}/`,
      host,
      tcp: l ? `${h}:${l.port}` : null,
      public: decl.public,
    };
  }

  async close(): Promise<void> {
    this.closed = true;
    if (this.syncTimer) clearInterval(this.syncTimer);
    if (this.sweepTimer) clearInterval(this.sweepTimer);
    for (const t of this.trailing.values()) clearTimeout(t);
    this.trailing.clear();
    // Only waits for a sync in flight to settle; its failure went to whoever started it.
    await this.syncing?.catch(() => undefined);
    const closing = [new Promise<void>((r) => this.server.close(() => r()))];
    for (const { server } of this.tcp.values())
      closing.push(new Promise<void>((r) => server.close(() => r())));
    this.tcp.clear();
    for (const s of this.sockets) s.destroy();
    await Promise.all(closing);
  }

  private track(s: Socket): void {
    // Small requests and responses must not wait out Nagle and a delayed ACK on each hop.
    s.setNoDelay(true);
    this.sockets.add(s);
    s.once('close', () => this.sockets.delete(s));
  }

  private begin(id: string): () => void {
    this.open.set(id, (this.open.get(id) ?? 0) + 1);
    this.touch(id);
    let ended = false;
    return () => {
      if (ended) return;
      ended = true;
      const n = (this.open.get(id) ?? 1) - 1;
      if (n > 0) this.open.set(id, n);
      else this.open.delete(id);
      // The idle countdown starts when the last connection ends, not when it began.
      this.touch(id);
    };
  }

  /**
   * Records activity, at most once per `touchEveryMs` per sandbox (each is a database write);
   * activity inside the window is written once it closes,
   * so the last request's time is never lost.
   */
  private touch(id: string): void {
    const every = this.opts.touchEveryMs ?? 1000;
    const now = Date.now();
    const last = this.touched.get(id) ?? 0;
    if (now - last >= every) {
      this.touched.set(id, now);
      this.writeTouch(id);
      return;
    }
    if (this.trailing.has(id) || this.closed) return;
    const t = setTimeout(
      () => {
        this.trailing.delete(id);
        this.touched.set(id, Date.now());
        this.writeTouch(id);
      },
      every - (now - last),
    );
    t.unref();
    this.trailing.set(id, t);
  }

  private writeTouch(id: string): void {
    // Not waited for: activity is written beside the traffic, never in its way. A failure is
    // a sandbox removed while a connection to it was open.
    try {
      void this.target.touch(id)?.catch(() => undefined);
    } catch {
      // The same, told at once.
    }
  }

  private principal(token: string): Answer<ProxyPrincipal | undefined> {
    const now = Date.now();
    const hit = this.auth.get(token);
    if (hit && now - hit.at < (this.opts.authCacheMs ?? 5000)) return hit.p;
    if (this.auth.size > 10_000) this.auth.clear();
    const p = this.target.authenticate(token);
    if (!(p instanceof Promise)) {
      this.auth.set(token, { p, at: now });
      return p;
    }
    return p.then((v) => {
      this.auth.set(token, { p: v, at: now });
      return v;
    });
  }

  /** parseHost, remembered: a keep-alive connection sends the same Host on every request. */
  private route(hostHeader: string | undefined): Route | undefined {
    if (hostHeader === undefined) return undefined;
    const hit = this.routes.get(hostHeader);
    if (hit !== undefined || this.routes.has(hostHeader)) return hit;
    const route = parseHost(hostHeader, this.domain);
    if (this.routes.size >= 1000) this.routes.clear();
    this.routes.set(hostHeader, route);
    return route;
  }

  /**
   * The sandbox and port a request is for, if the caller may reach it: at once when the token
   * and the sandbox are at hand, else a promise. Throws (or rejects with) ProxyError.
   */
  private resolve(hostHeader: string | undefined, creds: Credentials, hopTo?: string): Answer<Routed> {
    const route = this.route(hostHeader);
    if (!route) {
      throw new ProxyError(
        ErrorCode.PROXY_NO_ROUTE,
        `no sandbox in host "${(hostHeader ?? '').slice(0, 100)}"`,
        `sandbox URLs look like http://PORT-ID.${this.domain}:${this.port}/ (dormant url ID PORT)`,
      );
    }
    const p = creds.token === undefined ? undefined : this.principal(creds.token);
    if (p instanceof Promise) return p.then((known) => this.resolveFor(route, creds, known, hopTo));
    return this.resolveFor(route, creds, p, hopTo);
  }

  private resolveFor(
    given: Route,
    creds: Credentials,
    p: ProxyPrincipal | undefined,
    hopTo: string | undefined,
  ): Answer<Routed> {
    if (creds.token !== undefined && !p) {
      throw new ProxyError(ErrorCode.UNAUTHORIZED, 'unknown or revoked dormant token');
    }
    // A hop from another node's proxy (its admin token, in the header) names the sandbox by
    // the id that node resolved for its client; from anyone else the name is ignored.
    const route =
      hopTo !== undefined && p?.admin === true && creds.from === 'header' ? { ...given, ref: hopTo } : given;
    const found = this.target.find(route.ref);
    if (found instanceof Promise) return found.then((boxes) => this.pick(route, p, boxes));
    return this.pick(route, p, found);
  }

  private pick(route: Route, p: ProxyPrincipal | undefined, found: readonly ProxiedSandbox[]): Routed {
    const withPort = found.filter((s) => s.ports.some((x) => x.port === route.port));
    const mine = p ? withPort.filter((s) => p.admin || s.tenant === p.tenant) : [];
    const pub = withPort.filter((s) => s.ports.some((x) => x.port === route.port && x.public));
    const pick = mine.length > 0 ? mine : pub;
    if (pick.length === 1) return { s: pick[0]!, port: route.port, admin: p?.admin === true };
    if (pick.length > 1) {
      throw new ProxyError(
        ErrorCode.PROXY_AMBIGUOUS,
        `more than one sandbox is named ${route.ref}`,
        'use the sandbox id',
      );
    }
    if (!p) {
      throw new ProxyError(
        ErrorCode.UNAUTHORIZED,
        `${hostFor(route.port, route.ref, this.domain)} needs a dormant token`,
        `send Authorization: Bearer TOKEN, an X-Dormant-Token header, a ${TOKEN_COOKIE} cookie or ?${TOKEN_COOKIE}=TOKEN`,
      );
    }
    throw new ProxyError(
      ErrorCode.SANDBOX_NOT_FOUND,
      `no sandbox ${route.ref} with port ${route.port}`,
      'dormant get ID shows the ports a sandbox declared',
    );
  }

  /**
   * Where an HTTP request for `s` goes once it runs: in a fleet, a sandbox awake on another
   * node (or woken there) is reached through that node's proxy, which has its address at hand
   * (addresses are each node's own). A request that came from another node's proxy (`hopped`,
   * which the relay believes only of an admin token) is served here or not at all: never sent
   * on, and never to an address recorded for another node.
   */
  private async upstream(s: ProxiedSandbox, port: number, via: string, hopped: boolean): Promise<Upstream> {
    if (hopped) {
      if (s.elsewhere !== undefined) throw moved(s);
      const awake = s.state === 'running' && s.address !== undefined;
      const address = await this.ready(s, port, via, true);
      // Woken on yet another node (whose proxy may not be known): not this node's to serve.
      if (
        address === undefined ||
        (!awake && (await this.target.find(s.id)).some((x) => x.id === s.id && x.elsewhere !== undefined))
      )
        throw moved(s);
      // The node that sent it could not look whether the port accepts.
      if (awake)
        await this.accepting(s.id, address, port, Date.now() + (this.opts.wakeTimeoutMs ?? 30_000)).catch(
          () => undefined,
        );
      return { host: address, port };
    }
    const through = async (x: ProxiedSandbox | undefined): Promise<Upstream | undefined> => {
      if (x?.elsewhere === undefined || !this.target.nodeProxy) return undefined;
      const np = await this.target.nodeProxy(x.elsewhere);
      return np && { host: np.host, port: np.port, hop: { node: x.elsewhere, token: np.token } };
    };
    const there = await through(s);
    if (there) return there;
    const address = await this.ready(s, port, via, this.target.nodeProxy !== undefined);
    if (address !== undefined) return { host: address, port };
    // Woken on another node whose proxy is known: that proxy serves it.
    const there2 = await through((await this.target.find(s.id)).find((x) => x.id === s.id));
    if (there2) return there2;
    throw moved(s);
  }

  /**
   * The sandbox's address once it runs and accepts on `port`; bounded by the wake timeout.
   * `unlessElsewhere`: undefined when it woke on another node (whose proxy then serves it).
   */
  private async ready(s: ProxiedSandbox, port: number, via: string): Promise<string>;
  private async ready(
    s: ProxiedSandbox,
    port: number,
    via: string,
    unlessElsewhere: boolean,
  ): Promise<string | undefined>;
  private async ready(
    s: ProxiedSandbox,
    port: number,
    via: string,
    unlessElsewhere = false,
  ): Promise<string | undefined> {
    if (s.state === 'running' && s.address) return s.address;
    const timeoutMs = this.opts.wakeTimeoutMs ?? 30_000;
    const deadline = Date.now() + timeoutMs;
    let w = this.wakes.get(s.id);
    if (!w) {
      w = this.target.wake(s.id, `proxy: ${via} on port ${port}`).finally(() => this.wakes.delete(s.id));
      w.catch(() => undefined); // a caller that timed out no longer listens
      this.wakes.set(s.id, w);
    }
    const timedOut = (): ProxyError =>
      new ProxyError(
        ErrorCode.WAKE_TIMEOUT,
        `sandbox ${s.id} did not wake within ${formatDurationMs(timeoutMs)}`,
        'it is still waking; retry shortly',
        this.opts.retryAfterS ?? 5,
      );
    let timer: NodeJS.Timeout | undefined;
    const address = await Promise.race([
      w,
      new Promise<never>((_, reject) => {
        timer = setTimeout(() => reject(timedOut()), Math.max(0, deadline - Date.now()));
      }),
    ])
      .catch((e: unknown) => {
        if (e instanceof ProxyError) throw e;
        throw new ProxyError(
          ErrorCode.WAKE_FAILED,
          `sandbox ${s.id} could not be woken: ${asError(e).message}`,
        );
      })
      .finally(() => clearTimeout(timer));
    if (unlessElsewhere) {
      // Woken on another node: its proxy serves it, where that proxy is known (else the
      // address, as on one host).
      const now = (await this.target.find(s.id)).find((x) => x.id === s.id);
      if (now?.elsewhere !== undefined && (await this.target.nodeProxy?.(now.elsewhere)) !== undefined)
        return undefined;
    }
    // A sandbox started afresh (from archived) needs a moment before its server listens.
    await this.accepting(s.id, address, port, deadline).catch(() => {
      throw timedOut();
    });
    return address;
  }

  private async accepting(id: string, address: string, port: number, deadline: number): Promise<void> {
    for (;;) {
      // Asked of the sandbox's socket tables first: a probe connection would take the accept
      // of a server that accepts once (its client then never gets through).
      const known = await this.target.listening?.(id, port);
      const ok =
        known ??
        (await new Promise<boolean>((resolve, reject) => {
          const c = connect({ host: address, port });
          c.once('connect', () => {
            c.destroy();
            resolve(true);
          });
          c.once('error', (e) => {
            c.destroy();
            if (errnoCode(e) === 'ECONNREFUSED') resolve(false);
            else reject(e);
          });
        }));
      if (ok) return;
      if (Date.now() > deadline) throw new Error('not accepting');
      await new Promise((r) => setTimeout(r, 50));
    }
  }

  /** Opens a TCP listener for every declared port that has none, closes those of removed sandboxes. */
  sync(): Promise<void> {
    if (this.syncing) return this.syncing;
    const run = this.syncOnce().finally(() => (this.syncing = undefined));
    this.syncing = run;
    return run;
  }

  private async syncOnce(): Promise<void> {
    if (this.closed) return;
    const mode = this.tcpMode;
    const want = new Map<string, { id: string; port: number }>();
    if (mode !== 'off') {
      for (const s of await this.target.list()) {
        if (s.state === 'deleting' || s.state === 'failed') continue;
        for (const p of s.ports)
          if (mode === 'all' || p.public) want.set(`${s.id}:${p.port}`, { id: s.id, port: p.port });
      }
    }
    let changed = false;
    for (const [key, l] of this.tcp) {
      if (want.has(key)) continue;
      this.tcp.delete(key);
      this.tcpPorts.delete(key);
      changed = true;
      await new Promise<void>((r) => l.server.close(() => r()));
    }
    for (const [key, w] of want) {
      if (this.tcp.has(key) || this.closed) continue;
      const server = createTcpServer((c) => void this.onTcp(w.id, w.port, c));
      const listenOn = (port: number): Promise<void> =>
        new Promise<void>((resolve, reject) => {
          server.once('error', reject);
          server.listen(port, this.host, () => {
            server.off('error', reject);
            resolve();
          });
        });
      const remembered = this.tcpPorts.get(key);
      try {
        await listenOn(remembered ?? 0);
      } catch (e) {
        if (remembered === undefined || errnoCode(e) !== 'EADDRINUSE') throw e;
        await listenOn(0);
      }
      const a = server.address();
      const port = typeof a === 'object' && a ? a.port : 0;
      this.tcp.set(key, { server, port });
      if (this.tcpPorts.get(key) !== port) changed = true;
      this.tcpPorts.set(key, port);
    }
    if (changed && this.opts.tcpPortsFile !== undefined) await this.saveTcpPorts(this.opts.tcpPortsFile);
  }

  /** Temp file, fsync, rename: a crash leaves the old map or the new one. */
  private async saveTcpPorts(path: string): Promise<void> {
    const tmp = `${path}.tmp`;
    const fh = await open(tmp, 'w', 0o600);
    try {
      await fh.writeFile(JSON.stringify(Object.fromEntries(this.tcpPorts)));
      await fh.sync();
    } finally {
      await fh.close();
    }
    await rename(tmp, path);
  }

  private async onTcp(id: string, port: number, client: Socket): Promise<void> {
    this.track(client);
    client.on('error', () => client.destroy());
    const s = (await this.target.find(id)).find((x) => x.id === id);
    if (!s) {
      client.destroy();
      return;
    }
    const end = this.begin(id);
    client.once('close', end);
    try {
      // What the client sends while the sandbox wakes waits in the socket's buffer.
      client.pause();
      const address = await this.ready(s, port, 'tcp connection');
      if (client.destroyed) return;
      const touch = (): void => this.touch(id);
      // The sandbox's bytes are read into a reused buffer and written on at once.
      const up: Socket = connect({
        host: address,
        port,
        onread: reusedReads(client, (d) => {
          touch();
          if (!client.write(d)) {
            up.pause();
            client.once('drain', () => void up.resume());
          }
        }),
      });
      this.track(up);
      up.once('error', () => client.destroy());
      up.once('close', () => client.destroy());
      client.once('close', () => up.destroy());
      up.once('end', () => client.end());
      up.once('connect', () => {
        relayBytes(client, up, touch);
        client.resume();
      });
    } catch {
      // The sandbox did not wake or is gone: a raw TCP client learns that by the closed socket.
      client.destroy();
    }
  }
}

/**
 * Copies what `from` reads to `to`, pausing while `to` is full; one listener per read, which
 * also records activity (cheaper than pipe() plus a listener of its own).
 */
function relayBytes(from: Socket, to: Socket, touch: () => void): void {
  const resume = (): void => void from.resume();
  from.on('data', (d: Buffer) => {
    touch();
    if (!to.write(d)) {
      from.pause();
      to.once('drain', resume);
    }
  });
  from.once('end', () => to.end());
}

/** A sandbox that is (now) another node's: the client asks again, and is routed there. */
function moved(s: ProxiedSandbox): ProxyError {
  return new ProxyError(
    ErrorCode.NODE_UNAVAILABLE,
    `sandbox ${s.id} moved to another node while the request was on its way`,
    'send it again',
    1,
  );
}
