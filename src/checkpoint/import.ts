/**
 * What an imported archive says about the container it came from: podman's and CRI-O's
 * config.dump (name, base image name and id) and spec.dump (command, environment, working
 * folder, memory limit, and the annotations dormant's own export adds: ports, image manifest
 * digest). And the rule that decides whether a base image is the one the archive was made on.
 */
import { join } from 'node:path';
import { DormantError } from '../domain/errors.js';
import { readJsonFile } from './source.js';
import { invalidArchive } from './tar.js';

/** Annotations dormant's export writes into spec.dump, read back by import. */
export const ANNOTATION_PORTS = 'org.dormant.ports';
export const ANNOTATION_MANIFEST = 'org.dormant.image.manifest';

export interface ArchiveFacts {
  engine: 'podman' | 'cri-o' | 'dormant' | 'unknown';
  /** The container's name as recorded (podman name, or CRI-O container name). */
  name?: string;
  /** The base image's name as recorded (e.g. docker.io/library/busybox:latest). */
  imageName?: string;
  /** Digests the archive gives for its base image (`sha256:<hex>`): image id, manifest. */
  imageIds: string[];
  command: string[];
  env: Record<string, string>;
  cwd?: string;
  memoryBytes?: number;
  ports: number[];
  /** The container's hostname (spec.dump), when it is one a sandbox may have. */
  hostname?: string;
  /**
   * The container had a network namespace of its own making with no path (podman's
   * `--network none`): CRIU dumped it with the processes, and restores it as it was, out of
   * reach of the sandbox's network.
   */
  networkInDump?: true;
}

const str = (v: unknown): string | undefined => (typeof v === 'string' && v !== '' ? v : undefined);

function asDigest(v: unknown): string | undefined {
  const s = str(v);
  if (s === undefined) return undefined;
  const m = /^(?:sha256:)?([0-9a-f]{64})$/.exec(s);
  return m ? `sha256:${m[1]!}` : undefined;
}

function obj(v: unknown): Record<string, unknown> {
  return typeof v === 'object' && v !== null && !Array.isArray(v) ? (v as Record<string, unknown>) : {};
}

/** Reads config.dump and spec.dump from an unpacked archive's root folder. */
export async function readArchiveFacts(rootDir: string | undefined): Promise<ArchiveFacts> {
  if (rootDir === undefined)
    throw invalidArchive(
      'no config.dump or spec.dump: a folder of bare CRIU images cannot be imported',
      undefined,
    );
  const config = obj(await readJsonFile(join(rootDir, 'config.dump')));
  const spec = obj(await readJsonFile(join(rootDir, 'spec.dump')));
  if (Object.keys(spec).length === 0)
    throw invalidArchive("spec.dump is missing or empty: the container's command is unknown");
  const annotations = obj(spec.annotations);
  const process = obj(spec.process);
  const engine =
    annotations['org.dormant.exported'] === 'true'
      ? 'dormant'
      : annotations['io.container.manager'] === 'libpod'
        ? 'podman'
        : Object.keys(annotations).some((k) => k.startsWith('io.kubernetes.cri-o.'))
          ? 'cri-o'
          : 'unknown';
  const args = Array.isArray(process.args)
    ? process.args.filter((a): a is string => typeof a === 'string')
    : [];
  const env: Record<string, string> = {};
  for (const kv of Array.isArray(process.env) ? process.env : []) {
    if (typeof kv !== 'string') continue;
    const i = kv.indexOf('=');
    if (i > 0) env[kv.slice(0, i)] = kv.slice(i + 1);
  }
  const ids = new Set<string>();
  // podman 4 records the image id (its config digest) as rootfsImageID.
  for (const v of [
    config.rootfsImageRef,
    config.rootfsImage,
    config.rootfsImageID,
    annotations[ANNOTATION_MANIFEST],
  ]) {
    const d = asDigest(v);
    if (d) ids.add(d);
  }
  let ports: number[] = [];
  const rawPorts = str(annotations[ANNOTATION_PORTS]);
  if (rawPorts !== undefined) {
    try {
      const p = JSON.parse(rawPorts) as unknown;
      if (Array.isArray(p))
        ports = p.filter(
          (x): x is number => typeof x === 'number' && Number.isInteger(x) && x > 0 && x < 65536,
        );
    } catch {
      throw invalidArchive(`spec.dump annotation ${ANNOTATION_PORTS} is not a JSON list of ports`);
    }
  }
  const limit = obj(obj(obj(spec.linux).resources).memory).limit;
  const name =
    str(annotations['io.kubernetes.cri-o.ContainerName']) ??
    str(annotations['io.kubernetes.container.name']) ??
    str(config.name);
  const imageName = str(config.rootfsImageName) ?? str(annotations['io.kubernetes.cri-o.ImageName']);
  const cwd = str(process.cwd);
  const hostname = str(spec.hostname);
  const namespaces = Array.isArray(obj(spec.linux).namespaces)
    ? (obj(spec.linux).namespaces as unknown[])
    : [];
  const networkInDump = namespaces.some((n) => obj(n).type === 'network' && str(obj(n).path) === undefined);
  return {
    engine,
    ...(name !== undefined ? { name } : {}),
    ...(imageName !== undefined ? { imageName } : {}),
    imageIds: [...ids],
    command: args,
    env,
    ...(cwd !== undefined ? { cwd } : {}),
    ...(typeof limit === 'number' && Number.isSafeInteger(limit) && limit > 0 ? { memoryBytes: limit } : {}),
    ports,
    ...(hostname !== undefined && /^[a-zA-Z0-9][a-zA-Z0-9.-]{0,62}$/.test(hostname) ? { hostname } : {}),
    ...(networkInDump ? { networkInDump: true as const } : {}),
  };
}

