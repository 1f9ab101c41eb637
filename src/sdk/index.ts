/**
 * dormant's TypeScript SDK: pause and resume for AI-agent sandboxes, over the HTTP API.
 * Published from this workspace as `@dormant/sdk` (packages/sdk).
 *
 * @example
 * ```ts
 * import { Sandbox } from '@dormant/sdk';
 * const sb = await Sandbox.create({ rootfs: '/srv/rootfs', command: ['sleep', 'infinity'] });
 * await sb.hibernate();
 * await sb.resume();
 * ```
 */
export {
  Sandbox,
  type ConnectionOptions,
  type SandboxCreateOptions,
  type SandboxCallOptions,
  type ExecOptions,
} from './sandbox.js';
export {
  DormantClient,
  DEFAULT_URL,
  type ClientOptions,
  type CallOptions,
  type CreateSandboxOptions,
  type SandboxInfo,
  type CheckpointInfo,
  type ExecResult,
  type SandboxUrlInfo,
  type TokenInfo,
  type TransitionInfo,
  type SandboxState,
  type GpuPolicy,
} from './client.js';
export { SANDBOX_STATES, API_ERRORS, type ApiErrorCode, type ErrorFamily } from './contract.gen.js';
export { readEventStream, type ServerSentEvent } from './sse.js';
export {
  DormantApiError,
  AuthenticationError,
  ForbiddenError,
  NotFoundError,
  InvalidArgumentError,
  ConflictError,
  SandboxOperationError,
  VaultError,
  ConnectionError,
  TimeoutError,
  errorClassFor,
  apiError,
  CLIENT_ERROR_CODES,
} from './errors.js';
