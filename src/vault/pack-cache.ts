/**
 * A local cache of an S3 vault's packs, bounded in bytes: a pack written or read on this node
 * is kept as a file, and the least recently used go when the cache is over its bound. Packs
 * are immutable (gc writes new ones under new names), so a cached copy is never stale; it is
 * sealed ciphertext, as in the bucket. Only `.pack` objects are cached: indexes and manifests
 * are small and read once per process.
 *
 * A file is complete when it has its name (written to a temporary, then renamed), so a crash
 * leaves at most temporaries, removed when the cache is next opened.
 */
import { mkdir, open, readdir, rename, rm, stat, type FileHandle } from 'node:fs/promises';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import { fileReader, type StoreReader } from './store.js';

export interface CacheWriter {
  /** Appends `p`. */
  write(p: Uint8Array): Promise<void>;
  /** Writes `p` at `pos` (the file grows to cover it). */
  at(p: Uint8Array, pos: number): Promise<void>;
  commit(): Promise<void>;
  abort(): Promise<void>;
}

/**
 * Fetches an object's body, handing each piece to `sink` with its position (a retry starts
 * again at 0); resolves to the bytes it handed over.
 */
export type BodyGet = (sink: (chunk: Buffer, at: number) => void | Promise<void>) => Promise<number>;

const TMP = '.tmp-';
/** What a fill gathers of a body before it writes it to the file. */
const FILL_GATHER = 1024 * 1024;

export class PackCache {
  /** name -> size, in order of last use (a Map keeps insertion order: re-insert on use). */
  private readonly files = new Map<string, number>();
  private total = 0;
  private ready: Promise<void> | undefined;
  private readonly filling = new Map<string, Promise<boolean>>();

  constructor(
    private readonly dir: string,
    private readonly maxBytes: number,
  ) {}

  private file(name: string): string {
    // Object names are [A-Za-z0-9._-] segments: '+' cannot occur in them, so this is one to one.
    return join(this.dir, name.replaceAll('/', '+'));
  }

  private init(): Promise<void> {
    this.ready ??= (async () => {
      await mkdir(this.dir, { recursive: true, mode: 0o700 });
      const found: { name: string; size: number; atime: number }[] = [];
      for (const f of await readdir(this.dir)) {
        const p = join(this.dir, f);
        if (f.includes(TMP)) {
          await rm(p, { force: true });
          continue;
        }
        const st = await stat(p).catch(() => undefined);
        if (st?.isFile()) found.push({ name: f.replaceAll('+', '/'), size: st.size, atime: st.atimeMs });
      }
      found.sort((a, b) => a.atime - b.atime);
      for (const f of found) this.note(f.name, f.size);
      await this.evict();
    })();
    return this.ready;
  }

  private note(name: string, size: number): void {
    const had = this.files.get(name);
    if (had !== undefined) {
      this.files.delete(name);
      this.total -= had;
    }
    this.files.set(name, size);
    this.total += size;
  }

  private async evict(): Promise<void> {
    for (const [name, size] of this.files) {
      if (this.total <= this.maxBytes) break;
      this.files.delete(name);
      this.total -= size;
      // A reader that has it open keeps reading: the inode lives until it closes.
      await rm(this.file(name), { force: true });
    }
  }

  /** Whether an object of this size is worth caching: a pack, at most a quarter of the bound. */
  wants(name: string, size: number): boolean {
    return name.endsWith('.pack') && size <= this.maxBytes / 4;
  }

  /** Whether `name` is cached, or being fetched into the cache, now. */
  async has(name: string): Promise<boolean> {
    await this.init();
    return this.files.has(name) || this.filling.has(name);
  }

  /** When `name` is being fetched into the cache: a reader on it once there (or undefined). */
  pending(name: string): Promise<StoreReader | undefined> | undefined {
    const p = this.filling.get(name);
    return p?.then((kept) => (kept ? this.open(name) : undefined)).catch(() => undefined);
  }

  /** A reader on the cached copy, or undefined when there is none. */
  async open(name: string): Promise<StoreReader | undefined> {
    if (!name.endsWith('.pack')) return undefined;
    await this.init();
    const size = this.files.get(name);
    if (size === undefined) return undefined;
    let h: FileHandle;
    try {
      h = await open(this.file(name), 'r');
    } catch {
      this.files.delete(name);
      this.total -= size;
      return undefined;
    }
    this.note(name, size);
    return fileReader(name, h, size);
  }

