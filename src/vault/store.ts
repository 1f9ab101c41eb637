/**
 * The storage port under the vault: named, immutable objects, written atomically. The vault
 * never updates an object in place; it writes new ones and deletes old ones, so the same port
 * fits a local directory (the default, below) and an S3-compatible bucket (s3-store.ts:
 * `create` maps to a multipart upload, `commit` to completing it, `openReader` to ranged GETs).
 *
 * Names are `/`-separated relative paths made of [A-Za-z0-9._-] segments.
 */
import { open, link, mkdir, readdir, rename, rm, stat, readFile, type FileHandle } from 'node:fs/promises';
import { randomBytes } from 'node:crypto';
import { dirname, join } from 'node:path';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';

export interface StoreEntry {
  /** The object's full name. */
  name: string;
  sizeBytes: number;
  mtimeMs: number;
}

/** A streaming writer: nothing is visible under the name until `commit` resolves. */
export interface StoreWriter {
  /** Appends bytes; resolves when the store has taken them (backpressure). */
  write(parts: readonly Uint8Array[]): Promise<void>;
  /** Bytes written so far. */
  readonly sizeBytes: number;
  /** Makes the object durable and visible under its name. */
  commit(): Promise<void>;
  /** Drops what was written. Safe to call after a failed commit. */
  abort(): Promise<void>;
}

export interface StoreReader {
  /**
   * Reads exactly `length` bytes at `offset` (into `target` when given, which must be large
   * enough), or throws VAULT_CORRUPT when the object is shorter.
   */
  read(offset: number, length: number, target?: Buffer): Promise<Buffer>;
  readonly sizeBytes: number;
  close(): Promise<void>;
}

export interface VaultStore {
  /** Where the objects live, for messages (`/var/lib/dormant/vault`, `s3://bucket/prefix`). */
  readonly location: string;
  /** Reads a whole object; throws VAULT_NOT_FOUND (details.object) when it does not exist. */
  read(name: string): Promise<Buffer>;
  openReader(name: string): Promise<StoreReader>;
  /**
   * A hint that `name` will be opened soon: a store whose objects are far away may start
   * fetching it now. Never fails (a failed fetch is the later openReader's to report).
   */
  prefetch?(name: string): void;
  /** Writes a whole object atomically and durably. */
  write(name: string, data: Uint8Array): Promise<void>;
  /**
   * A streaming writer. `expectedBytes`, when the caller knows about how large the object will
   * be (a pack's target size), lets a store that buffers allocate once; it is not a limit.
   */
  create(name: string, expectedBytes?: number): Promise<StoreWriter>;
  /**
   * Writes an object only if none exists under the name (returns false then). Used for keys
   * and tombstones, where two racing writers must agree on one value.
   */
  writeNew(name: string, data: Uint8Array): Promise<boolean>;
  /** Objects under a prefix (a folder), including unfinished temporaries (`*.tmp-*`). */
  list(prefix: string): Promise<StoreEntry[]>;
  /** Removes an object; removing a missing one is not an error. */
  remove(name: string): Promise<void>;
  /** Removes every object under a prefix (a folder), and the folder. */
  removeAll(prefix: string): Promise<void>;
  /**
   * Removes an object so that its bytes are as hard to recover as the store allows: the local
   * store overwrites the file with random bytes and syncs before unlinking (see docs/VAULT.md
   * for what that does not guarantee on copy-on-write filesystems and SSDs).
   */
  shred(name: string): Promise<void>;
}

export const TMP_MARK = '.tmp-';

/** A StoreReader over an open file of `sizeBytes` (object `name`, for messages); closing it closes `h`. */
export function fileReader(name: string, h: FileHandle, sizeBytes: number): StoreReader {
  return {
    sizeBytes,
    async read(offset: number, length: number, target?: Buffer): Promise<Buffer> {
      const b = target ? target.subarray(0, length) : Buffer.allocUnsafe(length);
      let got = 0;
      while (got < length) {
        const { bytesRead } = await h.read(b, got, length - got, offset + got);
        if (bytesRead === 0) break;
        got += bytesRead;
      }
      if (got !== length) {
        throw new DormantError(
          ErrorCode.VAULT_CORRUPT,
          `vault object ${name} is truncated: wanted ${length} bytes at ${offset}, got ${got}`,
          { details: { object: name } },
        );
      }
      return b;
    },
    close: () => h.close(),
  };
}

