/**
 * Request and response shapes of the HTTP API: one zod schema validates and documents each.
 * This file is the API's contract: the server's answers are typed by the response schemas
 * (z.output), /v1/openapi.json is made from them (openapi.ts), and the SDK's types
 * (src/sdk/contract.ts) are generated from them by `npm run gen` (scripts/gen-sdk-types.mjs).
 * Describe a field with `.describe()`, not a comment, so the description reaches all three.
 */
import { z } from 'zod';
import { parseDurationMs, parseSizeBytes } from '../domain/units.js';
import { GPU_POLICIES } from '../domain/gpu.js';
import {
  LABEL_KEY_PATTERN,
  MAX_LABEL_VALUE,
  MAX_LABELS,
  SANDBOX_STATES,
  type SandboxState,
} from '../domain/sandbox.js';
import { ERRORS } from '../domain/errors.js';

/** A duration in milliseconds, or a human one (`15m`, `7d`). */
const duration = z.union([z.number().int().nonnegative(), z.string().max(32)]).transform((v, ctx) => {
  if (typeof v === 'number') return v;
  try {
    return parseDurationMs(v);
  } catch (e) {
    ctx.addIssue({ code: 'custom', message: (e as Error).message });
    return z.NEVER;
  }
});

const size = z.union([z.number().int().positive(), z.string().max(32)]).transform((v, ctx) => {
  if (typeof v === 'number') return v;
  try {
    return parseSizeBytes(v);
  } catch (e) {
    ctx.addIssue({ code: 'custom', message: (e as Error).message });
    return z.NEVER;
  }
});

const envName = z
  .string()
  .regex(/^[A-Za-z_][A-Za-z0-9_]{0,127}$/, 'environment variable names: letters, digits, _');

const labelKey = z
  .string()
  .regex(
    LABEL_KEY_PATTERN,
    "label keys: 1-63 letters, digits, '.', '_', '/', '-', starting with a letter or digit",
  );

const labels = z
  .record(labelKey, z.string().max(MAX_LABEL_VALUE))
  .refine((l) => Object.keys(l).length <= MAX_LABELS, `at most ${MAX_LABELS} labels`)
  .describe(`your own key/value labels (at most ${MAX_LABELS}; values up to ${MAX_LABEL_VALUE} characters)`);

export const CreateSandboxBody = z.strictObject({
  name: z.string().min(1).max(63).optional(),
  rootfs: z.string().min(1).max(4096).optional(),
  image: z
    .string()
    .min(1)
    .max(4096)
    .optional()
    .describe(
      'a registry reference (REGISTRY/NAME:TAG or REGISTRY/NAME@sha256:DIGEST), pulled with your registry login; or an absolute OCI image layout folder (DIR[:TAG])',
    ),
  command: z
    .array(z.string().max(65_536))
    .max(1024)
    .default([])
    .describe("may be empty with an image: the image's Entrypoint and Cmd are used"),
  env: z.record(envName, z.string().max(65_536)).optional(),
  ports: z
    .array(
      z.union([
        z.number().int().min(1).max(65535),
        z.strictObject({ port: z.number().int().min(1).max(65535), public: z.boolean().default(false) }),
      ]),
    )
    .max(32)
    .optional()
    .describe('ports inside the sandbox; `public: true` opens one through the wake proxy without a token'),
  memory: size.optional().describe('bytes, or a size like `512M`'),
  cpus: z.number().positive().max(256).optional(),
  disk: size
    .optional()
    .describe("disk quota of the writable layer: bytes, or a size like `10G`; default: the daemon's"),
  idle: duration
    .optional()
    .describe('hibernate after this long idle: milliseconds, or a duration like `15m`'),
  pauseAfter: duration.optional(),
  archiveAfter: duration.optional(),
  lifetime: duration.optional(),
  onResume: z.array(z.string().max(65_536)).min(1).max(1024).optional(),
  gpus: z
    .union([z.string().max(64), z.array(z.number().int().min(0).max(255)).max(64)])
    .transform((v) => (typeof v === 'string' ? v : v.join(',')))
    .optional()
    .describe('GPUs: `all`, or device indexes like `0,1`; refused on a node without an NVIDIA driver'),
  gpuPolicy: z
    .enum(GPU_POLICIES)
    .optional()
    .describe('what hibernate does when the sandbox holds GPU state; default keep-running (docs/GPU.md)'),
  labels: labels.optional(),
  template: z
    .string()
    .min(1)
    .max(128)
    .optional()
    .describe(
      "a template's name or id: the sandbox starts from its checkpoint (memory, processes, files); give no rootfs, image, command, env, ports or limits",
    ),
  egress: z
    .union([z.string().max(16_384), z.array(z.string().max(253)).max(64)])
    .optional()
    .describe(
      "where it may connect beyond the node: `internet` (all but private ranges, the node and other sandboxes), `none`, or IPv4 CIDRs and host names like `198.18.0.0/15,api.example.com`; default: the tenant's (docs/NETWORK.md)",
    ),
  runtime: z
    .enum(['runc', 'runsc'])
    .optional()
    .describe(
      "its container runtime: `runc`, or `runsc` (gVisor's user-space kernel, docs/RUNTIME.md); default: the tenant's",
    ),
});
export type CreateSandboxBody = z.infer<typeof CreateSandboxBody>;

