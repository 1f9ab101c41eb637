/**
 * The daemon's one configuration: a JSON file, DORMANT_* environment variables and `dormant
 * serve` flags, over the defaults (./defaults.ts). Precedence: flags > environment > file >
 * defaults. Each layer is validated on its own, so an error names the file and key, the
 * variable or the flag it came from.
 *
 * This is the only module of the daemon that reads the process environment.
 */
import { readFileSync } from 'node:fs';
import { dirname, isAbsolute, resolve } from 'node:path';
import { z } from 'zod';
import { redactUrl } from '../state/redact.js';
import { NODE_NAME_PATTERN } from '../domain/node.js';
import { DormantError, ErrorCode } from '../domain/errors.js';
import type { SandboxPolicy } from '../domain/sandbox.js';
import type { PriceSheet } from '../domain/cost.js';
import { parseDurationMs, parseSizeBytes } from '../domain/units.js';
import { egressText, parseEgressPolicy, type EgressPolicy } from '../domain/egress.js';
import { RUNTIME_KINDS, type RuntimeKind } from '../domain/sandbox.js';
import type { RunscPlatform } from '../runtime/runsc.js';
import { SETTINGS, type Setting } from './settings.js';
import { DEFAULTS, DEFAULT_CONFIG_FILE, defaultMasterKeyFile, defaultProxyListen } from './defaults.js';

/** The configuration in force: every value set, durations in ms and sizes in bytes. */
export interface DaemonConfig {
  /** HOST:PORT of the API; port 0 picks a free one. */
  listen: string;
  dataDir: string;
  /** The vault's master key: a file, or a command (a KMS hook) that prints it. */
  masterKey: { file: string } | { command: string };
  /** Log every request to stderr. */
  log: boolean;
  /** The least severe lines logged. */
  logLevel: 'debug' | 'info' | 'warn' | 'error';
  /** json, text, or auto (text on a terminal). */
  logFormat: 'json' | 'text' | 'auto';
  /** The log's own file (instead of stderr), rotated past logMaxBytes with logKeep old ones kept. */
  logFile?: string;
  logMaxBytes: number;
  logKeep: number;
  /** Debug output: `timings` prints each create, hibernate, resume and fork step by step. */
  debug: string[];
  proxy: {
    enabled: boolean;
    listen: string;
    domain: string;
    wakeTimeoutMs: number;
    tcp: 'all' | 'public' | 'off';
  };
  policy: {
    enabled: boolean;
    intervalMs: number;
    cpuActiveShare: number;
    /** The node's defaults under every sandbox's own policy. */
    defaults: SandboxPolicy;
    /** Per-tenant defaults, over the node's. */
    tenants: Record<string, SandboxPolicy>;
  };
  sandbox: {
    /** Host folders a tenant's rootfs, image and archive paths may come from. */
    allowedSourceRoots: string[];
    seccompProfile: string;
    apparmorProfile?: string;
    /** A user namespace for every new sandbox (root inside a host nobody; runtime/userns.ts). */
    userNamespace: boolean;
    /** Disk quota of a sandbox's writable layer when its create names none. */
    diskBytes: number;
    /** The IPv4 subnet sandboxes get their /30s from (runtime/network.ts); distinct per node in a fleet across hosts. */
    subnet?: string;
  };
  /** templateCacheBytes: templates' checkpoints kept decrypted in staging (control/ops/template-cache.ts). */
  checkpoint: { keep: number; timeoutMs: number; templateCacheBytes: number };
  restore: { lazy: boolean; pagesFromVault: boolean; pagesFromVaultAboveBytes: number; timeoutMs: number };
  importLimits: { maxBytes: number; maxMemberBytes: number; maxEntries: number };
  api: { bodyLimitBytes: number; execBodyLimitBytes: number; maxUploadBytes: number };
  meter: { intervalMs: number; prices: Partial<PriceSheet> };
  /** Registry pulls and the image cache (docs/IMAGES.md). */
  images: { insecureRegistries: string[]; pullTimeoutMs: number; maxPullBytes: number; gcIntervalMs: number };
  /** The E2B front (docs/E2B.md): off unless `listen` is set. */
  e2b: { listen?: string; templates: Record<string, E2bTemplateConfig> };
  /** Sandboxes' way out (docs/NETWORK.md): the default policy, per-tenant ones, the resolvers. */
  egress: { default: EgressPolicy; tenants: Record<string, EgressPolicy>; dns: string[] };
  /** The container runtime of a sandbox whose create names none, per tenant; gVisor's platform. */
  runtime: { default: RuntimeKind; tenants: Record<string, RuntimeKind>; runscPlatform: RunscPlatform };
  /** Where checkpoints live: `<dataDir>/vault` unless an S3 URL is set (docs/VAULT.md). */
  vault: S3VaultConfig | undefined;
  /** The database of record: `<dataDir>/state.db` (SQLite) unless a PostgreSQL URL is set (docs/STATE.md). */
  state: { url: string } | undefined;
  /**
   * This node in a fleet (docs/FLEET.md): its name (default the host name), where the other
   * nodes reach its API, and its lease. Used only with the state in PostgreSQL.
   */
  node: { name?: string; url?: string; leaseMs: number };
}

