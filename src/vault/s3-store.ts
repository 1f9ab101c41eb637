/**
 * The vault's storage port on an S3-compatible bucket (AWS S3, Ceph RGW, MinIO, ...).
 *
 * - `create`/`commit`: the object is cut into parts; the first full part starts a multipart
 *   upload, parts go up a few at a time (write() waits when they are all in flight), commit
 *   completes the upload. An object smaller than one part is a single PUT. abort (or a failed
 *   commit) aborts the upload, so nothing half-written ever becomes visible under the name.
 * - `openReader`: one HEAD for the size, then ranged GETs; a read whose body breaks off is
 *   retried with backoff (the SDK's own retries stop once the response has started).
 * - Every request goes through the SDK's standard retry strategy (exponential backoff with
 *   jitter on 5xx, throttling and connection errors).
 * - `writeNew` (create-if-absent, for keys and tombstones) does NOT use conditional writes
 *   (`If-None-Match: *` is not on every S3 server): it is a HEAD and then the PUT, under the
 *   vault's create lock (locks.ts): a local lock file by default, exact for one node; for
 *   nodes sharing the bucket prefix, a PostgreSQL advisory lock keyed by the object's name.
 * - `shred` is a DELETE: what S3 does with the bytes after that (versioned buckets keep them)
 *   is the provider's; the crypto-shred guarantee comes from the keys (docs/VAULT.md).
 * - Optionally, a local cache of packs (`cache`): a node keeps the packs it wrote or read,
 *   bounded in bytes, least recently used out first, so a resume on the node that hibernated
 *   reads local files. Packs are immutable (gc writes new ones under new names), so a cached
 *   copy never goes stale.
 */
import {
  AbortMultipartUploadCommand,
  CompleteMultipartUploadCommand,
  CreateMultipartUploadCommand,
  DeleteObjectCommand,
  DeleteObjectsCommand,
  GetObjectCommand,
  HeadObjectCommand,
  ListObjectsV2Command,
  PutObjectCommand,
  S3Client,
  UploadPartCommand,
  type CompletedPart,
  type S3ClientConfig,
} from '@aws-sdk/client-s3';
import type { Readable } from 'node:stream';
import { randomBytes } from 'node:crypto';
import { Agent as HttpAgent } from 'node:http';
import { Agent as HttpsAgent } from 'node:https';
import { DormantError, ErrorCode } from '../domain/errors.js';
import { checkName, type StoreEntry, type StoreReader, type StoreWriter, type VaultStore } from './store.js';
import { LocalVaultLocks, type VaultLocks } from './locks.js';
import { PackCache, type CacheWriter } from './pack-cache.js';

export interface S3Location {
  bucket: string;
  /** `''` or `a/b` (no slash at either end). */
  prefix: string;
}

