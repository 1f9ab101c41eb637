/** Export: a checkpoint of the vault written as a podman / CRI-O archive. */

import { randomBytes } from 'node:crypto';
import { mkdir } from 'node:fs/promises';
import { join } from 'node:path';
import { DormantError } from '../../domain/errors.js';
import { unpackImage } from '../../runtime/image.js';
import { FS_DIFF, FS_META, unpackFilesystem } from '../../runtime/layer.js';
import { openDormantCheckpoint } from '../../checkpoint/source.js';
import { ANNOTATION_MANIFEST, ANNOTATION_PORTS } from '../../checkpoint/import.js';
import { rootfsDiffMembers } from '../../checkpoint/rootfs-diff.js';
import { exportCheckpoint, type ArchiveMember } from '../../checkpoint/export.js';
import type { Compression } from '../../checkpoint/archive.js';
import { LifecycleContext } from '../context.js';
import { exportedOciConfig } from '../../runtime/oci.js';

/**
 * A checkpoint of the vault written as a podman / CRI-O archive (with the sandbox's
 * filesystem diff, when the checkpoint is its newest), into a private staging file. The
 * caller streams it out and calls `close()`. Refused with CHECKPOINT_HAS_SECRETS unless
 * `allowPlaintext`.
 */
export async function exportArchive(
  ctx: LifecycleContext,
  ckId: string,
  tenant: string | undefined,
  opts: {
    allowPlaintext?: boolean;
    encrypted?: boolean;
    compression?: Compression;
    signal?: AbortSignal;
  },
): Promise<{ file: string; sizeBytes: number; findings: number; close(): Promise<void> }> {
  const c = await ctx.store.getCheckpoint(ckId);
  if (!c || (tenant !== undefined && c.tenant !== tenant))
    throw new DormantError('CHECKPOINT_NOT_FOUND', `no checkpoint ${ckId.slice(0, 80)}`);
  if (c.kind !== 'memory')
    throw new DormantError(
      'CHECKPOINT_FILESYSTEM_ONLY',
      `checkpoint ${ckId} holds only a filesystem (no processes)`,
    );
  const s = await ctx.store.getSandbox(c.sandboxId);
  const dir = ctx.staging(`${ckId}-export-${randomBytes(4).toString('hex')}`);
  await mkdir(dir, { recursive: true, mode: 0o700 });
  const close = () => ctx.wipe(dir);
  try {
    const ck = await openDormantCheckpoint({
      vault: ctx.vault,
      tenant: c.tenant,
      checkpointId: c.id,
      stagingDir: dir,
    });
    const extra: ArchiveMember[] = [];
    const annotations: Record<string, string> = {};
    let image: { id?: string; name?: string } = {};
    if (s) {
      const src = s.spec.source;
      if (src.kind === 'image') {
        annotations[ANNOTATION_MANIFEST] = src.digest;
        // An image no longer in the cache: the export goes out without its image's facts.
        const img = await unpackImage(
          src.tag !== undefined ? `${src.path}:${src.tag}` : src.path,
          ctx.opts.imageCacheDir ?? join(ctx.opts.stagingDir, 'images'),
        ).catch(() => undefined);
        image = {
          id: (img?.configDigest ?? src.digest).replace(/^sha256:/, ''),
          ...((img?.refName ?? src.tag) !== undefined ? { name: img?.refName ?? src.tag } : {}),
        };
      }
      annotations[ANNOTATION_PORTS] = JSON.stringify(s.spec.ports.map((p) => p.port));
      if (c.meta[FS_META] === 'tar') {
        // The checkpoint carries its own diff (GNU tar of the upper folder, whiteouts as
        // devices): unpacked on staging, then written the way podman expects it
        // (deleted.files for whiteouts).
        const tree = join(dir, 'fs-tree');
        await unpackFilesystem(join(ck.imagesDir, FS_DIFF), tree);
        extra.push(...(await rootfsDiffMembers(tree, join(dir, 'rootfs-diff.tar'))));
      } else if (s.checkpointId === c.id) {
        // Older checkpoints: the writable layer belongs with the newest checkpoint only.
        await ctx.locks.run(s.id, async () => {
          const upper = (await ctx.runtime.state(s.id)).upperDir;
          extra.push(...(await rootfsDiffMembers(upper, join(dir, 'rootfs-diff.tar'))));
        });
      }
    }
    const out = join(
      dir,
      `${ckId}.tar${opts.compression === 'gzip' ? '.gz' : opts.compression === 'none' ? '' : '.zst'}`,
    );
    const r = await exportCheckpoint(ck, {
      out,
      format: 'podman',
      compression: opts.compression ?? 'zstd',
      allowPlaintext: opts.allowPlaintext === true,
      encrypted: opts.encrypted === true,
      extra,
      meta: {
        id: Buffer.from(c.id).toString('hex').padEnd(64, '0').slice(0, 64),
        name: s?.name ?? c.sandboxId,
        ...(image.id !== undefined ? { image: image.id } : {}),
        ...(image.name !== undefined ? { imageName: image.name } : {}),
        createdAt: new Date(s?.createdAt ?? c.createdAt).toISOString(),
        checkpointedAt: new Date(c.createdAt).toISOString(),
        ...(s
          ? {
              env: Object.entries(await ctx.openEnv(s)).map(([k, v]) => `${k}=${v}`),
              args: s.spec.command,
            }
          : {}),
        ...(s?.spec.cwd !== undefined ? { cwd: s.spec.cwd } : {}),
        ...(s ? { memoryBytes: s.spec.memoryBytes } : {}),
        // What podman restores it with: the sandbox's own process, namespaces and mounts.
        ...(s ? { oci: exportedOciConfig(await ctx.runtimeSpec(s)) } : {}),
        annotations,
      },
      ...(opts.signal ? { signal: opts.signal } : {}),
    });
    // The unpacked images are in the archive now; only the archive stays until it is sent.
    await ck.close();
    return { file: r.out, sizeBytes: r.sizeBytes, findings: r.scan.findings.length, close };
  } catch (e) {
    await close();
    throw e;
  }
}
