/**
 * The TypeScript client of dormant's HTTP API. The CLI is built on it.
 *
 * @example
 * ```ts
 * const client = new DormantClient({ url: DEFAULT_URL, token: 'dmt_...' });
 * const sb = await client.createSandbox({ rootfs: '/srv/rootfs', command: ['sh', '-c', 'sleep infinity'] });
 * await client.hibernate(sb.id);
 * await client.resume(sb.id);
 * ```
 */

import type {
  CheckpointInfo,
  CreateSandboxOptions,
  CreateTemplateOptions,
  ExecResult,
  ListSandboxesOptions,
  SandboxInfo,
  SandboxMetrics,
  SandboxPage,
  SandboxUrlInfo,
  TemplateInfo,
  TokenInfo,
  TransitionInfo,
  UpdateSandboxOptions,
} from './contract.gen.js';
import { apiError, type DormantApiError } from './errors.js';
import { readEventStream } from './sse.js';

export { DormantApiError } from './errors.js';
// The API's shapes, generated from its schemas (src/api/schemas.ts) by `npm run gen`.
export type {
  CheckpointInfo,
  CreateSandboxOptions,
  ExecResult,
  GpuPolicy,
  SandboxInfo,
  SandboxState,
  SandboxUrlInfo,
  CreateTemplateOptions,
  TemplateInfo,
  TokenInfo,
  TransitionInfo,
} from './contract.gen.js';

/** The typed error for a failed streaming answer (one read as a stream, not by `request`). */
async function errorOf(res: Response, fallback: string): Promise<DormantApiError> {
  // A body that is not JSON (a proxy's page, a cut connection) still gives an error: by status.
  const data = (await res.json().catch(() => ({}))) as {
    error?: { code?: string; message?: string; hint?: string };
  };
  return apiError(
    data.error?.code ?? `HTTP_${res.status}`,
    data.error?.message ?? fallback,
    res.status,
    data.error?.hint,
  );
}

/** Where a daemon listens by default: `dormant serve` on this host. */
export const DEFAULT_URL = 'http://127.0.0.1:7420';

export interface ClientOptions {
  /** Default DEFAULT_URL. */
  url?: string;
  token?: string;
  /** Per-request timeout in milliseconds. Default 300 000 (hibernate and resume take seconds). */
  timeoutMs?: number;
  /** The fetch to send requests with. Default: the global one (the dormant CLI brings a lighter one). */
  fetch?: typeof globalThis.fetch;
}

export interface CallOptions {
  signal?: AbortSignal;
}

export class DormantClient {
  readonly url: string;
  private readonly token: string | undefined;
  private readonly timeoutMs: number;
  private readonly fetch: typeof globalThis.fetch;

  constructor(opts: ClientOptions = {}) {
    this.url = (opts.url ?? DEFAULT_URL).replace(/\/$/, '');
    this.token = opts.token;
    this.timeoutMs = opts.timeoutMs ?? 300_000;
    // The global is looked up at each call, as before this option.
    this.fetch = opts.fetch ?? ((input, init) => globalThis.fetch(input, init));
  }

  /**
   * Sends one request; resolves with the parsed JSON (or text), rejects with a DormantApiError
   * of the class for its code (errors.ts). An aborted `signal` rejects with the signal's reason.
   */
  async request<T>(
    method: string,
    path: string,
    body?: unknown,
    opts: CallOptions & { rawBody?: Uint8Array | Blob | ReadableStream<Uint8Array> } = {},
  ): Promise<T> {
    opts.signal?.throwIfAborted();
    const timeout = AbortSignal.timeout(this.timeoutMs);
    const signals = [timeout, ...(opts.signal ? [opts.signal] : [])];
    let res: Response;
    const raw = opts.rawBody;
    try {
      res = await this.fetch(`${this.url}${path}`, {
        method,
        headers: {
          ...(this.token ? { authorization: `Bearer ${this.token}` } : {}),
          ...(raw !== undefined
            ? { 'content-type': 'application/octet-stream' }
            : body !== undefined
              ? { 'content-type': 'application/json' }
              : {}),
        },
        ...(raw !== undefined
          ? // A stream goes out as it is read (Node's fetch needs `duplex` for that).
            { body: raw, ...(raw instanceof ReadableStream ? { duplex: 'half' } : {}) }
          : body !== undefined
            ? { body: JSON.stringify(body) }
            : {}),
        signal: AbortSignal.any(signals),
      });
    } catch (e) {
      throw this.transportError(e, method, path, timeout, opts.signal);
    }
    let text: string;
    try {
      text = await res.text();
    } catch (e) {
      throw this.transportError(e, method, path, timeout, opts.signal);
    }
    const type = res.headers.get('content-type') ?? '';
    const data: unknown = type.includes('application/json') && text !== '' ? JSON.parse(text) : text;
    if (!res.ok) {
      const err = (data as { error?: { code?: string; message?: string; hint?: string } }).error;
      throw apiError(
        err?.code ?? `HTTP_${res.status}`,
        err?.message ?? `${method} ${path}: HTTP ${res.status}`,
        res.status,
        err?.hint,
      );
    }
    return data as T;
  }