/** `s3://bucket` or `s3://bucket/some/prefix` (a trailing slash is dropped). */
export function parseS3Url(url: string): S3Location {
  const m = /^s3:\/\/([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(\/.*)?$/.exec(url);
  if (!m) {
    throw new DormantError(
      ErrorCode.INVALID_ARGUMENT,
      `invalid vault URL "${url}": expected s3://BUCKET or s3://BUCKET/PREFIX (bucket: 3-63 lowercase letters, digits, '.' or '-')`,
    );
  }
  const prefix = (m[2] ?? '').replace(/^\/+|\/+$/g, '');
  if (prefix !== '') {
    try {
      checkName(prefix);
    } catch {
      throw new DormantError(
        ErrorCode.INVALID_ARGUMENT,
        `invalid vault URL "${url}": the prefix must be /-separated segments of letters, digits, '.', '_' or '-'`,
      );
    }
  }
  return { bucket: m[1]!, prefix };
}

export interface S3StoreOptions extends S3Location {
  /** `http://127.0.0.1:7480` for RGW or MinIO; default: AWS's endpoint for the region. */
  endpoint?: string;
  /** Default `us-east-1` (what most S3-compatible servers accept). */
  region?: string;
  /** Default: the SDK's credential chain (AWS_ACCESS_KEY_ID, profiles, instance roles). */
  credentials?: { accessKeyId: string; secretAccessKey: string };
  /** A local folder for this node's lock files (writeNew), used when `locks` is not given. */
  lockDir: string;
  /**
   * What `writeNew` takes its create lock from. Default: a lock file in `lockDir` (one node).
   * Nodes sharing the bucket prefix pass the PostgreSQL locks (state/pg-locks.ts); the store
   * does not close them.
   */
  locks?: VaultLocks;
  /** A local cache of packs: a folder and its bound in bytes. */
  cache?: { dir: string; maxBytes: number };
  /** Multipart part size; at least 5 MiB (S3's minimum for all parts but the last). Default 8 MiB. */
  partSizeBytes?: number;
  /** Parts uploading at once per writer. Default 4. */
  partsInFlight?: number;
  /** Attempts per request (SDK retries) and per ranged read. Default 5. */
  maxAttempts?: number;
  /** ListObjectsV2 page size (tests make it small to cross pages). Default 1000. */
  listPageSize?: number;
}

/** What `checkServer` found the server to get wrong, and what the store does instead. */
export interface S3ServerProblems {
  rangedReads: boolean;
  multipart: boolean;
  /** For people: one line per problem. */
  warnings: string[];
}

const MIN_PART = 5 * 1024 * 1024;

interface S3ErrorLike {
  name?: string;
  Code?: string;
  code?: string;
  message?: string;
  $metadata?: { httpStatusCode?: number };
}

function statusOf(e: unknown): number | undefined {
  return (e as S3ErrorLike)?.$metadata?.httpStatusCode;
}

function nameOf(e: unknown): string {
  const x = e as S3ErrorLike;
  return x?.name ?? x?.Code ?? x?.code ?? 'Error';
}

function isNotFound(e: unknown): boolean {
  const n = nameOf(e);
  if (n === 'NoSuchBucket') return false;
  return n === 'NoSuchKey' || n === 'NotFound' || statusOf(e) === 404;
}

/** Worth another try: the server's 5xx, throttling, a connection that broke. */
function isTransient(e: unknown): boolean {
  const s = statusOf(e);
  if (s !== undefined) return s >= 500 || s === 429 || s === 408;
  const n = nameOf(e);
  return (
    /^(ECONNRESET|ECONNREFUSED|EPIPE|ETIMEDOUT|EAI_AGAIN|ENOTFOUND|TimeoutError|RequestTimeout|SlowDown)$/.test(
      n,
    ) || /socket hang up|ECONNRESET|premature close|aborted/i.test(String((e as S3ErrorLike)?.message))
  );
}

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

export class S3Store implements VaultStore {
  readonly location: string;
  client: S3Client;
  private clientOptions: S3ClientConfig;
  private readonly bucket: string;
  private readonly prefix: string;
  private partSize: number;
  /** False when the server's ranged GETs return wrong bytes: whole objects are read instead. */
  private ranged = true;
  private readonly partsInFlight: number;
  private readonly attempts: number;
  private readonly pageSize: number;
  private readonly locks: VaultLocks;
  private readonly cache: PackCache | undefined;
  /** @internal the writers' request bodies, kept between packs. */
  readonly bodies = new BodyPool();

  constructor(o: S3StoreOptions) {
    this.bucket = o.bucket;
    this.prefix = o.prefix;
    this.location = `s3://${o.bucket}${o.prefix === '' ? '' : `/${o.prefix}`}`;
    this.partSize = Math.max(MIN_PART, o.partSizeBytes ?? 8 * 1024 * 1024);
    this.partsInFlight = Math.max(1, o.partsInFlight ?? 4);
    this.attempts = Math.max(1, o.maxAttempts ?? 5);
    this.pageSize = Math.min(1000, Math.max(1, o.listPageSize ?? 1000));
    this.locks = o.locks ?? new LocalVaultLocks(o.lockDir);
    this.cache = o.cache ? new PackCache(o.cache.dir, o.cache.maxBytes) : undefined;
    this.clientOptions = {
      region: o.region ?? 'us-east-1',
      ...(o.endpoint !== undefined ? { endpoint: o.endpoint } : {}),
      ...(o.credentials ? { credentials: o.credentials } : {}),
      // Bucket in the path: S3-compatible servers on an address have no per-bucket host names.
      forcePathStyle: true,
      maxAttempts: this.attempts,
      retryMode: 'standard',
      // Checksums only where S3 requires them: many S3-compatible servers reject the newer
      // trailing CRC headers. Integrity is the vault's own (every record carries a GCM tag).
      requestChecksumCalculation: 'WHEN_REQUIRED',
      responseChecksumValidation: 'WHEN_REQUIRED',
      requestHandler: { connectionTimeout: 10_000, requestTimeout: 120_000 },
    };
    this.client = new S3Client(this.clientOptions);
  }

  private key(name: string): string {
    checkName(name);
    return this.prefix === '' ? name : `${this.prefix}/${name}`;
  }

  private folderKey(prefix: string): string {
    const p = prefix.replace(/\/$/, '');
    if (p === '') return this.prefix === '' ? '' : `${this.prefix}/`;
    return `${this.key(p)}/`;
  }

  private fail(op: string, name: string, e: unknown): DormantError {
    if (e instanceof DormantError) return e;
    const status = statusOf(e);
    const n = nameOf(e);
    const hint =
      status === 403 || n === 'InvalidAccessKeyId' || n === 'SignatureDoesNotMatch'
        ? "check the vault's S3 credentials (vault.accessKeyId, the secret) and the bucket's policy"
        : n === 'NoSuchBucket'
          ? `create the bucket ${this.bucket} first (dormant does not create buckets)`
          : status === undefined
            ? 'check vault.endpoint and that the S3 server is up and reachable'
            : 'the S3 server refused the request; see its message';
    return new DormantError(
      ErrorCode.VAULT_IO,
      `S3 ${op} of ${this.location}/${name} failed: ${n}${status !== undefined ? ` (HTTP ${status})` : ''}: ${(e as S3ErrorLike)?.message ?? String(e)}`,
      { cause: e, hint, details: { object: name } },
    );
  }

  private notFound(name: string): DormantError {
    return new DormantError(ErrorCode.VAULT_NOT_FOUND, `vault object ${name} not found in ${this.location}`, {
      details: { object: name },
    });
  }

  /** Retries `fn` on transient errors the SDK could not retry (a body that broke off). */
  private async retrying<T>(fn: () => Promise<T>): Promise<T> {
    for (let attempt = 1; ; attempt++) {
      try {
        return await fn();
      } catch (e) {
        if (attempt >= this.attempts || !isTransient(e)) throw e;
        await sleep(Math.min(5000, 100 * 2 ** attempt) * (0.5 + Math.random() / 2));
      }
    }
  }

  /** GETs `key` (a range of it when given) into `target`; throws when the body is short. */
  private async getInto(name: string, target: Buffer, offset?: number): Promise<number> {
    return this.getTo(
      name,
      target.length,
      (c, at) => {
        c.copy(target, at);
      },
      offset,
    );
  }

  /**
   * GETs `key` (`length` bytes of it from `offset` when given), handing each piece of the body
   * to `sink` with its position; returns the bytes received. A retry starts again from
   * position 0, so a sink that writes by position needs no reset.
   */
  private async getTo(
    name: string,
    length: number,
    sink: (chunk: Buffer, at: number) => void | Promise<void>,
    offset?: number,
  ): Promise<number> {
    return this.retrying(async () => {
      const res = await this.client.send(
        new GetObjectCommand({
          Bucket: this.bucket,
          Key: this.key(name),
          ...(offset !== undefined ? { Range: `bytes=${offset}-${offset + length - 1}` } : {}),
        }),
      );
      let got = 0;
      for await (const chunk of res.Body as Readable) {
        const c = chunk as Buffer;
        if (got + c.length > length) throw new Error(`${name}: the server sent more than asked`);
        const w = sink(c, got);
        if (w) await w;
        got += c.length;
      }
      return got;
    });
  }

  async read(name: string): Promise<Buffer> {
    let size: number;
    try {
      size = await this.head(name);
      const b = Buffer.allocUnsafe(size);
      const got = await this.getInto(name, b);
      if (got !== size) throw new Error(`short body: ${got} of ${size} bytes`);
      return b;
    } catch (e) {
      if (isNotFound(e)) throw this.notFound(name);
      throw this.fail('GET', name, e);
    }
  }

  /** The object's size; throws the SDK's not-found error when it is missing. */
  private async head(name: string): Promise<number> {
    const res = await this.client.send(new HeadObjectCommand({ Bucket: this.bucket, Key: this.key(name) }));
    return res.ContentLength ?? 0;
  }

  private async exists(name: string): Promise<boolean> {
    try {
      await this.head(name);
      return true;
    } catch (e) {
      if (isNotFound(e)) return false;
      throw this.fail('HEAD', name, e);
    }
  }

  async openReader(name: string): Promise<StoreReader> {
    const cached = this.cache ? await this.cache.open(name) : undefined;
    if (cached) return cached;
    // On its way (a prefetch): that fetch, rather than a second one.
    const fetched = await this.cache?.pending(name);
    if (fetched) return fetched;
    let sizeBytes: number;
    try {
      sizeBytes = await this.head(name);
    } catch (e) {
      if (isNotFound(e)) throw this.notFound(name);
      throw this.fail('HEAD', name, e);
    }
    if (this.cache?.wants(name, sizeBytes)) {
      // A pack read once is likely read again (a resume after a failed one, forks): it is
      // fetched whole with one GET, streamed into the cache's file (no buffer of its size in
      // this process: fresh memory costs a page fault per 4 KiB), and read there.
      const local = await this.cache
        .fill(name, sizeBytes, (sink) => this.getTo(name, sizeBytes, sink))
        .catch((e: unknown) => {
          if (isNotFound(e)) throw this.notFound(name);
          // The server cannot serve ranges: a failed whole GET is the read's failure.
          if (!this.ranged) throw this.fail('GET', name, e);
          return undefined;
        });
      if (local) return local;
    }
    if (!this.ranged) {
      // The server cannot serve ranges (checkServer), and no cache holds the object (none, or
      // its disk could not take it): the whole object into memory, once.
      const whole = Buffer.allocUnsafe(sizeBytes);
      try {
        const got = await this.getInto(name, whole);
        if (got !== sizeBytes) throw new Error(`short body: ${got} of ${sizeBytes} bytes`);
      } catch (e) {
        if (isNotFound(e)) throw this.notFound(name);
        throw this.fail('GET', name, e);
      }
      return bufferReader(name, whole);
    }
    const truncated = (offset: number, length: number, got: number): DormantError =>
      new DormantError(
        ErrorCode.VAULT_CORRUPT,
        `vault object ${name} is truncated: wanted ${length} bytes at ${offset}, got ${got}`,
        { details: { object: name } },
      );
    return {
      sizeBytes,
      read: async (offset: number, length: number, target?: Buffer): Promise<Buffer> => {
        const b = target ? target.subarray(0, length) : Buffer.allocUnsafe(length);
        if (length === 0) return b;
        if (offset + length > sizeBytes) throw truncated(offset, length, Math.max(0, sizeBytes - offset));
        let got: number;
        try {
          got = await this.getInto(name, b, offset);
        } catch (e) {
          if (isNotFound(e)) throw this.notFound(name);
          throw this.fail('ranged GET', name, e);
        }
        if (got !== length) throw truncated(offset, length, got);
        return b;
      },
      close: async (): Promise<void> => undefined,
    };
  }

  /**
   * Starts fetching pack `name` into the pack cache, unless it is there or on its way (a
   * restore asks for the packs it will need next while it decodes the one it has). Only with
   * a cache; failures are left for the openReader that follows to meet and report.
   */
  prefetch(name: string): void {
    const cache = this.cache;
    if (!cache || !name.endsWith('.pack')) return;
    void (async () => {
      if (await cache.has(name)) return;
      const sizeBytes = await this.head(name);
      if (!cache.wants(name, sizeBytes)) return;
      await cache.load(name, sizeBytes, (sink) => this.getTo(name, sizeBytes, sink));
    })().catch(() => undefined);
  }

  private async put(name: string, body: Buffer): Promise<void> {
    try {
      await this.client.send(new PutObjectCommand({ Bucket: this.bucket, Key: this.key(name), Body: body }));
    } catch (e) {
      throw this.fail('PUT', name, e);
    }
  }

  async write(name: string, data: Uint8Array): Promise<void> {
    if (data.length <= Math.min(this.partSize, 2 ** 31)) {
      await this.put(name, Buffer.from(data.buffer, data.byteOffset, data.length));
      if (this.cache?.wants(name, data.length)) await this.cache.keep(name, data).catch(() => undefined);
      return;
    }
    const w = await this.create(name, data.length);
    try {
      await w.write([data]);
      await w.commit();
    } catch (e) {
      await w.abort();
      throw e;
    }
  }

  async writeNew(name: string, data: Uint8Array): Promise<boolean> {
    this.key(name);
    // No conditional PUT: HEAD then PUT, with every other writer of this name kept out.
    return this.locks.whileCreating(this.location, name, async () => {
      if (await this.exists(name)) return false;
      await this.put(name, Buffer.from(data.buffer, data.byteOffset, data.length));
      return true;
    });
  }

  async create(name: string, expectedBytes?: number): Promise<StoreWriter> {
    const key = this.key(name);
    return new MultipartWriter(
      this,
      name,
      key,
      this.bucket,
      this.partSize,
      this.partsInFlight,
      this.cache,
      expectedBytes,
    );
  }

  /** @internal the writer's way to report an SDK error the same way the store does. */
  failure(op: string, name: string, e: unknown): DormantError {
    return this.fail(op, name, e);
  }

  async list(prefix: string): Promise<StoreEntry[]> {
    const base = this.folderKey(prefix);
    const strip = this.prefix === '' ? 0 : this.prefix.length + 1;
    const out: StoreEntry[] = [];
    let token: string | undefined;
    try {
      do {
        const res = await this.client.send(
          new ListObjectsV2Command({
            Bucket: this.bucket,
            Prefix: base,
            MaxKeys: this.pageSize,
            ...(token !== undefined ? { ContinuationToken: token } : {}),
          }),
        );
        for (const o of res.Contents ?? []) {
          if (o.Key === undefined) continue;
          out.push({
            name: o.Key.slice(strip),
            sizeBytes: o.Size ?? 0,
            mtimeMs: o.LastModified?.getTime() ?? 0,
          });
        }
        token = res.IsTruncated ? res.NextContinuationToken : undefined;
      } while (token !== undefined);
    } catch (e) {
      throw this.fail('LIST', prefix || '/', e);
    }
    return out.sort((a, b) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0));
  }

  async remove(name: string): Promise<void> {
    try {
      // DELETE of a missing key succeeds on S3: removing twice is not an error, as the port says.
      await this.client.send(new DeleteObjectCommand({ Bucket: this.bucket, Key: this.key(name) }));
    } catch (e) {
      if (isNotFound(e)) return;
      throw this.fail('DELETE', name, e);
    }
    await this.cache?.drop(name);
  }

  async removeAll(prefix: string): Promise<void> {
    const names = (await this.list(prefix)).map((e) => e.name);
    for (let i = 0; i < names.length; i += 1000) {
      const batch = names.slice(i, i + 1000);
      try {
        const res = await this.client.send(
          new DeleteObjectsCommand({
            Bucket: this.bucket,
            Delete: { Objects: batch.map((n) => ({ Key: this.key(n) })), Quiet: true },
          }),
        );
        const bad = (res.Errors ?? []).filter((x) => x.Code !== 'NoSuchKey');
        if (bad.length > 0) {
          const e = new Error(bad[0]!.Message ?? 'delete failed');
          e.name = bad[0]!.Code ?? 'Error';
          throw e;
        }
      } catch (e) {
        throw this.fail('DELETE (batch)', prefix, e);
      }
      for (const n of batch) await this.cache?.drop(n);
    }
  }

  async shred(name: string): Promise<void> {
    // S3 offers no overwrite in place: a delete is all a client can do (docs/VAULT.md).
    await this.remove(name);
  }

  /**
   * Checks, with a probe object under `.probe/`, that the server returns the right bytes for a
   * ranged GET and puts a multipart upload together in order. Where it does not (Ceph RGW's
   * dbstore backend gets both wrong in 18.2 and 20.2), the store stops using them: it reads
   * whole objects and sends each object in one PUT, and the warnings say so. Call once at start.
   */
  async checkServer(): Promise<S3ServerProblems> {
    const probe = `.probe/${randomBytes(8).toString('hex')}`;
    const data = randomBytes(MIN_PART + 4096);
    const warnings: string[] = [];
    let rangedReads = false;
    let multipart = false;
    // A server that gets ranges wrong may also send more than its Content-Length and leave
    // the connection unusable: the probes run on a client of their own, closed after.
    const main = this.client;
    this.client = new S3Client(this.clientOptions);
    try {
      await this.put(probe, data);
      const range = Buffer.alloc(16);
      const got = await this.getInto(probe, range, MIN_PART).catch(() => -1);
      rangedReads = got === 16 && range.equals(data.subarray(MIN_PART, MIN_PART + 16));
      this.client.destroy();
      this.client = new S3Client(this.clientOptions);
      // Two parts: the first of the minimum size, the second the rest.
      const w = new MultipartWriter(
        this,
        probe,
        this.key(probe),
        this.bucket,
        MIN_PART,
        2,
        undefined,
        undefined,
      );
      try {
        await w.write([data]);
        await w.commit();
        const whole = await this.read(probe);
        multipart = whole.equals(data);
      } catch {
        multipart = false;
      }
    } finally {
      this.client.destroy();
      this.client = main;
      await this.remove(probe).catch(() => undefined);
    }
    if (!rangedReads || !multipart) {
      // Seen on RGW's dbstore: a response longer than its Content-Length, which corrupts the
      // next response on a kept-alive connection. One connection per request from now on.
      this.clientOptions = {
        ...this.clientOptions,
        requestHandler: {
          connectionTimeout: 10_000,
          requestTimeout: 120_000,
          httpAgent: new HttpAgent({ keepAlive: false }),
          httpsAgent: new HttpsAgent({ keepAlive: false }),
        },
      };
      this.client.destroy();
      this.client = new S3Client(this.clientOptions);
    }
    if (!rangedReads) {
      this.ranged = false;
      warnings.push(
        `the S3 server at ${this.location} returns wrong bytes for ranged GETs: the vault reads whole objects instead`,
      );
    }
    if (!multipart) {
      this.partSize = Number.POSITIVE_INFINITY;
      warnings.push(
        `the S3 server at ${this.location} puts multipart uploads together wrongly: the vault sends each object in one PUT`,
      );
    }
    return { rangedReads, multipart, warnings };
  }

  /** Closes the SDK's connections. */
  destroy(): void {
    this.client.destroy();
    this.bodies.clear();
  }
}

/** At most this many bytes of idle body buffers are kept (two packs' worth and some). */
const MAX_IDLE_BODY_BYTES = 96 * 1024 * 1024;
/** Idle body buffers are let go this long after the last one came back. */
const BODY_IDLE_MS = 10_000;

/**
 * Body buffers for the writers, reused from one pack (or part) to the next. Memory the process
 * has not touched yet costs a page fault per 4 KiB on first write: a fresh 32 MiB buffer per
 * pack was 63k faults and about 1.5 s of CPU per 256 MiB hibernated on the 2-core test host,
 * more than the copy itself. A buffer comes back only once the request that sent it has
 * settled (the SDK is done with it, retries included); the pool keeps a few, and none once
 * the writers have been idle for a while, so a quiet daemon holds no buffers.
 */
class BodyPool {
  private free: Buffer[] = [];
  private freeBytes = 0;
  private timer: NodeJS.Timeout | undefined;

  /** Bytes held for the next writers (tests). */
  get idleBytes(): number {
    return this.freeBytes;
  }

  /** A buffer of exactly `bytes` bytes, not zero-filled: the writer writes before it sends. */
  take(bytes: number): Buffer {
    const i = this.free.findIndex((b) => b.length === bytes);
    if (i < 0) return Buffer.allocUnsafeSlow(bytes);
    const b = this.free.splice(i, 1)[0]!;
    this.freeBytes -= b.length;
    return b;
  }

  /** Hands `b` back; nothing may read or write it after. */
  give(b: Buffer): void {
    this.free.push(b);
    this.freeBytes += b.length;
    while (this.freeBytes > MAX_IDLE_BODY_BYTES) this.freeBytes -= this.free.shift()!.length;
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.clear(), BODY_IDLE_MS);
    this.timer.unref();
  }

  clear(): void {
    clearTimeout(this.timer);
    this.timer = undefined;
    this.free = [];
    this.freeBytes = 0;
  }
}

