/**
 * Sandboxes as objects, in the style users know from E2B: `Sandbox.create()`,
 * `Sandbox.connect(id)`, `Sandbox.list()`, the lifecycle on the instance, and E2B's toolbox:
 * `sandbox.commands` (commands.ts), `sandbox.files` (files.ts), `sandbox.pty` (pty.ts).
 * Everything goes through the HTTP API; times are milliseconds and sizes bytes; every call
 * takes an `AbortSignal`; failures are typed errors carrying the API's codes (errors.ts).
 *
 * Where dormant differs from E2B: a sandbox is not killed when its time is up, it falls asleep
 * (hibernates: processes and memory kept in the vault) and any later call wakes it. So E2B's
 * `timeoutMs` / `setTimeout(ms)` here set how long the sandbox may stay idle before it
 * hibernates; `lifetimeMs` is the hard end, and `kill()` deletes it.
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
import { Commands } from './commands.js';
import { NotFoundError } from './errors.js';
import { Files } from './files.js';
import { Pty } from './pty.js';
import type { SandboxMetricSample, UpdateSandboxOptions } from './contract.gen.js';

/** Where the daemon is and who is calling. Defaults: `DORMANT_URL`, `DORMANT_TOKEN`. */
export interface ConnectionOptions {
  /** The daemon's address. Default `DORMANT_URL`, else DEFAULT_URL (this host's daemon). */
  url?: string;
  /** An API token (`dmt_...`). Default `DORMANT_TOKEN`. */
  token?: string;
  /** E2B's name for `token`. */
  apiKey?: string;
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
  /** Labels to find it by (`Sandbox.list({ query: { labels } })`). */
  labels?: Record<string, string>;
  /** E2B's name for `labels` (merged with them). */
  metadata?: Record<string, string>;
  /** E2B's name for `env` (merged with it): the environment of every process inside. */
  envs?: Record<string, string>;
  /**
   * E2B's sandbox timeout. Here the sandbox is not killed when it runs out: it hibernates
   * after this long idle (the same as `idleTimeoutMs`), and the next call wakes it.
   */
  timeoutMs?: number;
  /**
   * A dormant template (`dormant template ls`): the sandbox starts from its warmed checkpoint,
   * memory and files as the template has them; no rootfs, image, command or limits then.
   */
  template?: string;
}

/** A sandbox as `Sandbox.list` gives it: the API's view, with E2B's names for two fields. */
export type ListedSandbox = SandboxInfo & {
  /** Same as `id`. */
  sandboxId: string;
  /** Same as `labels`. */
  metadata: Record<string, string>;
};

/** What `Sandbox.list` selects. */
export interface SandboxListOptions extends ConnectionOptions {
  query?: {
    /** Only sandboxes carrying all of these labels. */
    labels?: Record<string, string>;
    /** E2B's name for `labels` (merged with them). */
    metadata?: Record<string, string>;
    /** Only sandboxes in this state (or in one of these). */
    state?: SandboxState | SandboxState[];
  };
  /** At most this many (all of them by default; pages are followed). */
  limit?: number;
}

/** One meter sample, with E2B's names for its fields alongside the API's (null: not known). */
export type SandboxMetrics = SandboxMetricSample & {
  timestamp: Date;
  cpuUsedPct: number | null;
  memUsed: number;
  diskUsed: number | null;
};

/** Options of one call: an `AbortSignal`. */
export interface SandboxCallOptions {
  signal?: AbortSignal;
}

export interface ExecOptions extends SandboxCallOptions {
  /** Kill the command after this long. Default 60 000. */
  timeoutMs?: number;
  /** Written to the command's standard input (bytes may hold NUL). */
  stdin?: string | Uint8Array;
}

/** Base64 of bytes (no Buffer: the SDK runs wherever fetch does). */
function toBase64(bytes: Uint8Array): string {
  let bin = '';
  for (let i = 0; i < bytes.length; i += 0x8000) bin += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(bin);
}

const env = (name: string): string | undefined => {
  const v = typeof process !== 'undefined' ? process.env[name] : undefined;
  return v === '' ? undefined : v;
};

function clientFor(o: ConnectionOptions): DormantClient {
  const token = o.token ?? o.apiKey ?? env('DORMANT_TOKEN');
  return new DormantClient({
    url: o.url ?? env('DORMANT_URL') ?? DEFAULT_URL,
    ...(token !== undefined ? { token } : {}),
    ...(o.requestTimeoutMs !== undefined ? { timeoutMs: o.requestTimeoutMs } : {}),
  });
}

