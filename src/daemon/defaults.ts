/**
 * Every default of the daemon's configuration, in one place. Where a layer below already names
 * its default as a constant, that constant is used here, so the value is written once; the
 * daemon always passes these values down explicitly, so the layers' own fallbacks (kept for
 * embedding them alone) never decide what an operator gets.
 */
import { DEFAULT_POLICY, type SandboxPolicy } from '../domain/sandbox.js';
import { DEFAULT_MAX_BYTES, DEFAULT_MAX_MEMBER_BYTES } from '../checkpoint/archive.js';
import { TEMPLATE_CACHE_BYTES } from '../control/ops/template-cache.js';
import { DEFAULT_SECCOMP_PROFILE } from '../runtime/runc.js';
import { DEFAULT_DISK_BYTES } from '../control/sandboxes.js';
import {
  DEFAULT_BODY_LIMIT_BYTES,
  DEFAULT_EXEC_BODY_LIMIT_BYTES,
  DEFAULT_MAX_UPLOAD_BYTES,
} from '../api/server.js';
import { DEFAULT_URL } from '../sdk/client.js';

export { DEFAULT_CONFIG_FILE } from './settings.js';

/** Where the API listens: the address the CLI and the SDK look for the daemon at by default. */
export const DEFAULT_LISTEN = new URL(DEFAULT_URL).host;

export { DEFAULT_DATA_DIR } from './settings.js';
import { DEFAULT_DATA_DIR } from './settings.js';

export const DEFAULTS = {
  listen: DEFAULT_LISTEN,
  dataDir: DEFAULT_DATA_DIR,
  log: false,
  logLevel: 'info' as const,
  logFormat: 'auto' as const,
  /** A log file rotates past 100 MiB; five old ones are kept: 600 MiB at most. */
  logMaxBytes: 100 * 1024 ** 2,
  logKeep: 5,
  debug: [] as string[],
  proxy: {
    enabled: true,
    domain: 'dormant.localhost',
    wakeTimeoutMs: 30_000,
    /** Raw TCP listeners for public ports only: a private port needs a token, which TCP cannot carry. */
    tcp: 'public' as 'all' | 'public' | 'off',
  },
  policy: {
    enabled: true,
    intervalMs: 5_000,
    /** CPU share of one core above which a sandbox counts as busy. */
    cpuActiveShare: 0.05,
    defaults: DEFAULT_POLICY as SandboxPolicy,
  },
  sandbox: {
    diskBytes: DEFAULT_DISK_BYTES,
    seccompProfile: DEFAULT_SECCOMP_PROFILE,
    userNamespace: true,
  },
  checkpoint: {
    /** Committed checkpoints kept per sandbox; older ones are deleted. */
    keep: 2,
    /** How long CRIU's dump may run before it is ended as hung. */
    timeoutMs: 120_000,
    /** Templates' checkpoints kept decrypted in the staging tmpfs between creates, in all. */
    templateCacheBytes: TEMPLATE_CACHE_BYTES,
  },
  /** An S3 vault's local pack cache and upload part size (docs/VAULT.md). */
  vault: { cacheBytes: 2 * 1024 ** 3, partSizeBytes: 8 * 1024 ** 2 },
  /** A node stops renewing its lease (killed, cut off): after this its sandboxes go back to their checkpoints. */
  node: { leaseMs: 30_000 },
  restore: {
    lazy: true,
    pagesFromVault: true,
    /**
     * Only checkpoints bigger than this are served from the vault: smaller ones are staged, as
     * their fetch costs little and CRIU's own daemon then pages them in at local speed.
     */
    pagesFromVaultAboveBytes: 256 * 1024 * 1024,
    /** How long CRIU's restore may run before it is ended as hung. */
    timeoutMs: 120_000,
  },
  importLimits: {
    maxBytes: DEFAULT_MAX_BYTES,
    maxMemberBytes: DEFAULT_MAX_MEMBER_BYTES,
    /** A checkpoint archive holds a few images per process and a handful of metadata files. */
    maxEntries: 100_000,
  },
  api: {
    bodyLimitBytes: DEFAULT_BODY_LIMIT_BYTES,
    execBodyLimitBytes: DEFAULT_EXEC_BODY_LIMIT_BYTES,
    maxUploadBytes: DEFAULT_MAX_UPLOAD_BYTES,
  },
  meter: {
    intervalMs: 15_000,
  },
  images: {
    /** One pull, all of its registry requests together. */
    pullTimeoutMs: 10 * 60_000,
    /** The blobs of one image, as its manifest declares them. */
    maxPullBytes: 8 * 1024 ** 3,
    /** How often unpacked images and blobs no sandbox uses are removed. */
    gcIntervalMs: 60 * 60_000,
  },
} as const;

/** The proxy's address when none is set: the API's host on the API's port + 1 (a free one when that is 0). */
export function defaultProxyListen(apiListen: string): string {
  const m = /^(.*):(\d+)$/.exec(apiListen);
  if (!m) throw new RangeError(`listen ${apiListen}: expected HOST:PORT`);
  const port = Number(m[2]);
  return `${m[1]!}:${port === 0 ? 0 : port + 1}`;
}

/** The master key file when none is set. */
export function defaultMasterKeyFile(dataDir: string): string {
  return `${dataDir.replace(/\/+$/, '')}/master.key`;
}
