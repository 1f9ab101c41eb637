/**
 * The toolbox agent (native/agent/, docs/ARCHITECTURE.md "The toolbox agent") on the runc
 * runtime: where its binary is, the host's read-only copy of it, and starting it inside a
 * running sandbox with `runc exec`.
 *
 * The host copy. A process inside a sandbox can open /proc/PID/exe of the agent while it still
 * runs from the host's file (the moment before it re-executes from the sandbox's /dev); were
 * that file writable, the sandbox could replace the binary the daemon starts in every other
 * sandbox (CVE-2019-5736's lesson). So the daemon copies the binary once into a tmpfs of its
 * own, remounts it read-only, opens the file, and detaches the mount (`umount -l`): the copy
 * lives exactly as long as the daemon holds it open, has no path on the host, and any open
 * for writing fails with EROFS. runc is handed that open file as fd 3 (`--preserve-fds 1`),
 * and the agent is run as /proc/self/fd/3.
 */
import {
  access,
  chmod,
  constants,
  copyFile,
  mkdtemp,
  readFile,
  readlink,
  open,
  rmdir,
  stat,
  type FileHandle,
} from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { DormantError, ErrorCode } from '../domain/errors.js';
import { run } from '../sys/exec.js';
import { AGENT_PORT, AgentClient, AgentError, type AgentAddress } from './agent-client.js';
import { isMountPoint } from './rootfs.js';
import type { CallOptions, SandboxState } from './runtime.js';

/** How long a started agent has to answer its first ping. */
const START_WAIT_MS = 2000;
const MOUNT_TIMEOUT_MS = 15_000;

/**
 * Where the agent's binary may be: $DORMANT_AGENT_BINARY, this checkout's build (so the agent
 * and the client that speaks to it come from the same source), setup.sh's install.
 */
export function agentBinaryCandidates(env: NodeJS.ProcessEnv = process.env): string[] {
  const here = dirname(fileURLToPath(import.meta.url));
  return [
    ...(env.DORMANT_AGENT_BINARY ? [env.DORMANT_AGENT_BINARY] : []),
    join(here, '..', '..', 'build', 'native', 'dormant-agent'),
    '/opt/dormant/bin/dormant-agent',
  ];
}

export async function locateAgentBinary(env: NodeJS.ProcessEnv = process.env): Promise<string | undefined> {
  for (const p of agentBinaryCandidates(env)) {
    if (
      await access(p, constants.X_OK)
        .then(() => true)
        .catch(() => false)
    )
      return p;
    // An explicit setting that does not work is not silently replaced by another binary.
    if (p === env.DORMANT_AGENT_BINARY) return undefined;
  }
  return undefined;
}

/** The read-only copy, made once per process (see the top). */
let hostCopy: Promise<FileHandle> | undefined;

async function makeHostCopy(): Promise<FileHandle> {
  const binary = await locateAgentBinary();
  if (!binary)
    throw new AgentError(
      'ENOAGENT',
      'agent: the dormant-agent binary is not built (npm run build, or scripts/setup.sh installs it in /opt/dormant/bin)',
    );
  const size = (await stat(binary)).size;
  const dir = await mkdtemp('/dev/shm/dormant-agent-');
  try {
    const options = `size=${Math.ceil(size / 4096) * 4096 + (64 << 10)},mode=0700,nosuid,nodev`;
    await run('mount', ['-t', 'tmpfs', '-o', options, 'dormant-agent', dir], { timeoutMs: MOUNT_TIMEOUT_MS });
    const path = join(dir, 'dormant-agent');
    await copyFile(binary, path);
    await chmod(path, 0o555);
    await run('mount', ['-o', 'remount,ro', dir], { timeoutMs: MOUNT_TIMEOUT_MS });
    return await open(path, 'r');
  } finally {
    if (await isMountPoint(dir)) await run('umount', ['-l', dir], { timeoutMs: MOUNT_TIMEOUT_MS });
    await rmdir(dir);
  }
}

/**
 * A path that opens the host's read-only copy of the agent (a /proc link to this process's
 * open file), made on first use.
 */
export async function agentHostCopy(): Promise<string> {
  const copy = (hostCopy ??= makeHostCopy());
  // a failure (say, the binary is not built yet) is tried again on the next call
  copy.catch(() => {
    if (hostCopy === copy) hostCopy = undefined;
  });
  const fh = await copy;
  return `/proc/${process.pid}/fd/${fh.fd}`;
}

/** How to run runc for sandbox `id`: its path, its arguments with `args` appended, its environment. */
export type RuncCommand = (id: string, args: string[]) => [string, string[], Record<string, string>];