/** What a single-PUT writer allocates when the caller gives no expected size. */
const FIRST_BUFFER_BYTES = 8 * 1024 * 1024;
/**
 * Room past the caller's expected size: a pack closes once it reaches its target, so it ends
 * up to one record (256 KiB of data and its framing) past it.
 */
const EXPECTED_SLACK_BYTES = 1024 * 1024;

/**
 * A streaming writer on a multipart upload (or one PUT for an object under one part).
 *
 * What was written is copied (the caller reuses its buffers) straight into the buffer that
 * becomes the request's body: one buffer of the part size per part, or, for one PUT of the
 * whole object, one buffer of the expected size (grown if the object outgrows it). No list of
 * copies joined at the end: on the S3 vault's hibernate those copies and the join were most
 * of the extra CPU against the local vault (docs/BENCHMARKS.md, "S3 vault: profile verdict").
 */
class MultipartWriter implements StoreWriter {
  /** The next body being filled: bytes [0, fill) are written, not yet sent. */
  private buf: Buffer | undefined;
  private fill = 0;
  private size = 0;
  private uploadId: Promise<string> | undefined;
  private readonly parts: CompletedPart[] = [];
  private readonly inFlight = new Set<Promise<void>>();
  private nextPart = 1;
  private error: unknown;
  private done = false;
  private cancelled = false;
  private committed = false;
  private readonly tee: Promise<CacheWriter | undefined>;

