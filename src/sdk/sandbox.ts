/**
 * Sandboxes as objects, in the style users know from E2B: `Sandbox.create()`,
 * `Sandbox.connect(id)`, `Sandbox.list()`, and the lifecycle on the instance. Everything
 * goes through the HTTP API; times are milliseconds and sizes bytes; every call takes an
 * `AbortSignal`; failures are typed errors carrying the API's codes (errors.ts).
 *
 * @example
 * ```ts
 * import { Sandbox } from '@dormant/sdk';
 * const sb = await Sandbox.create({ rootfs: '/srv/rootfs', command: ['sleep', 'infinity'] });
 * console.log((await sb.exec('echo hello')).stdout);
 * await sb.hibernate();                       // memory freed, processes in the vault
 * const again = await Sandbox.connect(sb.id); // resumed, memory intact
 * await again.kill();
 * ```
 */
import {
  DEFAULT_URL,
  DormantClient,
  type CallOptions,
  type ExecResult,
  type SandboxInfo,
  type SandboxState,
  type TransitionInfo,
} from './client.js';

/** Where the daemon is and who is calling. Defaults: `DORMANT_URL`, `DORMANT_TOKEN`. */
export interface ConnectionOptions {
  /** The daemon's address. Default `DORMANT_URL`, else DEFAULT_URL (this host's daemon). */
  url?: string;
  /** An API token (`dmt_...`). Default `DORMANT_TOKEN`. */
  token?: string;
  /** How long one request may take, in milliseconds. Default 300 000. */
  requestTimeoutMs?: number;
  /** Aborts the call; it rejects with the signal's reason. */
  signal?: AbortSignal;
}

/** How to start a sandbox. Milliseconds and bytes throughout. */
export interface SandboxCreateOptions extends ConnectionOptions {
  /** Lowercase letters, digits and dashes; default: the id. */
  name?: string;
  /** A root filesystem folder on the daemon's machine. One of `rootfs` or `image`. */
  rootfs?: string;
  /** An OCI image layout folder on the daemon's machine (`DIR` or `DIR:TAG`). */
  image?: string;
  /** The command; optional with an image (its entrypoint is used). */
  command?: string[];
  env?: Record<string, string>;
  /** Ports inside the sandbox reachable through the wake proxy; `public` needs no token. */
  ports?: (number | { port: number; public?: boolean })[];
  /** Memory limit in bytes. Default 512 MiB. */
  memoryBytes?: number;
  /** CPU limit in cores. Default 1. */
  cpus?: number;
  /** Hibernate after this long idle. Default 15 minutes. */
  idleTimeoutMs?: number;
  /** Pause (memory kept) after this long idle, before hibernating. */
  pauseAfterMs?: number;
  /** Archive (keep only the filesystem) after this long hibernated. Default 7 days. */
  archiveAfterMs?: number;
  /** End the sandbox this long after it was created. */
  lifetimeMs?: number;
  /** A command run inside after every resume (refresh credentials, reconnect). */
  onResume?: string[];
}

/** Options of one call: an `AbortSignal`. */
export interface SandboxCallOptions {
  signal?: AbortSignal;
}

export interface ExecOptions extends SandboxCallOptions {
  /** Kill the command after this long. Default 60 000. */
  timeoutMs?: number;
  /** Written to the command's standard input. */
  stdin?: string;
}

const env = (name: string): string | undefined => {
  const v = typeof process !== 'undefined' ? process.env[name] : undefined;
  return v === '' ? undefined : v;
};

function clientFor(o: ConnectionOptions): DormantClient {
  const token = o.token ?? env('DORMANT_TOKEN');
  return new DormantClient({
    url: o.url ?? env('DORMANT_URL') ?? DEFAULT_URL,
    ...(token !== undefined ? { token } : {}),
    ...(o.requestTimeoutMs !== undefined ? { timeoutMs: o.requestTimeoutMs } : {}),
  });
}

const call = (o: SandboxCallOptions | undefined): CallOptions => (o?.signal ? { signal: o.signal } : {});

/** States a sandbox sleeps in; `connect` resumes from them. */
const SLEEPING = new Set<SandboxState>(['paused', 'hibernated', 'archived']);

/**
 * One sandbox. Get one from {@link Sandbox.create}, {@link Sandbox.connect} or
 * {@link Sandbox.fork}; {@link Sandbox.info} is what the daemon said last.
 */
export class Sandbox {
  /** The sandbox's id (`sb-...`). */
  readonly id: string;
  /** The HTTP client this sandbox talks through (for calls the instance has no method for). */
  readonly client: DormantClient;
  private last: SandboxInfo;