  private transportError(
    e: unknown,
    method: string,
    path: string,
    timeout: AbortSignal,
    signal: AbortSignal | undefined,
  ): unknown {
    if (signal?.aborted) return signal.reason;
    if (timeout.aborted)
      return apiError(
        'TIMEOUT',
        `${method} ${path}: no answer from ${this.url} in ${this.timeoutMs} ms`,
        0,
        'raise the client timeout (timeoutMs), or check the daemon log',
        { cause: e },
      );
    const why = e instanceof Error ? (e.cause instanceof Error ? e.cause.message : e.message) : String(e);
    return apiError(
      'DAEMON_UNREACHABLE',
      `cannot reach dormant at ${this.url}: ${why}`,
      0,
      'start it with `dormant serve`, or set DORMANT_URL',
      { cause: e },
    );
  }

  /**
   * Sends one request and resolves with the response as soon as its headers arrive, for the
   * routes that answer a stream (a command's ndjson output, a file's bytes, watch events). The
   * client's timeout covers only the wait for the headers: a stream may last as long as its
   * command does. Cancel it with `opts.signal` or by cancelling the body. A failed answer
   * rejects with the typed error (errors.ts), as `request` does.
   */
  async open(
    method: string,
    path: string,
    opts: CallOptions & { json?: unknown; rawBody?: Uint8Array | Blob | ReadableStream<Uint8Array> } = {},
  ): Promise<Response> {
    opts.signal?.throwIfAborted();
    const headersDue = new AbortController();
    const timer = setTimeout(() => headersDue.abort(), this.timeoutMs);
    const raw = opts.rawBody;
    let res: Response;
    try {
      res = await this.fetch(`${this.url}${path}`, {
        method,
        headers: {
          ...(this.token ? { authorization: `Bearer ${this.token}` } : {}),
          ...(raw !== undefined
            ? { 'content-type': 'application/octet-stream' }
            : opts.json !== undefined
              ? { 'content-type': 'application/json' }
              : {}),
        },
        ...(raw !== undefined
          ? { body: raw, ...(raw instanceof ReadableStream ? { duplex: 'half' } : {}) }
          : opts.json !== undefined
            ? { body: JSON.stringify(opts.json) }
            : {}),
        signal: opts.signal ? AbortSignal.any([headersDue.signal, opts.signal]) : headersDue.signal,
      });
    } catch (e) {
      throw this.transportError(e, method, path, headersDue.signal, opts.signal);
    } finally {
      clearTimeout(timer);
    }
    if (!res.ok) throw await errorOf(res, `${method} ${path}: HTTP ${res.status}`);
    return res;
  }