export const ExecBody = z.strictObject({
  command: z.array(z.string().max(65_536)).min(1).max(1024),
  timeoutMs: z.number().int().positive().max(3_600_000).optional(),
  stdin: z
    .string()
    .max(16 * 1024 * 1024)
    .optional(),
  stdinBase64: z
    .string()
    .max(22_369_624)
    .optional()
    .describe('stdin as base64, for bytes that are not text (instead of stdin)'),
  encoding: z
    .enum(['utf8', 'base64'])
    .optional()
    .describe('of stdout and stderr in the answer; default utf8'),
  maxOutputBytes: z
    .number()
    .int()
    .positive()
    .max(64 * 1024 * 1024)
    .optional()
    .describe('bytes kept of each of stdout and stderr; default 16 MiB (truncated says what was cut)'),
});

export const KeepaliveBody = z.strictObject({ for: duration.optional() }).optional();

export const IdParams = z.object({ id: z.string().min(1).max(128) });

export const LogsQuery = z.object({
  follow: z
    .enum(['1', 'true', '0', 'false'])
    .optional()
    .transform((v) => v === '1' || v === 'true'),
  restore: z
    .enum(['1', 'true', '0', 'false'])
    .optional()
    .transform((v) => v === '1' || v === 'true')
    .describe("the log of the sandbox's last failed restore (CRIU's) instead of its output"),
});

export const ForkBody = z
  .strictObject({
    name: z.string().min(1).max(63).optional(),
    labels: labels.optional().describe("the fork's labels instead of its parent's"),
  })
  .optional();

/** One query parameter given once or repeated (`?label=a&label=b`). */
const repeated = (item: z.ZodString, max: number) =>
  z
    .union([item, z.array(item).max(max)])
    .transform((v) => (typeof v === 'string' ? [v] : v))
    .optional();

const stateList = z
  .union([z.string().max(1024), z.array(z.string().max(1024)).max(16)])
  .transform((v, ctx) => {
    const out: SandboxState[] = [];
    for (const s of (typeof v === 'string' ? [v] : v).flatMap((x) => x.split(','))) {
      if (!(SANDBOX_STATES as readonly string[]).includes(s)) {
        ctx.addIssue({
          code: 'custom',
          message: `unknown state "${s.slice(0, 40)}": expected one or more of ${SANDBOX_STATES.join(', ')}`,
        });
        return z.NEVER;
      }
      out.push(s as SandboxState);
    }
    return out;
  });

/** GET /v1/sandboxes: filters (each given must match) and a page. */
export const ListSandboxesQuery = z.object({
  state: stateList
    .optional()
    .describe('only sandboxes in one of these states: comma-separated or repeated, e.g. `running,paused`'),
  label: repeated(z.string().max(512), 64).describe(
    'repeatable: `key=value` (the label has that value) or `key` (the sandbox has the label); all must match',
  ),
  name: z.string().max(63).optional().describe('only the sandbox of this name'),
  tenant: z
    .string()
    .max(63)
    .optional()
    .describe("only this tenant's sandboxes (an admin token sees every tenant)"),
  limit: z.coerce.number().int().min(1).max(1000).default(100).describe('sandboxes per page, 1-1000'),
  cursor: z.string().max(512).optional().describe("the previous page's `nextCursor`"),
});

