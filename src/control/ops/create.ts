/** Create: a new sandbox from a root filesystem or an OCI image, started at once. */

import { randomBytes } from 'node:crypto';
import { stat } from 'node:fs/promises';
import { join } from 'node:path';
import { DormantError, asError } from '../../domain/errors.js';
import {
  newId,
  validateLabels,
  validateName,
  type PortSpec,
  type Sandbox,
  type SandboxPolicy,
  type SandboxSpec,
  type RuntimeKind,
} from '../../domain/sandbox.js';
import { parseImageRef, unpackImage, type ImageConfig } from '../../runtime/image.js';
import { isRegistryRef } from '../../runtime/registry.js';
import { MAX_DISK_BYTES, MIN_DISK_BYTES } from '../../runtime/oci.js';
import { parseEgressPolicy, type EgressPolicy } from '../../domain/egress.js';
import { DEFAULT_GPU_POLICY, parseGpuPolicy, parseGpus, type GpuPolicy } from '../../domain/gpu.js';
import { LifecycleContext, invalid } from '../context.js';
import { gpuDevices, checkGpusAvailable } from './gpu.js';

export interface CreateSandboxInput {
  tenant: string;
  /** The caller holds an admin token: host paths outside the allowed folders are accepted. */
  admin?: boolean;
  name?: string;
  rootfs?: string;
  image?: string;
  command: string[];
  env?: Record<string, string>;
  ports?: (number | PortSpec)[];
  memoryBytes?: number;
  cpus?: number;
  /** Disk quota of the writable layer. Default: the daemon's (10 GiB unless configured). */
  diskBytes?: number;
  policy?: SandboxPolicy;
  onResume?: string[];
  /** GPUs: `all` or indexes like `0,1`. Refused on a node without an NVIDIA driver. */
  gpus?: string;
  /** What hibernate does when the sandbox holds GPU state. Default keep-running. */
  gpuPolicy?: GpuPolicy;
  /** The caller's key/value labels (domain/sandbox.ts validateLabels). */
  labels?: Record<string, string>;
  /** Start from this template's checkpoint (id or name; ops/template-start.ts) instead. */
  template?: string;
  /** `internet`, `none`, or CIDRs and host names (domain/egress.ts). Default: the tenant's. */
  egress?: string | string[];
  /** `runc` or `runsc` (gVisor). Default: the tenant's, else the node's (runc). */
  runtime?: RuntimeKind;
}

/** The runtime a create gets: its own, else its tenant's default, else the node's (runc). */
export function runtimeOf(
  ctx: LifecycleContext,
  input: Pick<CreateSandboxInput, 'tenant' | 'runtime'>,
): RuntimeKind {
  const d = ctx.opts.defaultRuntime;
  return input.runtime ?? d?.tenants[input.tenant] ?? d?.node ?? 'runc';
}

/** The egress a create gets: its own, else its tenant's default, else the node's (internet). */
export async function egressOf(
  ctx: LifecycleContext,
  tenant: string,
  asked?: string | string[],
): Promise<EgressPolicy> {
  const d = ctx.opts.defaultEgress;
  const policy =
    asked !== undefined ? parseEgressPolicy(asked) : (d?.tenants[tenant] ?? d?.node ?? { mode: 'internet' });
  // Names are resolved now: one that does not resolve fails the create before anything exists.
  await ctx.runtime.checkEgress?.(policy);
  return policy;
}

export const DEFAULT_MEMORY = 512 * 1024 ** 2;
/** The writable layer's disk quota when neither the create nor the daemon names one. */
export const DEFAULT_DISK_BYTES = 10 * 1024 ** 3;

/** A disk quota, checked before anything is made (the runtime checks it again). */
export function checkDiskBytes(bytes: number): number {
  if (!(Number.isSafeInteger(bytes) && bytes >= MIN_DISK_BYTES && bytes <= MAX_DISK_BYTES))
    throw invalid(
      `disk quota ${String(bytes)} bytes is out of range`,
      'give --disk from 32M to 16T less 1G, e.g. --disk 10G',
    );
  return bytes;
}

async function validateSource(
  ctx: LifecycleContext,
  input: CreateSandboxInput,
): Promise<{ source: SandboxSpec['source']; image?: ImageConfig; release?: () => void }> {
  if (input.image !== undefined) {
    if (input.rootfs !== undefined) throw invalid('give --rootfs or --image, not both');
    if (isRegistryRef(input.image)) {
      // A registry reference: any tenant may name one (it names no host path); the pull uses
      // the tenant's own credentials for that registry.
      if (!ctx.opts.images)
        throw new DormantError('IMAGE_REF_INVALID', 'this daemon pulls no images from registries', {
          hint: 'give an absolute OCI image layout folder',
        });
      const held = await ctx.opts.images.pull(input.tenant, input.image);
      return {
        source: { kind: 'image', path: held.ref, digest: held.image.digest, rootfs: held.image.rootfs },
        image: held.image.config,
        release: held.release,
      };
    }
    const { layout } = parseImageRef(input.image);
    await ctx.checkPath(layout, 'image', input.admin === true);
    const held = ctx.opts.images
      ? await ctx.opts.images.unpackLayout(input.image)
      : {
          image: await unpackImage(
            input.image,
            ctx.opts.imageCacheDir ?? join(ctx.opts.stagingDir, 'images'),
          ),
        };
    const img = held.image;
    const { tag } = parseImageRef(input.image);
    return {
      source: {
        kind: 'image',
        path: layout,
        ...(tag !== undefined ? { tag } : {}),
        digest: img.digest,
        rootfs: img.rootfs,
      },
      image: img.config,
      ...('release' in held ? { release: held.release } : {}),
    };
  }
  const path = input.rootfs;
  if (path === undefined)
    throw invalid('a sandbox needs a root filesystem', 'pass --rootfs DIR or --image OCI_LAYOUT_DIR[:TAG]');
  const real = await ctx.checkPath(path, 'rootfs', input.admin === true);
  if (!(await stat(real)).isDirectory()) throw invalid(`rootfs ${path} is not a folder`);
  // The resolved path: what was checked is what gets mounted.
  return { source: { kind: 'rootfs', path: real } };
}

