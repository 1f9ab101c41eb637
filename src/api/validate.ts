/** Request validation: one zod schema parses each request part, or the answer is a 400. */
import type { z } from 'zod';
import { DormantError, ErrorCode } from '../domain/errors.js';
import type { CreateSandboxInput } from '../control/ops/create.js';

/**
 * Parses `value` with `schema`; on failure throws INVALID_ARGUMENT (400) naming the first bad
 * field, with every issue in `details` for programs.
 */
export function parse<T extends z.ZodType>(schema: T, value: unknown, what: string): z.output<T> {
  const nul = findNul(value, []);
  if (nul !== undefined) {
    // No path, name, argument or variable may hold a NUL byte: the kernel would cut it there.
    throw new DormantError(
      ErrorCode.INVALID_ARGUMENT,
      `invalid ${what}: ${nul || what}: contains a NUL byte`,
    );
  }
  const r = schema.safeParse(value);
  if (!r.success) {
    const issue = r.error.issues[0];
    const path = issue && issue.path.length > 0 ? issue.path.join('.') : what;
    throw new DormantError(
      ErrorCode.INVALID_ARGUMENT,
      `invalid ${what}: ${path}: ${issue?.message ?? 'invalid'}`,
      {
        details: { issues: r.error.issues.map((i) => ({ path: i.path.join('.'), message: i.message })) },
      },
    );
  }
  return r.data;
}

/** The path of the first string (or key) holding a NUL byte, if any. */
function findNul(value: unknown, path: string[], depth = 0): string | undefined {
  if (depth > 64) return undefined;
  if (typeof value === 'string') return value.includes('\u0000') ? path.join('.') : undefined;
  if (Array.isArray(value)) {
    for (const [i, v] of value.entries()) {
      const hit = findNul(v, [...path, String(i)], depth + 1);
      if (hit !== undefined) return hit;
    }
    return undefined;
  }
  if (typeof value === 'object' && value !== null) {
    for (const [k, v] of Object.entries(value)) {
      if (k.includes('\u0000')) return [...path, k.split('\u0000').join('\\0')].join('.');
      const hit = findNul(v, [...path, k], depth + 1);
      if (hit !== undefined) return hit;
    }
  }
  return undefined;
}

type SandboxSource = Pick<
  CreateSandboxInput,
  'rootfs' | 'image' | 'env' | 'ports' | 'memoryBytes' | 'cpus' | 'diskBytes'
>;

/**
 * A body's root filesystem or image, environment, ports and limits as the controller takes
 * them: a sandbox's create and a template's builder read the same fields.
 */
export function sourceAndLimits(b: {
  rootfs?: string | undefined;
  image?: string | undefined;
  env?: Record<string, string> | undefined;
  ports?: SandboxSource['ports'] | undefined;
  memory?: number | undefined;
  cpus?: number | undefined;
  disk?: number | undefined;
}): SandboxSource {
  return {
    ...(b.rootfs !== undefined ? { rootfs: b.rootfs } : {}),
    ...(b.image !== undefined ? { image: b.image } : {}),
    ...(b.env !== undefined ? { env: b.env } : {}),
    ...(b.ports !== undefined ? { ports: b.ports } : {}),
    ...(b.memory !== undefined ? { memoryBytes: b.memory } : {}),
    ...(b.cpus !== undefined ? { cpus: b.cpus } : {}),
    ...(b.disk !== undefined ? { diskBytes: b.disk } : {}),
  };
}
