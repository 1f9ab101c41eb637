/**
 * Images for sandboxes: registry pulls (runtime/registry.ts, through skopeo), the cache of
 * unpacked images they share with OCI layout folders (runtime/image.ts), each tenant's
 * registry credentials, and the garbage collection of what no sandbox uses.
 *
 * Storage under the cache folder (`<data-dir>/images`):
 * - `sha256-<manifest>/`: one unpacked image (rootfs, image.json), shared by every sandbox
 *   made from it, whatever tenant: a tenant reaches it only through a manifest the registry
 *   served to that tenant, with that tenant's credentials, on this create.
 * - `registry/<tenant>/blobs/sha256/`: the tenant's downloaded blobs, shared between its pulls
 *   (a layer is fetched once). Per tenant, so that a blob is never handed to a tenant whose
 *   registry did not serve it: knowing a digest is not access.
 * - `registry/<tenant>/pulls/<random>/`: a pull's OCI layout (its index), gone after the pull.
 * - `registry/alias/sha256-<registry digest>`: when skopeo rewrote a manifest on the way into
 *   the layout (a Docker schema 2 manifest becomes OCI), the digest it got.
 *
 * Credentials are sealed with the tenant's key (the vault's TenantSecrets, as --env values
 * are): the database never holds a password in clear, and destroying the tenant key makes
 * them unreadable. In clear they exist only in memory and, for the length of one skopeo run,
 * in a 0600 auth file in a private folder of the daemon's tmpfs staging.
 *
 * Pulls and the collector exclude each other (a read/write gate): a collection never removes
 * a blob a pull is writing. An image a create has just pulled is pinned until its sandbox is
 * recorded, so a collection in between does not take it away.
 */