export async function createSandbox(ctx: LifecycleContext, input: CreateSandboxInput): Promise<Sandbox> {
  // Checked before an image is unpacked: a bad label costs nothing.
  const labels = validateLabels(input.labels ?? {});
  const egress = await egressOf(ctx, input.tenant, input.egress);
  const { source, image, release } = await validateSource(ctx, input);
  let sandbox: Sandbox;
  try {
    sandbox = await recordSandbox(ctx, input, labels, source, image, egress);
  } finally {
    // Recorded (or refused): the image collector sees the sandbox's use from here on.
    release?.();
  }
  const id = sandbox.id;
  return ctx.locks.run(id, async () => {
    const t = ctx.timer();
    try {
      ctx.step('create:before-runtime');
      const spec = await ctx.runtimeSpec(sandbox);
      const st = await t.time('runtime create', () => ctx.runtime.create(spec, { timer: t }));
      ctx.step('create:created');
      await t.time('runtime start', () => ctx.runtime.start(id, { timer: t }));
      await ctx.store.transition(id, 'creating', 'running', 'create', ctx.clock.now(), {
        address: st.network.address,
      });
      ctx.report(t.finish('create', id, true));
      return await ctx.get(id);
    } catch (e) {
      ctx.report(t.finish('create', id, false));
      await ctx.runtime.destroy(id).catch((x: unknown) => ctx.warnCleanup(id, 'destroy', x));
      await ctx.store.transition(id, 'creating', 'failed', 'create failed', ctx.clock.now(), {
        lastError: asError(e).message,
      });
      throw e;
    }
  });
}

/** Checks the rest of the request and records the sandbox as `creating`. */
async function recordSandbox(
  ctx: LifecycleContext,
  input: CreateSandboxInput,
  labels: Record<string, string>,
  source: SandboxSpec['source'],
  image: ImageConfig | undefined,
  egress: EgressPolicy,
): Promise<Sandbox> {
  const command = input.command.length > 0 ? input.command : (image?.command ?? []);
  if (command.length === 0) throw invalid('a sandbox needs a command', 'dormant create ... -- CMD ARG...');
  const id = newId('sb', randomBytes);
  const name = validateName(input.name ?? id);
  if ((await ctx.store.listSandboxes(input.tenant)).some((s) => s.name === name)) {
    throw new DormantError('SANDBOX_NAME_TAKEN', `a sandbox named ${name} already exists`);
  }
  const ports = (input.ports ?? []).map((p) => (typeof p === 'number' ? { port: p, public: false } : p));
  for (const p of ports)
    if (!Number.isInteger(p.port) || p.port < 1 || p.port > 65535)
      throw invalid(`invalid port ${String(p.port)}`);
  const gpus = input.gpus === undefined ? undefined : parseGpus(input.gpus);
  const gpuPolicy = input.gpuPolicy === undefined ? DEFAULT_GPU_POLICY : parseGpuPolicy(input.gpuPolicy);
  if (gpus !== undefined) await checkGpusAvailable(ctx, gpus);
  const devices = gpus !== undefined ? await gpuDevices(ctx, gpus) : [];
  const now = ctx.clock.now();
  const sandbox: Sandbox = {
    id,
    ...ctx.placed(),
    tenant: input.tenant,
    name,
    state: 'creating',
    ...(gpus !== undefined ? { gpus } : {}),
    gpuPolicy,
    spec: {
      source,
      command,
      env: await ctx.sealEnv(input.tenant, id, { ...image?.env, ...input.env }),
      ...(image?.workingDir !== undefined ? { cwd: image.workingDir } : {}),
      ...(devices.length > 0 ? { devices } : {}),
      ports,
      memoryBytes: input.memoryBytes ?? DEFAULT_MEMORY,
      cpus: input.cpus ?? 1,
      diskBytes: checkDiskBytes(input.diskBytes ?? ctx.opts.defaultDiskBytes ?? DEFAULT_DISK_BYTES),
      // Only what the caller set: node and tenant defaults apply to the rest when the policy
      // runs, so changing a default reaches existing sandboxes.
      policy: { ...input.policy },
      ...(input.onResume ? { onResume: input.onResume } : {}),
      ...(Object.keys(labels).length > 0 ? { labels } : {}),
      egress,
      ...(runtimeOf(ctx, input) === 'runsc' ? { runtime: 'runsc' as const } : {}),
    },
    createdAt: now,
    stateSince: now,
    lastActiveAt: now,
    memoryBytes: 0,
  };
  await ctx.store.insertSandbox(sandbox, 'create');
  return sandbox;
}
