/**
 * dormant's TypeScript SDK: pause and resume for AI-agent sandboxes, over the HTTP API.
 * Published from this workspace as `@dormant/sdk` (packages/sdk).
 *
 * @example
 * ```ts
 * import { Sandbox } from '@dormant/sdk';
 * const sb = await Sandbox.create({ rootfs: '/srv/rootfs', labels: { user: 'ada' } });
 * await sb.commands.run('echo hi', { onStdout: (d) => process.stdout.write(d) });
 * await sb.files.write('/tmp/a.txt', 'hello');
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
  type ListedSandbox,
  type SandboxListOptions,
  type SandboxMetrics,
} from './sandbox.js';
export {
  Commands,
  CommandHandle,
  CommandExitError,
  type CommandResult,
  type CommandStartOptions,
  type OutputCallbacks,
} from './commands.js';
export { Files, type WriteData, type WriteInfo, type FilesystemEvent, type WatchHandle } from './files.js';
export { Pty, type PtyCreateOptions } from './pty.js';
export type {
  CommandInfo,
  FileInfo,
  WatchEvent,
  CommandEvent,
  SandboxMetricSample,
  SandboxPage,
  UpdateSandboxOptions,
  ListSandboxesOptions,
} from './contract.gen.js';
export { readNdjson } from './ndjson.js';
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
  type RegistryLoginInfo,
  type CachedImageInfo,
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