  constructor(
    private readonly store: S3Store,
    private readonly name: string,
    private readonly key: string,
    private readonly bucket: string,
    /** Infinity: one PUT of the whole object (a server whose multipart uploads are wrong). */
    private readonly partSize: number,
    private readonly maxInFlight: number,
    cache: PackCache | undefined,
    private readonly expectedBytes: number | undefined,
  ) {
    // The node that writes a pack is the likeliest to read it back (resume where it slept).
    this.tee = cache ? cache.writer(name).catch(() => undefined) : Promise.resolve(undefined);
  }

  get sizeBytes(): number {
    return this.size;
  }

  private started(): Promise<string> {
    this.uploadId ??= this.store.client
      .send(new CreateMultipartUploadCommand({ Bucket: this.bucket, Key: this.key }))
      .then((r) => {
        if (r.UploadId === undefined) throw new Error('the server gave no UploadId');
        return r.UploadId;
      });
    return this.uploadId;
  }

  /**
   * What was written and not yet sent: `body`, a view of `whole`, which goes back to the pool
   * once the request that sends it has settled. The writer starts a new buffer after.
   */
  private take(): { body: Buffer; whole: Buffer | undefined } {
    const whole = this.buf;
    const body = whole?.subarray(0, this.fill) ?? Buffer.alloc(0);
    this.buf = undefined;
    this.fill = 0;
    return { body, whole };
  }

