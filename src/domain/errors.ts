/**
 * Every error a user can see carries a stable `code` (what scripts match on). The table below
 * (ERRORS) is the one place a code is defined: its HTTP status, its family (what kind of
 * failure: the SDK's error classes are one per family) and a default hint (what to do about
 * it). The API answers the table's status; the SDK, the OpenAPI document and docs/API.md are
 * generated from the table (scripts/gen-sdk-types.mjs), and a test holds them to it.
 * Messages name the sandbox, path or digest involved and never carry a secret.
 */

/** What kind of failure a code is. The SDK has one error class per family. */
export const ERROR_FAMILIES = [
  /** The request is wrong; the message names the field (400, 405, 415). */
  'invalid',
  /** No token, or an unknown or revoked one (401). */
  'unauthenticated',
  /** The token may not do this (403). */
  'forbidden',
  /** No such thing for this token's tenant (404). */
  'not-found',
  /** Not possible in the current state (409); the hint says what to do first. */
  'conflict',
  /** Bigger than a limit allows (413, 431). */
  'too-large',
  /** Well formed, but its content cannot be used (422). */
  'unprocessable',
  /** A lifecycle operation failed on the node; the sandbox is left as the message says. */
  'operation',
  /** The checkpoint vault refused or failed. */
  'vault',
  /** Something took longer than its bound (408, 504). */
  'timeout',
  /** The daemon cannot serve this now, or a sandbox behind it did not answer (502, 503). */
  'unavailable',
  /** A fault of the daemon or its node (500): the daemon log has the whole error. */
  'internal',
] as const;
export type ErrorFamily = (typeof ERROR_FAMILIES)[number];

export interface ErrorInfo {
  /** The HTTP status the API (and the wake proxy) answers. */
  readonly status: number;
  readonly family: ErrorFamily;
  /** What to do about it; a throw site may give a more precise one. */
  readonly hint: string;
}

const e = (status: number, family: ErrorFamily, hint: string): ErrorInfo => ({ status, family, hint });

/**
 * Stable error codes. Add freely; never rename one that has shipped, nor change its status
 * (scripts match on both). After a change here, run `npm run gen`.
 */
