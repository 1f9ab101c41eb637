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

function blobPath(layout: string, digest: string): string {
  const m = /^sha256:([0-9a-f]{64})$/.exec(digest);
  if (!m) throw bad(layout, `unsupported or malformed digest "${digest.slice(0, 80)}"`);
  return join(layout, 'blobs', 'sha256', m[1]!);
}

/** Reads a blob, checking its size and digest. Small JSON blobs only. */
async function readJsonBlob<T>(layout: string, d: Descriptor): Promise<T> {
  if (typeof d.size !== 'number' || d.size > MAX_JSON_BYTES)
    throw bad(layout, `blob ${d.digest} is too large for JSON`);
  let data: Buffer;
  try {
    data = await readFile(blobPath(layout, d.digest));
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

async function verifyBlob(layout: string, d: Descriptor): Promise<string> {
  const path = blobPath(layout, d.digest);
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
export async function unpackImage(ref: string, cacheDir: string): Promise<UnpackedImage> {
  const { layout, tag } = parseImageRef(ref);
  try {
    if (!(await stat(layout)).isDirectory()) throw bad(layout, 'is not a folder');
  } catch (e) {
    if (errnoCode(e) === 'ENOENT') throw bad(layout, 'does not exist');
    throw e;
  }
  const desc = await pickManifest(layout, tag);
  const manifest = await readJsonBlob<{ config?: Descriptor; layers?: Descriptor[] }>(layout, desc);
  if (!manifest.config || !Array.isArray(manifest.layers))
    throw bad(layout, `manifest ${desc.digest} has no config or layers`);
  const cfg = await readJsonBlob<{
    architecture?: string;
    config?: { Env?: string[]; Entrypoint?: string[] | null; Cmd?: string[] | null; WorkingDir?: string };
  }>(layout, manifest.config);
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
    return { digest: desc.digest, ...ids, rootfs, config };
  } catch (e) {
    if (errnoCode(e) !== 'ENOENT') throw e;
  }
  // Unpack beside the cache entry and rename it into place: a crash leaves no half image.
  await mkdir(cacheDir, { recursive: true, mode: 0o700 });
  const tmp = join(cacheDir, `.${key}.${process.pid}.${Date.now()}`);
  await mkdir(join(tmp, 'rootfs'), { recursive: true, mode: 0o755 });
  try {
    for (const layer of manifest.layers) {
      const path = await verifyBlob(layout, layer);
      await applyLayer(layout, join(tmp, 'rootfs'), layer, path);
    }
    await writeFile(join(tmp, 'complete'), `${desc.digest}\n`);
    await rm(target, { recursive: true, force: true });
    await rename(tmp, target);
  } catch (e) {
    await rm(tmp, { recursive: true, force: true });
    if (e instanceof DormantError && e.code !== ErrorCode.COMMAND_FAILED) throw e;
    throw bad(layout, `a layer could not be unpacked: ${e instanceof Error ? e.message : String(e)}`);
  }
  return { digest: desc.digest, ...ids, rootfs, config };
}