  /** The body buffer, with room past `fill`: a new one, or a larger copy of a full one. */
  private room(): Buffer {
    const b = this.buf;
    if (b !== undefined && this.fill < b.length) return b;
    let cap: number;
    if (Number.isFinite(this.partSize)) cap = this.partSize;
    else if (b === undefined)
      cap = (this.expectedBytes ?? FIRST_BUFFER_BYTES - EXPECTED_SLACK_BYTES) + EXPECTED_SLACK_BYTES;
    else cap = Math.ceil(b.length * 1.5);
    const next = this.store.bodies.take(cap);
    if (b !== undefined) {
      b.copy(next, 0, 0, this.fill);
      this.store.bodies.give(b);
    }
    this.buf = next;
    return next;
  }

  private async flush({ body, whole }: { body: Buffer; whole: Buffer | undefined }): Promise<void> {
    const partNumber = this.nextPart++;
    const p = (async () => {
      try {
        const UploadId = await this.started();
        const r = await this.store.client.send(
          new UploadPartCommand({
            Bucket: this.bucket,
            Key: this.key,
            UploadId,
            PartNumber: partNumber,
            Body: body,
          }),
        );
        this.parts.push({ PartNumber: partNumber, ETag: r.ETag! });
      } finally {
        if (whole !== undefined) this.store.bodies.give(whole);
      }
    })();
    const tracked = p.then(
      () => undefined,
      (e: unknown) => {
        this.error ??= e;
      },
    );
    this.inFlight.add(tracked);
    void tracked.finally(() => this.inFlight.delete(tracked));
    while (this.inFlight.size >= this.maxInFlight) await Promise.race(this.inFlight);
  }

