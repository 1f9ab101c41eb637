/**
 * A checkpoint as an OCI image layout (what `checkpointctl build` makes with buildah): one
 * uncompressed layer that is the podman / CRI-O checkpoint archive itself (its members land at
 * the image's root), and the manifest annotation CRI-O looks for to treat an image as a
 * checkpoint, `io.kubernetes.cri-o.annotations.checkpoint.name` (the container's name).
 *
 * podman (4.x, `podman container restore IMAGE`) takes an image for a checkpoint only when its
 * manifest carries `io.podman.annotations.checkpoint.runtime.name`, and only when that is the
 * runtime podman itself runs; it then mounts the image and reads config.dump, spec.dump and
 * checkpoint/ from its root, as from an archive. The podman annotations here come from the
 * archive's own config.dump (name, runtime, base image), so the two never disagree.
 *
 * Written into a new folder, blobs by their sha256, index.json last: a reader never sees a
 * layout whose index names a blob that is not there yet.
 */
import { createHash } from 'node:crypto';
import { createReadStream } from 'node:fs';
import { copyFile, mkdir, readdir, rename, rm, writeFile } from 'node:fs/promises';
import { arch } from 'node:os';
import { join } from 'node:path';
import type { KeyObject } from 'node:crypto';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';
import { MAX_METADATA_MEMBER_BYTES, tooLarge } from './archive.js';
import { encryptLayer } from './encrypt.js';
import { TarParser } from './tar.js';

/** The annotation CRI-O reads to restore a container from a checkpoint image. */
export const CRIO_CHECKPOINT_NAME = 'io.kubernetes.cri-o.annotations.checkpoint.name';
/** podman's checkpoint image annotations (libpod's define package names them). */
export const PODMAN_CHECKPOINT = 'io.podman.annotations.checkpoint';
const REF_NAME = 'org.opencontainers.image.ref.name';
const OCI_ARCH: Record<string, string> = { x64: 'amd64', arm64: 'arm64', ppc64: 'ppc64le', s390x: 's390x' };

async function sha256File(path: string): Promise<{ digest: string; size: number }> {
  const h = createHash('sha256');
  let size = 0;
  for await (const chunk of createReadStream(path, { highWaterMark: 1024 * 1024 }) as AsyncIterable<Buffer>) {
    h.update(chunk);
    size += chunk.length;
  }
  return { digest: `sha256:${h.digest('hex')}`, size };
}

async function putJson(blobs: string, value: unknown): Promise<{ digest: string; size: number }> {
  const data = Buffer.from(JSON.stringify(value));
  const hex = createHash('sha256').update(data).digest('hex');
  await writeFile(join(blobs, hex), data, { mode: 0o600 });
  return { digest: `sha256:${hex}`, size: data.length };
}

/**
 * config.dump of an uncompressed podman-layout archive, read from the archive's start (dormant
 * writes it first) and no further than it; undefined when the archive has none.
 */
