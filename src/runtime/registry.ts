/**
 * Images from OCI registries, through skopeo (Debian's package): dormant speaks no registry
 * protocol of its own. A pull is three steps, each a skopeo process bounded in time:
 *
 * 1. `skopeo inspect --raw` reads the reference's manifest. A manifest list (index) is
 *    resolved here to this node's architecture, and the declared sizes of the layers are
 *    held to the configured maximum before a byte of them is fetched.
 * 2. `skopeo inspect --config` reads the image config: an image for another architecture is
 *    refused, naming both.
 * 3. `skopeo copy docker://HOST/NAME@DIGEST oci:LAYOUT` copies exactly the manifest that was
 *    inspected (pinned by digest, so a tag moved in between changes nothing) into a fresh OCI
 *    layout whose blobs go to a shared blob folder (`--dest-shared-blob-dir`): a layer already
 *    there is not fetched again. skopeo verifies every blob against its digest as it writes
 *    it, and runs under `prlimit --fsize`, so no file it writes outgrows the maximum; its
 *    output goes to disk, never through the daemon's memory.
 *
 * Credentials reach skopeo only as a 0600 auth file in a private folder the caller removes
 * after the pull (never an argument, never the environment); without one, `--no-creds` keeps
 * skopeo from reading any auth file of the host's. Plain HTTP (`--tls-verify=false`) only for
 * loopback registries and those the operator named. The signature policy is dormant's own
 * (accept: content is held to digests, not signatures), so the host's policy.json is not needed.
 */
