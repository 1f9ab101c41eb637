/** Import: a podman export or a kubelet / CRI-O checkpoint archive becomes a hibernated sandbox. */

import { randomBytes } from 'node:crypto';
import { createWriteStream } from 'node:fs';
import { chmod, mkdir, readFile, rm, stat } from 'node:fs/promises';
import { Transform } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { basename, join } from 'node:path';
import { DormantError, ErrorCode } from '../../domain/errors.js';
import { newId, validateName, type Sandbox, type SandboxSpec } from '../../domain/sandbox.js';
import { parseImageRef, unpackImage, type ImageConfig } from '../../runtime/image.js';
import { FS_DIFF, FS_META } from '../../runtime/layer.js';
import { openCheckpointPath } from '../../checkpoint/source.js';
import { inspectCheckpoint } from '../../checkpoint/inspect.js';
import {
  imageDiffers,
  imageMismatch,
  imageRequired,
  readArchiveFacts,
  type ArchiveFacts,
} from '../../checkpoint/import.js';
import { applyDeletedFiles, applyRootfsDiff } from '../../checkpoint/rootfs-diff.js';
import { assertWithinProfile } from '../../checkpoint/profile-check-io.js';
import { narrowToProfile } from '../../checkpoint/narrow.js';
import { fillEngineBinds, readArchiveMounts } from '../../checkpoint/engine-mounts.js';
import { cpuFlagsInUse } from '../../checkpoint/cpu.js';
import { checkCompatible } from './restore.js';
import type { CheckpointRecord } from '../../state/store.js';
import { LifecycleContext, invalid } from '../context.js';
import { DEFAULT_MEMORY, DEFAULT_DISK_BYTES, checkDiskBytes, egressOf } from './create.js';

export interface ImportArchiveInput {
  tenant: string;
  /** The caller holds an admin token: host paths outside the allowed folders are accepted. */
  admin?: boolean;
  /** A podman export or a kubelet / CRI-O checkpoint archive on this node (absolute path). */
  archive: string;
  /** The base image as an OCI image layout (DIR[:TAG]); default: an image dormant holds. */
  image?: string;
  name?: string;
  /** Ports reachable through the proxy; default: what a dormant export recorded. */
  ports?: number[];
  memoryBytes?: number;
  /** `internet`, `none`, or CIDRs and host names (domain/egress.ts). Default: the tenant's. */
  egress?: string | string[];
}

/** CRIU and the kernel say x86_64 / aarch64; Node says x64 / arm64. */
const NODE_ARCH: Record<string, string> = { x86_64: 'x64', amd64: 'x64', aarch64: 'arm64' };

/**
 * The base image of an archive being imported: `--image` when given (it must be the one the
 * archive names), else an image one of the tenant's sandboxes was made from that matches
 * the archive's recorded digests (or, with no digest recorded, its name).
 */
async function importBase(
  ctx: LifecycleContext,
  facts: ArchiveFacts,
  image: string | undefined,
  tenant: string,
  admin: boolean,
): Promise<{ source: SandboxSpec['source']; image: ImageConfig }> {
  const cacheDir = ctx.opts.imageCacheDir ?? join(ctx.opts.stagingDir, 'images');
  const describe = async (ref: string) => {
    const img = await unpackImage(ref, cacheDir);
    const { layout, tag } = parseImageRef(ref);
    const refName = img.refName ?? tag;
    const identity = {
      ref,
      manifestDigest: img.digest,
      configDigest: img.configDigest,
      ...(refName !== undefined ? { refName } : {}),
    };
    const source: SandboxSpec['source'] = {
      kind: 'image',
      path: layout,
      ...(tag !== undefined ? { tag } : {}),
      digest: img.digest,
      rootfs: img.rootfs,
    };
    return { identity, source, image: img.config };
  };
  if (image !== undefined) {
    await ctx.checkPath(parseImageRef(image).layout, 'image', admin);
    const d = await describe(image);
    const why = imageMismatch(facts, d.identity);
    if (why !== undefined) throw imageDiffers(why);
    return { source: d.source, image: d.image };
  }
  if (facts.imageIds.length === 0 && facts.imageName === undefined) throw imageRequired(facts);
  const seen = new Set<string>();
  for (const s of await ctx.store.listSandboxes(tenant)) {
    const src = s.spec.source;
    if (src.kind !== 'image') continue;
    const ref = src.tag !== undefined ? `${src.path}:${src.tag}` : src.path;
    if (seen.has(ref)) continue;
    seen.add(ref);
    // An image gone from the cache cannot be the one the archive names.
    const d = await describe(ref).catch(() => undefined);
    if (!d) continue;
    const byId =
      facts.imageIds.includes(d.identity.manifestDigest) || facts.imageIds.includes(d.identity.configDigest);
    const byName =
      facts.imageIds.length === 0 &&
      d.identity.refName !== undefined &&
      imageMismatch(facts, d.identity) === undefined;
    if (byId || byName) return { source: d.source, image: d.image };
  }
  throw imageRequired(facts);
}