/** A duration to set, or null to drop the sandbox's own value (the tenant's or node's applies). */
const durationPatch = duration.nullable().optional();

/** PATCH /v1/sandboxes/{id}: only what is given changes. */
export const UpdateSandboxBody = z.strictObject({
  labels: z
    .record(labelKey, z.string().max(MAX_LABEL_VALUE).nullable())
    .optional()
    .describe('labels to set; a null value removes that label; labels not named are kept'),
  idle: durationPatch.describe('hibernate after this long idle; null: the default again'),
  pauseAfter: durationPatch,
  archiveAfter: durationPatch,
  lifetime: durationPatch,
  egress: z
    .union([z.string().max(16_384), z.array(z.string().max(253)).max(64)])
    .optional()
    .describe(
      'a new egress policy, as create takes it (`internet`, `none`, or a list): a running sandbox follows at once, a sleeping one at its resume',
    ),
});
export type UpdateSandboxBody = z.infer<typeof UpdateSandboxBody>;

export const MetricsQuery = z.object({
  since: z.coerce
    .number()
    .int()
    .nonnegative()
    .optional()
    .describe('samples taken at or after this time (milliseconds since the epoch); default: the last hour'),
});

export const ImportBody = z.strictObject({
  /** Absolute path of the archive on the daemon's machine. */
  archive: z.string().min(1).max(4096),
  image: z.string().min(1).max(4096).optional(),
  name: z.string().min(1).max(63).optional(),
  ports: z.array(z.number().int().min(1).max(65535)).max(32).optional(),
  memory: size.optional(),
  egress: z
    .union([z.string().max(16_384), z.array(z.string().max(253)).max(64)])
    .optional()
    .describe("its egress policy, as create takes it; default: the tenant's"),
});

/** `POST /v1/checkpoints/import` with the archive as an `application/octet-stream` body. */
export const ImportUploadQuery = z.object({
  /** The archive's file name (its suffix says the compression: .tar, .tar.gz, .tar.zst). */
  fileName: z.string().min(1).max(255).optional(),
  image: z.string().min(1).max(4096).optional(),
  name: z.string().min(1).max(63).optional(),
  /** Comma-separated. */
  ports: z
    .string()
    .max(400)
    .transform((v, ctx) => {
      const out = v.split(',').map(Number);
      if (out.length > 32 || out.some((p) => !Number.isInteger(p) || p < 1 || p > 65535)) {
        ctx.addIssue({ code: 'custom', message: 'ports: up to 32 numbers from 1 to 65535, comma-separated' });
        return z.NEVER;
      }
      return out;
    })
    .optional(),
  memory: size.optional(),
  /** Its egress policy, as create takes it (comma-separated); default: the tenant's. */
  egress: z.string().max(16_384).optional(),
});

export const ExportQuery = z.object({
  allowPlaintext: z.enum(['true', 'false', '1', '0']).optional(),
  /** The client encrypts the archive (an encrypted OCI layer) before it is written anywhere. */
  encrypted: z.enum(['true', 'false', '1', '0']).optional(),
  compression: z.enum(['zstd', 'gzip', 'none']).optional(),
});

export const CheckpointsQuery = z.object({ sandbox: z.string().max(128).optional() });

export const EventsQuery = z.object({
  /** Replay transitions after this id (the SSE `Last-Event-ID` header does the same). */
  since: z.coerce.number().int().nonnegative().optional(),
});

export const CreateTokenBody = z.strictObject({
  tenant: z
    .string()
    .regex(/^[a-z0-9][a-z0-9_-]{0,62}$/, 'tenant names: lowercase letters, digits, - and _, up to 63'),
  /** An admin token sees and manages every tenant. */
  admin: z.boolean().default(false),
  /** A key in E2B's format (`e2b_` + hex), for programs written for E2B's SDK (docs/E2B.md). */
  e2b: z.boolean().default(false),
});