/** An S3-compatible bucket as the vault's store. */
export interface S3VaultConfig {
  /** `s3://BUCKET[/PREFIX]` */
  url: string;
  endpoint?: string;
  region?: string;
  accessKeyId?: string;
  /** The secret, or a command (run with /bin/sh -c) that prints it. */
  secretAccessKey?: { value: string } | { command: string };
  cacheBytes: number;
  partSizeBytes: number;
}

/** An E2B template id as what a sandbox is made from (api/e2b/templates.ts). */
export type E2bTemplateConfig = ({ rootfs: string } | { image: string }) & {
  command?: string[];
  memoryBytes?: number;
  cpus?: number;
};

// ---- the file's shape (also what the environment and the flags are parsed into) ----

/** `30s`, `15m`, or a number of milliseconds. */
const duration = z.union([z.string(), z.number().int().nonnegative()]).transform((v, ctx) => {
  if (typeof v === 'number') return v;
  try {
    return parseDurationMs(v);
  } catch (e) {
    ctx.addIssue({ code: 'custom', message: (e as Error).message });
    return z.NEVER;
  }
});

/** `512M`, `10G`, or a number of bytes. */
const size = z.union([z.string(), z.number().int().nonnegative()]).transform((v, ctx) => {
  if (typeof v === 'number') return v;
  try {
    return parseSizeBytes(v);
  } catch (e) {
    ctx.addIssue({ code: 'custom', message: (e as Error).message });
    return z.NEVER;
  }
});

const bool = z.boolean({ error: 'expected true or false' });

const hostPort = z.string().regex(/^(\[[0-9a-fA-F:.]+\]|[^\s:[\]]*):\d{1,5}$/, 'expected HOST:PORT');

const policy = z.strictObject({
  pauseAfter: duration.optional(),
  hibernateAfter: duration.optional(),
  archiveAfter: duration.optional(),
  deleteAfter: duration.optional(),
  lifetime: duration.optional(),
});

/** An egress policy: `internet`, `none`, or CIDRs and host names (domain/egress.ts). */
const egressPolicy = z.union([z.string(), z.array(z.string())]).transform((v, ctx) => {
  try {
    return parseEgressPolicy(v);
  } catch (e) {
    ctx.addIssue({ code: 'custom', message: (e as Error).message });
    return z.NEVER;
  }
});

