/**
 * Writing checkpoints in the podman / CRI-O / kubelet archive layout: `checkpoint/` with
 * the CRIU images, `config.dump` and `spec.dump` (what checkpointctl and podman read for
 * the container's name, image, runtime and times), `stats-dump`, and any extra files
 * (rootfs-diff.tar, network.status), compressed with zstd, gzip or not at all.
 *
 * The archive is plaintext memory. `exportCheckpoint` scans first and refuses with
 * CHECKPOINT_HAS_SECRETS unless the caller allows plaintext.
 */
import { createReadStream, createWriteStream } from 'node:fs';
import { readdir, rename, rm, stat } from 'node:fs/promises';
import { basename, dirname, join } from 'node:path';
import { PassThrough, type Writable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { createGzip } from 'node:zlib';
import { CompressStream } from 'zstd-napi';
import { DormantError, ErrorCode } from '../domain/errors.js';
import type { Compression } from './archive.js';
import { clearRootMode, clearTcpCloseMark } from './narrow.js';
import { scanCheckpoint, type ScanReport } from './scan.js';
import type { OpenedCheckpoint } from './source.js';
import { TAR_END, tarHeader, tarPadding } from './tar.js';

export interface ArchiveMember {
  /** Name inside the archive. */
  name: string;
  /** A file to copy, or the bytes themselves. */
  file?: string;
  data?: Buffer;
}

async function writeMember(out: Writable, m: ArchiveMember): Promise<void> {
  const write = (b: Buffer): Promise<void> =>
    new Promise((resolve, reject) => {
      out.write(b, (e) => (e ? reject(e) : resolve()));
    });
  if (m.data !== undefined) {
    await write(tarHeader({ name: m.name, size: m.data.length, type: 'file', mode: 0o600 }));
    await write(m.data);
    await write(tarPadding(m.data.length));
    return;
  }
  const size = (await stat(m.file!)).size;
  await write(tarHeader({ name: m.name, size, type: 'file', mode: 0o600 }));
  let n = 0;
  for await (const chunk of createReadStream(m.file!, {
    highWaterMark: 1024 * 1024,
  }) as AsyncIterable<Buffer>) {
    n += chunk.length;
    if (n > size) throw new DormantError(ErrorCode.INTERNAL, `${m.file} grew while it was archived`);
    await write(chunk);
  }
  if (n !== size) throw new DormantError(ErrorCode.INTERNAL, `${m.file} shrank while it was archived`);
  await write(tarPadding(size));
}

/**
 * Writes a tar of `members` (folders first as given) to `outFile` atomically (temp file
 * in the same folder, then rename), compressed as asked.
 */
export async function writeArchive(
  outFile: string,
  members: ArchiveMember[],
  opts: { compression?: Compression; dirs?: string[] } = {},
): Promise<{ sizeBytes: number }> {
  const tmp = join(dirname(outFile), `.${basename(outFile)}.${process.pid}.tmp`);
  const tarStream = new PassThrough();
  const comp = opts.compression ?? 'zstd';
  const sink = createWriteStream(tmp, { mode: 0o600, flags: 'wx' });
  const done =
    comp === 'zstd'
      ? pipeline(tarStream, new CompressStream({ compressionLevel: 3 }), sink)
      : comp === 'gzip'
        ? pipeline(tarStream, createGzip({ level: 6 }), sink)
        : pipeline(tarStream, sink);
  try {
    for (const d of opts.dirs ?? []) tarStream.write(tarHeader({ name: `${d}/`, size: 0, type: 'dir' }));
    for (const m of members) await writeMember(tarStream, m);
    tarStream.end(TAR_END);
    await done;
    await rename(tmp, outFile);
  } catch (e) {
    tarStream.destroy();
    await done.catch(() => undefined);
    await rm(tmp, { force: true });
    throw e;
  }
  return { sizeBytes: (await stat(outFile)).size };
}

export interface PodmanMetadata {
  id: string;
  name: string;
  /** The base image's id (podman: the config digest's hex). */
  image?: string;
  /** The base image's name or tag. Default: `image`. */
  imageName?: string;
  runtime?: string;
  cwd?: string;
  memoryBytes?: number;
  /** Extra spec.dump annotations (dormant's own: ports, image manifest). */
  annotations?: Record<string, string>;
  createdAt?: string;
  checkpointedAt?: string;
  env?: string[];
  args?: string[];
  /**
   * The OCI config the engine restores with (runtime/oci.ts exportedOciConfig): its process
   * (user, capabilities, which podman's exec and inspect read), namespaces and mounts. Absent:
   * a spec of `env`, `args`, `cwd` and `memoryBytes` only.
   */
  oci?: Record<string, unknown>;
}

/** config.dump and spec.dump as podman writes them (the fields checkpointctl reads). */
export function podmanMetadata(m: PodmanMetadata): { config: Buffer; spec: Buffer } {
  const config = {
    id: m.id,
    name: m.name,
    rootfsImage: m.image ?? '',
    rootfsImageRef: m.image ?? '',
    rootfsImageName: m.imageName ?? m.image ?? '',
    // podman 4 restores only with both or neither of its name and id (its rootfsImageID).
    rootfsImageID: m.image ?? '',
    runtime: m.runtime ?? 'runc',
    createdTime: m.createdAt ?? new Date().toISOString(),
    checkpointedTime: m.checkpointedAt ?? new Date().toISOString(),
    restoredTime: '0001-01-01T00:00:00Z',
    restored: false,
    // The dump's network namespace is external (the sandbox joined one the runtime made): podman
    // must make one for CRIU to restore into (runc hands it over as extRootNetNS). Made by podman
    // with no network in it, as `--network none` would be if it made one: loopback only.
    createNetNS: true,
    networkMode: 'none',
  };
  const annotations = { ...m.annotations, 'io.container.manager': 'libpod', 'org.dormant.exported': 'true' };
  const spec =
    m.oci !== undefined
      ? { ...m.oci, annotations: { ...(m.oci.annotations as Record<string, string>), ...annotations } }
      : {
          ociVersion: '1.0.2',
          process: { env: m.env ?? [], args: m.args ?? [], cwd: m.cwd ?? '/' },
          root: { path: 'rootfs' },
          ...(m.memoryBytes !== undefined
            ? { linux: { resources: { memory: { limit: m.memoryBytes } } } }
            : {}),
          annotations,
        };
  return { config: Buffer.from(JSON.stringify(config)), spec: Buffer.from(JSON.stringify(spec)) };
}

/** Members for a podman-layout archive from a folder of CRIU images. */
export async function podmanMembers(
  imagesDir: string,
  meta: PodmanMetadata,
  extra: ArchiveMember[] = [],
): Promise<ArchiveMember[]> {
  const { config, spec } = podmanMetadata(meta);
  const out: ArchiveMember[] = [
    { name: 'config.dump', data: config },
    { name: 'spec.dump', data: spec },
  ];
  const names = (await readdir(imagesDir, { withFileTypes: true }))
    .filter((d) => d.isFile())
    .map((d) => d.name);
  for (const n of names.sort()) {
    // podman keeps stats-dump at the top; the images go under checkpoint/.
    // A dormant checkpoint keeps its filesystem diff with the images; podman's is at the top.
    if (n === 'rootfs-diff.tar') {
      if (!extra.some((m) => m.name === n)) out.push({ name: n, file: join(imagesDir, n) });
    } else if (n === 'stats-dump') out.push({ name: n, file: join(imagesDir, n) });
    else out.push({ name: `checkpoint/${n}`, file: join(imagesDir, n) });
  }
  return [...out, ...extra];
}

export interface ExportOptions {
  out: string;
  format: 'podman';
  compression?: Compression;
  /** Export even when the scan finds secrets. */
  allowPlaintext?: boolean;
  /**
   * The caller encrypts the archive before it reaches a disk (an encrypted OCI layer): export
   * even when the scan finds secrets (they are still reported).
   */
  encrypted?: boolean;
  meta: PodmanMetadata;
  /** Members beyond the images (rootfs-diff.tar, deleted.files), replacing the checkpoint's own. */
  extra?: ArchiveMember[];
  signal?: AbortSignal;
}

/**
 * Exports an opened checkpoint as a podman archive, after scanning it. Throws
 * CHECKPOINT_HAS_SECRETS (with the findings' kinds and places, never the secrets) unless
 * `allowPlaintext` or `encrypted`.
 */
export async function exportCheckpoint(
  ck: OpenedCheckpoint,
  opts: ExportOptions,
): Promise<{ out: string; sizeBytes: number; scan: ScanReport }> {
  const scan = await scanCheckpoint(ck, { signal: opts.signal });
  if (scan.findings.length > 0 && opts.allowPlaintext !== true && opts.encrypted !== true) {
    const kinds = [...new Set(scan.findings.map((f) => f.kind))].join(', ');
    throw new DormantError(
      ErrorCode.CHECKPOINT_HAS_SECRETS,
      `checkpoint ${ck.ref} holds ${scan.findings.length} secret(s) (${kinds}); refusing to write it out in plaintext`,
      {
        hint: '`dormant checkpoint scan` lists them; export with --format oci --encrypt --recipient jwe:PUB.pem, or pass --allow-plaintext to export anyway',
        details: { findings: scan.findings.map((f) => ({ kind: f.kind, where: f.where, path: f.path })) },
      },
    );
  }
  const extra: ArchiveMember[] = [...(opts.extra ?? [])];
  const given = new Set(extra.map((m) => m.name));
  if (ck.rootDir) {
    for (const n of ['rootfs-diff.tar', 'network.status', 'deleted.files']) {
      if (given.has(n)) continue;
      const p = join(ck.rootDir, n);
      if (
        await stat(p).then(
          (s) => s.isFile(),
          () => false,
        )
      )
        extra.push({ name: n, file: p });
    }
  }
  // podman 4 restores with no --tcp-close, and over a root folder of its own mode. Only on a
  // copy of the images: a folder is the user's.
  if (ck.kind !== 'folder') {
    await clearTcpCloseMark(ck.imagesDir);
    await clearRootMode(ck.imagesDir);
  }
  const members = await podmanMembers(ck.imagesDir, opts.meta, extra);
  const { sizeBytes } = await writeArchive(opts.out, members, {
    compression: opts.compression ?? 'zstd',
    dirs: ['checkpoint'],
  });
  return { out: opts.out, sizeBytes, scan };
}
