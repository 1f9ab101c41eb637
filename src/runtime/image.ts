/**
 * Root filesystems from OCI image layout folders (what `skopeo copy ... oci:DIR`, `umoci` or
 * `podman save --format oci-dir` write): index.json -> manifest -> config and layers. Layers
 * are unpacked once, in order, into a cache keyed by the manifest digest, and that folder is
 * the read-only lower layer of every sandbox made from the image.
 *
 * Every blob is verified against its sha256 digest before it is used, so a tampered layout is
 * refused. Layer whiteouts (`.wh.NAME`, `.wh..wh..opq`) are applied before the layer's own
 * files are extracted. GNU tar refuses member names with `..` and never follows a symlink it
 * has just created out of the target folder. Decompression happens in tar's own process (and
 * zstd's, which refuses windows over 128 MiB by default); the daemon reads the listing line by
 * line, so its memory does not grow with a layer's size or number of files.
 */
import { createHash } from 'node:crypto';
import { createReadStream } from 'node:fs';
import { mkdir, readFile, readdir, rename, rm, stat, writeFile } from 'node:fs/promises';
import { join, normalize } from 'node:path';
import { StringDecoder } from 'node:string_decoder';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';
import { run } from '../sys/exec.js';
import { exists } from '../sys/fs.js';

export interface ImageConfig {
  /** Entrypoint followed by Cmd: the command when the user gives none. */
  command: string[];
  env: Record<string, string>;
  workingDir?: string;
}

export interface UnpackedImage {
  /** sha256:... of the manifest: the image's identity. */
  digest: string;
  /** sha256:... of the image config: what podman and CRI-O call the image id. */
  configDigest: string;
  /** The manifest's `org.opencontainers.image.ref.name` annotation (its tag), if any. */
  refName?: string;
  rootfs: string;
  config: ImageConfig;
}

interface Descriptor {
  mediaType?: string;
  digest: string;
  size: number;
  annotations?: Record<string, string>;
}

const REF_NAME = 'org.opencontainers.image.ref.name';
/** The unpacked image's identity and defaults, beside its rootfs. */
const IMAGE_META = 'image.json';
const MAX_JSON_BYTES = 4 * 1024 * 1024;
/** Whiteouts kept from a layer's listing while it streams (each is a name in memory). */
const MAX_WHITEOUTS = 100_000;
/** A listed name longer than this is not a file name (Linux's PATH_MAX is 4096 bytes). */
const MAX_LISTED_NAME_CHARS = 64 * 1024;

function bad(layout: string, why: string): DormantError {
  return new DormantError('IMAGE_INVALID', `OCI image layout ${layout}: ${why}`, {
    status: 400,
    hint: 'pass a folder made by `skopeo copy docker://IMAGE oci:DIR:TAG` or `umoci`',
  });
}

/**
 * `blobs` is where a layout's blobs are: its own `blobs/` folder, or a blob folder shared
 * between layouts (skopeo's `--dest-shared-blob-dir`, as registry pulls use).
 */
function blobPath(layout: string, blobs: string, digest: string): string {
  const m = /^sha256:([0-9a-f]{64})$/.exec(digest);
  if (!m) throw bad(layout, `unsupported or malformed digest "${digest.slice(0, 80)}"`);
  return join(blobs, 'sha256', m[1]!);
}

/** Reads a blob, checking its size and digest. Small JSON blobs only. */
async function readJsonBlob<T>(layout: string, blobs: string, d: Descriptor): Promise<T> {
  if (typeof d.size !== 'number' || d.size > MAX_JSON_BYTES)
    throw bad(layout, `blob ${d.digest} is too large for JSON`);
  let data: Buffer;
  try {
    data = await readFile(blobPath(layout, blobs, d.digest));
  } catch (e) {
    if (errnoCode(e) === 'ENOENT') throw bad(layout, `blob ${d.digest} is missing`);
    throw e;
  }
  const got = `sha256:${createHash('sha256').update(data).digest('hex')}`;
  if (got !== d.digest || data.length !== d.size)
    throw bad(layout, `blob ${d.digest} does not match its digest or size`);
  try {
    return JSON.parse(data.toString('utf8')) as T;
  } catch {
    throw bad(layout, `blob ${d.digest} is not JSON`);
  }
}