/** One layer of configuration: everything optional; unknown keys are errors (a typo would else be ignored). */
const Layer = z.strictObject({
  listen: hostPort.optional(),
  dataDir: z.string().min(1).optional(),
  masterKeyFile: z.string().min(1).optional(),
  masterKeyCommand: z.string().min(1).optional(),
  log: bool.optional(),
  logLevel: z.enum(['debug', 'info', 'warn', 'error']).optional(),
  logFormat: z.enum(['json', 'text', 'auto']).optional(),
  logFile: z.string().min(1).optional(),
  logMaxSize: size.optional(),
  logKeep: z.number().int().min(0).max(1000).optional(),
  debug: z.array(z.enum(['timings'])).optional(),
  proxy: z
    .strictObject({
      enabled: bool.optional(),
      listen: hostPort.optional(),
      domain: z
        .string()
        .regex(/^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$/i, 'expected a DNS name')
        .optional(),
      wakeTimeout: duration.optional(),
      tcp: z.enum(['all', 'public', 'off']).optional(),
    })
    .optional(),
  policy: z
    .strictObject({
      enabled: bool.optional(),
      interval: duration.optional(),
      cpuActiveShare: z.number().positive().optional(),
      defaults: policy.optional(),
      tenants: z.record(z.string().min(1), policy).optional(),
    })
    .optional(),
  sandbox: z
    .strictObject({
      allowedSourceRoots: z.array(z.string().min(1)).optional(),
      seccompProfile: z.string().min(1).optional(),
      apparmorProfile: z.string().min(1).optional(),
      userNamespace: bool.optional(),
      diskQuota: size.optional(),
      subnet: z
        .string()
        .regex(/^\d{1,3}(\.\d{1,3}){3}\/\d{1,2}$/, 'expected an IPv4 CIDR such as 10.213.0.0/16')
        .optional(),
    })
    .optional(),
  checkpoint: z
    .strictObject({
      keep: z.number().int().min(1).optional(),
      timeout: duration.optional(),
      templateCache: size.optional(),
    })
    .optional(),
  restore: z
    .strictObject({
      lazy: bool.optional(),
      pagesFromVault: bool.optional(),
      pagesFromVaultAbove: size.optional(),
      timeout: duration.optional(),
    })
    .optional(),
  importLimits: z
    .strictObject({
      maxBytes: size.optional(),
      maxMemberBytes: size.optional(),
      maxEntries: z.number().int().min(1).optional(),
    })
    .optional(),
  api: z
    .strictObject({
      bodyLimit: size.optional(),
      execBodyLimit: size.optional(),
      maxUpload: size.optional(),
    })
    .optional(),
  images: z
    .strictObject({
      insecureRegistries: z.array(z.string().min(1)).optional(),
      pullTimeout: duration.optional(),
      maxPullSize: size.optional(),
      gcInterval: duration.optional(),
    })
    .optional(),
  e2b: z
    .strictObject({
      listen: hostPort.optional(),
      templates: z
        .record(
          z.string().min(1).max(128),
          z
            .strictObject({
              rootfs: z.string().min(1).optional(),
              image: z.string().min(1).optional(),
              command: z.array(z.string()).min(1).optional(),
              memory: size.optional(),
              cpus: z.number().positive().optional(),
            })
            .refine(
              (t) => (t.rootfs === undefined) !== (t.image === undefined),
              'give rootfs or image (one)',
            ),
        )
        .optional(),
    })
    .optional(),
  runtime: z
    .strictObject({
      default: z.enum(RUNTIME_KINDS).optional(),
      tenants: z.record(z.string().min(1), z.enum(RUNTIME_KINDS)).optional(),
      runscPlatform: z.enum(['ptrace', 'kvm', 'systrap']).optional(),
    })
    .optional(),
  egress: z
    .strictObject({
      default: egressPolicy.optional(),
      tenants: z.record(z.string().min(1), egressPolicy).optional(),
      dns: z.array(z.ipv4()).max(3).optional(),
    })
    .optional(),
  node: z
    .strictObject({
      name: z
        .string()
        .regex(NODE_NAME_PATTERN, 'expected a name of letters, digits, ".", "_" and "-" (at most 63)')
        .optional(),
      url: z
        .string()
        .regex(
          /^https?:\/\/[^\s/]+\/?$/,
          'expected http(s)://HOST:PORT, where the other nodes reach this API',
        )
        .optional(),
      lease: duration
        .refine((ms) => ms >= 1_000 && ms <= 3_600_000, 'expected a lease from 1s to 1h')
        .optional(),
    })
    .optional(),
  state: z
    .strictObject({
      url: z
        .string()
        .regex(/^postgres(ql)?:\/\/[^\s]+$/, 'expected postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE')
        .optional(),
    })
    .optional(),
  vault: z
    .strictObject({
      url: z
        .string()
        .regex(
          /^s3:\/\/[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](\/[A-Za-z0-9._/-]*)?$/,
          'expected s3://BUCKET or s3://BUCKET/PREFIX',
        )
        .optional(),
      endpoint: z
        .string()
        .regex(/^https?:\/\/[^\s/]+\/?$/, 'expected http(s)://HOST[:PORT]')
        .optional(),
      region: z.string().min(1).optional(),
      accessKeyId: z.string().min(1).optional(),
      secretAccessKey: z.string().min(1).optional(),
      secretAccessKeyCommand: z.string().min(1).optional(),
      cacheSize: size.optional(),
      partSize: size
        .refine(
          (n) => n >= 5 * 1024 * 1024 && n <= 5 * 1024 ** 3,
          'expected a size from 5M to 5G (S3 part limits)',
        )
        .optional(),
    })
    .optional(),
  meter: z
    .strictObject({
      interval: duration.optional(),
      prices: z
        .strictObject({
          currency: z.string().min(1).optional(),
          nodeCostPerHour: z.number().nonnegative().optional(),
          nodeVcpus: z.number().positive().optional(),
          nodeMemory: size.optional(),
          cpuShare: z.number().min(0).max(1).optional(),
          storagePerGiBMonth: z.number().nonnegative().optional(),
        })
        .optional(),
    })
    .optional(),
});
type Layer = z.output<typeof Layer>;

export { SETTINGS, type Setting } from './settings.js';

/** The environment variable naming the configuration file. */
export const CONFIG_ENV = 'DORMANT_CONFIG';

// ---- loading ----

/** Where a value came from, for error messages. */
type Source = { kind: 'file'; path: string } | { kind: 'env' } | { kind: 'flags' };

function issueText(issue: z.core.$ZodIssue): { key: string; message: string } {
  const key = issue.path.map(String).join('.');
  if (issue.code === 'unrecognized_keys') {
    const prefix = key === '' ? '' : `${key}.`;
    return {
      key: issue.keys.map((k) => `${prefix}${k}`).join(', '),
      message: 'unknown key',
    };
  }
  return { key: key === '' ? '(top level)' : key, message: issue.message };
}

