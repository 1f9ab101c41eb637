/** Request and response shapes of the HTTP API: one zod schema validates and documents each. */
import { z } from 'zod';
import { parseDurationMs, parseSizeBytes } from '../domain/units.js';
import { GPU_POLICIES } from '../domain/gpu.js';

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

export const CreateSandboxBody = z.strictObject({
  name: z.string().min(1).max(63).optional(),
  rootfs: z.string().min(1).max(4096).optional(),
  image: z.string().min(1).max(4096).optional(),
  /** May be empty with an image: the image's Entrypoint and Cmd are used. */
  command: z.array(z.string().max(65_536)).max(1024).default([]),
  env: z.record(envName, z.string().max(65_536)).optional(),
  ports: z
    .array(
      z.union([
        z.number().int().min(1).max(65535),
        z.strictObject({ port: z.number().int().min(1).max(65535), public: z.boolean().default(false) }),
      ]),
    )
    .max(32)
    .optional(),
  memory: size.optional(),
  cpus: z.number().positive().max(256).optional(),
  /** Disk quota of the writable layer (`10G`); default: the daemon's. */
  disk: size.optional(),
  idle: duration.optional(),
  pauseAfter: duration.optional(),
  archiveAfter: duration.optional(),
  lifetime: duration.optional(),
  onResume: z.array(z.string().max(65_536)).min(1).max(1024).optional(),
  /** GPUs: `all`, or device indexes like `0,1`. */
  gpus: z
    .union([z.string().max(64), z.array(z.number().int().min(0).max(255)).max(64)])
    .transform((v) => (typeof v === 'string' ? v : v.join(',')))
    .optional(),
  /** What hibernate does when the sandbox holds GPU state. Default keep-running. */
  gpuPolicy: z.enum(GPU_POLICIES).optional(),
});
export type CreateSandboxBody = z.infer<typeof CreateSandboxBody>;

export const ExecBody = z.strictObject({
  command: z.array(z.string().max(65_536)).min(1).max(1024),
  timeoutMs: z.number().int().positive().max(3_600_000).optional(),
  stdin: z
    .string()
    .max(16 * 1024 * 1024)
    .optional(),
});

export const KeepaliveBody = z.strictObject({ for: duration.optional() }).optional();

export const IdParams = z.object({ id: z.string().min(1).max(128) });

export const LogsQuery = z.object({
  follow: z
    .enum(['1', 'true', '0', 'false'])
    .optional()
    .transform((v) => v === '1' || v === 'true'),
});

export const ForkBody = z.strictObject({ name: z.string().min(1).max(63).optional() }).optional();

export const ImportBody = z.strictObject({
  /** Absolute path of the archive on the daemon's machine. */
  archive: z.string().min(1).max(4096),
  image: z.string().min(1).max(4096).optional(),
  name: z.string().min(1).max(63).optional(),
  ports: z.array(z.number().int().min(1).max(65535)).max(32).optional(),
  memory: size.optional(),
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
});

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
