/**
 * The shapes of the toolbox and metadata routes (commands, files, metrics, labels), written
 * from the design while their schemas are being added to the API. Once `npm run gen` emits
 * them into contract.gen.ts, these become re-exports of the generated ones.
 */

/** A command the sandbox's agent started (`GET /v1/sandboxes/{id}/commands`). */
export interface CommandInfo {
  /** The agent's id of the process: its pid inside the sandbox, as a decimal string. */
  id: string;
  pid: number;
  args: string[];
  cwd: string;
  tag: string;
  pty: boolean;
  running: boolean;
  exitCode: number | null;
  signal: string | null;
  /** Milliseconds since the epoch. */
  startedAt: number;
}

/** A file or folder inside a sandbox (`GET /v1/sandboxes/{id}/files/stat`). */
export interface FileInfo {
  name: string;
  /** Absolute, inside the sandbox. */
  path: string;
  type: 'file' | 'dir' | 'symlink' | 'other';
  size: number;
  mode: number;
  mtimeMs: number;
  symlinkTarget?: string;
}

/** One change under a watched folder (`GET /v1/sandboxes/{id}/files/watch`). */
export interface WatchEvent {
  type: 'create' | 'write' | 'remove' | 'rename' | 'chmod';
  path: string;
  isDir: boolean;
}

/** One line of a command's ndjson output stream. */
export type CommandEvent =
  | { type: 'start'; id: string; pid: number; from?: number }
  | { type: 'stdout' | 'stderr'; data: string }
  | { type: 'end'; exitCode: number | null; signal: string | null; durationMs: number; timedOut: boolean }
  | { type: 'error'; code: string; message: string };