const call = (o: SandboxCallOptions | undefined): CallOptions => (o?.signal ? { signal: o.signal } : {});

/** A program run when neither a command nor an image's own is given: idle, waiting for calls. */
const IDLE_COMMAND = ['sleep', 'infinity'];

/** Labels carried by the API's view (an older daemon's has none). */
const labelsOf = (info: SandboxInfo): Record<string, string> => info.labels ?? {};

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
  /** Commands inside: `run` (streamed), background handles, `list`, `kill`, `connect`. */
  readonly commands: Commands;
  /** Files inside: `read`, `write`, `list`, `makeDir`, `remove`, `rename`, `watchDir`, ... */
  readonly files: Files;
  /** Terminals inside: `create`, `sendInput`, `resize`, `kill`. */
  readonly pty: Pty;
  private last: SandboxInfo;

  private constructor(client: DormantClient, info: SandboxInfo) {
    this.client = client;
    this.id = info.id;
    this.last = info;
    this.commands = new Commands(client, info.id);
    this.files = new Files(client, info.id);
    this.pty = new Pty(this.commands);
  }

  /** E2B's name for {@link id}. */
  get sandboxId(): string {
    return this.id;
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
  static async create(opts?: SandboxCreateOptions): Promise<Sandbox>;
  /**
   * E2B's form: the template is an OCI image layout on the daemon's machine (`DIR` or
   * `DIR:TAG`), as `image`.
   */
  static async create(template: string, opts?: SandboxCreateOptions): Promise<Sandbox>;
  static async create(a: string | SandboxCreateOptions = {}, b: SandboxCreateOptions = {}): Promise<Sandbox> {
    const opts = typeof a === 'string' ? { ...b, image: a } : a;
    const client = clientFor(opts);
    // Neither given: what the environment names (DORMANT_IMAGE, else DORMANT_ROOTFS), as E2B
    // falls back on its default template, so a ported program need not name one.
    // A template brings its own filesystem and program: no default is filled in beside it.
    const tpl = opts.template;
    const image =
      opts.image ?? (opts.rootfs === undefined && tpl === undefined ? env('DORMANT_IMAGE') : undefined);
    const rootfs =
      opts.rootfs ?? (image === undefined && tpl === undefined ? env('DORMANT_ROOTFS') : undefined);
    const envs =
      opts.env !== undefined || opts.envs !== undefined ? { ...opts.env, ...opts.envs } : undefined;
    const labels =
      opts.labels !== undefined || opts.metadata !== undefined
        ? { ...opts.metadata, ...opts.labels }
        : undefined;
    // A rootfs names no program to run; an E2B sandbox just waits for calls, so this one idles.
    const command = opts.command ?? (image === undefined && tpl === undefined ? IDLE_COMMAND : undefined);
    const idle = opts.idleTimeoutMs ?? opts.timeoutMs;
    const info = await client.createSandbox(
      {
        ...(opts.name !== undefined ? { name: opts.name } : {}),
        ...(rootfs !== undefined ? { rootfs } : {}),
        ...(image !== undefined ? { image } : {}),
        ...(command !== undefined ? { command } : {}),
        ...(envs !== undefined ? { env: envs } : {}),
        ...(labels !== undefined ? { labels } : {}),
        ...(opts.ports !== undefined ? { ports: opts.ports } : {}),
        ...(opts.memoryBytes !== undefined ? { memory: opts.memoryBytes } : {}),
        ...(opts.cpus !== undefined ? { cpus: opts.cpus } : {}),
        ...(idle !== undefined ? { idle } : {}),
        ...(opts.pauseAfterMs !== undefined ? { pauseAfter: opts.pauseAfterMs } : {}),
        ...(opts.archiveAfterMs !== undefined ? { archiveAfter: opts.archiveAfterMs } : {}),
        ...(opts.lifetimeMs !== undefined ? { lifetime: opts.lifetimeMs } : {}),
        ...(opts.onResume !== undefined ? { onResume: opts.onResume } : {}),
        ...(tpl !== undefined ? { template: tpl } : {}),
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
   * The token's sandboxes (every tenant's for an admin token), as the daemon sees them now,
   * oldest first; `query` filters by labels and state (on the daemon), `limit` caps the count.
   * The pages of the answer are followed.
   *
   * @example
   * ```ts
   * const asleep = await Sandbox.list({ query: { state: 'hibernated' } });
   * const mine = await Sandbox.list({ query: { labels: { user: 'ada' } }, limit: 10 });
   * ```
   */
  static async list(opts: SandboxListOptions = {}): Promise<ListedSandbox[]> {
    const client = clientFor(opts);
    const labels = { ...opts.query?.metadata, ...opts.query?.labels };
    const state = opts.query?.state;
    const out: ListedSandbox[] = [];
    let cursor: string | undefined;
    do {
      const page = await client.querySandboxes(
        {
          label: Object.entries(labels).map(([k, v]) => `${k}=${v}`),
          ...(state !== undefined ? { state } : {}),
          ...(opts.limit !== undefined ? { limit: Math.min(1000, opts.limit - out.length) } : {}),
          ...(cursor !== undefined ? { cursor } : {}),
        },
        call(opts),
      );
      for (const s of page.sandboxes) out.push({ ...s, sandboxId: s.id, metadata: labelsOf(s) });
      cursor = page.nextCursor;
    } while (cursor !== undefined && (opts.limit === undefined || out.length < opts.limit));
    return out;
  }

  /**
   * Deletes a sandbox by id or name; resolves false when there was none (E2B's static kill).
   * @example
   * ```ts
   * await Sandbox.kill('sb-0123456789abcdef');
   * ```
   */
  static async kill(id: string, opts: ConnectionOptions = {}): Promise<boolean> {
    const client = clientFor(opts);
    // The daemon's delete is idempotent (a gone sandbox answers as a deleted one), so whether
    // there was one to kill is asked first.
    try {
      await client.getSandbox(id, call(opts));
    } catch (e) {
      if (e instanceof NotFoundError) return false;
      throw e;
    }
    await client.remove(id, call(opts));
    return true;
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

  /** The labels it carries (E2B's `metadata`), as of the last call. */
  get labels(): Record<string, string> {
    return labelsOf(this.last);
  }

  /**
   * E2B's `setTimeout`: here, how long the sandbox may stay idle before it hibernates,
   * counted from its last activity (a call, a request through the proxy). It is not killed
   * then, only put to sleep; the next call wakes it. Use `lifetimeMs` at create, or `kill()`,
   * to end it.
   * @example
   * ```ts
   * await sb.setTimeout(10 * 60_000);
   * ```
   */
  async setTimeout(timeoutMs: number, opts?: SandboxCallOptions): Promise<SandboxInfo> {
    return this.update({ idle: timeoutMs }, opts);
  }

  /**
   * Adds, changes (a string) or removes (null) labels.
   * @example
   * ```ts
   * await sb.setLabels({ stage: 'review', draft: null });
   * ```
   */
  async setLabels(labels: Record<string, string | null>, opts?: SandboxCallOptions): Promise<SandboxInfo> {
    return this.update({ labels }, opts);
  }

  /**
   * Changes labels and the idle policy (`PATCH /v1/sandboxes/{id}`): durations in
   * milliseconds or like `15m`; null puts the default back.
   * @example
   * ```ts
   * await sb.update({ idle: '30m', archiveAfter: null });
   * ```
   */
  async update(changes: UpdateSandboxOptions, opts?: SandboxCallOptions): Promise<SandboxInfo> {
    return (this.last = await this.client.updateSandbox(this.id, changes, call(opts)));
  }

  /**
   * CPU, memory and disk over time, from the daemon's meter (oldest first); `since` is a time
   * in milliseconds since the epoch.
   * @example
   * ```ts
   * const last = (await sb.getMetrics()).at(-1);
   * console.log(last?.cpuUsedPct, last?.memUsed);
   * ```
   */
  async getMetrics(opts: SandboxCallOptions & { since?: number } = {}): Promise<SandboxMetrics[]> {
    const r = await this.client.sandboxMetrics(this.id, opts.since, call(opts));
    return r.samples.map((m) => ({
      ...m,
      timestamp: new Date(m.at),
      cpuUsedPct: m.cpuPercent,
      memUsed: m.memoryBytes,
      diskUsed: m.diskBytes,
    }));
  }

  /** Whether it runs now (asks the daemon). A sleeping sandbox still answers every call. */
  async isRunning(opts?: SandboxCallOptions): Promise<boolean> {
    return (await this.getInfo(opts)).state === 'running';
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
        ...(typeof opts.stdin === 'string' ? { stdin: opts.stdin } : {}),
        ...(opts.stdin instanceof Uint8Array ? { stdinBase64: toBase64(opts.stdin) } : {}),
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