async function verifyBlob(layout: string, blobs: string, d: Descriptor): Promise<string> {
  const path = blobPath(layout, blobs, d.digest);
  const hash = createHash('sha256');
  let size = 0;
  try {
    for await (const chunk of createReadStream(path)) {
      hash.update(chunk as Buffer);
      size += (chunk as Buffer).length;
    }
  } catch (e) {
    if (errnoCode(e) === 'ENOENT') throw bad(layout, `layer ${d.digest} is missing`);
    throw e;
  }
  if (`sha256:${hash.digest('hex')}` !== d.digest || size !== d.size)
    throw bad(layout, `layer ${d.digest} does not match its digest or size`);
  return path;
}

/** Splits `DIR[:TAG]`; a colon inside the folder path is kept when no such tag form fits. */
export function parseImageRef(ref: string): { layout: string; tag?: string } {
  const m = /^(.*?):([A-Za-z0-9_][A-Za-z0-9._-]{0,127})$/.exec(ref);
  return m && !m[2]!.includes('/') ? { layout: m[1]!, tag: m[2]! } : { layout: ref };
}

async function pickManifest(layout: string, tag: string | undefined): Promise<Descriptor> {
  let index: { manifests?: Descriptor[] };
  try {
    const file = join(layout, 'index.json');
    if ((await stat(file)).size > MAX_JSON_BYTES)
      throw bad(layout, `index.json is over ${MAX_JSON_BYTES} bytes`);
    index = JSON.parse(await readFile(file, 'utf8')) as { manifests?: Descriptor[] };
  } catch (e) {
    if (e instanceof DormantError) throw e;
    if (errnoCode(e) === 'ENOENT') throw bad(layout, 'no index.json (is this an OCI image layout?)');
    throw bad(layout, `index.json is unreadable: ${String(e)}`);
  }
  const manifests = (index.manifests ?? []).filter(
    (m) => m.mediaType === undefined || m.mediaType.includes('manifest'),
  );
  if (tag !== undefined) {
    const hit = manifests.find((m) => m.annotations?.[REF_NAME] === tag);
    if (!hit) {
      const tags = manifests.map((m) => m.annotations?.[REF_NAME]).filter(Boolean);
      throw bad(layout, `no image tagged "${tag}" (tags: ${tags.join(', ') || 'none'})`);
    }
    return hit;
  }
  if (manifests.length !== 1) throw bad(layout, `holds ${manifests.length} images; name one with DIR:TAG`);
  return manifests[0]!;
}

function splitEnv(list: string[] | undefined): Record<string, string> {
  const env: Record<string, string> = {};
  for (const kv of list ?? []) {
    const i = kv.indexOf('=');
    if (i > 0) env[kv.slice(0, i)] = kv.slice(i + 1);
  }
  return env;
}

/** Applies one layer's whiteouts to what the layers below left, then extracts its files. */
async function applyLayer(layout: string, rootfs: string, layer: Descriptor, path: string): Promise<void> {
  const mt = layer.mediaType ?? '';
  const decompress =
    mt.endsWith('+gzip') || mt.endsWith('.gzip') ? ['--gzip'] : mt.endsWith('+zstd') ? ['--zstd'] : [];
  // The listing is read line by line as tar prints it, keeping only the whiteouts: a layer of
  // a million files costs the daemon no more memory than one of ten (and none is dropped, as
  // keeping only the tail of a capped output would).
  const whiteouts: string[] = [];
  let problem: string | undefined;
  const stop = new AbortController();
  const decoder = new StringDecoder('utf8');
  let partial = '';
  const onLine = (raw: string): void => {
    if (raw === '' || problem !== undefined) return;
    const name = normalize(raw.replace(/^\/+/, ''));
    if (name.startsWith('..'))
      problem = `layer ${layer.digest} has a member outside the root: ${raw.slice(0, 200)}`;
    else if ((name.split('/').pop() ?? '').startsWith('.wh.')) {
      whiteouts.push(name);
      if (whiteouts.length > MAX_WHITEOUTS)
        problem = `layer ${layer.digest} has more than ${MAX_WHITEOUTS} whiteouts`;
    }
    if (problem !== undefined) stop.abort();
  };
  const onText = (text: string): void => {
    const lines = (partial + text).split('\n');
    partial = lines.pop() ?? '';
    for (const l of lines) onLine(l);
    if (partial.length > MAX_LISTED_NAME_CHARS && problem === undefined) {
      problem = `layer ${layer.digest} has a member name over ${MAX_LISTED_NAME_CHARS} characters`;
      stop.abort();
    }
  };
  try {
    await run('tar', [...decompress, '-tf', path], {
      timeoutMs: 600_000,
      maxOutputBytes: 64 * 1024,
      signal: stop.signal,
      onStdout: (b) => onText(decoder.write(b)),
    });
  } catch (e) {
    if (problem === undefined) throw e;
  }
  onText(decoder.end());
  onLine(partial);
  if (problem !== undefined) throw bad(layout, problem);
  for (const name of whiteouts) {
    const base = name.split('/').pop() ?? '';
    const dir = name.includes('/') ? name.slice(0, name.lastIndexOf('/')) : '';
    if (base === '.wh..wh..opq') {
      // Opaque directory: nothing of the lower layers shows through.
      const target = join(rootfs, dir);
      for (const entry of await readdir(target).catch(() => [] as string[]))
        await rm(join(target, entry), { recursive: true, force: true });
    } else {
      await rm(join(rootfs, dir, base.slice(4)), { recursive: true, force: true });
    }
  }
  await run(
    'tar',
    [...decompress, '-xf', path, '-C', rootfs, '--numeric-owner', '--exclude=.wh.*', '--exclude=*/.wh.*'],
    {
      timeoutMs: 600_000,
    },
  );
}