  private constructor(client: DormantClient, info: SandboxInfo) {
    this.client = client;
    this.id = info.id;
    this.last = info;
  }

  /**
   * Starts a sandbox and resolves when it runs.
   *
   * @example
   * ```ts
   * const sb = await Sandbox.create({
   *   rootfs: '/srv/rootfs',
   *   command: ['python3', '-m', 'http.server', '8080'],
   *   ports: [8080],
   *   memoryBytes: 256 * 1024 * 1024,
   *   idleTimeoutMs: 5 * 60_000,
   * });
   * ```
   */
  static async create(opts: SandboxCreateOptions): Promise<Sandbox> {
    const client = clientFor(opts);
    const info = await client.createSandbox(
      {
        ...(opts.name !== undefined ? { name: opts.name } : {}),
        ...(opts.rootfs !== undefined ? { rootfs: opts.rootfs } : {}),
        ...(opts.image !== undefined ? { image: opts.image } : {}),
        ...(opts.command !== undefined ? { command: opts.command } : {}),
        ...(opts.env !== undefined ? { env: opts.env } : {}),
        ...(opts.ports !== undefined ? { ports: opts.ports } : {}),
        ...(opts.memoryBytes !== undefined ? { memory: opts.memoryBytes } : {}),
        ...(opts.cpus !== undefined ? { cpus: opts.cpus } : {}),
        ...(opts.idleTimeoutMs !== undefined ? { idle: opts.idleTimeoutMs } : {}),
        ...(opts.pauseAfterMs !== undefined ? { pauseAfter: opts.pauseAfterMs } : {}),
        ...(opts.archiveAfterMs !== undefined ? { archiveAfter: opts.archiveAfterMs } : {}),
        ...(opts.lifetimeMs !== undefined ? { lifetime: opts.lifetimeMs } : {}),
        ...(opts.onResume !== undefined ? { onResume: opts.onResume } : {}),
      },
      call(opts),
    );
    return new Sandbox(client, info);
  }

  /**
   * Connects to an existing sandbox by id or name. A paused, hibernated or archived sandbox
   * is resumed first (pass `resume: false` to leave it asleep).
   *
   * @example
   * ```ts
   * const sb = await Sandbox.connect('sb-0123456789abcdef'); // running again
   * ```
   */
  static async connect(id: string, opts: ConnectionOptions & { resume?: boolean } = {}): Promise<Sandbox> {
    const client = clientFor(opts);
    let info = await client.getSandbox(id, call(opts));
    if ((opts.resume ?? true) && SLEEPING.has(info.state)) info = await client.resume(info.id, call(opts));
    return new Sandbox(client, info);
  }

  /**
   * The token's sandboxes (every tenant's for an admin token), as the daemon sees them now.
   *
   * @example
   * ```ts
   * const asleep = (await Sandbox.list()).filter((s) => s.state === 'hibernated');
   * ```
   */
  static async list(opts: ConnectionOptions = {}): Promise<SandboxInfo[]> {
    return clientFor(opts).listSandboxes(call(opts));
  }

  /** What the daemon said about this sandbox last (state, memory, ports, ...). */
  get info(): SandboxInfo {
    return this.last;
  }

  /** The state as of the last call (`running`, `hibernated`, ...); {@link getInfo} refreshes it. */
  get state(): SandboxState {
    return this.last.state;
  }

  /**
   * Asks the daemon for this sandbox's current state.
   * @example
   * ```ts
   * const { state, memoryBytes } = await sb.getInfo();
   * ```
   */
  async getInfo(opts?: SandboxCallOptions): Promise<SandboxInfo> {
    return (this.last = await this.client.getSandbox(this.id, call(opts)));
  }

  /**
   * Runs a command inside and resolves with its output and exit code (a non-zero exit is
   * not an error). A string runs through `sh -c`.
   *
   * @example
   * ```ts
   * const r = await sb.exec('ls /srv', { timeoutMs: 10_000 });
   * if (r.exitCode !== 0) console.error(r.stderr);
   * await sb.exec(['python3', '-c', 'print(6*7)']);
   * ```
   */
  async exec(command: string | string[], opts: ExecOptions = {}): Promise<ExecResult> {
    const argv = typeof command === 'string' ? ['sh', '-c', command] : command;
    return this.client.exec(
      this.id,
      argv,
      {
        ...(opts.timeoutMs !== undefined ? { timeoutMs: opts.timeoutMs } : {}),
        ...(opts.stdin !== undefined ? { stdin: opts.stdin } : {}),
      },
      call(opts),
    );
  }