  health(opts?: CallOptions) {
    return this.request<{ ok: boolean; version: string }>('GET', '/v1/health', undefined, opts);
  }
  createSandbox(o: CreateSandboxOptions, opts?: CallOptions) {
    return this.request<SandboxInfo>('POST', '/v1/sandboxes', o, opts);
  }
  async listSandboxes(opts?: CallOptions): Promise<SandboxInfo[]> {
    return (await this.request<{ sandboxes: SandboxInfo[] }>('GET', '/v1/sandboxes', undefined, opts))
      .sandboxes;
  }
  getSandbox(id: string, opts?: CallOptions) {
    return this.request<SandboxInfo>('GET', `/v1/sandboxes/${encodeURIComponent(id)}`, undefined, opts);
  }
  private op(id: string, op: string, body: unknown, opts?: CallOptions) {
    return this.request<SandboxInfo>('POST', `/v1/sandboxes/${encodeURIComponent(id)}/${op}`, body, opts);
  }
  pause(id: string, opts?: CallOptions) {
    return this.op(id, 'pause', undefined, opts);
  }
  hibernate(id: string, opts?: CallOptions) {
    return this.op(id, 'hibernate', undefined, opts);
  }
  resume(id: string, opts?: CallOptions) {
    return this.op(id, 'resume', undefined, opts);
  }
  archive(id: string, opts?: CallOptions) {
    return this.op(id, 'archive', undefined, opts);
  }
  fork(id: string, o: { name?: string } = {}, opts?: CallOptions) {
    return this.op(id, 'fork', o, opts);
  }
  keepalive(id: string, forMs?: number | string, opts?: CallOptions) {
    return this.op(id, 'keepalive', forMs === undefined ? {} : { for: forMs }, opts);
  }
  /**
   * Runs a command and answers when it ends. `stdinBase64` carries bytes that are not text;
   * `encoding: 'base64'` answers stdout and stderr as base64 (binary-safe); output past
   * `maxOutputBytes` (default 16 MiB each) is cut and `truncated` says so.
   */
  exec(
    id: string,
    command: string[],
    o: {
      timeoutMs?: number;
      stdin?: string;
      stdinBase64?: string;
      encoding?: 'utf8' | 'base64';
      maxOutputBytes?: number;
    } = {},
    opts?: CallOptions,
  ) {
    return this.request<ExecResult>(
      'POST',
      `/v1/sandboxes/${encodeURIComponent(id)}/exec`,
      { command, ...o },
      opts,
    );
  }
  logs(id: string, opts?: CallOptions) {
    return this.request<string>('GET', `/v1/sandboxes/${encodeURIComponent(id)}/logs`, undefined, opts);
  }
  /** CRIU's log of the sandbox's last failed restore (NO_RESTORE_LOG when none failed). */
  restoreLog(id: string, opts?: CallOptions) {
    return this.request<string>(
      'GET',
      `/v1/sandboxes/${encodeURIComponent(id)}/logs?restore=1`,
      undefined,
      opts,
    );
  }
  /** Streams the sandbox's output as it grows; ends when the signal aborts or the sandbox is deleted. */
  async followLogs(id: string, onChunk: (text: string) => void, opts: CallOptions = {}): Promise<void> {
    const res = await this.fetch(`${this.url}/v1/sandboxes/${encodeURIComponent(id)}/logs?follow=1`, {
      headers: this.token ? { authorization: `Bearer ${this.token}` } : {},
      ...(opts.signal ? { signal: opts.signal } : {}),
    });
    if (!res.ok || !res.body) {
      throw await errorOf(res, 'logs failed');
    }
    const decoder = new TextDecoder();
    for await (const chunk of res.body) onChunk(decoder.decode(chunk as Uint8Array, { stream: true }));
  }
  async remove(id: string, opts?: CallOptions): Promise<void> {
    await this.request<string>('DELETE', `/v1/sandboxes/${encodeURIComponent(id)}`, undefined, opts);
  }
  /**
   * Where a sandbox port is reached through the wake proxy (`dormant url ID PORT`), which wakes
   * the sandbox on the first request. (Not `url()`: `url` is the daemon address.) Unless the
   * port was declared public, callers send the tenant's token (`Authorization: Bearer`,
   * `X-Dormant-Token`, a `dormant_token` cookie or `?dormant_token=`).
   */
  sandboxUrl(id: string, port: number, opts?: CallOptions) {
    return this.request<SandboxUrlInfo>(
      'GET',
      `/v1/sandboxes/${encodeURIComponent(id)}/url?port=${port}`,
      undefined,
      opts,
    );
  }
  /** Mints a token for a tenant (admin only). The token is in the answer, and nowhere else. */
  /** A template from a running sandbox (`from`), or built from a rootfs or image and a command. */
  createTemplate(o: CreateTemplateOptions, opts?: CallOptions) {
    return this.request<TemplateInfo>('POST', '/v1/templates', o, opts);
  }
  async listTemplates(opts?: CallOptions): Promise<TemplateInfo[]> {
    return (await this.request<{ templates: TemplateInfo[] }>('GET', '/v1/templates', undefined, opts))
      .templates;
  }
  getTemplate(ref: string, opts?: CallOptions) {
    return this.request<TemplateInfo>('GET', `/v1/templates/${encodeURIComponent(ref)}`, undefined, opts);
  }
  /** Publishes a template to every tenant (admin), or takes it back. */
  publishTemplate(ref: string, isPublic: boolean, opts?: CallOptions) {
    return this.request<TemplateInfo>(
      'PATCH',
      `/v1/templates/${encodeURIComponent(ref)}`,
      { public: isPublic },
      opts,
    );
  }
  async removeTemplate(ref: string, opts?: CallOptions): Promise<void> {
    await this.request<string>('DELETE', `/v1/templates/${encodeURIComponent(ref)}`, undefined, opts);
  }