/**
 * Unpacks the image (once; later calls reuse the cache) and returns its rootfs folder and
 * defaults. `cacheDir` holds one folder per manifest digest.
 */
export async function unpackImage(
  ref: string,
  cacheDir: string,
  opts: {
    /** The layout's blobs are in this shared folder (skopeo's --dest-shared-blob-dir). */
    blobDir?: string;
    /** Refuse an image whose config names another architecture (amd64, arm64). */
    arch?: string;
  } = {},
): Promise<UnpackedImage> {
  const { layout, tag } = parseImageRef(ref);
  const { arch } = opts;
  const blobs = opts.blobDir ?? join(layout, 'blobs');
  try {
    if (!(await stat(layout)).isDirectory()) throw bad(layout, 'is not a folder');
  } catch (e) {
    if (errnoCode(e) === 'ENOENT') throw bad(layout, 'does not exist');
    throw e;
  }
  const desc = await pickManifest(layout, tag);
  const manifest = await readJsonBlob<{ config?: Descriptor; layers?: Descriptor[] }>(layout, blobs, desc);
  if (!manifest.config || !Array.isArray(manifest.layers))
    throw bad(layout, `manifest ${desc.digest} has no config or layers`);
  const cfg = await readJsonBlob<{
    architecture?: string;
    config?: { Env?: string[]; Entrypoint?: string[] | null; Cmd?: string[] | null; WorkingDir?: string };
  }>(layout, blobs, manifest.config);
  if (arch !== undefined && cfg.architecture !== arch)
    throw new DormantError(
      ErrorCode.IMAGE_ARCH_MISMATCH,
      `image ${desc.digest} is built for ${cfg.architecture ?? 'no architecture'}; this node is ${arch}`,
    );
  const config: ImageConfig = {
    command: [...(cfg.config?.Entrypoint ?? []), ...(cfg.config?.Cmd ?? [])],
    env: splitEnv(cfg.config?.Env),
    ...(cfg.config?.WorkingDir ? { workingDir: cfg.config.WorkingDir } : {}),
  };
  const ids = {
    configDigest: manifest.config.digest,
    ...(desc.annotations?.[REF_NAME] !== undefined ? { refName: desc.annotations[REF_NAME] } : {}),
  };
  const key = desc.digest.replace(':', '-');
  const target = join(cacheDir, key);
  const rootfs = join(target, 'rootfs');
  try {
    await stat(join(target, 'complete'));
    const hit: UnpackedImage = { digest: desc.digest, ...ids, rootfs, config };
    // An entry unpacked before image.json existed gets it now (a registry cache hit reads it).
    if (!(await exists(join(target, IMAGE_META))))
      await writeFile(join(target, IMAGE_META), JSON.stringify(hit));
    return hit;
  } catch (e) {
    if (errnoCode(e) !== 'ENOENT') throw e;
  }
  // Unpack beside the cache entry and rename it into place: a crash leaves no half image.
  await mkdir(cacheDir, { recursive: true, mode: 0o700 });
  const tmp = join(cacheDir, `.${key}.${process.pid}.${Date.now()}`);
  await mkdir(join(tmp, 'rootfs'), { recursive: true, mode: 0o755 });
  try {
    for (const layer of manifest.layers) {
      const path = await verifyBlob(layout, blobs, layer);
      await applyLayer(layout, join(tmp, 'rootfs'), layer, path);
    }
    // What a later create needs without the layout (a registry pull's cache hit reads it).
    const meta: UnpackedImage = { digest: desc.digest, ...ids, rootfs, config };
    await writeFile(join(tmp, IMAGE_META), JSON.stringify(meta));
    await writeFile(join(tmp, 'complete'), `${desc.digest}\n`);
    if (await exists(join(target, 'complete'))) {
      // Another unpack of the same image finished first: its copy may already be a sandbox's
      // lower layer, so it stays and this one goes.
      await rm(tmp, { recursive: true, force: true });
      return meta;
    }
    await rm(target, { recursive: true, force: true });
    await rename(tmp, target);
  } catch (e) {
    await rm(tmp, { recursive: true, force: true });
    if (e instanceof DormantError && e.code !== ErrorCode.COMMAND_FAILED) throw e;
    throw bad(layout, `a layer could not be unpacked: ${e instanceof Error ? e.message : String(e)}`);
  }
  return { digest: desc.digest, ...ids, rootfs, config };
}