function where(source: Source, key: string): string {
  const s = SETTINGS.find((x) => key === x.key || key.startsWith(`${x.key}.`));
  switch (source.kind) {
    case 'file':
      return `${source.path}: ${key}`;
    case 'env':
      return `${s?.env ?? key} (${key})`;
    case 'flags':
      return `${s?.flag?.split(' ')[0] ?? key} (${key})`;
  }
}

function parseLayer(raw: unknown, source: Source, base: string): Layer {
  const r = Layer.safeParse(raw);
  if (!r.success) {
    const lines = r.error.issues.map((i) => {
      const t = issueText(i);
      return `${where(source, t.key)}: ${t.message}`;
    });
    throw configError(lines);
  }
  return resolvePaths(r.data, base);
}

function configError(lines: string[]): DormantError {
  return new DormantError(ErrorCode.INVALID_ARGUMENT, `invalid configuration:\n  ${lines.join('\n  ')}`, {
    hint: 'docs/CONFIG.md lists every key; `dormant config check [FILE]` checks a file',
  });
}

/** Relative paths in the file are relative to the file's folder; from flags and environment, to the working directory. */
function resolvePaths(l: Layer, base: string): Layer {
  const abs = (p: string): string => (isAbsolute(p) ? p : resolve(base, p));
  return {
    ...l,
    ...(l.dataDir !== undefined ? { dataDir: abs(l.dataDir) } : {}),
    ...(l.masterKeyFile !== undefined ? { masterKeyFile: abs(l.masterKeyFile) } : {}),
    ...(l.logFile !== undefined ? { logFile: abs(l.logFile) } : {}),
    ...(l.sandbox
      ? {
          sandbox: {
            ...l.sandbox,
            ...(l.sandbox.allowedSourceRoots
              ? { allowedSourceRoots: l.sandbox.allowedSourceRoots.map(abs) }
              : {}),
            ...(l.sandbox.seccompProfile !== undefined
              ? { seccompProfile: abs(l.sandbox.seccompProfile) }
              : {}),
          },
        }
      : {}),
  };
}

/** Sets `value` at the dotted `key` of `into`, making the objects on the way. */
function setAt(into: Record<string, unknown>, key: string, value: unknown): void {
  const parts = key.split('.');
  let o = into;
  for (const p of parts.slice(0, -1)) {
    o[p] ??= {};
    o = o[p] as Record<string, unknown>;
  }
  o[parts[parts.length - 1]!] = value;
}

/** An environment value as the JSON value the file would hold (durations and sizes stay strings, parsed by the schema). */
function fromEnvText(s: Setting, text: string): unknown {
  switch (s.kind) {
    case 'boolean':
      if (/^(1|true|yes|on)$/i.test(text)) return true;
      if (/^(0|false|no|off)$/i.test(text)) return false;
      return text; // the schema names it
    case 'integer':
      return /^\s*-?\d+\s*$/.test(text) ? Number(text) : text;
    case 'list':
      return text
        .split(',')
        .map((x) => x.trim())
        .filter((x) => x !== '');
    case 'paths':
      return text.split(':').filter((x) => x !== '');
    default:
      return text;
  }
}

function envLayerRaw(env: NodeJS.ProcessEnv): Record<string, unknown> {
  const raw: Record<string, unknown> = {};
  for (const s of SETTINGS) {
    const v = s.env !== undefined ? env[s.env] : undefined;
    if (v !== undefined && v !== '') setAt(raw, s.key, fromEnvText(s, v));
  }
  return raw;
}

/**
 * The flags `dormant serve` was given, as a layer: `values` are commander's option values and
 * `given` tells which ones the command line set (commander fills in negated booleans).
 */
export function flagLayerRaw(
  values: Record<string, unknown>,
  given: (attribute: string) => boolean,
): Record<string, unknown> {
  const raw: Record<string, unknown> = {};
  for (const s of SETTINGS) {
    if (s.flag === undefined) continue;
    const attr = flagAttribute(s.flag);
    if (!given(attr)) continue;
    const v = values[attr];
    if (s.kind === 'boolean') {
      // commander gives `--no-proxy` as proxy: false (and `--proxy` as true); a flag of its own,
      // `--log` or `--stage-lazy-pages`, sets the value it stands for.
      setAt(raw, s.key, s.flag.startsWith('--no-') ? v === true : s.flagSets);
    } else if (s.kind === 'integer') {
      setAt(raw, s.key, typeof v === 'string' ? fromEnvText(s, v) : v);
    } else if (s.kind === 'paths') {
      if (Array.isArray(v) && v.length > 0) setAt(raw, s.key, v);
    } else {
      setAt(raw, s.key, v);
    }
  }
  return raw;
}

/** commander's attribute name for a flag: `--no-lazy-restore` -> lazyRestore, `--data-dir <d>` -> dataDir. */
export function flagAttribute(flag: string): string {
  const name = flag.split(' ')[0]!.replace(/^--(no-)?/, '');
  return name.replace(/-([a-z])/g, (_, c: string) => c.toUpperCase());
}