  private check(): void {
    if (this.done) throw new DormantError(ErrorCode.INTERNAL, `writer of ${this.name} is closed`);
    if (this.error !== undefined) throw this.store.failure('upload', this.name, this.error);
  }

  async write(parts: readonly Uint8Array[]): Promise<void> {
    this.check();
    const tee = await this.tee;
    for (const p of parts) {
      this.size += p.length;
      await tee?.write(p);
      for (let at = 0; at < p.length;) {
        if (this.buf !== undefined && this.fill === this.partSize) {
          // A full part goes; the next bytes start the next part's buffer.
          await this.flush(this.take());
          this.check();
        }
        const b = this.room();
        const n = Math.min(p.length - at, b.length - this.fill);
        b.set(at === 0 && n === p.length ? p : p.subarray(at, at + n), this.fill);
        this.fill += n;
        at += n;
      }
    }
    if (this.fill === this.partSize) {
      await this.flush(this.take());
      this.check();
    }
  }

  async commit(): Promise<void> {
    this.check();
    this.done = true;
    try {
      if (this.uploadId === undefined) {
        const { body, whole } = this.take();
        try {
          await this.store.client.send(
            new PutObjectCommand({ Bucket: this.bucket, Key: this.key, Body: body }),
          );
        } finally {
          if (whole !== undefined) this.store.bodies.give(whole);
        }
      } else {
        if (this.fill > 0) await this.flush(this.take());
        while (this.inFlight.size > 0) await Promise.all(this.inFlight);
        if (this.error !== undefined) throw this.store.failure('upload', this.name, this.error);
        const UploadId = await this.uploadId;
        this.parts.sort((a, b) => a.PartNumber! - b.PartNumber!);
        await this.store.client.send(
          new CompleteMultipartUploadCommand({
            Bucket: this.bucket,
            Key: this.key,
            UploadId,
            MultipartUpload: { Parts: this.parts },
          }),
        );
      }
    } catch (e) {
      await this.cancel();
      throw this.store.failure('commit', this.name, e);
    }
    this.committed = true;
    const tee = await this.tee;
    await tee?.commit().catch(() => undefined);
  }

