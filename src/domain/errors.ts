/**
 * One error class for the whole project. Every error a user can see carries a stable
 * `code` (what scripts match on), an HTTP status (what the API answers), a `hint` (what to
 * do about it) and the underlying `cause`. Messages name the sandbox, path or digest
 * involved and never carry a secret.
 */
export class DormantError extends Error {
  readonly code: string;
  readonly status: number;
  readonly hint: string | undefined;
  /** Extra machine-readable facts (an exit code, a log excerpt). Never secrets. */
  readonly details: Readonly<Record<string, unknown>> | undefined;

  constructor(
    code: string,
    message: string,
    options: {
      status?: number;
      hint?: string;
      cause?: unknown;
      details?: Record<string, unknown>;
    } = {},
  ) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.name = 'DormantError';
    this.code = code;
    this.status = options.status ?? 500;
    this.hint = options.hint;
    this.details = options.details;
  }

  toJSON(): { code: string; message: string; hint?: string } {
    return this.hint === undefined
      ? { code: this.code, message: this.message }
      : { code: this.code, message: this.message, hint: this.hint };
  }
}

/** Stable error codes. Add freely; never rename one that has shipped. */
export const ErrorCode = {
  INVALID_ARGUMENT: 'INVALID_ARGUMENT',
  COMMAND_FAILED: 'COMMAND_FAILED',
  COMMAND_TIMEOUT: 'COMMAND_TIMEOUT',
  COMMAND_ABORTED: 'COMMAND_ABORTED',
  COMMAND_NOT_FOUND: 'COMMAND_NOT_FOUND',
  CRIU_NOT_FOUND: 'CRIU_NOT_FOUND',
  CRIU_TOO_OLD: 'CRIU_TOO_OLD',
  CRIU_DUMP_FAILED: 'CRIU_DUMP_FAILED',
  CRIU_RESTORE_FAILED: 'CRIU_RESTORE_FAILED',
  VAULT_CORRUPT: 'VAULT_CORRUPT',
  VAULT_KEY_MISSING: 'VAULT_KEY_MISSING',
  VAULT_NOT_FOUND: 'VAULT_NOT_FOUND',
  VAULT_IO: 'VAULT_IO',
  CHECKPOINT_NOT_FOUND: 'CHECKPOINT_NOT_FOUND',
  TENANT_KEY_DESTROYED: 'TENANT_KEY_DESTROYED',
  SANDBOX_KEY_DESTROYED: 'SANDBOX_KEY_DESTROYED',
  VAULT_KEY_WRONG: 'VAULT_KEY_WRONG',
  VAULT_BUSY: 'VAULT_BUSY',
  CHECKPOINT_EXISTS: 'CHECKPOINT_EXISTS',
  RUNTIME_SANDBOX_EXISTS: 'RUNTIME_SANDBOX_EXISTS',
  RUNTIME_SANDBOX_NOT_FOUND: 'RUNTIME_SANDBOX_NOT_FOUND',
  RUNTIME_INVALID_STATE: 'RUNTIME_INVALID_STATE',
  RUNTIME_CREATE_FAILED: 'RUNTIME_CREATE_FAILED',
  RUNTIME_EXEC_FAILED: 'RUNTIME_EXEC_FAILED',
  RUNTIME_CHECKPOINT_FAILED: 'RUNTIME_CHECKPOINT_FAILED',
  RUNTIME_RESTORE_FAILED: 'RUNTIME_RESTORE_FAILED',
  RUNTIME_NETWORK_FAILED: 'RUNTIME_NETWORK_FAILED',
  RUNTIME_ROOTFS_FAILED: 'RUNTIME_ROOTFS_FAILED',
  RUNTIME_LOG_FAILED: 'RUNTIME_LOG_FAILED',
  CRIU_IMAGE_MALFORMED: 'CRIU_IMAGE_MALFORMED',
  CHECKPOINT_ARCHIVE_INVALID: 'CHECKPOINT_ARCHIVE_INVALID',
  CHECKPOINT_ARCHIVE_TOO_LARGE: 'CHECKPOINT_ARCHIVE_TOO_LARGE',
  CHECKPOINT_HAS_SECRETS: 'CHECKPOINT_HAS_SECRETS',
  /** A checkpoint's images give its processes more than a sandbox has (capabilities, seccomp, namespaces, mounts) (422). */
  CHECKPOINT_OUTSIDE_PROFILE: 'CHECKPOINT_OUTSIDE_PROFILE',
  INTERNAL: 'INTERNAL',
  /** A tenant named a host path (rootfs, image, archive) outside the operator's allowed folders (403). */
  HOST_PATH_FORBIDDEN: 'HOST_PATH_FORBIDDEN',
  /** Wake proxy: the sandbox did not wake within the bound (503, Retry-After). */
  WAKE_TIMEOUT: 'WAKE_TIMEOUT',
  /** Wake proxy: the resume failed (502). */
  WAKE_FAILED: 'WAKE_FAILED',
  /** Wake proxy: the connection caps are reached (503, Retry-After). */
  PROXY_BUSY: 'PROXY_BUSY',
  /** Wake proxy: the Host names no sandbox port (404). */
  PROXY_NO_ROUTE: 'PROXY_NO_ROUTE',
  /** Wake proxy: a sandbox name shared by several visible sandboxes (409). */
  PROXY_AMBIGUOUS: 'PROXY_AMBIGUOUS',
  /** Wake proxy: the sandbox's server did not answer (502). */
  PROXY_UPSTREAM: 'PROXY_UPSTREAM',
  /** The daemon runs no wake proxy (503). */
  PROXY_DISABLED: 'PROXY_DISABLED',
} as const;
export type ErrorCode = (typeof ErrorCode)[keyof typeof ErrorCode];

export function isDormantError(e: unknown, code?: string): e is DormantError {
  return e instanceof DormantError && (code === undefined || e.code === code);
}

/** Narrow an unknown thrown value to an Error without losing it. */
export function asError(e: unknown): Error {
  return e instanceof Error ? e : new Error(String(e));
}

/** The errno code of a Node system error (`ENOENT`, ...), if it is one. */
export function errnoCode(e: unknown): string | undefined {
  if (typeof e === 'object' && e !== null && 'code' in e) {
    const c = e.code;
    return typeof c === 'string' ? c : undefined;
  }
  return undefined;
}
