/**
 * Files inside a sandbox, shaped like E2B's `sandbox.files`, over the plain HTTP file routes
 * (`/v1/sandboxes/{id}/files...`): bytes go as raw request and response bodies, streamed, so
 * any size works and nothing is re-encoded. Paths are inside the sandbox (absolute, or from
 * its working directory); the sandbox's agent resolves them, so `..` and symlinks cannot leave
 * it. Every call wakes a sleeping sandbox first.
 *
 * @example
 * ```ts
 * await sb.files.write('/tmp/data.bin', new Uint8Array([0, 255]));
 * const back = await sb.files.read('/tmp/data.bin', { format: 'bytes' });
 * for (const e of await sb.files.list('/tmp')) console.log(e.type, e.path);
 * ```
 */
import type { CallOptions, DormantClient } from './client.js';
import { NotFoundError } from './errors.js';
import { readNdjson } from './ndjson.js';
import type { FileInfo, WatchEvent } from './contract.gen.js';

/** What `write` accepts. */
export type WriteData = string | ArrayBuffer | Uint8Array | Blob | ReadableStream<Uint8Array>;

/** What `write` answers: E2B's WriteInfo fields, and the size written. */
export interface WriteInfo {
  name: string;
  path: string;
  type: 'file';
  size: number;
}

/** A change under a watched folder; `name` is its path relative to that folder (as in E2B). */
export interface FilesystemEvent extends WatchEvent {
  name: string;
}

/** A running `watchDir`. */
export interface WatchHandle {
  /** Stops watching. */
  stop(): Promise<void>;
}

const baseName = (p: string) => p.replace(/\/+$/, '').split('/').pop() ?? p;

/** `sandbox.files`. */
export class Files {
  /** @internal */
  constructor(
    private readonly client: DormantClient,
    private readonly sandboxId: string,
  ) {}

