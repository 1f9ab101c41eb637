/**
 * Typed errors of the SDK. Every error the API answers carries a stable `code`
 * (`SANDBOX_NOT_FOUND`, `ILLEGAL_TRANSITION`, ...), and each code a family in the API's error
 * table (API_ERRORS in contract.gen.ts, generated from the daemon's); the SDK maps each family
 * to a class, so callers can `catch (e) { if (e instanceof NotFoundError) ... }` and still read
 * `e.code`, `e.status` and `e.hint`.
 *
 * @example
 * ```ts
 * import { Sandbox, NotFoundError } from '@dormant/sdk';
 * try {
 *   await Sandbox.connect('sb-0123456789abcdef');
 * } catch (e) {
 *   if (e instanceof NotFoundError) console.log(e.code, e.hint); // SANDBOX_NOT_FOUND
 *   else throw e;
 * }
 * ```
 */

import { API_ERRORS, type ApiErrorCode, type ErrorFamily } from './contract.gen.js';

/** Any error the dormant API answered (or the daemon could not be reached), with its stable code. */
export class DormantApiError extends Error {
  /** Stable: what scripts match on. */
  readonly code: string;
  /** The HTTP status the API answered; 0 when no answer came. */
  readonly status: number;
  /** What to do about it. */
  readonly hint: string | undefined;
  constructor(code: string, message: string, status: number, hint?: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = 'DormantApiError';
    this.code = code;
    this.status = status;
    this.hint = hint;
  }
}

/**
 * The token is missing, unknown or revoked (family `unauthenticated`: `UNAUTHORIZED`, 401).
 * @example
 * ```ts
 * catch (e) { if (e instanceof AuthenticationError) console.error('set DORMANT_TOKEN'); }
 * ```
 */
export class AuthenticationError extends DormantApiError {
  override readonly name = 'AuthenticationError';
}

/** The token may not do this (family `forbidden`, 403): an admin token, or an allowed path, is needed. */
export class ForbiddenError extends DormantApiError {
  override readonly name = 'ForbiddenError';
}

/**
 * No such sandbox, checkpoint or token for this token's tenant (family `not-found`, 404).
 * Another tenant's ids answer this too.
 * @example
 * ```ts
 * const gone = await sb.getInfo().catch((e) => e instanceof NotFoundError);
 * ```
 */
export class NotFoundError extends DormantApiError {
  override readonly name = 'NotFoundError';
}

/** The request was invalid (family `invalid`: `INVALID_ARGUMENT`, 400); the message names the field. */
export class InvalidArgumentError extends DormantApiError {
  override readonly name = 'InvalidArgumentError';
}

/**
 * Not possible in the sandbox's current state (family `conflict`: `ILLEGAL_TRANSITION`, ...), e.g.
 * exec in a hibernated sandbox. The hint says what to do first.
 * @example
 * ```ts
 * try { await sb.exec('ls'); } catch (e) { if (e instanceof ConflictError) await sb.resume(); }
 * ```
 */
export class ConflictError extends DormantApiError {
  override readonly name = 'ConflictError';
}

/**
 * A lifecycle operation failed on the node (family `operation`: `HIBERNATE_FAILED`,
 * `RESUME_FAILED`, `CRIU_*`, `RUNTIME_*_FAILED`, ...). The sandbox is left as the message says (a failed hibernate
 * leaves it running; a failed resume keeps the checkpoint).
 */
export class SandboxOperationError extends DormantApiError {
  override readonly name = 'SandboxOperationError';
}

/** The checkpoint vault refused or failed (family `vault`: `VAULT_*`, `*_KEY_DESTROYED`). */
export class VaultError extends DormantApiError {
  override readonly name = 'VaultError';
}

/** The daemon could not be reached (`DAEMON_UNREACHABLE`): not running, or a wrong URL. */
export class ConnectionError extends DormantApiError {
  override readonly name = 'ConnectionError';
}

/** The call took longer than the client's `requestTimeoutMs` (`TIMEOUT`). */
export class TimeoutError extends DormantApiError {
  override readonly name = 'TimeoutError';
}

/**
 * Codes the client makes itself (status 0: no answer came), besides the API's (API_ERRORS).
 */
export const CLIENT_ERROR_CODES = ['DAEMON_UNREACHABLE', 'TIMEOUT'] as const;

/** The class of each family of the API's error table. */
const CLASS_OF_FAMILY: Record<ErrorFamily, typeof DormantApiError> = {
  invalid: InvalidArgumentError,
  unauthenticated: AuthenticationError,
  forbidden: ForbiddenError,
  'not-found': NotFoundError,
  conflict: ConflictError,
  operation: SandboxOperationError,
  vault: VaultError,
  'too-large': DormantApiError,
  unprocessable: DormantApiError,
  timeout: DormantApiError,
  unavailable: DormantApiError,
  internal: DormantApiError,
};

/**
 * The error class for an API code and HTTP status: the code's family in the API's error table
 * (API_ERRORS, generated from the daemon's); a code this SDK does not know (a newer daemon's)
 * is classed by its status; otherwise DormantApiError.
 */
export function errorClassFor(code: string, status: number): typeof DormantApiError {
  if (code === 'DAEMON_UNREACHABLE') return ConnectionError;
  if (code === 'TIMEOUT') return TimeoutError;
  if (Object.hasOwn(API_ERRORS, code)) return CLASS_OF_FAMILY[API_ERRORS[code as ApiErrorCode].family];
  if (status === 401) return AuthenticationError;
  if (status === 403) return ForbiddenError;
  if (status === 404) return NotFoundError;
  if (status === 400) return InvalidArgumentError;
  if (status === 409) return ConflictError;
  return DormantApiError;
}

/** Builds the typed error for an API answer. */
export function apiError(
  code: string,
  message: string,
  status: number,
  hint?: string,
  options?: { cause?: unknown },
): DormantApiError {
  const C = errorClassFor(code, status);
  return new C(code, message, status, hint, options);
}
