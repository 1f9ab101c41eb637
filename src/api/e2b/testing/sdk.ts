/**
 * E2B's own SDK (`e2b` on npm, a devDependency) for the tests and the benchmark: found by
 * normal resolution, or under DORMANT_E2B_SDK_DIR (a folder holding node_modules/e2b, for a
 * checkout whose node_modules lacks it). Typed here by the part the tests use, so the build
 * does not need the package.
 */
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

export interface E2bOpts {
  apiKey?: string;
  metadata?: Record<string, string>;
  timeoutMs?: number;
  requestTimeoutMs?: number;
}

export interface E2bCommandResult {
  exitCode: number;
  stdout: string;
  stderr: string;
  error?: string;
}

export interface E2bCommandHandle {
  pid: number;
  stdout: string;
  stderr: string;
  wait(): Promise<E2bCommandResult>;
  disconnect(): Promise<void>;
  kill(): Promise<boolean>;
}

export interface E2bRunOpts {
  background?: boolean;
  stdin?: boolean;
  cwd?: string;
  envs?: Record<string, string>;
  onStdout?: (data: string) => void;
  onStderr?: (data: string) => void;
}

export interface E2bEntry {
  name: string;
  type?: string;
  path: string;
  size: number;
}

export interface E2bSandbox {
  sandboxId: string;
  commands: {
    run(cmd: string, opts?: E2bRunOpts): Promise<E2bCommandResult & E2bCommandHandle>;
    list(): Promise<{ pid: number; cmd: string; args: string[] }[]>;
    connect(pid: number, opts?: { onStdout?: (data: string) => void }): Promise<E2bCommandHandle>;
    sendStdin(pid: number, data: string): Promise<void>;
    kill(pid: number): Promise<boolean>;
  };
  files: {
    write(path: string, data: string | Uint8Array): Promise<{ path: string; name: string }>;
    read(path: string): Promise<string>;
    list(path: string): Promise<E2bEntry[]>;
    exists(path: string): Promise<boolean>;
    getInfo(path: string): Promise<E2bEntry>;
    makeDir(path: string): Promise<boolean>;
    rename(from: string, to: string): Promise<E2bEntry>;
    remove(path: string): Promise<void>;
    watchDir(
      path: string,
      onEvent: (e: { name: string; type: string }) => void,
      opts?: { recursive?: boolean },
    ): Promise<{ stop(): Promise<void> }>;
  };
  pty: {
    create(opts: { cols: number; rows: number; onData: (d: Uint8Array) => void }): Promise<E2bCommandHandle>;
    sendInput(pid: number, data: Uint8Array): Promise<void>;
    resize(pid: number, size: { cols: number; rows: number }): Promise<void>;
    kill(pid: number): Promise<boolean>;
  };
  getHost(port: number): string;
  betaPause(): Promise<boolean>;
  createSnapshot(opts?: { name?: string }): Promise<E2bSnapshotInfo>;
  getMetrics(): Promise<{ cpuCount: number; memUsed: number; memTotal: number; timestamp: Date }[]>;
  setTimeout(ms: number): Promise<void>;
  kill(): Promise<void>;
}

export interface E2bSnapshotInfo {
  snapshotId: string;
  names: string[];
}

export interface E2bSandboxClass {
  create(template: string, opts?: E2bOpts): Promise<E2bSandbox>;
  connect(id: string, opts?: E2bOpts): Promise<E2bSandbox>;
  kill(id: string, opts?: E2bOpts): Promise<boolean>;
  fork(id: string, opts?: E2bOpts & { count?: number }): Promise<(E2bSandbox | Error)[]>;
  list(opts?: E2bOpts): {
    nextItems(): Promise<{ sandboxId: string; metadata: Record<string, string>; state: string }[]>;
  };
  listSnapshots(opts?: E2bOpts): { nextItems(): Promise<E2bSnapshotInfo[]> };
  deleteSnapshot(id: string, opts?: E2bOpts): Promise<boolean>;
}

export interface E2bSdk {
  Sandbox: E2bSandboxClass;
  AuthenticationError: new (...a: never[]) => Error;
  NotFoundError: new (...a: never[]) => Error;
  CommandExitError: new (...a: never[]) => Error & { exitCode: number };
}

export async function loadE2bSdk(): Promise<E2bSdk> {
  const name = 'e2b';
  try {
    return (await import(name)) as E2bSdk;
  } catch (e) {
    const dir = process.env.DORMANT_E2B_SDK_DIR;
    if (dir === undefined || dir === '')
      throw new Error(
        `the e2b package is not installed (npm install), nor DORMANT_E2B_SDK_DIR set: ${String(e)}`,
      );
    return (await import(
      pathToFileURL(join(dir, 'node_modules', 'e2b', 'dist', 'index.mjs')).href
    )) as E2bSdk;
  }
}