  private route(rest: string, query: Record<string, string | undefined> = {}): string {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(query)) if (v !== undefined) q.set(k, v);
    const qs = q.toString();
    return `/v1/sandboxes/${encodeURIComponent(this.sandboxId)}/files${rest}${qs ? `?${qs}` : ''}`;
  }

  /**
   * A file's content: text (UTF-8, the default), bytes, a Blob, or a stream (for big files).
   * @example
   * ```ts
   * const text = await sb.files.read('/etc/hostname');
   * const stream = await sb.files.read('/var/log/big.log', { format: 'stream' });
   * ```
   */
  read(path: string, opts?: CallOptions & { format?: 'text' }): Promise<string>;
  read(path: string, opts: CallOptions & { format: 'bytes' }): Promise<Uint8Array>;
  read(path: string, opts: CallOptions & { format: 'blob' }): Promise<Blob>;
  read(path: string, opts: CallOptions & { format: 'stream' }): Promise<ReadableStream<Uint8Array>>;
  async read(
    path: string,
    opts: CallOptions & { format?: 'text' | 'bytes' | 'blob' | 'stream' } = {},
  ): Promise<string | Uint8Array | Blob | ReadableStream<Uint8Array>> {
    const res = await this.client.open(
      'GET',
      this.route('', { path }),
      opts.signal ? { signal: opts.signal } : {},
    );
    switch (opts.format ?? 'text') {
      case 'stream':
        return res.body ?? new Blob([]).stream();
      case 'bytes':
        return new Uint8Array(await res.arrayBuffer());
      case 'blob':
        return res.blob();
      default:
        return res.text();
    }
  }

  /**
   * Writes a file (parent folders are made; an existing file is replaced whole, never left
   * half-written). The array form writes several files, one after another.
   * @example
   * ```ts
   * await sb.files.write('/app/main.py', 'print(42)\n');
   * await sb.files.write([{ path: '/a', data: 'x' }, { path: '/b', data: new Uint8Array(8) }]);
   * ```
   */
  write(path: string, data: WriteData, opts?: CallOptions & { mode?: number }): Promise<WriteInfo>;
  write(files: { path: string; data: WriteData }[], opts?: CallOptions): Promise<WriteInfo[]>;
  async write(
    pathOrFiles: string | { path: string; data: WriteData }[],
    dataOrOpts?: WriteData | (CallOptions & { mode?: number }),
    maybeOpts: CallOptions & { mode?: number } = {},
  ): Promise<WriteInfo | WriteInfo[]> {
    if (typeof pathOrFiles !== 'string') {
      const opts = (dataOrOpts ?? {}) as CallOptions;
      const out: WriteInfo[] = [];
      for (const f of pathOrFiles) out.push(await this.writeOne(f.path, f.data, opts));
      return out;
    }
    return this.writeOne(pathOrFiles, dataOrOpts as WriteData, maybeOpts);
  }

  private async writeOne(
    path: string,
    data: WriteData,
    opts: CallOptions & { mode?: number },
  ): Promise<WriteInfo> {
    const body =
      typeof data === 'string'
        ? new TextEncoder().encode(data)
        : data instanceof ArrayBuffer
          ? new Uint8Array(data)
          : data;
    const mode = opts.mode !== undefined ? opts.mode.toString(8).padStart(3, '0') : undefined;
    const r = await this.client.request<{ path: string; size: number }>(
      'PUT',
      this.route('', { path, mode }),
      undefined,
      {
        ...(opts.signal ? { signal: opts.signal } : {}),
        rawBody: body,
      },
    );
    return { name: baseName(r.path), path: r.path, type: 'file', size: r.size };
  }

  /**
   * The entries of a folder; `depth` > 1 goes that many levels down (at most 16).
   * @example
   * ```ts
   * const names = (await sb.files.list('/app', { depth: 2 })).map((e) => e.path);
   * ```
   */
  async list(path: string, opts: CallOptions & { depth?: number } = {}): Promise<FileInfo[]> {
    const route = this.route('/list', { path, depth: String(opts.depth ?? 1) });
    return (await this.client.request<{ entries: FileInfo[] }>('GET', route, undefined, opts)).entries;
  }

  /** A file's or folder's type, size, mode and time (the link itself for a symlink). */
  getInfo(path: string, opts?: CallOptions): Promise<FileInfo> {
    return this.client.request<FileInfo>('GET', this.route('/stat', { path }), undefined, opts);
  }

  /** Whether the path exists (a dangling symlink counts: it is there). */
  async exists(path: string, opts?: CallOptions): Promise<boolean> {
    try {
      await this.getInfo(path, opts);
      return true;
    } catch (e) {
      if (e instanceof NotFoundError && e.code === 'FILE_NOT_FOUND') return false;
      throw e;
    }
  }

  /** Makes a folder and its parents; resolves false when it already was there. */
  async makeDir(path: string, opts?: CallOptions): Promise<boolean> {
    return (await this.client.request<{ created: boolean }>('POST', this.route('/mkdir'), { path }, opts))
      .created;
  }

  /** Removes a file, or a folder with everything in it. */
  async remove(path: string, opts?: CallOptions): Promise<void> {
    await this.client.request<unknown>('POST', this.route('/remove'), { path }, opts);
  }

  /** Moves a file or folder; resolves with what is at the new path. */
  async rename(oldPath: string, newPath: string, opts?: CallOptions): Promise<FileInfo> {
    await this.client.request<unknown>('POST', this.route('/rename'), { from: oldPath, to: newPath }, opts);
    return this.getInfo(newPath, opts);
  }

  /**
   * Calls `onEvent` for each change under a folder until `stop()` (or the signal aborts).
   * Resolves once the watch is in place.
   * @example
   * ```ts
   * const w = await sb.files.watchDir('/app', (e) => console.log(e.type, e.name), { recursive: true });
   * await w.stop();
   * ```
   */
  async watchDir(
    path: string,
    onEvent: (e: FilesystemEvent) => void | Promise<void>,
    opts: CallOptions & { recursive?: boolean; onExit?: (err?: unknown) => void } = {},
  ): Promise<WatchHandle> {
    const stop = new AbortController();
    const signal = opts.signal ? AbortSignal.any([stop.signal, opts.signal]) : stop.signal;
    const res = await this.client.open(
      'GET',
      this.route('/watch', { path, recursive: opts.recursive === true ? 'true' : undefined }),
      { signal },
    );
    const body = res.body;
    const root = path.replace(/\/+$/, '');
    const pump = (async () => {
      if (!body) return;
      for await (const e of readNdjson<WatchEvent>(body)) {
        const name = e.path.startsWith(`${root}/`) ? e.path.slice(root.length + 1) : baseName(e.path);
        await onEvent({ ...e, name });
      }
    })().then(
      () => opts.onExit?.(),
      (e: unknown) => opts.onExit?.(signal.aborted ? undefined : e),
    );
    return {
      stop: async () => {
        stop.abort();
        await pump;
      },
    };
  }
}
