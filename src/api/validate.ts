/** Request validation: one zod schema parses each request part, or the answer is a 400. */
import type { z } from 'zod';
import { DormantError, ErrorCode } from '../domain/errors.js';

/**
 * Parses `value` with `schema`; on failure throws INVALID_ARGUMENT (400) naming the first bad
 * field, with every issue in `details` for programs.
 */
export function parse<T extends z.ZodType>(schema: T, value: unknown, what: string): z.output<T> {
  const r = schema.safeParse(value);
  if (!r.success) {
    const issue = r.error.issues[0];
    const path = issue && issue.path.length > 0 ? issue.path.join('.') : what;
    throw new DormantError(
      ErrorCode.INVALID_ARGUMENT,
      `invalid ${what}: ${path}: ${issue?.message ?? 'invalid'}`,
      {
        status: 400,
        details: { issues: r.error.issues.map((i) => ({ path: i.path.join('.'), message: i.message })) },
      },
    );
  }
  return r.data;
}