async function readConfigDump(archiveTar: string): Promise<Record<string, unknown> | undefined> {
  const chunks: Buffer[] = [];
  let size = 0;
  let found = false;
  let done = false;
  const parser = new TarParser({
    entry(h) {
      if (h.type !== 'file' || h.name.replace(/^\.\//, '') !== 'config.dump') return undefined;
      if (h.size > MAX_METADATA_MEMBER_BYTES) throw tooLarge('config.dump');
      found = true;
      return (c) => {
        chunks.push(c);
        size += c.length;
      };
    },
    entryEnd() {
      if (found) done = true;
    },
  });
  const stream = createReadStream(archiveTar, { highWaterMark: 64 * 1024 });
  try {
    for await (const chunk of stream as AsyncIterable<Buffer>) {
      parser.push(chunk);
      if (done) break;
    }
  } finally {
    stream.destroy();
  }
  if (!done) return undefined;
  try {
    const v: unknown = JSON.parse(Buffer.concat(chunks, size).toString('utf8'));
    return typeof v === 'object' && v !== null ? (v as Record<string, unknown>) : undefined;
  } catch (e) {
    throw new DormantError(ErrorCode.CHECKPOINT_ARCHIVE_INVALID, 'config.dump in the archive is not JSON', {
      cause: e,
      hint: 'the archive is written by `dormant checkpoint export`; export the checkpoint again',
    });
  }
}

/**
 * The manifest annotations podman reads from a checkpoint image. Only the runtime's name decides
 * anything (podman's restore refuses an image without it, or made for another runtime); the
 * rest is what `podman container checkpoint --create-image` records, where config.dump has it.
 */
function podmanAnnotations(
  config: Record<string, unknown> | undefined,
  name: string,
): Record<string, string> {
  const str = (k: string) => (typeof config?.[k] === 'string' ? config[k] : '');
  const out: Record<string, string> = {
    [`${PODMAN_CHECKPOINT}.name`]: str('name') || name,
    // dormant dumps through runc; config.dump says so, and an older archive without it meant runc.
    [`${PODMAN_CHECKPOINT}.runtime.name`]: str('runtime') || 'runc',
    [`${PODMAN_CHECKPOINT}.host.arch`]: OCI_ARCH[arch()] ?? arch(),
  };
  if (str('rootfsImageID') !== '') out[`${PODMAN_CHECKPOINT}.rootfsImageID`] = str('rootfsImageID');
  if (str('rootfsImageName') !== '') {
    out[`${PODMAN_CHECKPOINT}.rootfsImageName`] = str('rootfsImageName');
    out[`${PODMAN_CHECKPOINT}.rawImageName`] = str('rootfsImageName');
  }
  return out;
}

export interface OciCheckpointOptions {
  /** The container name recorded for CRI-O (the checkpoint.name annotation). */
  containerName: string;
  /** The tag in index.json. Default `latest`. */
  tag?: string;
  /** More manifest annotations (where the checkpoint came from). */
  annotations?: Record<string, string>;
  created?: string;
  /**
   * Encrypt the layer for these RSA public keys (ocicrypt's AES_256_CTR_HMAC_SHA256 with a JWE
   * key annotation; see encrypt.ts). The plain archive is read once and never copied.
   */
  encryptFor?: KeyObject[];
}

/**
 * Writes `outDir` (which must not exist, or be empty) as an OCI image layout whose one layer is
 * `archiveTar`, an uncompressed podman-layout checkpoint archive. Returns the manifest digest.
 */
export async function writeOciCheckpointImage(
  archiveTar: string,
  outDir: string,
  opts: OciCheckpointOptions,
): Promise<{ manifestDigest: string; layerDigest: string }> {
  try {
    if ((await readdir(outDir)).length > 0)
      throw new DormantError(ErrorCode.INVALID_ARGUMENT, `--out ${outDir} is not empty`, {
        hint: 'an OCI layout is written into a new or empty folder',
      });
  } catch (e) {
    if (errnoCode(e) !== 'ENOENT') throw e;
  }
  const blobs = join(outDir, 'blobs', 'sha256');
  await mkdir(blobs, { recursive: true, mode: 0o700 });
  let layer: { digest: string; size: number };
  let diffId: string;
  let layerDesc: Record<string, unknown>;
  if (opts.encryptFor !== undefined) {
    const tmp = join(blobs, `.layer.${process.pid}.tmp`);
    try {
      const enc = await encryptLayer(archiveTar, tmp, opts.encryptFor);
      layer = { digest: enc.digest, size: enc.size };
      await rename(tmp, join(blobs, enc.digest.slice(7)));
      diffId = enc.plainDigest;
      layerDesc = {
        mediaType: 'application/vnd.oci.image.layer.v1.tar+encrypted',
        ...layer,
        annotations: enc.annotations,
      };
    } catch (e) {
      await rm(tmp, { force: true });
      throw e;
    }
  } else {
    layer = await sha256File(archiveTar);
    await copyFile(archiveTar, join(blobs, layer.digest.slice(7)));
    diffId = layer.digest;
    layerDesc = { mediaType: 'application/vnd.oci.image.layer.v1.tar', ...layer };
  }
  const created = opts.created ?? new Date().toISOString();
  const config = await putJson(blobs, {
    created,
    architecture: OCI_ARCH[arch()] ?? arch(),
    os: 'linux',
    config: {},
    rootfs: { type: 'layers', diff_ids: [diffId] },
    history: [
      { created, created_by: `dormant checkpoint export --format oci${opts.encryptFor ? ' --encrypt' : ''}` },
    ],
  });
  const annotations = {
    ...opts.annotations,
    ...podmanAnnotations(await readConfigDump(archiveTar), opts.containerName),
    [CRIO_CHECKPOINT_NAME]: opts.containerName,
  };
  const manifest = await putJson(blobs, {
    schemaVersion: 2,
    mediaType: 'application/vnd.oci.image.manifest.v1+json',
    config: { mediaType: 'application/vnd.oci.image.config.v1+json', ...config },
    layers: [layerDesc],
    annotations,
  });
  await writeFile(join(outDir, 'oci-layout'), '{"imageLayoutVersion":"1.0.0"}', { mode: 0o600 });
  const index = {
    schemaVersion: 2,
    mediaType: 'application/vnd.oci.image.index.v1+json',
    manifests: [
      {
        mediaType: 'application/vnd.oci.image.manifest.v1+json',
        ...manifest,
        annotations: { [REF_NAME]: opts.tag ?? 'latest', ...annotations },
      },
    ],
  };
  // index.json last, by rename: it names only blobs that are already there.
  const tmp = join(outDir, `.index.json.${process.pid}.tmp`);
  try {
    await writeFile(tmp, JSON.stringify(index), { mode: 0o600 });
    await rename(tmp, join(outDir, 'index.json'));
  } catch (e) {
    await rm(tmp, { force: true });
    throw e;
  }
  return { manifestDigest: manifest.digest, layerDigest: layer.digest };
}