/** Refuses names that are not `/`-separated [A-Za-z0-9._-] segments (no `..`, no `.`, no empty ones). */
export function checkName(name: string): void {
  if (
    !/^[A-Za-z0-9._-]+(\/[A-Za-z0-9._-]+)*$/.test(name) ||
    name.split('/').some((s) => s === '..' || s === '.')
  ) {
    throw new DormantError(ErrorCode.INVALID_ARGUMENT, `invalid vault object name "${name}"`);
  }
}

function ioError(what: string, e: unknown): DormantError {
  if (e instanceof DormantError) return e;
  return new DormantError(ErrorCode.VAULT_IO, `${what}: ${e instanceof Error ? e.message : String(e)}`, {
    cause: e,
    hint: 'check that the vault directory exists, is writable and its disk is not full',
  });
}

async function fsyncDir(dir: string): Promise<void> {
  const h = await open(dir, 'r');
  try {
    await h.sync();
  } finally {
    await h.close();
  }
}

/** The default store: a directory on local disk; durability through fsync of file and folder. */
export class LocalDirStore implements VaultStore {
  readonly location: string;
  private readonly made = new Set<string>();

  constructor(readonly root: string) {
    this.location = root;
  }

  private path(name: string): string {
    checkName(name);
    return join(this.root, ...name.split('/'));
  }

  private async ensureDir(dir: string): Promise<void> {
    if (this.made.has(dir)) return;
    await mkdir(dir, { recursive: true, mode: 0o700 });
    this.made.add(dir);
  }

  async read(name: string): Promise<Buffer> {
    try {
      return await readFile(this.path(name));
    } catch (e) {
      if (errnoCode(e) === 'ENOENT') {
        throw new DormantError(ErrorCode.VAULT_NOT_FOUND, `vault object ${name} not found in ${this.root}`, {
          details: { object: name },
        });
      }
      throw ioError(`reading ${name}`, e);
    }
  }

  async openReader(name: string): Promise<StoreReader> {
    let h: FileHandle;
    try {
      h = await open(this.path(name), 'r');
    } catch (e) {
      if (errnoCode(e) === 'ENOENT') {
        throw new DormantError(ErrorCode.VAULT_NOT_FOUND, `vault object ${name} not found in ${this.root}`, {
          details: { object: name },
        });
      }
      throw ioError(`opening ${name}`, e);
    }
    return fileReader(name, h, (await h.stat()).size);
  }

  async write(name: string, data: Uint8Array): Promise<void> {
    const w = await this.create(name);
    try {
      await w.write([data]);
      await w.commit();
    } catch (e) {
      await w.abort();
      throw e;
    }
  }

  async writeNew(name: string, data: Uint8Array): Promise<boolean> {
    const final = this.path(name);
    const dir = dirname(final);
    const tmp = `${final}${TMP_MARK}${randomBytes(6).toString('hex')}`;
    try {
      await this.ensureDir(dir);
      const h = await open(tmp, 'wx', 0o600);
      try {
        await h.writeFile(data);
        await h.sync();
      } finally {
        await h.close();
      }
      // link() fails with EEXIST instead of replacing: the first writer wins, atomically.
      try {
        await link(tmp, final);
      } catch (e) {
        if (errnoCode(e) === 'EEXIST') return false;
        throw e;
      }
      await fsyncDir(dir);
      return true;
    } catch (e) {
      throw ioError(`creating ${name}`, e);
    } finally {
      await rm(tmp, { force: true });
    }
  }