import { createHash } from 'node:crypto';
import { writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { DormantError, ErrorCode, isDormantError } from '../domain/errors.js';
import { run, type RunResult } from '../sys/exec.js';

/** A registry reference: `HOST[:PORT]/NAME[:TAG][@sha256:DIGEST]`. */
export interface RegistryRef {
  host: string;
  repository: string;
  tag?: string;
  digest?: string;
}

/** The reference as text (`HOST/NAME:TAG`, `HOST/NAME@DIGEST`). */
export function formatRegistryRef(r: RegistryRef): string {
  return `${r.host}/${r.repository}${r.tag !== undefined ? `:${r.tag}` : ''}${r.digest !== undefined ? `@${r.digest}` : ''}`;
}

/** An OCI layout is named by an absolute path; anything else is a registry reference. */
export function isRegistryRef(image: string): boolean {
  return !image.startsWith('/');
}

const HOST_RE =
  /^(?:localhost|\[[0-9a-fA-F:.]+\]|(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?)*)(?::\d{1,5})?$/;
const COMPONENT_RE = /^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$/;
const TAG_RE = /^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$/;
const DIGEST_RE = /^sha256:[0-9a-f]{64}$/;

function refInvalid(text: string, why: string): DormantError {
  return new DormantError(
    ErrorCode.IMAGE_REF_INVALID,
    `image "${text.slice(0, 200)}" is neither an absolute OCI layout folder nor a registry reference: ${why}`,
  );
}

/** A registry host as a tenant names it (`registry.example.com`, `127.0.0.1:5000`, `[::1]:5000`). */
export function checkRegistryHost(host: string): string {
  if (!HOST_RE.test(host) || host.length > 255)
    throw new DormantError(ErrorCode.IMAGE_REF_INVALID, `"${host.slice(0, 200)}" is not a registry host`, {
      hint: 'give HOST or HOST:PORT, e.g. registry.example.com or 127.0.0.1:5000',
    });
  return host.toLowerCase();
}

/**
 * Parses a registry reference. The registry must be named (its first component holds a dot or
 * a port, or is `localhost`): an image is never fetched from a registry the user did not name.
 */
export function parseRegistryRef(text: string): RegistryRef {
  if (text.length > 1024) throw refInvalid(text, 'longer than 1024 characters');
  let rest = text;
  let digest: string | undefined;
  const at = rest.indexOf('@');
  if (at >= 0) {
    digest = rest.slice(at + 1);
    rest = rest.slice(0, at);
    if (!DIGEST_RE.test(digest)) throw refInvalid(text, 'the digest is not sha256: and 64 hex digits');
  }
  const slash = rest.indexOf('/');
  if (slash <= 0) throw refInvalid(text, 'no registry host (give REGISTRY/NAME:TAG)');
  const host = rest.slice(0, slash);
  let path = rest.slice(slash + 1);
  if (!(host.includes('.') || host.includes(':') || host === 'localhost'))
    throw refInvalid(text, `"${host}" is not a registry host (name the registry: HOST/NAME:TAG)`);
  if (!HOST_RE.test(host)) throw refInvalid(text, `"${host}" is not a registry host`);
  let tag: string | undefined;
  const colon = path.lastIndexOf(':');
  if (colon >= 0) {
    tag = path.slice(colon + 1);
    path = path.slice(0, colon);
    if (!TAG_RE.test(tag)) throw refInvalid(text, `"${tag.slice(0, 130)}" is not a tag`);
  }
  if (path === '' || !path.split('/').every((c) => COMPONENT_RE.test(c)))
    throw refInvalid(text, 'the name must be lowercase letters, digits and . _ - separated by /');
  // No tag and no digest: `latest`, as every container tool reads it.
  if (tag === undefined && digest === undefined) tag = 'latest';
  return {
    host: host.toLowerCase(),
    repository: path,
    ...(tag !== undefined ? { tag } : {}),
    ...(digest !== undefined ? { digest } : {}),
  };
}

/** Whether plain HTTP may be used: loopback registries, and those the operator named. */
export function plainHttpAllowed(host: string, insecureRegistries: readonly string[]): boolean {
  const name = host.replace(/:\d+$/, '');
  if (name === 'localhost' || name === '[::1]' || /^127\.\d+\.\d+\.\d+$/.test(name)) return true;
  return insecureRegistries.some((r) => r.toLowerCase() === host || r.toLowerCase() === name);
}

/** The Go architecture name (what image configs say) of Node's `process.arch`. */
export function ociArch(nodeArch: string): string {
  return (
    (
      { x64: 'amd64', ia32: '386', arm: 'arm', arm64: 'arm64', ppc64: 'ppc64le', s390x: 's390x' } as Record<
        string,
        string
      >
    )[nodeArch] ?? nodeArch
  );
}

export interface PullOptions {
  /** A private folder (tmpfs) for the auth file, the policy and skopeo's HOME; removed by the caller. */
  privateDir: string;
  /** `{ username, password }`, or undefined: anonymous. */
  credentials?: { username: string; password: string };
  insecureRegistries: readonly string[];
  /** Architecture as image configs name it (amd64, arm64). */
  arch: string;
  /** When the whole pull must have finished (Date.now() ms). */
  deadline: number;
  /** Most bytes the image's blobs may add up to. */
  maxBytes: number;
}

/** The manifest skopeo will copy, resolved and checked. */
export interface ResolvedImage {
  ref: RegistryRef;
  /** sha256 of the image manifest in the registry (a manifest list resolved to this node's entry). */
  digest: string;
  /** Sum of the config's and layers' declared sizes. */
  bytes: number;
}

interface Descriptor {
  mediaType?: string;
  digest?: string;
  size?: number;
  platform?: { os?: string; architecture?: string };
}

interface Skopeo {
  global: string[];
  env: Record<string, string | undefined>;
  authArgs: (prefix: '' | 'src-') => string[];
  o: PullOptions;
}

/** Writes the policy (and the auth file) into the private folder and returns how to run skopeo. */
async function prepare(ref: RegistryRef, o: PullOptions): Promise<Skopeo> {
  const policy = join(o.privateDir, 'policy.json');
  await writeFile(policy, '{"default":[{"type":"insecureAcceptAnything"}]}\n', { mode: 0o600 });
  let authFile: string | undefined;
  if (o.credentials) {
    authFile = join(o.privateDir, 'auth.json');
    const auth = Buffer.from(`${o.credentials.username}:${o.credentials.password}`).toString('base64');
    await writeFile(authFile, JSON.stringify({ auths: { [ref.host]: { auth } } }), { mode: 0o600 });
  }
  const tlsVerify = !plainHttpAllowed(ref.host, o.insecureRegistries);
  return {
    global: ['--policy', policy, '--override-os', 'linux', '--override-arch', o.arch],
    // No auth file of the host's is read (REGISTRY_AUTH_FILE, ~/.docker, $XDG_RUNTIME_DIR).
    env: {
      HOME: o.privateDir,
      XDG_RUNTIME_DIR: o.privateDir,
      XDG_CONFIG_HOME: o.privateDir,
      REGISTRY_AUTH_FILE: undefined,
      DOCKER_CONFIG: undefined,
    },
    authArgs: (prefix) => [
      ...(authFile !== undefined ? [`--${prefix}authfile`, authFile] : [`--${prefix}no-creds`]),
      `--${prefix}tls-verify=${String(tlsVerify)}`,
    ],
    o,
  };
}

/** Maps what skopeo printed on failure to one of the registry errors. */
export function registryError(refText: string, out: string): DormantError {
  const line =
    (/level=fatal msg="(.*)"\s*$/m.exec(out)?.[1] ?? out.trim().split('\n').pop() ?? '')
      .replace(/\\"/g, '"')
      .slice(0, 500) || 'no output';
  const host = refText.split('/')[0] ?? refText;
  if (/Digest did not match|digest.*(does not match|mismatch)|manifest digest/i.test(out))
    return new DormantError(
      ErrorCode.IMAGE_DIGEST_MISMATCH,
      `${refText}: the registry served content that does not match its digest: ${line}`,
    );
  if (/unauthorized|authentication required|invalid username\/password|denied|401 Unauthorized/i.test(out))
    return new DormantError(
      ErrorCode.REGISTRY_UNAUTHORIZED,
      `${refText}: the registry refused access: ${line}`,
      {
        hint: `dormant registry login ${host} --username U --password-stdin (credentials are per tenant)`,
      },
    );
  if (/manifest unknown|name unknown|not found|404/i.test(out))
    return new DormantError(ErrorCode.IMAGE_NOT_FOUND, `${refText}: no such image in the registry: ${line}`);
  if (/HTTP response to HTTPS client/i.test(out))
    return new DormantError(
      ErrorCode.REGISTRY_UNAVAILABLE,
      `${refText}: the registry speaks plain HTTP: ${line}`,
      {
        hint: `only loopback registries may use plain HTTP unless the operator lists ${host} in images.insecureRegistries`,
      },
    );
  if (/file size limit exceeded|SIGXFSZ|signal: file size/i.test(out))
    return new DormantError(ErrorCode.IMAGE_TOO_LARGE, `${refText}: a blob outgrew the pull's size limit`);
  return new DormantError(
    ErrorCode.REGISTRY_UNAVAILABLE,
    `${refText}: the registry could not be read: ${line}`,
  );
}

async function skopeo(
  s: Skopeo,
  refText: string,
  args: string[],
  extra: { fsizeLimit?: number; input?: string } = {},
): Promise<RunResult> {
  const { fsizeLimit } = extra;
  const left = s.o.deadline - Date.now();
  if (left <= 0)
    throw new DormantError(ErrorCode.IMAGE_PULL_TIMEOUT, `${refText}: the pull ran past its time limit`);
  const [cmd, argv] =
    fsizeLimit !== undefined
      ? ['prlimit', [`--fsize=${fsizeLimit}`, '--', 'skopeo', ...s.global, ...args]]
      : ['skopeo', [...s.global, ...args]];
  let r: RunResult;
  try {
    r = await run(cmd, argv, {
      timeoutMs: left,
      env: s.env,
      okExitCodes: [0, 1, 2, 125],
      maxOutputBytes: 4 * 1024 * 1024,
      ...(extra.input !== undefined ? { input: extra.input } : {}),
    });
  } catch (e) {
    if (isDormantError(e) && e.code === ErrorCode.COMMAND_TIMEOUT)
      throw new DormantError(ErrorCode.IMAGE_PULL_TIMEOUT, `${refText}: the pull ran past its time limit`);
    if (isDormantError(e) && e.code === ErrorCode.COMMAND_FAILED && /prlimit/.test(e.message))
      throw registryError(refText, `${e.message}\nfile size limit exceeded`);
    throw e;
  }
  if (r.exitCode !== 0) throw registryError(refText, `${r.stderr}\n${r.stdout}`);
  return r;
}

interface Manifest {
  mediaType?: string;
  manifests?: Descriptor[];
  config?: Descriptor;
  layers?: Descriptor[];
  os?: string;
  architecture?: string;
}

/** A manifest, a manifest list or an image config: each is read for a few fields only. */
function parseJson(refText: string, text: string, what: string): Manifest {
  try {
    return JSON.parse(text) as Manifest;
  } catch {
    throw new DormantError(ErrorCode.REGISTRY_UNAVAILABLE, `${refText}: the registry's ${what} is not JSON`);
  }
}

function archMismatch(refText: string, has: string[], arch: string): DormantError {
  return new DormantError(
    ErrorCode.IMAGE_ARCH_MISMATCH,
    `${refText} is built for ${has.join(', ') || 'no platform'}; this node is linux/${arch}`,
  );
}

/**
 * Steps 1 and 2: the manifest this node would run (a list resolved to its architecture),
 * held to the size limit and the node's architecture before anything large is fetched.
 */
export async function resolveImage(ref: RegistryRef, o: PullOptions): Promise<ResolvedImage> {
  const s = await prepare(ref, o);
  const text = formatRegistryRef(ref);
  const repo = `docker://${ref.host}/${ref.repository}`;
  // A digest wins over a tag given with it (skopeo takes one or the other).
  const target = ref.digest !== undefined ? `${repo}@${ref.digest}` : `docker://${text}`;
  const top = await skopeo(s, text, ['inspect', '--raw', ...s.authArgs(''), target]);
  let raw = top.stdout;
  let digest = `sha256:${createHash('sha256').update(raw, 'utf8').digest('hex')}`;
  if (ref.digest !== undefined && digest !== ref.digest)
    throw new DormantError(
      ErrorCode.IMAGE_DIGEST_MISMATCH,
      `${text}: the registry answered a manifest whose digest is ${digest}`,
    );
  let m = parseJson(text, raw, 'manifest');
  if (Array.isArray(m.manifests)) {
    const pick = m.manifests.find((d) => d.platform?.os === 'linux' && d.platform.architecture === o.arch);
    if (!pick || typeof pick.digest !== 'string' || !/^sha256:[0-9a-f]{64}$/.test(pick.digest))
      throw archMismatch(
        text,
        m.manifests.map((d) => `${d.platform?.os ?? '?'}/${d.platform?.architecture ?? '?'}`),
        o.arch,
      );
    raw = (await skopeo(s, text, ['inspect', '--raw', ...s.authArgs(''), `${repo}@${pick.digest}`])).stdout;
    digest = `sha256:${createHash('sha256').update(raw, 'utf8').digest('hex')}`;
    if (digest !== pick.digest)
      throw new DormantError(
        ErrorCode.IMAGE_DIGEST_MISMATCH,
        `${text}: the registry answered ${pick.digest} with a manifest whose digest is ${digest}`,
      );
    m = parseJson(text, raw, 'manifest');
  }
  if (!m.config || !Array.isArray(m.layers))
    throw new DormantError(ErrorCode.REGISTRY_UNAVAILABLE, `${text}: the manifest has no config or layers`);
  const bytes = [m.config, ...m.layers].reduce(
    (n, d) => n + (typeof d.size === 'number' ? d.size : Infinity),
    0,
  );
  if (!(bytes <= o.maxBytes))
    throw new DormantError(
      ErrorCode.IMAGE_TOO_LARGE,
      `${text} is ${String(bytes)} bytes, over the daemon's limit of ${o.maxBytes}`,
    );
  const cfg = parseJson(
    text,
    (await skopeo(s, text, ['inspect', '--config', '--raw', ...s.authArgs(''), `${repo}@${digest}`])).stdout,
    'image config',
  );
  if (cfg.architecture !== o.arch || (cfg.os !== undefined && cfg.os !== 'linux'))
    throw archMismatch(text, [`${cfg.os ?? '?'}/${cfg.architecture ?? '?'}`], o.arch);
  return { ref, digest, bytes };
}

/**
 * Step 3: copies the resolved manifest into `layout` (a new, empty folder), its blobs into
 * `blobDir` (shared between pulls: what is there is not fetched). Returns the tag the layout
 * holds the image under.
 */
export async function copyImage(
  img: ResolvedImage,
  o: PullOptions & { layout: string; blobDir: string },
): Promise<string> {
  const s = await prepare(img.ref, o);
  const text = formatRegistryRef(img.ref);
  const tag = 'pulled';
  await skopeo(
    s,
    text,
    [
      'copy',
      '--quiet',
      ...s.authArgs('src-'),
      '--dest-shared-blob-dir',
      o.blobDir,
      `docker://${img.ref.host}/${img.ref.repository}@${img.digest}`,
      `oci:${o.layout}:${tag}`,
    ],
    // No file skopeo writes (a blob, or its temporary copy) may pass the pull's limit.
    { fsizeLimit: Math.max(o.maxBytes, 1024 * 1024) },
  );
  return tag;
}

/** Checks credentials with the registry (`skopeo login`, the password on stdin). */
export async function verifyLogin(
  host: string,
  o: Omit<PullOptions, 'arch' | 'maxBytes'> & { credentials: { username: string; password: string } },
): Promise<void> {
  const s = await prepare(
    { host, repository: 'x' },
    { ...o, credentials: undefined, arch: 'amd64', maxBytes: 0 },
  );
  const tlsVerify = !plainHttpAllowed(host, o.insecureRegistries);
  // The password goes on stdin, never the command line; the auth file skopeo writes is in the
  // private folder the caller removes.
  await skopeo(
    s,
    host,
    [
      'login',
      '--authfile',
      join(o.privateDir, 'login.json'),
      `--tls-verify=${String(tlsVerify)}`,
      '--username',
      o.credentials.username,
      '--password-stdin',
      host,
    ],
    { input: `${o.credentials.password}\n` },
  );
}
