/**
 * GET /v1/sandboxes as a query: its filters and its pages. The cursor is opaque to clients:
 * base64url of the last listed sandbox's place in the listing order (createdAt, id), so a
 * page starts right after it whatever was created or removed meanwhile, and nothing is listed
 * twice.
 */
import { DormantError, ErrorCode } from '../domain/errors.js';
import { validateLabelKey } from '../domain/sandbox.js';

export interface ListCursor {
  createdAt: number;
  id: string;
}

export function encodeCursor(c: ListCursor): string {
  return Buffer.from(JSON.stringify([c.createdAt, c.id])).toString('base64url');
}

/** The cursor's place, or INVALID_ARGUMENT for one this API did not make. */
export function decodeCursor(text: string): ListCursor {
  let v: unknown;
  try {
    v = JSON.parse(Buffer.from(text, 'base64url').toString('utf8'));
  } catch {
    v = undefined;
  }
  if (
    !Array.isArray(v) ||
    v.length !== 2 ||
    !Number.isSafeInteger(v[0]) ||
    typeof v[1] !== 'string' ||
    v[1].length > 128
  )
    throw new DormantError(ErrorCode.INVALID_ARGUMENT, 'invalid cursor: pass the nextCursor of a listing', {
      hint: 'start again without a cursor',
    });
  return { createdAt: v[0] as number, id: v[1] };
}

/** `k=v` (the label has that value) or `k` (the label is present), checked. */
export function parseLabelFilter(text: string): readonly [string, string?] {
  const i = text.indexOf('=');
  if (i < 0) return [validateLabelKey(text)];
  return [validateLabelKey(text.slice(0, i)), text.slice(i + 1)];
}