import { randomBytes } from 'node:crypto';
import { arch as nodeArch } from 'node:os';
import { chmod, mkdir, readFile, readdir, rm, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { DormantError, ErrorCode, isDormantError } from '../domain/errors.js';
import type { Sandbox } from '../domain/sandbox.js';
import type { StateStore } from '../state/store.js';
import {
  listUnpacked,
  manifestBlobs,
  readUnpacked,
  removeStaleUnpacks,
  removeUnpacked,
  unpackImage,
  type UnpackedImage,
} from '../runtime/image.js';
import {
  checkRegistryHost,
  copyImage,
  formatRegistryRef,
  ociArch,
  parseRegistryRef,
  resolveImage,
  verifyLogin,
  type PullOptions,
} from '../runtime/registry.js';
import { KeyedMutex } from './mutex.js';
import type { EnvSecrets } from './options.js';

/** The part of the state store images need: the sandboxes (what is in use) and the logins. */
export type ImageStore = Pick<
  StateStore,
  'listSandboxes' | 'putRegistryCredential' | 'listRegistryCredentials' | 'deleteRegistryCredential'
>;

export interface ImageServiceOptions {
  store: ImageStore;
  /** Seals the passwords (the daemon's TenantSecrets). Without it no login can be stored. */
  secrets?: EnvSecrets;
  /** Unpacked images, blobs and pull layouts (`<data-dir>/images`). */
  cacheDir: string;
  /** The daemon's tmpfs staging: auth files live there for one skopeo run. */
  stagingDir: string;
  /** Registries that may be reached over plain HTTP besides loopback ones. */
  insecureRegistries?: readonly string[];
  /** Bound on one pull, all of its skopeo runs together. Default 10 min. */
  pullTimeoutMs?: number;
  /** Bound on the blobs of one image (declared sizes, and each file skopeo writes). Default 8 GiB. */
  maxPullBytes?: number;
  /** Architecture as image configs name it. Default: this node's. */
  arch?: string;
}

/** Where a credential's sealed value is bound (in place of a sandbox id; sandbox ids are `sb-…`). */
const CREDENTIAL_SCOPE = 'registry-credentials';
/** Crash leftovers (dot folders, pull layouts) older than this are collected. */
const STALE_MS = 60 * 60 * 1000;

export interface RegistryLogin {
  tenant: string;
  host: string;
  username: string;
  createdAt: number;
}

export interface CachedImageView {
  digest: string;
  unpackedAt: number;
  /** The sources of the sandboxes using it (references or layout folders). */
  refs: string[];
  sandboxes: number;
}

export interface PruneResult {
  images: string[];
  blobs: number;
}

/** A pulled or unpacked image, held against the collector until `release`. */
export interface HeldImage {
  image: UnpackedImage;
  /** The reference as recorded (`HOST/NAME:TAG`, `HOST/NAME@DIGEST`). */
  ref: string;
  /** True when the unpacked image was already in the cache (no layer was fetched). */
  cached: boolean;
  release: () => void;
}

/** Pulls share, the collector excludes: readers and one writer. */
class Gate {
  private readers = 0;
  private writer: Promise<void> | undefined;
  private drained: (() => void)[] = [];

  async read<T>(fn: () => Promise<T>): Promise<T> {
    while (this.writer) await this.writer;
    this.readers++;
    try {
      return await fn();
    } finally {
      if (--this.readers === 0) for (const d of this.drained.splice(0)) d();
    }
  }

  async write<T>(fn: () => Promise<T>): Promise<T> {
    while (this.writer) await this.writer;
    let done!: () => void;
    this.writer = new Promise<void>((r) => (done = r));
    try {
      while (this.readers > 0) await new Promise<void>((r) => this.drained.push(r));
      return await fn();
    } finally {
      this.writer = undefined;
      done();
    }
  }
}

export class ImageService {
  private readonly gate = new Gate();
  private readonly pins = new Map<string, number>();
  /** One copy and unpack per image at a time. */
  private readonly unpacking = new KeyedMutex();
  private timer: NodeJS.Timeout | undefined;
  readonly arch: string;

  constructor(private readonly o: ImageServiceOptions) {
    this.arch = o.arch ?? ociArch(nodeArch());
  }

  private registryDir(...parts: string[]): string {
    return join(this.o.cacheDir, 'registry', ...parts);
  }

  private pin(digest: string): () => void {
    this.pins.set(digest, (this.pins.get(digest) ?? 0) + 1);
    let released = false;
    return () => {
      if (released) return;
      released = true;
      const n = (this.pins.get(digest) ?? 1) - 1;
      if (n <= 0) this.pins.delete(digest);
      else this.pins.set(digest, n);
    };
  }

  /** A private folder in tmpfs staging for one skopeo step; removed by `fn`'s end. */
  private async withPrivateDir<T>(fn: (dir: string) => Promise<T>): Promise<T> {
    const dir = join(this.o.stagingDir, `registry-${randomBytes(8).toString('hex')}`);
    await mkdir(dir, { recursive: true, mode: 0o700 });
    await chmod(dir, 0o700);
    try {
      return await fn(dir);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  }

  // ---- credentials ----

  async login(tenant: string, hostText: string, username: string, password: string): Promise<RegistryLogin> {
    const host = checkRegistryHost(hostText);
    if (username === '' || username.length > 256 || username.includes(':') || /[\r\n]/.test(username))
      throw new DormantError(ErrorCode.INVALID_ARGUMENT, 'invalid username: 1 to 256 characters, no colon');
    if (password === '' || password.length > 4096 || /[\r\n]/.test(password))
      throw new DormantError(ErrorCode.INVALID_ARGUMENT, 'invalid password: 1 to 4096 characters, one line');
    const secrets = this.o.secrets;
    if (!secrets)
      throw new DormantError(
        ErrorCode.INTERNAL,
        'this daemon has no tenant keys to seal registry credentials with',
      );
    // Checked with the registry first: a typo is found now, not at the next create.
    await this.withPrivateDir((privateDir) =>
      verifyLogin(host, {
        privateDir,
        credentials: { username, password },
        insecureRegistries: this.o.insecureRegistries ?? [],
        deadline: Date.now() + Math.min(this.o.pullTimeoutMs ?? 600_000, 60_000),
      }),
    );
    const sealed = (await secrets.seal(tenant, CREDENTIAL_SCOPE, { [host]: password }))[host]!;
    const row = { tenant, host, username, sealed, createdAt: Date.now() };
    await this.o.store.putRegistryCredential(row);
    return { tenant, host, username, createdAt: row.createdAt };
  }

  async logout(tenant: string, hostText: string): Promise<void> {
    const host = checkRegistryHost(hostText);
    if (!(await this.o.store.deleteRegistryCredential(tenant, host)))
      throw new DormantError(ErrorCode.REGISTRY_CREDENTIALS_NOT_FOUND, `no login to ${host} for this tenant`);
  }

  /** The logins of a tenant (every tenant's when undefined): never a password. */
  async logins(tenant?: string): Promise<RegistryLogin[]> {
    return (await this.o.store.listRegistryCredentials(tenant)).map((r) => ({
      tenant: r.tenant,
      host: r.host,
      username: r.username,
      createdAt: r.createdAt,
    }));
  }

  private async credentials(tenant: string, host: string): Promise<PullOptions['credentials']> {
    const row = (await this.o.store.listRegistryCredentials(tenant)).find((r) => r.host === host);
    if (!row || !this.o.secrets) return undefined;
    const open = await this.o.secrets.open(tenant, CREDENTIAL_SCOPE, { [host]: row.sealed });
    return { username: row.username, password: open[host]! };
  }

  // ---- pulls ----

  /** An OCI layout folder's image, unpacked (or found in the cache) and held. */
  async unpackLayout(ref: string): Promise<HeldImage> {
    return this.gate.read(async () => {
      const image = await unpackImage(ref, this.o.cacheDir);
      return { image, ref, cached: false, release: this.pin(image.digest) };
    });
  }

  /**
   * Pulls `refText` for `tenant` with the tenant's credentials for that registry. The
   * registry is always asked for the manifest (it decides whether this tenant may have the
   * image, and where a tag points now); layers already in the cache are not fetched again.
   */
  async pull(tenant: string, refText: string): Promise<HeldImage> {
    const ref = parseRegistryRef(refText);
    const text = formatRegistryRef(ref);
    return this.gate.read(async () => {
      const credentials = await this.credentials(tenant, ref.host);
      const deadline = Date.now() + (this.o.pullTimeoutMs ?? 600_000);
      const base = {
        ...(credentials ? { credentials } : {}),
        insecureRegistries: this.o.insecureRegistries ?? [],
        arch: this.arch,
        deadline,
        maxBytes: this.o.maxPullBytes ?? 8 * 1024 ** 3,
      };
      const resolved = await this.withPrivateDir((privateDir) => resolveImage(ref, { ...base, privateDir }));
      return this.unpacking.run(resolved.digest, async () => {
        const hit = await this.cached(resolved.digest);
        if (hit) return { image: hit, ref: text, cached: true, release: this.pin(hit.digest) };
        const blobDir = this.registryDir(tenant, 'blobs');
        const layout = this.registryDir(tenant, 'pulls', randomBytes(8).toString('hex'));
        await mkdir(blobDir, { recursive: true, mode: 0o700 });
        await mkdir(layout, { recursive: true, mode: 0o700 });
        try {
          const tag = await this.withPrivateDir((privateDir) =>
            copyImage(resolved, { ...base, privateDir, layout, blobDir }),
          );
          const image = await unpackImage(`${layout}:${tag}`, this.o.cacheDir, {
            blobDir,
            arch: this.arch,
          }).catch((e: unknown) => {
            if (isDormantError(e) && /does not match its digest/.test(e.message))
              throw new DormantError(
                ErrorCode.IMAGE_DIGEST_MISMATCH,
                `${text}: a blob does not match its digest`,
              );
            throw e;
          });
          if (image.digest !== resolved.digest) await this.writeAlias(resolved.digest, image.digest);
          return { image, ref: text, cached: false, release: this.pin(image.digest) };
        } finally {
          await rm(layout, { recursive: true, force: true });
        }
      });
    });
  }

  private aliasFile(registryDigest: string): string {
    return this.registryDir('alias', registryDigest.replace(':', '-'));
  }

  private async writeAlias(registryDigest: string, localDigest: string): Promise<void> {
    await mkdir(this.registryDir('alias'), { recursive: true, mode: 0o700 });
    await writeFile(this.aliasFile(registryDigest), localDigest);
  }

  /** The unpacked image for a registry manifest digest, if the cache has it. */
  private async cached(registryDigest: string): Promise<UnpackedImage | undefined> {
    const direct = await readUnpacked(this.o.cacheDir, registryDigest);
    if (direct) return direct;
    const local = await readFile(this.aliasFile(registryDigest), 'utf8').catch(() => undefined);
    return local !== undefined ? readUnpacked(this.o.cacheDir, local.trim()) : undefined;
  }

  // ---- the cache and its collector ----

  private async inUse(): Promise<Map<string, Sandbox[]>> {
    const used = new Map<string, Sandbox[]>();
    // Every sandbox the store holds, in any state: a hibernated or archived one's checkpoint
    // is restored over the same lower layer.
    for (const s of await this.o.store.listSandboxes()) {
      if (s.spec.source.kind !== 'image') continue;
      const list = used.get(s.spec.source.digest) ?? [];
      list.push(s);
      used.set(s.spec.source.digest, list);
    }
    return used;
  }

  async list(): Promise<CachedImageView[]> {
    const used = await this.inUse();
    return (await listUnpacked(this.o.cacheDir)).map((c) => {
      const users = used.get(c.digest) ?? [];
      return {
        digest: c.digest,
        unpackedAt: c.unpackedAt,
        refs: [...new Set(users.map((s) => (s.spec.source.kind === 'image' ? s.spec.source.path : '')))],
        sandboxes: users.length,
      };
    });
  }

  /**
   * Removes unpacked images and downloaded blobs that no sandbox (in any state) uses and no
   * create in flight holds, and what crashes left.
   */
  async prune(): Promise<PruneResult> {
    return this.gate.write(async () => {
      // The pins before the sandboxes: no pin is taken during the write gate, and a create
      // records its sandbox before it lets go of its pin, so one or the other names its image.
      const pinned = [...this.pins.keys()];
      const keep = new Set([...(await this.inUse()).keys(), ...pinned]);
      const images: string[] = [];
      for (const c of await listUnpacked(this.o.cacheDir)) {
        if (keep.has(c.digest)) continue;
        await removeUnpacked(this.o.cacheDir, c.digest);
        images.push(c.digest);
      }
      await removeStaleUnpacks(this.o.cacheDir, STALE_MS);
      let blobs = 0;
      for (const tenant of await readdir(this.registryDir()).catch(() => [] as string[])) {
        if (tenant === 'alias') continue;
        const blobDir = this.registryDir(tenant, 'blobs');
        const wanted = new Set<string>();
        for (const d of keep) for (const b of await manifestBlobs(blobDir, d)) wanted.add(b);
        for (const hex of await readdir(join(blobDir, 'sha256')).catch(() => [] as string[])) {
          if (wanted.has(`sha256:${hex}`)) continue;
          await rm(join(blobDir, 'sha256', hex), { force: true });
          blobs++;
        }
        // No pull runs now (the gate): any pull layout left is a crash's.
        await rm(this.registryDir(tenant, 'pulls'), { recursive: true, force: true });
      }
      for (const a of await readdir(this.registryDir('alias')).catch(() => [] as string[])) {
        const local = await readFile(this.registryDir('alias', a), 'utf8').catch(() => '');
        if (!keep.has(local.trim())) await rm(this.registryDir('alias', a), { force: true });
      }
      return { images, blobs };
    });
  }

  /** Collects every `intervalMs` (0: never); failures go to `warn`. */
  start(intervalMs: number, warn: (m: string) => void): void {
    if (intervalMs <= 0) return;
    this.timer = setInterval(() => {
      this.prune().catch((e: unknown) => warn(`image collection failed: ${String(e)}`));
    }, intervalMs);
    this.timer.unref();
  }

  /** Stops the timer and waits for pulls in flight and a collection under way. */
  async close(): Promise<void> {
    if (this.timer) clearInterval(this.timer);
    await this.gate.write(async () => undefined);
  }
}