/**
 * `dormant checkpoint import`: a podman export or a kubelet / CRI-O checkpoint archive
 * becomes a hibernated sandbox. The archive is unpacked (through the hostile-input guards of
 * the archive reader) into memory-backed staging, its filesystem diff goes into the new
 * sandbox's writable layer, its CRIU images into the vault, and the staging is wiped. A
 * failure removes everything of the new sandbox; a crash leaves it for reconcile to remove.
 */
export async function importArchive(ctx: LifecycleContext, input: ImportArchiveInput): Promise<Sandbox> {
  const archive = await ctx.checkPath(input.archive, 'archive', input.admin === true);
  if (!(await stat(archive)).isFile()) throw invalid(`archive ${input.archive} is not a file`);
  return importFrom(ctx, input, archive);
}

/**
 * `dormant checkpoint import` of an uploaded archive: the bytes are streamed into
 * memory-backed staging (0600, never the data disk: the archive holds plaintext memory),
 * refused once past `maxBytes`, imported as `importArchive` does, and wiped.
 */
export async function importUpload(
  ctx: LifecycleContext,
  input: Omit<ImportArchiveInput, 'archive'> & { fileName?: string },
  body: NodeJS.ReadableStream,
  maxBytes: number,
): Promise<Sandbox> {
  const dir = ctx.staging(`${randomBytes(8).toString('hex')}-upload`);
  await mkdir(dir, { recursive: true, mode: 0o700 });
  try {
    const name = (input.fileName ?? 'upload.tar').replace(/[^A-Za-z0-9._-]/g, '_').slice(0, 100);
    const file = join(dir, name.startsWith('.') ? `_${name}` : name);
    let seen = 0;
    const cap = new Transform({
      transform(chunk: Buffer, _enc, done) {
        seen += chunk.length;
        if (seen > maxBytes)
          done(
            new DormantError(
              ErrorCode.CHECKPOINT_ARCHIVE_TOO_LARGE,
              `the uploaded archive is larger than this node accepts (${maxBytes} bytes)`,
            ),
          );
        else done(null, chunk);
      },
    });
    await pipeline(body, cap, createWriteStream(file, { mode: 0o600, flags: 'wx' }));
    if (seen === 0) throw invalid('the upload is empty', 'send the archive as the request body');
    return await importFrom(ctx, { ...input, archive: name }, file);
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}

async function importFrom(
  ctx: LifecycleContext,
  input: ImportArchiveInput,
  archive: string,
): Promise<Sandbox> {
  // Checked before anything is unpacked: a bad path is the caller's mistake, said at once.
  if (input.image !== undefined)
    await ctx.checkPath(parseImageRef(input.image).layout, 'image', input.admin === true);
  if (input.name !== undefined) {
    const n = validateName(input.name);
    if ((await ctx.store.listSandboxes(input.tenant)).some((s) => s.name === n))
      throw new DormantError('SANDBOX_NAME_TAKEN', `a sandbox named ${n} already exists`);
  }
  // As a create gets it (checked before anything is unpacked): without one, the imported
  // sandbox would have no way out at all.
  const egress = await egressOf(ctx, input.tenant, input.egress);
  const id = newId('sb', randomBytes);
  const dir = ctx.staging(`${id}-import`);
  await mkdir(dir, { recursive: true, mode: 0o700 });
  let inserted = false;
  try {
    const ck = await openCheckpointPath(archive, { stagingDir: dir, ...ctx.opts.importLimits });
    ctx.step('import:unpacked');
    const facts = await readArchiveFacts(ck.rootDir);
    if (facts.networkInDump === true)
      throw new DormantError(
        'CHECKPOINT_OUTSIDE_PROFILE',
        "the container's network namespace is inside the checkpoint (podman --network none): a sandbox's network is dormant's, and that one would restore out of its reach",
        { hint: 'checkpoint the container with a network of podman (its default) or --network ns:PATH' },
      );
    const base = await importBase(ctx, facts, input.image, input.tenant, input.admin === true);
    // Reading the images refuses malformed ones before anything is created.
    const report = await inspectCheckpoint(ck);
    // And what they would restore is held to a sandbox's profile, also before anything is made:
    // first the engines' default privileges a sandbox goes without are taken out of the images
    // (podman's CAP_SETFCAP, its clear no_new_privs), then anything still beyond is refused.
    const profile = ctx.checkpointProfile(input.admin === true);
    const narrowed = await narrowToProfile(ck.imagesDir, profile);
    await assertWithinProfile(ck.imagesDir, profile, 'the archive');
    // The engine's own bind mounts (the profile check allowed only those) and the root's mode.
    const mounts = await readArchiveMounts(ck.imagesDir);
    // The CPU features its processes hold state of: one this node lacks is refused now, with
    // what differs, rather than a process that dies at its next such instruction after resume.
    const cpuFlags = await cpuFlagsInUse(ck.imagesDir);
    const m0 = report.metadata;
    const probe: CheckpointRecord = {
      id: basename(archive),
      sandboxId: id,
      tenant: input.tenant,
      createdAt: 0,
      kind: 'memory',
      logicalBytes: 0,
      storedBytes: 0,
      meta: {
        ...(m0.arch !== undefined ? { arch: NODE_ARCH[m0.arch] ?? m0.arch } : {}),
        ...(m0.criuVersion !== undefined ? { criuVersion: m0.criuVersion } : {}),
        cpuFlags,
      },
    };
    await checkCompatible(ctx, 'being imported', probe);
    const command = facts.command.length > 0 ? facts.command : base.image.command;
    if (command.length === 0) throw invalid(`archive ${input.archive} records no command`);
    const derived = await (async () => {
      try {
        const n = validateName(facts.name ?? id);
        return (await ctx.store.listSandboxes(input.tenant)).some((s) => s.name === n) ? id : n;
      } catch {
        return id;
      }
    })();
    const name = input.name !== undefined ? validateName(input.name) : derived;
    const ports = (input.ports ?? facts.ports).map((port) => ({ port, public: false }));
    for (const p of ports)
      if (!Number.isInteger(p.port) || p.port < 1 || p.port > 65535)
        throw invalid(`invalid port ${String(p.port)}`);
    const now = ctx.clock.now();
    const cwd = facts.cwd ?? base.image.workingDir;
    const sandbox: Sandbox = {
      id,
      ...ctx.placed(),
      tenant: input.tenant,
      name,
      state: 'creating',
      spec: {
        source: base.source,
        command,
        env: await ctx.sealEnv(input.tenant, id, { ...base.image.env, ...facts.env }),
        ...(cwd !== undefined ? { cwd } : {}),
        ports,
        memoryBytes: input.memoryBytes ?? facts.memoryBytes ?? DEFAULT_MEMORY,
        cpus: 1,
        diskBytes: checkDiskBytes(ctx.opts.defaultDiskBytes ?? DEFAULT_DISK_BYTES),
        policy: {},
        importedFrom: basename(archive),
        ...(facts.hostname !== undefined ? { hostname: facts.hostname } : {}),
        ...(mounts.binds.length > 0 ? { engineBinds: mounts.binds } : {}),
        ...(mounts.cgroupBinds ? { cgroupNamespace: false as const } : {}),
        egress,
      },
      createdAt: now,
      stateSince: now,
      lastActiveAt: now,
      memoryBytes: 0,
    };
    await ctx.store.insertSandbox(sandbox, `import of ${basename(archive)}`);
    inserted = true;
    return await ctx.locks.run(id, async () => {
      const st = await ctx.runtime.prepare(await ctx.runtimeSpec(sandbox));
      // The layer is written at rest (overlayfs must not see its upper dir change under it).
      await ctx.runtime.stop(id);
      ctx.step('import:prepared');
      await fillEngineBinds(ck.rootDir, st.engineBinds ?? [], {
        hostname: facts.hostname ?? name,
        address: st.network.address,
      });
      // CRIU checks the root it restores into against the one it dumped (the overlay's root is
      // the writable layer's folder); the layer's tar carries the mode to every later restore.
      if (mounts.rootMode !== undefined) await chmod(st.upperDir, mounts.rootMode);
      if (ck.rootDir !== undefined) {
        const diff = join(ck.rootDir, 'rootfs-diff.tar');
        if (
          await stat(diff).then(
            (x) => x.isFile(),
            () => false,
          )
        )
          await applyRootfsDiff(diff, st.upperDir);
        const deleted = join(ck.rootDir, 'deleted.files');
        if (
          await stat(deleted).then(
            (x) => x.isFile(),
            () => false,
          )
        ) {
          await applyDeletedFiles(await readFile(deleted, 'utf8'), st.upperDir);
        }
      }
      // Into the checkpoint with the images: while it sleeps, the diff lives only in the vault.
      await ctx.runtime.packLayer(id, join(ck.imagesDir, FS_DIFF));
      ctx.step('import:filesystem');
      const platform = await ctx.platform();
      const m = report.metadata;
      const ckId = newId('ck', randomBytes);
      const meta: Record<string, string> = {
        arch: m.arch !== undefined ? (NODE_ARCH[m.arch] ?? m.arch) : platform.arch,
        // What the archive says of the kernel it was made on; absent, nothing is claimed.
        ...(m.kernel !== undefined ? { kernel: m.kernel } : {}),
        kind: 'memory',
        importedFrom: basename(archive),
        // Which profile it was checked against (admins' may be in the host's user namespace).
        importedBy: input.admin === true ? 'admin' : 'tenant',
        engine: facts.engine,
        [FS_META]: 'tar',
        ...(m.criuVersion !== undefined ? { criuVersion: m.criuVersion } : {}),
        // What the images held that a sandbox does not get (taken out above).
        ...(narrowed.capabilities.length > 0 || narrowed.noNewPrivs
          ? {
              narrowed: [...narrowed.capabilities, ...(narrowed.noNewPrivs ? ['no_new_privs set'] : [])].join(
                ',',
              ),
            }
          : {}),
      };
      const put = await ctx.vault.putCheckpoint({
        tenant: input.tenant,
        sandboxId: id,
        checkpointId: ckId,
        srcDir: ck.imagesDir,
        meta,
      });
      const record = { cpuFlags };
      // The plaintext is in the vault now: off the staging at once.
      await ck.close();
      ctx.step('import:stored');
      await ctx.store.insertCheckpoint({
        id: ckId,
        sandboxId: id,
        tenant: input.tenant,
        createdAt: ctx.clock.now(),
        kind: 'memory',
        logicalBytes: put.logicalBytes,
        storedBytes: put.storedBytes,
        meta: { ...meta, ...record },
      });
      await ctx.store.transition(
        id,
        'creating',
        'hibernated',
        `import of ${basename(archive)}`,
        ctx.clock.now(),
        // Its address is known from prepare(); a resume keeps it.
        { checkpointId: ckId, address: st.network.address },
      );
      ctx.step('import:committed');
      await ctx.runtime.emptyLayer(id);
      return await ctx.get(id);
    });
  } catch (e) {
    if (inserted) await undoImport(ctx, id, input.tenant);
    throw e;
  } finally {
    await ctx.wipe(dir);
  }
}

/** Removes every trace of an import that did not finish: runtime side, vault data, the row. */
async function undoImport(ctx: LifecycleContext, id: string, tenant: string): Promise<void> {
  await ctx.runtime.destroy(id).catch((e: unknown) => ctx.warnCleanup(id, 'destroy', e));
  await ctx.vault
    .destroySandboxKey({ tenant, sandboxId: id })
    .catch((e: unknown) => ctx.warnCleanup(id, 'shred its vault key', e));
  await ctx.store.deleteSandbox(id, 'import failed', ctx.clock.now());
}