function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === 'object' && v !== null && !Array.isArray(v);
}

/** `top` over `base`, object by object; arrays and values are replaced whole. */
function merge<T>(base: T, top: T): T {
  if (!isObject(base) || !isObject(top)) return top === undefined ? base : top;
  const out: Record<string, unknown> = { ...base };
  for (const [k, v] of Object.entries(top)) {
    if (v !== undefined) out[k] = merge(out[k], v);
  }
  return out as T;
}

function policyOf(p: z.output<typeof policy> | undefined): SandboxPolicy {
  const out: SandboxPolicy = {};
  if (p?.pauseAfter !== undefined) out.pauseAfterMs = p.pauseAfter;
  if (p?.hibernateAfter !== undefined) out.hibernateAfterMs = p.hibernateAfter;
  if (p?.archiveAfter !== undefined) out.archiveAfterMs = p.archiveAfter;
  if (p?.deleteAfter !== undefined) out.deleteAfterMs = p.deleteAfter;
  if (p?.lifetime !== undefined) out.lifetimeMs = p.lifetime;
  return out;
}

function e2bTemplateOf(t: NonNullable<NonNullable<Layer['e2b']>['templates']>[string]): E2bTemplateConfig {
  return {
    ...(t.rootfs !== undefined ? { rootfs: t.rootfs } : { image: t.image! }),
    ...(t.command !== undefined ? { command: t.command } : {}),
    ...(t.memory !== undefined ? { memoryBytes: t.memory } : {}),
    ...(t.cpus !== undefined ? { cpus: t.cpus } : {}),
  };
}

/** The vault's store settings, checked as a whole (one setting alone may be fine, not with another). */
function vaultOf(v: Layer['vault']): S3VaultConfig | undefined {
  if (v === undefined) return undefined;
  const problems: string[] = [];
  if (v.url === undefined) {
    const set = Object.keys(v).filter((k) => (v as Record<string, unknown>)[k] !== undefined);
    if (set.length > 0)
      problems.push(`vault: ${set.join(', ')} set but no vault.url (--vault, DORMANT_VAULT)`);
  }
  if (v.secretAccessKey !== undefined && v.secretAccessKeyCommand !== undefined)
    problems.push('vault: give secretAccessKey or secretAccessKeyCommand, not both');
  const secret = v.secretAccessKey ?? v.secretAccessKeyCommand;
  if ((v.accessKeyId === undefined) !== (secret === undefined))
    problems.push(
      'vault: accessKeyId and a secret (secretAccessKey, DORMANT_VAULT_SECRET_ACCESS_KEY or secretAccessKeyCommand) go together',
    );
  if (problems.length > 0) throw configError(problems);
  if (v.url === undefined) return undefined;
  return {
    url: v.url,
    ...(v.endpoint !== undefined ? { endpoint: v.endpoint } : {}),
    ...(v.region !== undefined ? { region: v.region } : {}),
    ...(v.accessKeyId !== undefined ? { accessKeyId: v.accessKeyId } : {}),
    ...(v.secretAccessKeyCommand !== undefined
      ? { secretAccessKey: { command: v.secretAccessKeyCommand } }
      : v.secretAccessKey !== undefined
        ? { secretAccessKey: { value: v.secretAccessKey } }
        : {}),
    cacheBytes: v.cacheSize ?? DEFAULTS.vault.cacheBytes,
    partSizeBytes: v.partSize ?? DEFAULTS.vault.partSizeBytes,
  };
}

