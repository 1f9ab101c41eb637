/**
 * The error table: every code has a status, a family and a hint, and a family's statuses are
 * the ones that family means; DormantError takes its status and default hint from the table.
 */
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { DormantError, ERROR_FAMILIES, ERRORS, ErrorCode, errorInfo, type ErrorFamily } from './errors.js';

/** The statuses each family may answer with. */
const STATUSES: Record<ErrorFamily, readonly number[]> = {
  invalid: [400, 405, 415],
  unauthenticated: [401],
  forbidden: [403],
  'not-found': [404],
  conflict: [409],
  'too-large': [413, 431],
  unprocessable: [422],
  operation: [500],
  vault: [409, 410, 500],
  timeout: [408, 504],
  unavailable: [502, 503],
  internal: [500],
};

describe('the error table', () => {
  test('every code has a status, a family and a hint', () => {
    for (const [code, e] of Object.entries(ERRORS)) {
      assert.match(code, /^[A-Z][A-Z0-9_]*$/, code);
      assert.ok(
        Number.isInteger(e.status) && e.status >= 400 && e.status <= 599,
        `${code}: status ${e.status}`,
      );
      assert.ok((ERROR_FAMILIES as readonly string[]).includes(e.family), `${code}: family ${e.family}`);
      assert.ok(STATUSES[e.family].includes(e.status), `${code}: ${e.status} is not a ${e.family} status`);
      assert.ok(e.hint.trim().length > 0, `${code}: no hint`);
    }
  });

  test('ErrorCode names every code of the table, and only those', () => {
    assert.deepEqual(Object.keys(ErrorCode), Object.keys(ERRORS));
    for (const [k, v] of Object.entries(ErrorCode)) assert.equal(k, v);
  });

  test('codes that shipped keep their status', () => {
    // Scripts match on these; a change here is a break of the API, not a refactor.
    const shipped: Record<string, number> = {
      INVALID_ARGUMENT: 400,
      UNAUTHORIZED: 401,
      FORBIDDEN: 403,
      HOST_PATH_FORBIDDEN: 403,
      NOT_FOUND: 404,
      SANDBOX_NOT_FOUND: 404,
      CHECKPOINT_NOT_FOUND: 404,
      ILLEGAL_TRANSITION: 409,
      SANDBOX_NAME_TAKEN: 409,
      CHECKPOINT_DAMAGED: 409,
      CHECKPOINT_HAS_SECRETS: 409,
      LAST_ADMIN_TOKEN: 409,
      TENANT_KEY_DESTROYED: 410,
      CHECKPOINT_ARCHIVE_TOO_LARGE: 413,
      CHECKPOINT_ARCHIVE_INVALID: 422,
      CHECKPOINT_OUTSIDE_PROFILE: 422,
      INTERNAL: 500,
      HIBERNATE_FAILED: 500,
      RESUME_FAILED: 500,
      WAKE_FAILED: 502,
      PROXY_UPSTREAM: 502,
      WAKE_TIMEOUT: 503,
      PROXY_BUSY: 503,
      PROXY_DISABLED: 503,
      COMMAND_TIMEOUT: 504,
    };
    for (const [code, status] of Object.entries(shipped)) assert.equal(errorInfo(code).status, status, code);
  });

  test('a DormantError answers its code’s status and hint; a site may give a better hint', () => {
    const e = new DormantError(ErrorCode.SANDBOX_NAME_TAKEN, 'name x is taken');
    assert.equal(e.status, 409);
    assert.equal(e.hint, ERRORS.SANDBOX_NAME_TAKEN.hint);
    assert.deepEqual(e.toJSON(), { code: 'SANDBOX_NAME_TAKEN', message: 'name x is taken', hint: e.hint });
    // The status option is left over from before the table: the table wins.
    const old = new DormantError('CHECKPOINT_NOT_FOUND', 'no checkpoint', {
      status: 409,
      hint: 'look elsewhere',
    });
    assert.equal(old.status, 404);
    assert.equal(old.hint, 'look elsewhere');
  });

  test('an unknown code is internal; a relayed error keeps what its peer answered', () => {
    assert.deepEqual(errorInfo('NO_SUCH_CODE'), ERRORS.INTERNAL);
    assert.deepEqual(errorInfo('toString'), ERRORS.INTERNAL);
    const r = DormantError.relayed('DAEMON_UNREACHABLE', 'cannot reach dormant', 0);
    assert.equal(r.code, 'DAEMON_UNREACHABLE');
    assert.equal(r.status, 0);
    assert.equal(r.hint, undefined);
  });
});
