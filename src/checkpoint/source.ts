/**
 * Opens what a user calls a checkpoint (REF) as a folder of CRIU images plus whatever
 * metadata came with it:
 * - a folder of CRIU images, or an unpacked podman/CRI-O archive (with checkpoint/ inside);
 * - a podman/CRI-O/kubelet archive (.tar, .tar.gz, .tar.zst), unpacked into a private
 *   memory-backed staging folder (never persistent disk) that `close()` wipes;
 * - a dormant checkpoint, restored from the vault into such a staging folder.
 */
import { mkdtemp, readFile, rm, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';
import { extractArchive, type ArchiveLimits, type Compression } from './archive.js';

/** Where plaintext images may be staged: memory-backed. */
export const DEFAULT_STAGING_DIR = '/dev/shm';

export interface OpenedCheckpoint {
  kind: 'folder' | 'archive' | 'dormant';
  ref: string;
  /** The folder of CRIU images. */
  imagesDir: string;
  /** The archive layout's root (config.dump, spec.dump, rootfs-diff.tar), when there is one. */
  rootDir?: string;
  compression?: Compression;
  /** Size of the archive file, or of the unpacked images. */
  sizeBytes: number;
  /** Metadata the vault keeps with a dormant checkpoint (arch, kernel, ...). */
  dormantMeta?: Record<string, string>;
  dormant?: { tenant: string; checkpointId: string; sandboxId?: string; createdAt?: string };
  /**
   * Pages files (by name, as in the images folder) left in place in an uncompressed archive
   * (openCheckpointPath's `pagesInPlace`): the archive and where each one's bytes lie in it.
   */
  pagesInPlace?: { archive: string; members: Map<string, { offset: number; size: number }> };
  /** Wipes any staging folder. Safe to call twice. */
  close(): Promise<void>;
}

async function isDir(p: string): Promise<boolean> {
  try {
    return (await stat(p)).isDirectory();
  } catch (e) {
    if (errnoCode(e) === 'ENOENT' || errnoCode(e) === 'ENOTDIR') return false;
    throw e;
  }
}

async function exists(p: string): Promise<boolean> {
  try {
    await stat(p);
    return true;
  } catch (e) {
    if (errnoCode(e) === 'ENOENT' || errnoCode(e) === 'ENOTDIR') return false;
    throw e;
  }
}

/** Makes a private (0700) staging folder under `base` for plaintext images. */
export async function makeStagingDir(base = DEFAULT_STAGING_DIR, prefix = 'dormant-ck-'): Promise<string> {
  return mkdtemp(join(base, prefix));
}

/** {@link makeStagingDir}, with a close that removes it (once, however often it is called). */
async function ownStaging(base?: string): Promise<{ staging: string; close: () => Promise<void> }> {
  const staging = await makeStagingDir(base);
  let closed = false;
  const close = async (): Promise<void> => {
    if (closed) return;
    closed = true;
    await rm(staging, { recursive: true, force: true });
  };
  return { staging, close };
}

function layoutOf(dir: string): Promise<{ imagesDir: string; rootDir?: string }> {
  return (async () => {
    if (await isDir(join(dir, 'checkpoint'))) return { imagesDir: join(dir, 'checkpoint'), rootDir: dir };
    if (await exists(join(dir, 'pstree.img'))) return { imagesDir: dir };
    throw new DormantError(
      ErrorCode.CHECKPOINT_ARCHIVE_INVALID,
      `${dir} holds neither CRIU images (pstree.img) nor a checkpoint/ folder`,
      { hint: 'REF is a checkpoint id, an archive (.tar, .tar.gz, .tar.zst) or a folder of CRIU images' },
    );
  })();
}

/** Pages files of the podman/CRI-O layout, which `pagesInPlace` leaves in the archive. */
const LAYOUT_PAGES = /^checkpoint\/(pages-\d+\.img)$/;

/**
 * Opens a folder or an archive file. `pagesInPlace`: for a caller that reads the pages only
 * through readPages with OpenedCheckpoint.pagesInPlace (the scan), an uncompressed archive's
 * pages files stay where they are instead of being copied to staging.
 */
export async function openCheckpointPath(
  ref: string,
  opts: ArchiveLimits & { stagingDir?: string; pagesInPlace?: boolean } = {},
): Promise<OpenedCheckpoint> {
  let st;
  try {
    st = await stat(ref);
  } catch (e) {
    if (errnoCode(e) === 'ENOENT')
      throw new DormantError(ErrorCode.CHECKPOINT_NOT_FOUND, `no such checkpoint file or folder: ${ref}`);
    throw e;
  }
  if (st.isDirectory()) {
    const l = await layoutOf(ref);
    return { kind: 'folder', ref, ...l, sizeBytes: 0, close: () => Promise.resolve() };
  }
  const { staging, close } = await ownStaging(opts.stagingDir);
  try {
    const r = await extractArchive(ref, staging, {
      ...opts,
      ...(opts.pagesInPlace === true ? { leaveInPlace: (rel: string) => LAYOUT_PAGES.test(rel) } : {}),
    });
    const l = await layoutOf(staging);
    const members = new Map<string, { offset: number; size: number }>();
    for (const [rel, at] of r.inPlace) members.set(LAYOUT_PAGES.exec(rel)![1]!, at);
    return {
      kind: 'archive',
      ref,
      ...l,
      compression: r.compression,
      sizeBytes: st.size,
      ...(members.size > 0 ? { pagesInPlace: { archive: ref, members } } : {}),
      close,
    };
  } catch (e) {
    await close();
    throw e;
  }
}

/** What openDormantCheckpoint needs of the vault. */
export interface VaultReader {
  restoreCheckpoint(o: {
    tenant: string;
    checkpointId: string;
    destDir: string;
    signal?: AbortSignal;
  }): Promise<unknown>;
}

/** Restores a dormant checkpoint from the vault into a private staging folder. */
export async function openDormantCheckpoint(o: {
  vault: VaultReader;
  tenant: string;
  checkpointId: string;
  sandboxId?: string;
  createdAt?: string;
  meta?: Record<string, string>;
  stagingDir?: string;
  signal?: AbortSignal;
}): Promise<OpenedCheckpoint> {
  const { staging, close } = await ownStaging(o.stagingDir);
  try {
    const dest = join(staging, 'images');
    await o.vault.restoreCheckpoint({
      tenant: o.tenant,
      checkpointId: o.checkpointId,
      destDir: dest,
      signal: o.signal,
    });
    const l = await layoutOf(dest);
    return {
      kind: 'dormant',
      ref: o.checkpointId,
      ...l,
      sizeBytes: 0,
      dormantMeta: o.meta,
      dormant: {
        tenant: o.tenant,
        checkpointId: o.checkpointId,
        sandboxId: o.sandboxId,
        createdAt: o.createdAt,
      },
      close,
    };
  } catch (e) {
    await close();
    throw e;
  }
}

/** Reads a JSON metadata file of the archive layout (config.dump, spec.dump), if present. */
export async function readJsonFile(path: string, maxBytes = 16 * 1024 * 1024): Promise<unknown> {
  try {
    const st = await stat(path);
    if (st.size > maxBytes)
      throw new DormantError(ErrorCode.CHECKPOINT_ARCHIVE_INVALID, `${path} is too large`);
    return JSON.parse(await readFile(path, 'utf8')) as unknown;
  } catch (e) {
    if (errnoCode(e) === 'ENOENT') return undefined;
    if (e instanceof SyntaxError)
      throw new DormantError(ErrorCode.CHECKPOINT_ARCHIVE_INVALID, `${path} is not valid JSON`, { cause: e });
    throw e;
  }
}