/** The merged layers over the defaults. */
function resolveConfig(l: Layer): DaemonConfig {
  const D = DEFAULTS;
  const dataDir = l.dataDir ?? D.dataDir;
  const listen = l.listen ?? D.listen;
  const prices = l.meter?.prices;
  return {
    listen,
    dataDir,
    masterKey:
      l.masterKeyCommand !== undefined
        ? { command: l.masterKeyCommand }
        : { file: l.masterKeyFile ?? defaultMasterKeyFile(dataDir) },
    log: l.log ?? D.log,
    logLevel: l.logLevel ?? D.logLevel,
    logFormat: l.logFormat ?? D.logFormat,
    ...(l.logFile !== undefined ? { logFile: l.logFile } : {}),
    logMaxBytes: l.logMaxSize ?? D.logMaxBytes,
    logKeep: l.logKeep ?? D.logKeep,
    debug: l.debug ?? [...D.debug],
    proxy: {
      enabled: l.proxy?.enabled ?? D.proxy.enabled,
      listen: l.proxy?.listen ?? defaultProxyListen(listen),
      domain: l.proxy?.domain ?? D.proxy.domain,
      wakeTimeoutMs: l.proxy?.wakeTimeout ?? D.proxy.wakeTimeoutMs,
      tcp: l.proxy?.tcp ?? D.proxy.tcp,
    },
    policy: {
      enabled: l.policy?.enabled ?? D.policy.enabled,
      intervalMs: l.policy?.interval ?? D.policy.intervalMs,
      cpuActiveShare: l.policy?.cpuActiveShare ?? D.policy.cpuActiveShare,
      // The file's node defaults overlay the built-in ones: setting pauseAfter keeps hibernateAfter.
      defaults: { ...D.policy.defaults, ...policyOf(l.policy?.defaults) },
      tenants: Object.fromEntries(Object.entries(l.policy?.tenants ?? {}).map(([t, p]) => [t, policyOf(p)])),
    },
    sandbox: {
      allowedSourceRoots: l.sandbox?.allowedSourceRoots ?? [],
      seccompProfile: l.sandbox?.seccompProfile ?? D.sandbox.seccompProfile,
      ...(l.sandbox?.apparmorProfile !== undefined ? { apparmorProfile: l.sandbox.apparmorProfile } : {}),
      userNamespace: l.sandbox?.userNamespace ?? D.sandbox.userNamespace,
      diskBytes: l.sandbox?.diskQuota ?? D.sandbox.diskBytes,
      ...(l.sandbox?.subnet !== undefined ? { subnet: l.sandbox.subnet } : {}),
    },
    checkpoint: {
      keep: l.checkpoint?.keep ?? D.checkpoint.keep,
      timeoutMs: l.checkpoint?.timeout ?? D.checkpoint.timeoutMs,
      templateCacheBytes: l.checkpoint?.templateCache ?? D.checkpoint.templateCacheBytes,
    },
    restore: {
      lazy: l.restore?.lazy ?? D.restore.lazy,
      pagesFromVault: l.restore?.pagesFromVault ?? D.restore.pagesFromVault,
      pagesFromVaultAboveBytes: l.restore?.pagesFromVaultAbove ?? D.restore.pagesFromVaultAboveBytes,
      timeoutMs: l.restore?.timeout ?? D.restore.timeoutMs,
    },
    importLimits: {
      maxBytes: l.importLimits?.maxBytes ?? D.importLimits.maxBytes,
      maxMemberBytes: l.importLimits?.maxMemberBytes ?? D.importLimits.maxMemberBytes,
      maxEntries: l.importLimits?.maxEntries ?? D.importLimits.maxEntries,
    },
    api: {
      bodyLimitBytes: l.api?.bodyLimit ?? D.api.bodyLimitBytes,
      execBodyLimitBytes: l.api?.execBodyLimit ?? D.api.execBodyLimitBytes,
      maxUploadBytes: l.api?.maxUpload ?? D.api.maxUploadBytes,
    },
    images: {
      insecureRegistries: l.images?.insecureRegistries ?? [],
      pullTimeoutMs: l.images?.pullTimeout ?? D.images.pullTimeoutMs,
      maxPullBytes: l.images?.maxPullSize ?? D.images.maxPullBytes,
      gcIntervalMs: l.images?.gcInterval ?? D.images.gcIntervalMs,
    },
    e2b: {
      ...(l.e2b?.listen !== undefined ? { listen: l.e2b.listen } : {}),
      templates: Object.fromEntries(
        Object.entries(l.e2b?.templates ?? {}).map(([k, t]) => [k, e2bTemplateOf(t)]),
      ),
    },
    runtime: {
      default: l.runtime?.default ?? 'runc',
      tenants: l.runtime?.tenants ?? {},
      runscPlatform: l.runtime?.runscPlatform ?? 'ptrace',
    },
    egress: {
      default: l.egress?.default ?? { mode: 'internet' },
      tenants: l.egress?.tenants ?? {},
      dns: l.egress?.dns ?? [],
    },
    vault: vaultOf(l.vault),
    state: l.state?.url !== undefined ? { url: l.state.url } : undefined,
    node: {
      ...(l.node?.name !== undefined ? { name: l.node.name } : {}),
      ...(l.node?.url !== undefined ? { url: l.node.url.replace(/\/$/, '') } : {}),
      leaseMs: l.node?.lease ?? D.node.leaseMs,
    },
    meter: {
      intervalMs: l.meter?.interval ?? D.meter.intervalMs,
      prices: {
        ...(prices?.currency !== undefined ? { currency: prices.currency } : {}),
        ...(prices?.nodeCostPerHour !== undefined ? { nodeCostPerHour: prices.nodeCostPerHour } : {}),
        ...(prices?.nodeVcpus !== undefined ? { nodeVcpus: prices.nodeVcpus } : {}),
        ...(prices?.nodeMemory !== undefined ? { nodeMemoryBytes: prices.nodeMemory } : {}),
        ...(prices?.cpuShare !== undefined ? { cpuShare: prices.cpuShare } : {}),
        ...(prices?.storagePerGiBMonth !== undefined
          ? { storagePerGiBMonth: prices.storagePerGiBMonth }
          : {}),
      },
    },
  };
}