  private async cancel(): Promise<void> {
    if (this.cancelled) return;
    this.cancelled = true;
    if (this.buf !== undefined) this.store.bodies.give(this.buf);
    this.buf = undefined;
    this.fill = 0;
    while (this.inFlight.size > 0) await Promise.all(this.inFlight);
    const tee = await this.tee;
    await tee?.abort().catch(() => undefined);
    if (this.uploadId === undefined) return;
    const UploadId = await this.uploadId.catch(() => undefined);
    if (UploadId === undefined) return;
    // Best effort: an upload left behind holds storage until the bucket's lifecycle rule
    // (AbortIncompleteMultipartUpload, docs/VAULT.md) ends it; it is never visible as an object.
    await this.store.client
      .send(new AbortMultipartUploadCommand({ Bucket: this.bucket, Key: this.key, UploadId }))
      .catch(() => undefined);
  }

  async abort(): Promise<void> {
    if (this.committed) return;
    this.done = true;
    await this.cancel();
  }
}

function bufferReader(name: string, data: Buffer): StoreReader {
  return {
    sizeBytes: data.length,
    async read(offset: number, length: number, target?: Buffer): Promise<Buffer> {
      if (offset + length > data.length) {
        throw new DormantError(
          ErrorCode.VAULT_CORRUPT,
          `vault object ${name} is truncated: wanted ${length} bytes at ${offset}, got ${Math.max(0, data.length - offset)}`,
          { details: { object: name } },
        );
      }
      if (!target) return Buffer.from(data.subarray(offset, offset + length));
      data.copy(target, 0, offset, offset + length);
      return target.subarray(0, length);
    },
    close: async () => undefined,
  };
}