  /**
   * Freezes every process; memory stays held, resume takes milliseconds.
   * @example
   * ```ts
   * await sb.pause();
   * ```
   */
  async pause(opts?: SandboxCallOptions): Promise<SandboxInfo> {
    return (this.last = await this.client.pause(this.id, call(opts)));
  }

  /**
   * Checkpoints the processes and memory into the vault (encrypted) and frees the memory.
   * Resolves when hibernated; a failure leaves the sandbox running (SandboxOperationError).
   * @example
   * ```ts
   * const { memoryBytes } = await sb.hibernate(); // 0
   * ```
   */
  async hibernate(opts?: SandboxCallOptions): Promise<SandboxInfo> {
    return (this.last = await this.client.hibernate(this.id, call(opts)));
  }

  /**
   * Back to running from paused, hibernated (memory restored) or archived (a fresh start on
   * its filesystem). A no-op on a running sandbox.
   * @example
   * ```ts
   * await sb.resume();
   * ```
   */
  async resume(opts?: SandboxCallOptions): Promise<SandboxInfo> {
    return (this.last = await this.client.resume(this.id, call(opts)));
  }

  /**
   * Keeps only the filesystem; process state is dropped. The cheapest way to sleep.
   * @example
   * ```ts
   * await sb.archive();
   * ```
   */
  async archive(opts?: SandboxCallOptions): Promise<SandboxInfo> {
    return (this.last = await this.client.archive(this.id, call(opts)));
  }

  /**
   * A new sandbox restored from this one's latest checkpoint (taken now if it runs), with a
   * copy of its filesystem; both carry on independently.
   * @example
   * ```ts
   * const child = await sb.fork({ name: 'try-another-approach' });
   * ```
   */
  async fork(opts: SandboxCallOptions & { name?: string } = {}): Promise<Sandbox> {
    const info = await this.client.fork(
      this.id,
      opts.name !== undefined ? { name: opts.name } : {},
      call(opts),
    );
    return new Sandbox(this.client, info);
  }

  /**
   * Tells the idle policy the sandbox is busy for a while (an agent waiting on a model).
   * @example
   * ```ts
   * await sb.keepalive(10 * 60_000);
   * ```
   */
  async keepalive(forMs: number, opts?: SandboxCallOptions): Promise<SandboxInfo> {
    return (this.last = await this.client.keepalive(this.id, forMs, call(opts)));
  }

  /**
   * Deletes the sandbox and its data, checkpoints included (their keys are destroyed).
   * @example
   * ```ts
   * await sb.kill();
   * ```
   */
  async kill(opts?: SandboxCallOptions): Promise<void> {
    await this.client.remove(this.id, call(opts));
  }

  /**
   * The address of a declared port through the wake proxy: the first request to it wakes a
   * sleeping sandbox. Unless the port is public, send the token with each request.
   * @example
   * ```ts
   * const u = await sb.url(8080);
   * await fetch(u, { headers: { authorization: `Bearer ${token}` } });
   * ```
   */
  async url(port: number, opts?: SandboxCallOptions): Promise<string> {
    return (await this.client.sandboxUrl(this.id, port, call(opts))).url;
  }

  /**
   * The sandbox's output so far, across hibernations; with `onData`, keeps streaming new
   * output until the signal aborts or the sandbox is deleted.
   * @example
   * ```ts
   * console.log(await sb.logs());
   * const ac = new AbortController();
   * void sb.logs({ onData: (t) => process.stdout.write(t), signal: ac.signal });
   * ```
   */
  async logs(opts: SandboxCallOptions & { onData?: (text: string) => void } = {}): Promise<string> {
    if (!opts.onData) return this.client.logs(this.id, call(opts));
    let all = '';
    const onData = opts.onData;
    await this.client
      .followLogs(
        this.id,
        (t) => {
          all += t;
          onData(t);
        },
        call(opts),
      )
      .catch((e: unknown) => {
        if (!opts.signal?.aborted) throw e;
      });
    return all;
  }

  /**
   * This sandbox's state transitions as they happen, until the signal aborts.
   * @example
   * ```ts
   * for await (const t of sb.transitions({ signal })) console.log(t.from, '->', t.to, t.reason);
   * ```
   */
  async *transitions(opts: SandboxCallOptions = {}): AsyncGenerator<TransitionInfo> {
    for await (const t of this.client.events(call(opts))) if (t.sandboxId === this.id) yield t;
  }
}