export interface LoadOptions {
  /** The file named by `--config` (it must exist). Default: DORMANT_CONFIG, else DEFAULT_CONFIG_FILE when it exists. */
  file?: string;
  /** Flags as raw layer values (flagLayerRaw). */
  flags?: Record<string, unknown>;
  /** Default: the process environment. */
  env?: NodeJS.ProcessEnv;
  /** What relative paths from flags and the environment are relative to. Default: the working directory. */
  cwd?: string;
}

export interface LoadedConfig {
  config: DaemonConfig;
  /** The file read, if any. */
  file: string | undefined;
}

/** Reads the configuration file (if any), the environment and the flags; throws INVALID_ARGUMENT naming every bad key. */
export function loadConfig(o: LoadOptions = {}): LoadedConfig {
  const env = o.env ?? process.env;
  const cwd = o.cwd ?? process.cwd();
  const named =
    o.file ?? (env[CONFIG_ENV] !== undefined && env[CONFIG_ENV] !== '' ? env[CONFIG_ENV] : undefined);
  const path = named !== undefined ? resolve(cwd, named) : DEFAULT_CONFIG_FILE;
  let text: string | undefined;
  try {
    text = readFileSync(path, 'utf8');
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    // The default file is optional; one the operator named is not.
    if (named !== undefined || code !== 'ENOENT')
      throw configError([`${path}: ${code === 'ENOENT' ? 'no such file' : (e as Error).message}`]);
  }
  let fileLayer: Layer = {};
  if (text !== undefined) {
    let raw: unknown;
    try {
      raw = JSON.parse(text);
    } catch (e) {
      throw configError([`${path}: not JSON: ${(e as Error).message}`]);
    }
    fileLayer = parseLayer(raw, { kind: 'file', path }, dirname(path));
  }
  const envLayer = parseLayer(envLayerRaw(env), { kind: 'env' }, cwd);
  const flagLayer = parseLayer(o.flags ?? {}, { kind: 'flags' }, cwd);
  return {
    config: resolveConfig(merge(merge(fileLayer, envLayer), flagLayer)),
    file: text !== undefined ? path : undefined,
  };
}

// ---- printing ----

function exactDuration(ms: number): string {
  for (const [unit, n] of [
    ['d', 86_400_000],
    ['h', 3_600_000],
    ['m', 60_000],
    ['s', 1000],
  ] as const) {
    if (ms !== 0 && ms % n === 0) return `${ms / n}${unit}`;
  }
  return ms === 0 ? '0s' : `${ms}ms`;
}

function exactSize(bytes: number): string {
  for (const [unit, n] of [
    ['T', 1024 ** 4],
    ['G', 1024 ** 3],
    ['M', 1024 ** 2],
    ['K', 1024],
  ] as const) {
    if (bytes !== 0 && bytes % n === 0) return `${bytes / n}${unit}`;
  }
  return String(bytes);
}

function policyText(p: SandboxPolicy): Record<string, string> {
  const out: Record<string, string> = {};
  if (p.pauseAfterMs !== undefined) out.pauseAfter = exactDuration(p.pauseAfterMs);
  if (p.hibernateAfterMs !== undefined) out.hibernateAfter = exactDuration(p.hibernateAfterMs);
  if (p.archiveAfterMs !== undefined) out.archiveAfter = exactDuration(p.archiveAfterMs);
  if (p.deleteAfterMs !== undefined) out.deleteAfter = exactDuration(p.deleteAfterMs);
  if (p.lifetimeMs !== undefined) out.lifetime = exactDuration(p.lifetimeMs);
  return out;
}

/**
 * The configuration in the file's own shape and units (a valid configuration file), with
 * secrets redacted: the master key command may carry a credential.
 */