/** PUT /v1/registries/{host}: a tenant's login to a registry (checked with it, stored sealed). */
export const RegistryLoginBody = z.strictObject({
  username: z.string().min(1).max(256),
  password: z.string().min(1).max(4096),
});

export const RegistryHostParams = z.object({ host: z.string().min(1).max(255) });

/** A token's public id: a prefix (at least 8 hex digits) of its SHA-256. */
export const TokenIdParams = z.object({
  id: z.string().regex(/^[0-9a-fA-F]{8,64}$/, 'a token id: 8-64 hex digits'),
});

/** Resume from an older checkpoint than the newest (when the newest is damaged). */
export const ResumeBody = z.strictObject({ from: z.string().min(1).max(128).optional() }).optional();

/** GET /v1/cost (documented here; the route checks its query itself). */
export const CostQuery = z.object({
  since: z.string().max(32).optional().describe('only the last DURATION, e.g. 24h, 7d'),
  by: z.enum(['sandbox', 'tenant']).optional(),
  points: z.coerce
    .number()
    .int()
    .min(0)
    .max(200)
    .optional()
    .describe('a series of N cumulative (spent, alwaysWarm) points'),
});

// ---- answers ------------------------------------------------------------------------------

export const SandboxStateSchema = z.enum(SANDBOX_STATES);
export const GpuPolicySchema = z.enum(GPU_POLICIES);

export const SandboxSchema = z.object({
  id: z.string(),
  name: z.string(),
  tenant: z.string(),
  state: SandboxStateSchema,
  ports: z.array(z.object({ port: z.number().int(), public: z.boolean() })),
  address: z.string().nullable().describe("the sandbox's address on the node; null while it has none"),
  memoryBytes: z
    .number()
    .int()
    .nonnegative()
    .describe("memory the sandbox's cgroup holds now; 0 while hibernated or archived"),
  memoryLimitBytes: z.number().int().positive(),
  diskLimitBytes: z
    .number()
    .int()
    .positive()
    .nullable()
    .describe('disk quota of the writable layer; null: none (a sandbox made before quotas)'),
  cpus: z.number(),
  command: z.array(z.string()),
  source: z
    .discriminatedUnion('kind', [
      z.object({ kind: z.literal('rootfs'), path: z.string() }),
      z.object({
        kind: z.literal('image'),
        path: z.string(),
        tag: z.string().optional(),
        digest: z.string(),
        rootfs: z.string(),
      }),
    ])
    .describe('a root filesystem folder, or an OCI image layout (with the digest of its manifest)'),
  createdAt: z.iso.datetime(),
  stateSince: z.iso.datetime(),
  lastActiveAt: z.iso.datetime(),
  checkpointId: z.string().nullable().describe('the newest checkpoint, or null'),
  lastError: z.string().nullable().describe('why the sandbox failed, or why its last operation failed'),
  policy: z
    .object({
      pauseAfterMs: z.number().optional(),
      hibernateAfterMs: z.number().optional(),
      archiveAfterMs: z.number().optional(),
      deleteAfterMs: z.number().optional(),
      lifetimeMs: z.number().optional(),
    })
    .describe('idle policy in milliseconds; an absent one never fires'),
  gpus: z.string().nullable().describe('GPUs it was created with (`all`, `0,1`), or null'),
  gpuPolicy: GpuPolicySchema.describe('what hibernate does when it holds GPU state (docs/GPU.md)'),
  labels: z.record(z.string(), z.string()).describe('its labels ({} when none)'),
  egress: z
    .string()
    .nullable()
    .describe('its egress policy: `internet`, `none`, or its list; null: none at all (made before egress)'),
  runtime: z.enum(['runc', 'runsc']).describe('its container runtime: `runc`, or `runsc` (gVisor)'),
  node: z
    .string()
    .nullable()
    .describe(
      'in a fleet, the node it lives on (awake) or last answered for it (asleep); null on a node alone',
    ),
});
export type SandboxView = z.output<typeof SandboxSchema>;