/** A base image as dormant knows it. */
export interface ImageIdentity {
  /** Where it is (an OCI layout folder, maybe with :TAG). */
  ref: string;
  manifestDigest: string;
  configDigest: string;
  refName?: string;
}

/** The tag of an image name (`docker.io/library/busybox:1.36` -> `1.36`), if it has one. */
function tagOf(name: string): string | undefined {
  const last = name.slice(name.lastIndexOf('/') + 1);
  const i = last.indexOf(':');
  return i >= 0 ? last.slice(i + 1) : undefined;
}

/**
 * Whether `img` is the archive's base image. Digests decide when the archive records any;
 * otherwise a recorded name must agree with the image's tag. Returns why not, or undefined.
 */
export function imageMismatch(facts: ArchiveFacts, img: ImageIdentity): string | undefined {
  if (facts.imageIds.length > 0) {
    if (facts.imageIds.includes(img.manifestDigest) || facts.imageIds.includes(img.configDigest))
      return undefined;
    return `the archive was made on image ${facts.imageName ?? ''}${facts.imageName ? ' ' : ''}(${facts.imageIds.join(', ')}), but ${img.ref} is ${img.configDigest} (manifest ${img.manifestDigest})`;
  }
  if (facts.imageName !== undefined && img.refName !== undefined) {
    const t = tagOf(facts.imageName);
    if (img.refName !== facts.imageName && img.refName !== t)
      return `the archive was made on image ${facts.imageName}, but ${img.ref} is tagged ${img.refName}`;
  }
  return undefined;
}

export function imageRequired(facts: ArchiveFacts): DormantError {
  const what = facts.imageName ?? facts.imageIds[0] ?? 'an unrecorded image';
  return new DormantError('IMAGE_REQUIRED', `the archive's base image ${what} is not one dormant holds`, {
    hint: 'pass it as an OCI image layout: --image DIR (e.g. from `skopeo copy docker://IMAGE oci:DIR`)',
  });
}

export function imageDiffers(why: string): DormantError {
  return new DormantError('IMAGE_MISMATCH', `wrong base image for this checkpoint: ${why}`, {
    hint: 'pass the image the container ran on (--image DIR[:TAG]); a checkpoint only restores on its own base',
  });
}