// ---- the cache: what is there, and removing what no sandbox uses ----

/** The unpacked image of `digest` when the cache holds it complete (with its defaults), else undefined. */
export async function readUnpacked(cacheDir: string, digest: string): Promise<UnpackedImage | undefined> {
  const m = /^sha256:([0-9a-f]{64})$/.exec(digest);
  if (!m) return undefined;
  const dir = join(cacheDir, `sha256-${m[1]!}`);
  if (!(await exists(join(dir, 'complete')))) return undefined;
  try {
    const meta = JSON.parse(await readFile(join(dir, IMAGE_META), 'utf8')) as UnpackedImage;
    if (meta.digest !== digest) return undefined;
    return { ...meta, rootfs: join(dir, 'rootfs') };
  } catch {
    // Unpacked by an older version (no image.json): the caller unpacks it from its layout.
    return undefined;
  }
}

const ENTRY_RE = /^sha256-([0-9a-f]{64})$/;

/** One unpacked image in the cache. */
export interface CachedImage {
  /** sha256:... of its manifest. */
  digest: string;
  path: string;
  /** When it was unpacked (ms). */
  unpackedAt: number;
}

/** The unpacked images in `cacheDir` (complete ones only). */
export async function listUnpacked(cacheDir: string): Promise<CachedImage[]> {
  const out: CachedImage[] = [];
  for (const name of await readdir(cacheDir).catch(() => [] as string[])) {
    const m = ENTRY_RE.exec(name);
    if (!m) continue;
    const path = join(cacheDir, name);
    const done = await stat(join(path, 'complete')).catch(() => undefined);
    if (done) out.push({ digest: `sha256:${m[1]!}`, path, unpackedAt: done.mtimeMs });
  }
  return out;
}

/**
 * Removes an unpacked image: renamed aside first (one step), so no create finds half of it,
 * then deleted. Unpacks a crash left behind (dot folders over an hour old) go too.
 */
export async function removeUnpacked(cacheDir: string, digest: string): Promise<void> {
  const m = /^sha256:([0-9a-f]{64})$/.exec(digest);
  if (!m) return;
  const aside = join(cacheDir, `.rm-${m[1]!}.${process.pid}.${Date.now()}`);
  try {
    await rename(join(cacheDir, `sha256-${m[1]!}`), aside);
  } catch (e) {
    if (errnoCode(e) === 'ENOENT') return;
    throw e;
  }
  await rm(aside, { recursive: true, force: true });
}

/** Dot folders (unpacks or removals a crash interrupted) older than `olderThanMs`. */
export async function removeStaleUnpacks(cacheDir: string, olderThanMs: number): Promise<void> {
  for (const name of await readdir(cacheDir).catch(() => [] as string[])) {
    if (!/^\.(sha256-|rm-)/.test(name)) continue;
    const st = await stat(join(cacheDir, name)).catch(() => undefined);
    if (st && Date.now() - st.mtimeMs > olderThanMs)
      await rm(join(cacheDir, name), { recursive: true, force: true });
  }
}

/**
 * The blobs a manifest in a shared blob folder names (itself, its config, its layers), or an
 * empty list when the manifest is not there or unreadable.
 */
export async function manifestBlobs(blobDir: string, manifestDigest: string): Promise<string[]> {
  const m = /^sha256:([0-9a-f]{64})$/.exec(manifestDigest);
  if (!m) return [];
  try {
    const file = join(blobDir, 'sha256', m[1]!);
    if ((await stat(file)).size > MAX_JSON_BYTES) return [manifestDigest];
    const doc = JSON.parse(await readFile(file, 'utf8')) as { config?: Descriptor; layers?: Descriptor[] };
    return [manifestDigest, ...[doc.config, ...(doc.layers ?? [])].flatMap((d) => (d ? [d.digest] : []))];
  } catch {
    return [];
  }
}