  async create(name: string): Promise<StoreWriter> {
    const final = this.path(name);
    const dir = dirname(final);
    const tmp = `${final}${TMP_MARK}${randomBytes(6).toString('hex')}`;
    let h: FileHandle;
    try {
      await this.ensureDir(dir);
      // O_EXCL: a temporary name is never shared, even with a writer in another process.
      h = await open(tmp, 'wx', 0o600);
    } catch (e) {
      throw ioError(`creating ${name}`, e);
    }
    let size = 0;
    let closed = false;
    const closeOnce = async (): Promise<void> => {
      if (closed) return;
      closed = true;
      await h.close();
    };
    return {
      get sizeBytes() {
        return size;
      },
      async write(parts: readonly Uint8Array[]): Promise<void> {
        let n = 0;
        for (const p of parts) n += p.length;
        try {
          let done = await h.writev(parts as Uint8Array[]);
          // writev may write less than asked (rare, large vectors); finish the rest.
          while (done.bytesWritten < n) {
            const rest = Buffer.concat(parts).subarray(done.bytesWritten);
            const w = await h.write(rest);
            done = { bytesWritten: done.bytesWritten + w.bytesWritten, buffers: done.buffers };
          }
        } catch (e) {
          throw ioError(`writing ${name}`, e);
        }
        size += n;
      },
      async commit(): Promise<void> {
        try {
          // Data first, then the name: a crash before the rename leaves only a temporary,
          // which gc removes; a crash after it leaves a complete, durable object.
          await h.datasync();
          await closeOnce();
          await rename(tmp, final);
          await fsyncDir(dir);
        } catch (e) {
          throw ioError(`committing ${name}`, e);
        }
      },
      async abort(): Promise<void> {
        await closeOnce().catch(() => undefined);
        await rm(tmp, { force: true });
      },
    };
  }

  async list(prefix: string): Promise<StoreEntry[]> {
    const base = prefix === '' ? this.root : this.path(prefix.replace(/\/$/, ''));
    const out: StoreEntry[] = [];
    const walk = async (dir: string, rel: string): Promise<void> => {
      let names: string[];
      try {
        names = await readdir(dir);
      } catch (e) {
        if (errnoCode(e) === 'ENOENT') return;
        throw ioError(`listing ${rel || '/'}`, e);
      }
      names.sort();
      for (const n of names) {
        const p = join(dir, n);
        const r = rel === '' ? n : `${rel}/${n}`;
        let st;
        try {
          st = await stat(p);
        } catch (e) {
          // Removed between readdir and stat (gc or a writer's rename): it is simply gone.
          if (errnoCode(e) === 'ENOENT') continue;
          throw ioError(`listing ${r}`, e);
        }
        if (st.isDirectory()) await walk(p, r);
        else out.push({ name: r, sizeBytes: st.size, mtimeMs: st.mtimeMs });
      }
    };
    await walk(base, prefix.replace(/\/$/, ''));
    return out;
  }

  async remove(name: string): Promise<void> {
    try {
      await rm(this.path(name), { force: true });
    } catch (e) {
      throw ioError(`removing ${name}`, e);
    }
  }

  async removeAll(prefix: string): Promise<void> {
    const p = this.path(prefix.replace(/\/$/, ''));
    try {
      await rm(p, { recursive: true, force: true });
    } catch (e) {
      throw ioError(`removing ${prefix}`, e);
    }
    // Forget folders this store made: a later write under the prefix must make them again.
    for (const d of [...this.made]) if (d === p || d.startsWith(`${p}/`)) this.made.delete(d);
  }

  async shred(name: string): Promise<void> {
    const p = this.path(name);
    let h: FileHandle;
    try {
      h = await open(p, 'r+');
    } catch (e) {
      if (errnoCode(e) === 'ENOENT') return;
      throw ioError(`shredding ${name}`, e);
    }
    try {
      const { size } = await h.stat();
      await h.write(randomBytes(size), 0, size, 0);
      await h.sync();
    } finally {
      await h.close();
    }
    await rm(p, { force: true });
    await fsyncDir(dirname(p));
  }
}