  /**
   * Fetches `name` whole into the cache, once even when asked twice at once: `get` hands the
   * object's bytes to the sink it is given, by position, and returns how many it sent; they go
   * straight to a temporary file (gathered into 1 MiB writes), renamed once complete. Resolves
   * to a reader on the cached copy, or undefined when the cache could not keep it (its disk
   * failed, a short body); rejects with `get`'s own error.
   */
  fill(name: string, size: number, get: BodyGet): Promise<StoreReader | undefined> {
    return this.load(name, size, get).then((kept) => (kept ? this.open(name) : undefined));
  }

  /** As `fill`, without opening the copy: whether the cache holds it now (a prefetch). */
  load(name: string, size: number, get: BodyGet): Promise<boolean> {
    // Fetched by another caller in the meantime (a prefetch, a reader): that copy.
    if (this.files.has(name) && !this.filling.has(name)) return Promise.resolve(true);
    let p = this.filling.get(name);
    if (p === undefined) {
      p = this.fetch(name, size, get).finally(() => this.filling.delete(name));
      this.filling.set(name, p);
    }
    return p;
  }

  private async fetch(name: string, size: number, get: BodyGet): Promise<boolean> {
    let w: CacheWriter;
    try {
      w = await this.writer(name);
    } catch {
      return false;
    }
    // Pieces of the body (64 KiB or so each) gathered into one reused buffer, written when
    // full: a sixteenth of the system calls. A retry of `get` starts again at 0.
    const gather = Buffer.allocUnsafe(Math.min(FILL_GATHER, Math.max(1, size)));
    let from = 0;
    let len = 0;
    let diskFailed = false;
    const flush = async (): Promise<void> => {
      if (len === 0) return;
      const n = len;
      len = 0;
      await w.at(gather.subarray(0, n), from);
      from += n;
    };
    try {
      const got = await get(async (c, at) => {
        if (diskFailed) return;
        try {
          if (len > 0 && at !== from + len) await flush();
          if (len === 0) from = at;
          let i = 0;
          while (i < c.length) {
            const n = Math.min(c.length - i, gather.length - len);
            c.copy(gather, len, i, i + n);
            len += n;
            i += n;
            if (len === gather.length) await flush();
          }
        } catch {
          diskFailed = true;
        }
      });
      if (!diskFailed) await flush().catch(() => (diskFailed = true));
      if (diskFailed || got !== size) {
        await w.abort();
        return false;
      }
    } catch (e) {
      await w.abort();
      throw e;
    }
    try {
      await w.commit();
      return true;
    } catch {
      await w.abort();
      return false;
    }
  }

  /** Keeps a copy of an object just written whole. */
  async keep(name: string, data: Uint8Array): Promise<void> {
    const w = await this.writer(name);
    try {
      await w.write(data);
      await w.commit();
    } catch (e) {
      await w.abort();
      throw e;
    }
  }

  /** Writes a copy while the object is being uploaded; `commit` once the upload has committed. */
  async writer(name: string): Promise<CacheWriter> {
    await this.init();
    const final = this.file(name);
    const tmp = `${final}${TMP}${randomBytes(6).toString('hex')}`;
    const h = await open(tmp, 'wx', 0o600);
    let size = 0;
    let closed = false;
    const close = async (): Promise<void> => {
      if (closed) return;
      closed = true;
      await h.close();
    };
    return {
      write: async (p) => {
        let done = 0;
        while (done < p.length) done += (await h.write(p, done, p.length - done, size + done)).bytesWritten;
        size += p.length;
      },
      at: async (p, pos) => {
        let done = 0;
        while (done < p.length) done += (await h.write(p, done, p.length - done, pos + done)).bytesWritten;
        size = Math.max(size, pos + p.length);
      },
      commit: async () => {
        await close();
        if (!this.wants(name, size)) {
          await rm(tmp, { force: true });
          return;
        }
        await rename(tmp, final);
        this.note(name, size);
        await this.evict();
      },
      abort: async () => {
        await close().catch(() => undefined);
        await rm(tmp, { force: true });
      },
    };
  }

  /** Forgets a removed object. */
  async drop(name: string): Promise<void> {
    if (!name.endsWith('.pack')) return;
    await this.init();
    const size = this.files.get(name);
    if (size !== undefined) {
      this.files.delete(name);
      this.total -= size;
    }
    await rm(this.file(name), { force: true });
  }

  /** Bytes held now (tests). */
  get bytes(): number {
    return this.total;
  }
}