/** GET /v1/sandboxes. */
export const SandboxListSchema = z.object({
  sandboxes: z.array(SandboxSchema),
  nextCursor: z
    .string()
    .optional()
    .describe('present when more sandboxes match: pass it as `cursor` for the next page'),
});
export type SandboxListView = z.output<typeof SandboxListSchema>;

/** One meter sample of a sandbox (GET /v1/sandboxes/{id}/metrics). */
export const MetricSampleSchema = z.object({
  at: z.number().int().describe('when it was taken, in milliseconds since the epoch'),
  cpuPercent: z
    .number()
    .nonnegative()
    .nullable()
    .describe('CPU used since the sample before, in percent of one CPU; null: no sample before to compare'),
  memoryBytes: z.number().int().nonnegative().describe('memory its cgroup held'),
  diskBytes: z
    .number()
    .int()
    .nonnegative()
    .nullable()
    .describe('bytes used on its writable layer; null: not known (a sandbox without a disk quota)'),
  egressBytes: z
    .number()
    .int()
    .nonnegative()
    .nullable()
    .describe('all it sent beyond the node so far (its egress); null: not known (no egress)'),
});
export type MetricSampleView = z.output<typeof MetricSampleSchema>;

export const SandboxMetricsSchema = z.object({
  samples: z
    .array(MetricSampleSchema)
    .describe('oldest first, taken while it was running or paused; at most 10 000'),
});

export const CheckpointSchema = z.object({
  id: z.string(),
  sandboxId: z.string(),
  tenant: z.string(),
  kind: z.enum(['memory', 'filesystem']).describe('memory: processes and files; filesystem: files only'),
  createdAt: z.iso.datetime(),
  logicalBytes: z.number().int().nonnegative(),
  storedBytes: z.number().int().nonnegative(),
  meta: z.record(z.string(), z.unknown()),
});
export type CheckpointView = z.output<typeof CheckpointSchema>;

/** One state transition, as GET /v1/events sends it (`event: transition`, `id:` = its id). */
export const TransitionSchema = z.object({
  id: z.number().int().positive(),
  sandboxId: z.string(),
  tenant: z.string(),
  from: SandboxStateSchema.nullable().describe('null: the sandbox was just made'),
  to: SandboxStateSchema,
  at: z.iso.datetime(),
  reason: z.string(),
});
export type TransitionView = z.output<typeof TransitionSchema>;

export const TokenSchema = z.object({
  id: z.string().describe('the first 12 hex digits of the SHA-256 of the token'),
  tenant: z.string(),
  admin: z.boolean(),
  createdAt: z.iso.datetime(),
  revokedAt: z.iso.datetime().nullable(),
});
export type TokenView = z.output<typeof TokenSchema>;

export const ExecResultSchema = z.object({
  exitCode: z.number().int(),
  stdout: z.string(),
  stderr: z.string(),
  durationMs: z.number(),
  truncated: z
    .object({ stdout: z.boolean(), stderr: z.boolean() })
    .describe('output cut at outputLimitBytes'),
  outputLimitBytes: z.number().int(),
});
export type ExecResultView = z.output<typeof ExecResultSchema>;

/** A sandbox port as reached through the wake proxy (GET /v1/sandboxes/{id}/url). */
export const SandboxUrlSchema = z.object({
  id: z.string(),
  port: z.number().int(),
  url: z.string().describe('`http://PORT-ID.<domain>:PROXYPORT/`'),
  host: z.string(),
  tcp: z
    .string()
    .nullable()
    .describe('`host:port` of the raw TCP listener for this port, or null when it has none'),
  public: z.boolean(),
  auth: z.enum(['token', 'none']).describe("'token': send the tenant's token; 'none': a public port"),
});

export const HealthSchema = z.object({ ok: z.boolean(), version: z.string() });

/** Every code the API can answer (the table in src/domain/errors.ts). */
export const ErrorCodeSchema = z.enum(
  Object.keys(ERRORS) as [keyof typeof ERRORS, ...(keyof typeof ERRORS)[]],
);