  createToken(o: { tenant: string; admin?: boolean; e2b?: boolean }, opts?: CallOptions) {
    return this.request<TokenInfo & { token: string }>('POST', '/v1/tokens', o, opts);
  }
  /** Every token's public id, tenant and dates (admin only). */
  async listTokens(opts?: CallOptions): Promise<TokenInfo[]> {
    return (await this.request<{ tokens: TokenInfo[] }>('GET', '/v1/tokens', undefined, opts)).tokens;
  }
  /** Revokes a token by its public id (admin only); requests with it are refused at once. */
  revokeToken(id: string, opts?: CallOptions) {
    return this.request<TokenInfo>('DELETE', `/v1/tokens/${encodeURIComponent(id)}`, undefined, opts);
  }

  /**
   * Stores this tenant's login to a registry (`HOST` or `HOST:PORT`), after the registry
   * accepted it; `createSandbox({ image: 'HOST/NAME:TAG' })` then pulls with it. The daemon
   * keeps the password sealed with the tenant's key and never answers it (docs/IMAGES.md).
   */
  registryLogin(host: string, login: { username: string; password: string }, opts?: CallOptions) {
    return this.request<RegistryLoginInfo>('PUT', `/v1/registries/${encodeURIComponent(host)}`, login, opts);
  }
  /** This tenant's registry logins (an admin: every tenant's), without passwords. */
  async listRegistryLogins(opts?: CallOptions): Promise<RegistryLoginInfo[]> {
    return (await this.request<{ registries: RegistryLoginInfo[] }>('GET', '/v1/registries', undefined, opts))
      .registries;
  }
  /** Forgets this tenant's login to a registry. */
  async registryLogout(host: string, opts?: CallOptions): Promise<void> {
    await this.request('DELETE', `/v1/registries/${encodeURIComponent(host)}`, undefined, opts);
  }
  /** The unpacked images on the node and the sandboxes using each (admin only). */
  async listImages(opts?: CallOptions): Promise<CachedImageInfo[]> {
    return (await this.request<{ images: CachedImageInfo[] }>('GET', '/v1/images', undefined, opts)).images;
  }
  /** Removes the unpacked images and downloaded blobs no sandbox uses (admin only). */
  pruneImages(opts?: CallOptions) {
    return this.request<{ images: string[]; blobs: number }>('POST', '/v1/images/prune', undefined, opts);
  }

  /**
   * State transitions as they happen (GET /v1/events), for this token's tenant. Ends when the
   * signal aborts (without an error) or the daemon closes the stream.
   *
   * @example
   * ```ts
   * const ac = new AbortController();
   * for await (const t of client.events({ signal: ac.signal })) console.log(t.sandboxId, t.from, '->', t.to);
   * ```
   */
  async *events(opts: CallOptions & { sinceId?: number } = {}): AsyncGenerator<TransitionInfo> {
    const q = opts.sinceId !== undefined ? `?since=${opts.sinceId}` : '';
    let res: Response;
    try {
      res = await this.fetch(`${this.url}/v1/events${q}`, {
        headers: this.token ? { authorization: `Bearer ${this.token}` } : {},
        ...(opts.signal ? { signal: opts.signal } : {}),
      });
    } catch (e) {
      if (opts.signal?.aborted) return;
      throw apiError(
        'DAEMON_UNREACHABLE',
        `cannot reach dormant at ${this.url}: ${String(e)}`,
        0,
        undefined,
        {
          cause: e,
        },
      );
    }
    if (!res.ok || !res.body) {
      throw await errorOf(res, 'events failed');
    }
    try {
      for await (const ev of readEventStream(res.body)) {
        if (ev.event === 'transition') yield JSON.parse(ev.data) as TransitionInfo;
      }
    } catch (e) {
      if (!opts.signal?.aborted) throw e;
    }
  }