/**
 * The runtime's ensureAgent (runtime.ts): the address of the agent of running sandbox `id`
 * that knows `token`, the one already there or else a new one. Calls for one sandbox run one
 * after the other, so concurrent first calls start it once.
 */
type AgentHost = {
  state(id: string, opts?: CallOptions): Promise<SandboxState>;
  pids(id: string): Promise<number[]>;
};

export function agentStarter(
  rt: AgentHost,
  runc: RuncCommand,
): (id: string, token: string, opts?: CallOptions) => Promise<AgentAddress> {
  const queues = new Map<string, Promise<unknown>>();
  return (id, token, opts = {}) => {
    const prev = queues.get(id) ?? Promise.resolve();
    const next = prev.catch(() => {}).then(() => ensureAgent(rt, runc, id, token, opts));
    queues.set(id, next);
    const forget = (): void => {
      if (queues.get(id) === next) queues.delete(id);
    };
    next.then(forget, forget);
    return next;
  };
}

async function ensureAgent(
  rt: AgentHost,
  runc: RuncCommand,
  id: string,
  token: string,
  opts: CallOptions,
): Promise<AgentAddress> {
  const state = await rt.state(id, opts);
  if (state.status !== 'running')
    throw new DormantError(
      ErrorCode.RUNTIME_INVALID_STATE,
      `sandbox ${id} is ${state.status}: its agent runs only while it runs`,
      { status: 409 },
    );
  const addr: AgentAddress = { host: state.network.address, port: AGENT_PORT, token };
  const client = new AgentClient(addr, { connectTimeoutMs: 1000 });
  const first = await client.ping().catch((e: unknown) => e);
  if (!(first instanceof Error)) return addr;
  // An agent with another token: one carried in by an imported checkpoint (made where the
  // sandbox had another id, so another seed). It is ended and ours started in its place; its
  // commands run on. Anything else answering on the agent's port (a program of the sandbox's
  // own) is left alone: a second agent could not listen there either.
  if (first instanceof AgentError && first.code === 'EAUTH' && (await endForeignAgents(rt, id)) > 0) {
    /* ended: start ours below */
  } else if (
    !(first instanceof AgentError) ||
    !['ECONNREFUSED', 'ETIMEDOUT', 'EHOSTUNREACH'].includes(first.code)
  )
    throw first;
  await startAgent(runc, id, token, opts);
  const deadline = Date.now() + START_WAIT_MS;
  for (;;) {
    opts.signal?.throwIfAborted();
    const r = await client.ping().catch((e: unknown) => e as Error);
    if (!(r instanceof Error)) return addr;
    if (Date.now() > deadline)
      throw new AgentError(
        'EAGENTSTART',
        `agent: started in sandbox ${id} but not answering within ${START_WAIT_MS} ms: ${r.message}`,
      );
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

/**
 * `runc exec` of the host copy as /proc/self/fd/3, the token on its stdin. The process gets
 * the sandbox's user, capabilities, seccomp filter, namespaces and cgroup, like any exec; the
 * shell opens the copy read-only as fd 3. Two things runc does not do for us:
 * - The time namespace. A restored sandbox runs in one CRIU made, which runc (1.1) does not
 *   know and so does not join (and cannot be made to: runc run inside it misreads its pid 1's
 *   start time and calls the container stopped). An agent started after a restore sits in the
 *   host's, and CRIU cannot restore a tree with a task outside its time namespace: such tasks
 *   are ended before each dump ({@link endOutsideTimeNamespace}); the agent starts again on
 *   the next toolbox call. An agent started before the first dump is dumped and restored with
 *   the sandbox, inside it.
 * - Not detached (no `-d`): the agent's first stage forks the agent and exits at once, and
 *   runc waits for it and reaps it. Detached, it was left a zombie in the sandbox's pid
 *   namespace with a parent outside it, for as long as the host's pid 1 does not reap.
 */
async function startAgent(runc: RuncCommand, id: string, token: string, opts: CallOptions): Promise<void> {
  const binary = await agentHostCopy().catch((e: unknown) => {
    if (e instanceof AgentError) throw e;
    throw new AgentError(
      'EAGENTSTART',
      `agent: no read-only copy of the agent on this host: ${e instanceof Error ? e.message : String(e)}`,
    );
  });
  const [runcPath, args, env] = runc(id, ['exec', '--preserve-fds', '1', id, '/proc/self/fd/3', 'serve']);
  try {
    const r = await run('sh', ['-c', 'exec 3<"$DORMANT_AGENT_COPY" && exec "$@"', 'sh', runcPath, ...args], {
      env: { ...env, DORMANT_AGENT_COPY: binary },
      input: `${token}\n`,
      timeoutMs: opts.timeoutMs ?? 15_000,
      signal: opts.signal,
      okExitCodes: Array.from({ length: 256 }, (_, i) => i),
    });
    // What the agent or runc said is the useful part (the command line is long and the same
    // every time): the agent's own errors come on its stderr before it detaches.
    if (r.exitCode !== 0)
      throw new Error(`exit ${String(r.exitCode)}: ${r.stderr.trim().slice(-500) || '(nothing on stderr)'}`);
  } catch (e) {
    throw new AgentError(
      'EAGENTSTART',
      `agent: could not start in sandbox ${id}: ${e instanceof Error ? e.message : String(e)}`,
    );
  }
}

/**
 * Ends (SIGKILL) the sandbox's agents (processes running a copy of the agent from where it
 * installs itself) and waits until they no longer listen; returns how many were ended.
 */
async function endForeignAgents(rt: AgentHost, id: string): Promise<number> {
  const agents: number[] = [];
  for (const pid of await rt.pids(id)) {
    const exe = await readlink(`/proc/${pid}/exe`).catch(() => '');
    if (/^\/(dev\/)?\.dormant\/agent( \(deleted\))?$/.test(exe)) agents.push(pid);
  }
  for (const pid of agents) {
    try {
      process.kill(pid, 'SIGKILL');
    } catch {
      // Gone already.
    }
  }
  const deadline = Date.now() + 2000;
  while (Date.now() < deadline && (await Promise.all(agents.map(timeNamespace))).some((n) => n !== undefined))
    await new Promise((r) => setTimeout(r, 20));
  return agents.length;
}

/** Whether the cgroup holding these cgroup.procs files is frozen (v1 freezer or v2). */
async function isFrozen(procsFiles: string[]): Promise<boolean> {
  for (const f of procsFiles) {
    const dir = dirname(f);
    const v1 = await readFile(join(dir, 'freezer.state'), 'utf8').catch(() => undefined);
    if (v1 !== undefined) return v1.trim() !== 'THAWED';
    const v2 = await readFile(join(dir, 'cgroup.freeze'), 'utf8').catch(() => undefined);
    if (v2 !== undefined) return v2.trim() === '1';
  }
  return false;
}

/** The time namespace of a process, or undefined once it is gone or a zombie. */
async function timeNamespace(pid: number): Promise<string | undefined> {
  return readlink(`/proc/${pid}/ns/time`).catch(() => undefined);
}

/**
 * Ends (SIGKILL) the sandbox's processes that are not in its pid 1's time namespace, before a
 * dump: a task started by `runc exec` into a restored sandbox (the toolbox agent and what it
 * runs, mostly) sits in the host's time namespace while the rest sits in the one CRIU made at
 * the restore, and CRIU cannot restore such a tree. Called with the sandbox frozen: it is
 * thawed while they die (a frozen task cannot, with the v1 freezer) and frozen again. Returns
 * the pids ended; [] (and nothing touched) in the usual case.
 */
export async function endOutsideTimeNamespace(
  rt: {
    pids(id: string): Promise<number[]>;
    procsFiles(id: string): string[];
    freeze(id: string, opts?: CallOptions): Promise<void>;
    thaw(id: string, opts?: CallOptions): Promise<void>;
  },
  id: string,
): Promise<number[]> {
  const pids = await rt.pids(id);
  // Its pid 1: the task whose innermost pid (the last NSpid) is 1.
  let own: string | undefined;
  for (const pid of pids) {
    const status = await readFile(`/proc/${pid}/status`, 'utf8').catch(() => '');
    if (/^NSpid:.*\s1$/m.test(status)) own = await timeNamespace(pid);
  }
  if (own === undefined) return [];
  const outside: number[] = [];
  for (const pid of pids) {
    const ns = await timeNamespace(pid);
    if (ns !== undefined && ns !== own) outside.push(pid);
  }
  if (outside.length === 0) return [];
  for (const pid of outside) {
    try {
      process.kill(pid, 'SIGKILL');
    } catch {
      // Gone already.
    }
  }
  const frozen = await isFrozen(rt.procsFiles(id));
  if (frozen) await rt.thaw(id);
  try {
    const deadline = Date.now() + 5000;
    for (;;) {
      const left = (await Promise.all(outside.map(timeNamespace))).filter((ns) => ns !== undefined);
      if (left.length === 0) break;
      if (Date.now() > deadline)
        throw new DormantError(
          ErrorCode.RUNTIME_INVALID_STATE,
          `sandbox ${id}: ${left.length} process(es) started after its restore (outside its time namespace) did not end`,
        );
      await new Promise((r) => setTimeout(r, 20));
    }
  } finally {
    if (frozen) await rt.freeze(id);
  }
  return outside;
}