export const ERRORS = {
  // ---- the request ---------------------------------------------------------------------
  INVALID_ARGUMENT: e(400, 'invalid', 'fix the request: the message names the field'),
  /** An egress policy that is not `internet`, `none` or a list of IPv4 CIDRs and host names. */
  EGRESS_POLICY_INVALID: e(
    400,
    'invalid',
    'give --egress internet, none, or CIDRs and host names: 198.18.0.0/15,api.example.com',
  ),
  /** A host name in an egress list that the node's resolvers cannot resolve to an IPv4 address. */
  EGRESS_HOST_UNRESOLVABLE: e(422, 'unprocessable', 'check the name, or list its addresses as CIDRs'),
  /** The wake proxy could not parse the request. */
  BAD_REQUEST: e(400, 'invalid', 'send well-formed HTTP/1.1'),
  /** The wake proxy relays no CONNECT. */
  METHOD_NOT_ALLOWED: e(405, 'invalid', 'use a plain HTTP method; CONNECT is not proxied'),
  /** A request body over the route's limit. */
  REQUEST_TOO_LARGE: e(413, 'too-large', 'send a smaller body (4 MiB of JSON; 32 MiB for exec)'),
  /** A request head over the wake proxy's limit. */
  REQUEST_HEAD_TOO_LARGE: e(431, 'too-large', 'send fewer or shorter headers (64 KiB in all)'),
  UNSUPPORTED_MEDIA_TYPE: e(415, 'invalid', 'send application/json (or application/octet-stream to import)'),
  /** The wake proxy's head deadline passed before the request head arrived. */
  REQUEST_TIMEOUT: e(408, 'timeout', 'send the whole request head at once'),
  /** An API route that does not exist, or a dashboard file. */
  NOT_FOUND: e(404, 'not-found', 'see GET /v1/openapi.json for the routes'),
  UNAUTHORIZED: e(
    401,
    'unauthenticated',
    'send Authorization: Bearer TOKEN (dormant token create, or <data-dir>/admin-token)',
  ),
  FORBIDDEN: e(403, 'forbidden', 'use the admin token (<data-dir>/admin-token) or ask your operator'),
  /** A tenant named a host path (rootfs, image, archive) outside the operator's allowed folders. */
  HOST_PATH_FORBIDDEN: e(
    403,
    'forbidden',
    'name a path inside a folder the operator allowed (dormant serve --allow-root), or upload the archive',
  ),
  TOKEN_NOT_FOUND: e(404, 'not-found', 'dormant token ls'),
  LAST_ADMIN_TOKEN: e(409, 'conflict', 'create another admin token first (POST /v1/tokens with admin: true)'),

  // ---- sandboxes -----------------------------------------------------------------------
  SANDBOX_NOT_FOUND: e(404, 'not-found', 'dormant ls lists the sandboxes this token sees'),
  /** An admin named a sandbox whose name more than one tenant uses. */
  SANDBOX_NAME_AMBIGUOUS: e(409, 'conflict', 'use one of the ids listed'),
  SANDBOX_NAME_TAKEN: e(409, 'conflict', 'pick another name, or delete the sandbox that has it'),
  ILLEGAL_TRANSITION: e(409, 'conflict', 'see the sandbox state (dormant ls); resume it first if it sleeps'),
  /** The sandbox has no checkpoint to resume or fork from. */
  NO_CHECKPOINT: e(409, 'conflict', 'hibernate the sandbox first (a running one has no checkpoint yet)'),
  HIBERNATE_FAILED: e(500, 'operation', 'the sandbox keeps running; see the daemon log for why'),
  RESUME_FAILED: e(500, 'operation', 'the checkpoint is kept; see the daemon log, then resume again'),
  /** `logs --restore` of a sandbox none of whose restores failed (on this node). */
  NO_RESTORE_LOG: e(
    404,
    'not-found',
    'only a failed resume leaves a restore log; dormant logs ID shows the output',
  ),
  /** The checkpoint was made on a node this one cannot restore (CPU, kernel, CRIU). */
  RESTORE_INCOMPATIBLE: e(409, 'conflict', 'resume it on a node like the one that made it'),
  /** The newest checkpoint failed to restore and is marked damaged. */
  CHECKPOINT_DAMAGED: e(409, 'conflict', 'resume from an older checkpoint (resume --from ID)'),
  FILESYSTEM_PACK_FAILED: e(500, 'operation', 'the sandbox is unchanged; see the daemon log'),
  FILESYSTEM_UNPACK_FAILED: e(500, 'operation', 'the checkpoint is kept; see the daemon log'),
  IMAGE_INVALID: e(400, 'invalid', 'give an OCI image layout folder (DIR or DIR:TAG)'),
  /** An imported checkpoint needs its image, and the daemon holds none that matches. */
  IMAGE_REQUIRED: e(422, 'unprocessable', 'pass the image the checkpoint was made from (image)'),
  IMAGE_MISMATCH: e(422, 'unprocessable', 'pass the image the checkpoint was made from'),
  /** `image` is neither an absolute layout folder nor a registry reference (docs/IMAGES.md). */
  IMAGE_REF_INVALID: e(
    400,
    'invalid',
    'give REGISTRY/NAME:TAG, REGISTRY/NAME@sha256:DIGEST, or an absolute OCI layout folder',
  ),
  /** The registry has no such repository, tag or digest. */
  IMAGE_NOT_FOUND: e(404, 'not-found', 'check the name and tag (skopeo list-tags docker://REGISTRY/NAME)'),
  /** The image is built for another CPU architecture than this node's. */
  IMAGE_ARCH_MISMATCH: e(422, 'unprocessable', 'use an image (or a manifest list entry) built for this node'),
  /** The registry served content that does not hash to the digest that names it. */
  IMAGE_DIGEST_MISMATCH: e(
    502,
    'unavailable',
    'the registry’s copy is damaged or tampered with; ask its operator',
  ),
  /** The image's layers add up to more than the daemon's images.maxPullBytes. */
  IMAGE_TOO_LARGE: e(
    413,
    'too-large',
    'use a smaller image, or ask the operator to raise images.maxPullBytes',
  ),
  /** A pull ran past the daemon's images.pullTimeout. */
  IMAGE_PULL_TIMEOUT: e(504, 'timeout', 'retry, or ask the operator to raise images.pullTimeout'),
  /** The registry cannot be reached (down, refused, TLS, plain HTTP not allowed). */
  REGISTRY_UNAVAILABLE: e(
    502,
    'unavailable',
    'check the registry address; plain HTTP needs images.insecureRegistries',
  ),
  /** The registry refused the tenant's credentials, or asked for some and the tenant has none. */
  REGISTRY_UNAUTHORIZED: e(403, 'forbidden', 'dormant registry login HOST --username U --password-stdin'),
  /** The tenant holds no credentials for that registry. */
  REGISTRY_CREDENTIALS_NOT_FOUND: e(
    404,
    'not-found',
    'dormant registry ls lists the registries you logged in to',
  ),

  // ---- templates -------------------------------------------------------------------------
  TEMPLATE_NOT_FOUND: e(404, 'not-found', 'dormant template ls lists the templates this token sees'),
  TEMPLATE_NAME_TAKEN: e(409, 'conflict', 'pick another name, or remove the template that has it'),
  /** The template's checkpoint is missing or does not authenticate in the vault. */
  TEMPLATE_DAMAGED: e(
    409,
    'conflict',
    'remove the template and make it again (dormant template rm NAME; dormant template create)',
  ),
  /** A controller made without the template store (embedding without the daemon's database). */
  TEMPLATES_UNAVAILABLE: e(503, 'unavailable', 'templates need the daemon’s database (dormant serve)'),
  /** A template's builder sandbox did not pass its ready probe in time. */
  TEMPLATE_NOT_READY: e(
    422,
    'unprocessable',
    "check the command and the probe (the builder's log is in the error), or give a longer --ready-timeout",
  ),

  // ---- GPUs ------------------------------------------------------------------------------
  GPU_UNAVAILABLE: e(409, 'conflict', 'dormant doctor shows the node’s GPUs'),
  GPU_NO_DRIVER: e(409, 'conflict', 'install the NVIDIA driver (with cuda-checkpoint) on the node'),
  GPU_CHECKPOINT_UNSUPPORTED: e(
    409,
    'conflict',
    'use gpuPolicy keep-running or filesystem-only (docs/GPU.md)',
  ),
  GPU_CHECKPOINT_FAILED: e(500, 'operation', 'the sandbox keeps running; see the daemon log'),
  GPU_FORK_UNSUPPORTED: e(409, 'conflict', 'a sandbox holding GPU state cannot be forked (docs/GPU.md)'),
  GPU_KEEP_RUNNING: e(409, 'conflict', 'its gpuPolicy is keep-running: it does not hibernate (docs/GPU.md)'),
  GPU_FILESYSTEM_ONLY: e(
    409,
    'conflict',
    'its gpuPolicy is filesystem-only: archive it instead (docs/GPU.md)',
  ),
  GPU_RESTORE_FAILED: e(500, 'operation', 'the checkpoint is kept; see the daemon log'),

  // ---- checkpoints -----------------------------------------------------------------------
  CHECKPOINT_NOT_FOUND: e(404, 'not-found', 'dormant checkpoint ls lists the checkpoints this token sees'),
  CHECKPOINT_EXISTS: e(409, 'conflict', 'a checkpoint with this id is already stored'),
  /** The checkpoint holds only a filesystem (no processes) where a memory checkpoint is needed. */
  CHECKPOINT_FILESYSTEM_ONLY: e(409, 'conflict', 'use a memory checkpoint (one made by hibernate)'),
  /** The daemon was started without a vault for checkpoint reads (inspect, scan). */
  CHECKPOINT_READS_DISABLED: e(503, 'unavailable', 'start the daemon with its vault'),
  CHECKPOINT_ARCHIVE_INVALID: e(422, 'unprocessable', 'give a podman or CRI-O checkpoint archive'),
  CHECKPOINT_ARCHIVE_TOO_LARGE: e(413, 'too-large', 'the daemon refuses archives past its upload limit'),
  CHECKPOINT_HAS_SECRETS: e(
    409,
    'conflict',
    'export with allowPlaintext, or encrypted (--format oci --encrypt)',
  ),
  /** A checkpoint's images give its processes more than a sandbox has (capabilities, seccomp, namespaces, mounts). */
  CHECKPOINT_OUTSIDE_PROFILE: e(
    422,
    'unprocessable',
    'only checkpoints of sandboxed processes can be imported',
  ),
  CRIU_IMAGE_MALFORMED: e(422, 'unprocessable', 'the checkpoint’s CRIU images cannot be read'),

  // ---- the database of record -------------------------------------------------------------
  /** PostgreSQL (state.url) cannot be reached, refused the login, or gave up on a statement. */
  STATE_UNAVAILABLE: e(
    503,
    'unavailable',
    'the database of record is out of reach; retry, and check the PostgreSQL server and the state URL',
  ),
  /** Another process already runs as this node on the state database. */
  STATE_IN_USE: e(409, 'conflict', 'another process runs as this node; give each node its own name (--node)'),
  // ---- the fleet ---------------------------------------------------------------------------
  NODE_NOT_FOUND: e(404, 'not-found', 'dormant node ls lists the nodes'),
  /** The node a request must go to does not answer, or no node takes placements. */
  NODE_UNAVAILABLE: e(
    503,
    'unavailable',
    'retry: a node that stopped renewing its lease has its sandboxes taken back once the lease runs out',
  ),
  /** Another node got there first (two nodes waking the same sandbox). */
  SANDBOX_BUSY: e(409, 'conflict', 'another node is changing this sandbox; retry once it is done'),
  // ---- the vault -------------------------------------------------------------------------
  VAULT_CORRUPT: e(500, 'vault', 'stored data failed its integrity check; resume from an older checkpoint'),
  VAULT_KEY_MISSING: e(500, 'vault', 'the vault key is missing on this node; restore it from a backup'),
  VAULT_NOT_FOUND: e(404, 'not-found', 'no such object in the vault'),
  VAULT_IO: e(500, 'vault', 'the vault could not read or write its files; check the data disk'),
  VAULT_KEY_WRONG: e(403, 'forbidden', 'use the key this vault was made with'),
  /** The vault was written by a newer dormant: nothing in it is touched. */
  VAULT_FORMAT_NEWER: e(409, 'vault', 'run the dormant that wrote this vault (or a newer one)'),
  VAULT_BUSY: e(409, 'vault', 'another process holds the vault; retry when it is done'),
  TENANT_KEY_DESTROYED: e(
    410,
    'vault',
    'the tenant’s key was destroyed: its checkpoints cannot be read again',
  ),
  SANDBOX_KEY_DESTROYED: e(
    410,
    'vault',
    'the sandbox’s key was destroyed: its checkpoints cannot be read again',
  ),

  // ---- the node --------------------------------------------------------------------------
  COMMAND_FAILED: e(500, 'internal', 'a program the daemon runs failed; see the daemon log'),
  COMMAND_TIMEOUT: e(504, 'timeout', 'it ran past its time limit: raise timeoutMs, or make it finish sooner'),
  COMMAND_ABORTED: e(
    500,
    'internal',
    'it was stopped (the daemon shutting down, or the request dropped); retry',
  ),
  COMMAND_NOT_FOUND: e(500, 'internal', 'a program the daemon needs is missing: run dormant doctor'),
  CRIU_NOT_FOUND: e(500, 'operation', 'install CRIU: run dormant doctor'),
  CRIU_TOO_OLD: e(500, 'operation', 'upgrade CRIU: dormant doctor names the version needed'),
  CRIU_DUMP_FAILED: e(500, 'operation', 'the sandbox keeps running; the daemon log has CRIU’s report'),
  CRIU_RESTORE_FAILED: e(500, 'operation', 'the checkpoint is kept; the daemon log has CRIU’s report'),
  RUNTIME_SANDBOX_EXISTS: e(409, 'conflict', 'a container with this id already runs on the node'),
  RUNTIME_SANDBOX_NOT_FOUND: e(404, 'not-found', 'the sandbox’s container is gone from the node'),
  RUNTIME_INVALID_STATE: e(409, 'conflict', 'the sandbox’s container is not in a state for this'),
  RUNTIME_CREATE_FAILED: e(500, 'operation', 'see the daemon log; dormant doctor checks the node'),
  RUNTIME_EXEC_FAILED: e(500, 'operation', 'see the daemon log'),
  RUNTIME_CHECKPOINT_FAILED: e(500, 'operation', 'the sandbox keeps running; see the daemon log'),
  RUNTIME_RESTORE_FAILED: e(500, 'operation', 'the checkpoint is kept; see the daemon log'),
  RUNTIME_NETWORK_FAILED: e(500, 'operation', 'see the daemon log; dormant doctor checks the node'),
  /** Every address of the sandbox subnet is in use. */
  RUNTIME_NO_ADDRESS: e(503, 'unavailable', 'delete unused sandboxes, or configure a larger subnet'),
  RUNTIME_ROOTFS_FAILED: e(500, 'operation', 'see the daemon log'),
  RUNTIME_LOG_FAILED: e(500, 'operation', 'see the daemon log'),
  INTERNAL: e(500, 'internal', 'see the daemon log'),

  // ---- the wake proxy --------------------------------------------------------------------
  /** The sandbox did not wake within the bound (with Retry-After). */
  WAKE_TIMEOUT: e(503, 'unavailable', 'retry after the Retry-After seconds: it is still waking'),
  /** The resume failed. */
  WAKE_FAILED: e(502, 'unavailable', 'see the sandbox’s lastError (dormant ls), then resume it'),
  /** The connection caps are reached (with Retry-After). */
  PROXY_BUSY: e(503, 'unavailable', 'retry after the Retry-After seconds'),
  /** The Host names no sandbox port. */
  PROXY_NO_ROUTE: e(404, 'not-found', 'use the address dormant url ID PORT gives'),
  /** A sandbox name shared by several visible sandboxes. */
  PROXY_AMBIGUOUS: e(409, 'conflict', 'use the sandbox id instead of its name'),
  /** The sandbox's server did not answer. */
  PROXY_UPSTREAM: e(502, 'unavailable', 'is the server inside the sandbox listening on that port?'),
  /** The daemon runs no wake proxy. */
  PROXY_DISABLED: e(503, 'unavailable', 'start dormant serve without --no-proxy'),

  // ---- the toolbox (commands and files inside a sandbox, through its agent) ---------------
  FILE_NOT_FOUND: e(404, 'not-found', 'no such file or folder in the sandbox: check the path'),
  FILE_EXISTS: e(409, 'conflict', 'something already exists at that path in the sandbox'),
  NOT_A_DIRECTORY: e(400, 'invalid', 'a part of the path is a file, not a folder'),
  IS_A_DIRECTORY: e(400, 'invalid', 'the path is a folder: list it, or name a file inside it'),
  DIRECTORY_NOT_EMPTY: e(409, 'conflict', 'the folder is not empty'),
  FILE_PERMISSION_DENIED: e(
    403,
    'forbidden',
    'the sandbox’s own permissions refuse this (its user, modes, read-only mounts)',
  ),
  /**
   * A command id the sandbox's agent does not know (COMMAND_NOT_FOUND, the name the toolbox
   * design gave it, was already the code of a missing host program, with status 500).
   */
  PROCESS_NOT_FOUND: e(
    404,
    'not-found',
    'no such command: it never ran, or it ended over 10 minutes ago (GET /v1/sandboxes/{id}/commands lists them)',
  ),
  /** The agent in the sandbox cannot be started or does not answer. */
  TOOLBOX_UNAVAILABLE: e(
    503,
    'unavailable',
    'the sandbox’s toolbox agent did not answer: is the sandbox running, with its network? see the daemon log',
  ),
} as const satisfies Record<string, ErrorInfo>;