  async listCheckpoints(sandboxId?: string, opts?: CallOptions): Promise<CheckpointInfo[]> {
    const q = sandboxId ? `?sandbox=${encodeURIComponent(sandboxId)}` : '';
    return (
      await this.request<{ checkpoints: CheckpointInfo[] }>('GET', `/v1/checkpoints${q}`, undefined, opts)
    ).checkpoints;
  }
  /**
   * A podman export or a kubelet / CRI-O checkpoint archive becomes a hibernated sandbox
   * (`dormant checkpoint import`); `resume` then runs it. `archive` and `image` (an OCI image
   * layout, DIR[:TAG]) are absolute paths on the daemon's machine; without `image` the daemon
   * uses an image it already holds that matches the archive's.
   */
  importCheckpoint(
    input: { archive: string; image?: string; name?: string; ports?: number[]; memory?: number | string },
    opts?: CallOptions,
  ): Promise<SandboxInfo> {
    return this.request<SandboxInfo>('POST', '/v1/checkpoints/import', input, opts);
  }
  /**
   * Imports an archive sent as the request's body: what a tenant token, which names no paths on
   * the daemon's machine, uses. `fileName` tells the compression by its suffix (`.tar`,
   * `.tar.gz`, `.tar.zst`); `image` is an image the daemon may read, as for `importCheckpoint`.
   */
  uploadCheckpoint(
    archive: Uint8Array | Blob | ReadableStream<Uint8Array>,
    input: { fileName: string; image?: string; name?: string; ports?: number[]; memory?: number | string },
    opts: CallOptions = {},
  ): Promise<SandboxInfo> {
    const q = new URLSearchParams({ fileName: input.fileName });
    if (input.image !== undefined) q.set('image', input.image);
    if (input.name !== undefined) q.set('name', input.name);
    if (input.ports !== undefined) q.set('ports', input.ports.join(','));
    if (input.memory !== undefined) q.set('memory', String(input.memory));
    return this.request<SandboxInfo>('POST', `/v1/checkpoints/import?${q.toString()}`, undefined, {
      ...opts,
      rawBody: archive,
    });
  }
  /**
   * The checkpoint as a podman / CRI-O archive (zstd by default), streamed. Refused with
   * CHECKPOINT_HAS_SECRETS when its scan finds secrets, unless `allowPlaintext`, or `encrypted`
   * (the caller promises to encrypt the stream before it reaches a disk, as the CLI's
   * `--format oci --encrypt` does).
   */
  async exportCheckpoint(
    id: string,
    o: {
      allowPlaintext?: boolean;
      encrypted?: boolean;
      compression?: 'zstd' | 'gzip' | 'none';
    } & CallOptions = {},
  ): Promise<{ body: ReadableStream<Uint8Array>; sizeBytes: number; secretsFound: number }> {
    const q = new URLSearchParams();
    if (o.allowPlaintext === true) q.set('allowPlaintext', 'true');
    if (o.encrypted === true) q.set('encrypted', 'true');
    if (o.compression !== undefined) q.set('compression', o.compression);
    const path = `/v1/checkpoints/${encodeURIComponent(id)}/export?${q.toString()}`;
    let res: Response;
    try {
      res = await this.fetch(`${this.url}${path}`, {
        headers: this.token ? { authorization: `Bearer ${this.token}` } : {},
        ...(o.signal ? { signal: o.signal } : {}),
      });
    } catch (e) {
      throw this.transportError(e, 'GET', path, AbortSignal.timeout(this.timeoutMs), o.signal);
    }
    if (!res.ok || !res.body) {
      throw await errorOf(res, `export of checkpoint ${id} failed`);
    }
    return {
      body: res.body as ReadableStream<Uint8Array>,
      sizeBytes: Number(res.headers.get('content-length') ?? 0),
      secretsFound: Number(res.headers.get('x-dormant-secrets-found') ?? 0),
    };
  }
  /**
   * What a checkpoint holds: process tree, files, sockets, memory, mounts and metadata
   * (`dormant checkpoint inspect ID`). The daemon reads it in memory and wipes it after.
   */
  inspectCheckpoint(id: string, opts?: CallOptions): Promise<CheckpointInspection> {
    return this.request<CheckpointInspection>(
      'GET',
      `/v1/checkpoints/${encodeURIComponent(id)}/inspect`,
      undefined,
      opts,
    );
  }
  /**
   * Secrets found in a checkpoint's memory, images and metadata (`dormant checkpoint scan ID`).
   * Findings carry a redacted preview and a fingerprint, never the secret.
   */
  scanCheckpoint(id: string, opts?: CallOptions): Promise<CheckpointScan> {
    return this.request<CheckpointScan>(
      'GET',
      `/v1/checkpoints/${encodeURIComponent(id)}/scan`,
      undefined,
      opts,
    );
  }