export const ErrorSchema = z.object({
  error: z.object({
    code: ErrorCodeSchema.describe('stable: what scripts match on (docs/API.md lists every code)'),
    message: z.string(),
    hint: z.string().optional().describe('what to do about it'),
  }),
});

export * from './schemas-toolbox.js';

// ---- templates (routes-templates.ts) -----------------------------------------------------

export const ReadyProbeBody = z
  .strictObject({
    port: z
      .number()
      .int()
      .min(1)
      .max(65535)
      .optional()
      .describe('ready once something inside listens on this TCP port'),
    command: z
      .array(z.string().max(65_536))
      .min(1)
      .max(1024)
      .optional()
      .describe('ready once this command, run inside, exits 0'),
    timeout: duration
      .optional()
      .describe('how long to wait: milliseconds or a duration like `30s`; default 60s'),
  })
  .describe('when the builder sandbox is checkpointed (both given: both must pass); none: at once');

export const CreateTemplateBody = z.strictObject({
  name: z.string().min(1).max(63),
  from: z
    .string()
    .min(1)
    .max(128)
    .optional()
    .describe('a running or paused sandbox (id or name) to checkpoint; it keeps running'),
  public: z.boolean().optional().describe('every tenant sees and uses it (admin tokens only)'),
  rootfs: z.string().min(1).max(4096).optional().describe('or: a builder sandbox from this root filesystem'),
  image: z.string().min(1).max(4096).optional().describe('or: a builder sandbox from this image'),
  command: z.array(z.string().max(65_536)).max(1024).default([]),
  env: z.record(envName, z.string().max(65_536)).optional(),
  ports: CreateSandboxBody.shape.ports,
  memory: size.optional(),
  cpus: z.number().positive().max(256).optional(),
  disk: size.optional(),
  ready: ReadyProbeBody.optional(),
});

export const TemplateSchema = z.object({
  id: z.string(),
  name: z.string(),
  tenant: z.string(),
  public: z.boolean(),
  checkpointId: z.string(),
  origin: z.string().describe('what it was made from: `sandbox ID`, `image REF` or `rootfs DIR`'),
  command: z.array(z.string()),
  ports: z.array(z.object({ port: z.number().int(), public: z.boolean() })),
  memoryLimitBytes: z.number().int(),
  logicalBytes: z.number().int().nullable().describe('bytes of the checkpoint (memory and files)'),
  storedBytes: z
    .number()
    .int()
    .nullable()
    .describe('bytes it added to the vault after dedup and compression'),
  createdAt: z.iso.datetime(),
});
export type TemplateView = z.output<typeof TemplateSchema>;

export const TemplateListSchema = z.object({ templates: z.array(TemplateSchema) });

export const PublishTemplateBody = z.strictObject({
  public: z.boolean().describe('true: every tenant sees it; false: only its own tenant again'),
});

/** A node of a fleet (GET /v1/nodes; api/fleet.ts nodeView). */
export const NodeSchema = z.object({
  name: z.string(),
  url: z.string().describe('where the other nodes reach its API'),
  proxyUrl: z.string().nullable().describe('its wake proxy, if it runs one'),
  state: z
    .enum(['active', 'draining', 'unreachable', 'lost'])
    .describe(
      'active: takes sandboxes; draining: hibernates its own, takes none; unreachable: its lease ran out, not yet marked; lost: its sandboxes were taken back',
    ),
  leaseUntil: z.string().describe('when its lease runs out unless renewed (ISO 8601, the database’s clock)'),
  startedAt: z.string(),
  lostAt: z.string().nullable(),
  capacity: z.object({
    memoryBytes: z.number().int(),
    cpus: z.number().int(),
    arch: z.string(),
    criuVersion: z.string().optional(),
    cpuFlags: z.array(z.string()).optional(),
    runtimes: z.array(z.string()),
  }),
  sandboxes: z.record(z.string(), z.number().int()).describe('its sandboxes by state'),
  memoryUsedBytes: z.number().int(),
});

export const ResumeQuery = z.strictObject({
  node: z.string().min(1).max(63).optional().describe('in a fleet, wake a sleeping sandbox on this node'),
});