export type ErrorCode = keyof typeof ERRORS;
/** Each code by name (`ErrorCode.SANDBOX_NOT_FOUND`), for code that prefers a constant to a string. */
export const ErrorCode = Object.freeze(
  Object.fromEntries(Object.keys(ERRORS).map((k) => [k, k])) as { readonly [K in ErrorCode]: K },
);

/** What the table says of a code; a code it does not know (from a newer peer) is internal. */
export function errorInfo(code: string): ErrorInfo {
  return Object.hasOwn(ERRORS, code) ? ERRORS[code as ErrorCode] : ERRORS.INTERNAL;
}

/**
 * One error class for the whole project: a code from the table, a message, and the
 * underlying `cause`. Its status and default hint come from the table.
 */
export class DormantError extends Error {
  /** A code of the table (string: an error relayed from a peer may carry a newer one). */
  readonly code: string;
  /** The code's status in the table. */
  readonly status: number;
  readonly hint: string | undefined;
  /** Extra machine-readable facts (an exit code, a log excerpt). Never secrets. */
  readonly details: Readonly<Record<string, unknown>> | undefined;

  constructor(
    code: ErrorCode,
    message: string,
    options: {
      /**
       * Not used: the table decides the status. Throw sites written before the table still
       * pass one; each drops it when next touched (a site that needs another status needs
       * another code).
       */
      status?: number;
      /** A more precise hint than the table's for this code. */
      hint?: string;
      cause?: unknown;
      details?: Record<string, unknown>;
    } = {},
  ) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.name = 'DormantError';
    this.code = code;
    const info = errorInfo(code);
    this.status = info.status;
    this.hint = options.hint ?? info.hint;
    this.details = options.details;
  }

  /**
   * An error another part answered with its own code and status (the CLI relays the SDK's:
   * a newer daemon's code, or the client's own DAEMON_UNREACHABLE), kept as answered.
   */
  static relayed(code: string, message: string, status: number, hint?: string): DormantError {
    const err = new DormantError('INTERNAL', message, hint === undefined ? {} : { hint });
    return Object.assign(err, { code, status, hint });
  }

  toJSON(): { code: string; message: string; hint?: string } {
    return this.hint === undefined
      ? { code: this.code, message: this.message }
      : { code: this.code, message: this.message, hint: this.hint };
  }
}

export function isDormantError(e: unknown, code?: ErrorCode): e is DormantError {
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