  // ---- metadata: filtered pages, updates, metrics -------------------------------------------

  /** One page of the sandboxes `q` selects; `nextCursor` is there when more remain. */
  querySandboxes(q: ListSandboxesOptions = {}, opts?: CallOptions): Promise<SandboxPage> {
    const params = new URLSearchParams();
    for (const [k, v] of Object.entries(q) as [string, string | number | string[] | undefined][]) {
      if (v === undefined) continue;
      for (const one of Array.isArray(v) ? v : [v]) params.append(k, String(one));
    }
    const qs = params.toString();
    return this.request<SandboxPage>('GET', `/v1/sandboxes${qs ? `?${qs}` : ''}`, undefined, opts);
  }
  /** Every sandbox `q` selects, page after page. */
  async *allSandboxes(
    q: Omit<ListSandboxesOptions, 'cursor'> = {},
    opts?: CallOptions,
  ): AsyncGenerator<SandboxInfo> {
    let cursor: string | undefined;
    do {
      const page = await this.querySandboxes({ ...q, ...(cursor !== undefined ? { cursor } : {}) }, opts);
      yield* page.sandboxes;
      cursor = page.nextCursor;
    } while (cursor !== undefined);
  }
  /** Changes labels (null removes one) and idle policy values (null: the default again). */
  updateSandbox(id: string, u: UpdateSandboxOptions, opts?: CallOptions) {
    return this.request<SandboxInfo>('PATCH', `/v1/sandboxes/${encodeURIComponent(id)}`, u, opts);
  }
  /** The meter's samples of the sandbox since `sinceMs` (epoch ms; default: the last hour). */
  sandboxMetrics(id: string, sinceMs?: number, opts?: CallOptions) {
    return this.request<SandboxMetrics>(
      'GET',
      `/v1/sandboxes/${encodeURIComponent(id)}/metrics${sinceMs !== undefined ? `?since=${sinceMs}` : ''}`,
      undefined,
      opts,
    );
  }
}

/** `GET /v1/checkpoints/{id}/inspect` (see src/checkpoint/inspect.ts for every field). */
/** A tenant's login to a registry (PUT /v1/registries/{host}); never the password. */
export interface RegistryLoginInfo {
  host: string;
  username: string;
  tenant: string;
  createdAt: string;
}

/** An unpacked image in the node's cache (GET /v1/images). */
export interface CachedImageInfo {
  digest: string;
  unpackedAt: string;
  /** The sources of the sandboxes using it. */
  refs: string[];
  sandboxes: number;
}

export interface CheckpointInspection {
  ref: string;
  metadata: Record<string, string | number | undefined>;
  processes: {
    pid: number;
    ppid: number;
    comm: string;
    cmdline?: string[];
    files: { fd: string; type: string; path: string }[];
    sockets: {
      fd: number;
      protocol: string;
      state: string;
      local: string;
      remote: string;
      listening: boolean;
      needsReconnect: boolean;
    }[];
    memory: { mappedBytes: number; storedBytes: number };
  }[];
  mounts: { mountpoint: string; fstype: string; source: string }[];
  sizes: { imagesBytes: number; memoryPagesBytes: number };
}

/** `GET /v1/checkpoints/{id}/scan`. */
export interface CheckpointScan {
  ref: string;
  findings: {
    kind: string;
    where: 'memory' | 'image' | 'filesystem' | 'metadata';
    process?: { pid: number; comm: string };
    mapping?: string;
    address?: string;
    path?: string;
    offset: number;
    name?: string;
    preview: string;
    fingerprint: string;
    occurrences: number;
  }[];
  scanned: Record<string, number>;
  durationMs: number;
}