export function configFileView(c: DaemonConfig): Record<string, unknown> {
  const p = c.meter.prices;
  return {
    listen: c.listen,
    dataDir: c.dataDir,
    ...('command' in c.masterKey ? { masterKeyCommand: '<redacted>' } : { masterKeyFile: c.masterKey.file }),
    log: c.log,
    logLevel: c.logLevel,
    logFormat: c.logFormat,
    ...(c.logFile !== undefined ? { logFile: c.logFile } : {}),
    logMaxSize: exactSize(c.logMaxBytes),
    logKeep: c.logKeep,
    debug: c.debug,
    proxy: {
      enabled: c.proxy.enabled,
      listen: c.proxy.listen,
      domain: c.proxy.domain,
      wakeTimeout: exactDuration(c.proxy.wakeTimeoutMs),
      tcp: c.proxy.tcp,
    },
    policy: {
      enabled: c.policy.enabled,
      interval: exactDuration(c.policy.intervalMs),
      cpuActiveShare: c.policy.cpuActiveShare,
      defaults: policyText(c.policy.defaults),
      tenants: Object.fromEntries(Object.entries(c.policy.tenants).map(([t, x]) => [t, policyText(x)])),
    },
    sandbox: {
      allowedSourceRoots: c.sandbox.allowedSourceRoots,
      seccompProfile: c.sandbox.seccompProfile,
      ...(c.sandbox.apparmorProfile !== undefined ? { apparmorProfile: c.sandbox.apparmorProfile } : {}),
      userNamespace: c.sandbox.userNamespace,
      diskQuota: exactSize(c.sandbox.diskBytes),
      ...(c.sandbox.subnet !== undefined ? { subnet: c.sandbox.subnet } : {}),
    },
    checkpoint: {
      keep: c.checkpoint.keep,
      timeout: exactDuration(c.checkpoint.timeoutMs),
      templateCache: exactSize(c.checkpoint.templateCacheBytes),
    },
    restore: {
      lazy: c.restore.lazy,
      pagesFromVault: c.restore.pagesFromVault,
      pagesFromVaultAbove: exactSize(c.restore.pagesFromVaultAboveBytes),
      timeout: exactDuration(c.restore.timeoutMs),
    },
    runtime: c.runtime,
    egress: {
      default: egressText(c.egress.default),
      tenants: Object.fromEntries(Object.entries(c.egress.tenants).map(([t, p]) => [t, egressText(p)])),
      dns: c.egress.dns,
    },
    ...(c.vault
      ? {
          vault: {
            url: c.vault.url,
            ...(c.vault.endpoint !== undefined ? { endpoint: c.vault.endpoint } : {}),
            ...(c.vault.region !== undefined ? { region: c.vault.region } : {}),
            ...(c.vault.accessKeyId !== undefined ? { accessKeyId: c.vault.accessKeyId } : {}),
            ...(c.vault.secretAccessKey === undefined
              ? {}
              : 'command' in c.vault.secretAccessKey
                ? { secretAccessKeyCommand: '<redacted>' }
                : { secretAccessKey: '<redacted>' }),
            cacheSize: exactSize(c.vault.cacheBytes),
            partSize: exactSize(c.vault.partSizeBytes),
          },
        }
      : {}),
    ...(c.state ? { state: { url: redactUrl(c.state.url) } } : {}),
    node: {
      ...(c.node.name !== undefined ? { name: c.node.name } : {}),
      ...(c.node.url !== undefined ? { url: c.node.url } : {}),
      lease: exactDuration(c.node.leaseMs),
    },
    importLimits: {
      maxBytes: exactSize(c.importLimits.maxBytes),
      maxMemberBytes: exactSize(c.importLimits.maxMemberBytes),
      maxEntries: c.importLimits.maxEntries,
    },
    api: {
      bodyLimit: exactSize(c.api.bodyLimitBytes),
      execBodyLimit: exactSize(c.api.execBodyLimitBytes),
      maxUpload: exactSize(c.api.maxUploadBytes),
    },
    images: {
      insecureRegistries: c.images.insecureRegistries,
      pullTimeout: exactDuration(c.images.pullTimeoutMs),
      maxPullSize: exactSize(c.images.maxPullBytes),
      gcInterval: exactDuration(c.images.gcIntervalMs),
    },
    e2b: {
      ...(c.e2b.listen !== undefined ? { listen: c.e2b.listen } : {}),
      templates: Object.fromEntries(
        Object.entries(c.e2b.templates).map(([k, t]) => [
          k,
          {
            ...('rootfs' in t ? { rootfs: t.rootfs } : { image: t.image }),
            ...(t.command !== undefined ? { command: t.command } : {}),
            ...(t.memoryBytes !== undefined ? { memory: exactSize(t.memoryBytes) } : {}),
            ...(t.cpus !== undefined ? { cpus: t.cpus } : {}),
          },
        ]),
      ),
    },
    meter: {
      interval: exactDuration(c.meter.intervalMs),
      prices: {
        ...(p.currency !== undefined ? { currency: p.currency } : {}),
        ...(p.nodeCostPerHour !== undefined ? { nodeCostPerHour: p.nodeCostPerHour } : {}),
        ...(p.nodeVcpus !== undefined ? { nodeVcpus: p.nodeVcpus } : {}),
        ...(p.nodeMemoryBytes !== undefined ? { nodeMemory: exactSize(p.nodeMemoryBytes) } : {}),
        ...(p.cpuShare !== undefined ? { cpuShare: p.cpuShare } : {}),
        ...(p.storagePerGiBMonth !== undefined ? { storagePerGiBMonth: p.storagePerGiBMonth } : {}),
      },
    },
  };
}

/** The defaults alone, for a daemon embedded with its data directory (and address) given in code. */
export function defaultConfig(o: { dataDir: string; listen?: string }): DaemonConfig {
  return resolveConfig({ dataDir: o.dataDir, ...(o.listen !== undefined ? { listen: o.listen } : {}) });
}
