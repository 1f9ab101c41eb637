/**
 * The Runtime port on runc (1.1.x) with CRIU. runc is called directly, through sys/exec's
 * run(), with a private state root so dormant's containers never mix with anyone else's.
 *
 * Host-side layout of one sandbox (`<stateDir>/sandboxes/<id>/`, mode 0700; nothing of it
 * is visible inside the sandbox except the overlay mounted at bundle/rootfs):
 *
 *   sandbox.json          the compiled spec, without its environment, and its network slot
 *                         (written first, atomically; 0600)
 *   bundle/rootfs/        overlay mount point: lower = spec.rootfs, upper/work below
 *   fs/upper/, fs/work/   the writable layer (fs/upper is the filesystem diff)
 *   fs.img                with a disk quota: the layer's ext4 image, loop-mounted at fs/ (quota.ts)
 *   log/output.log        the sandbox's stdout+stderr, appended by the log collector
 *   log/*.pid             the collector's pids (log-collector.ts)
 *   criu.conf             CRIU options runc cannot pass (tcp-close, skip-in-flight)
 *   runc.log              runc's own log (JSON lines), read back for error messages
 *
 * The OCI config (config.json, oci.ts) holds the sandbox's environment in clear, where API keys
 * live: it is written into `<bundleDir>/<id>/` on a memory-backed folder (never the data disk)
 * by prepare(), from the spec it is given, before `runc create` or `runc restore`. It stays
 * while the container exists (`runc exec` reads its process defaults, the environment too,
 * from the bundle) and is removed when the container ends (stop, so also after a checkpoint;
 * destroy): a hibernated sandbox's environment is nowhere in clear.
 */
import { chmod, mkdir, open, readFile, readdir, rename, rm, rmdir, stat, writeFile } from 'node:fs/promises';
import { createHash } from 'node:crypto';
import { dirname, join, resolve } from 'node:path';
import { accessSync, readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { DormantError, ErrorCode, errnoCode, isDormantError } from '../domain/errors.js';
import { run, type RunResult } from '../sys/exec.js';
import { ensureCollector, stopCollector } from './log-collector.js';
import {
  clearCriuNetworkLock,
  findSlot,
  parseSubnet,
  releaseSlot,
  reserveSlot,
  setUpNetwork,
  slotNetwork,
  tearDownNetwork,
  type Subnet,
} from './network.js';
import { buildOciConfig, compileSandboxSpec, criuConfigText } from './oci.js';
import { isMountPoint, mountOverlay, unmount, unmountAll } from './rootfs.js';
import { removeCgroupEverywhere } from '../sys/cgroup.js';
import { assertOwnFolder, privateFolder } from './staging.js';
import { ensureLayer, releaseLayer, remountLayer } from './quota.js';
import type {
  CallOptions,
  CheckpointOptions,
  CheckpointResult,
  ExecOptions,
  ExecResult,
  RestoreOptions,
  RestoreResult,
  Runtime,
  SandboxNetwork,
  SandboxSpec,
  SandboxState,
  SandboxStatus,
  PrepareOptions,
} from './runtime.js';

export interface RuncRuntimeOptions {
  /** Where sandboxes, runc's state and the network reservations live. Keep it root-only. */
  stateDir: string;
  /** Default `runc` on PATH. */
  runcPath?: string;
  /** The criu binary runc should run. Default `criu` on PATH. */
  criuPath?: string;
  /** Environment for runc (and so criu). Default `{ CRIU_FAULT: '130' }` (see PLATFORM.md). */
  criuEnv?: Record<string, string>;
  /** The IPv4 subnet sandboxes get /30s from. Default 10.213.0.0/16. */
  subnet?: string;
  /** Parent of every sandbox's cgroup. Default `/dormant`. */
  cgroupParent?: string;
  /** Host-wide folder of network slot reservations. Default `/var/lib/dormant-net`. */
  netSlotDir?: string;
  /**
   * How long a checkpoint (runc checkpoint, so CRIU's dump) may take before it is ended as
   * hung and the sandbox thawed. Default 120 s.
   */
  checkpointTimeoutMs?: number;
  /**
   * Memory-backed folder (tmpfs) for the sandboxes' OCI configs, which hold their environment
   * in clear. Default `/dev/shm/dormant-bundles-<hash of stateDir>`; the daemon puts it next to
   * its staging folder and wipes it at start.
   */
  bundleDir?: string;
  /** The seccomp profile (OCI `linux.seccomp`) of every sandbox. Default config/seccomp-default.json; `false`: none. */
  seccomp?: Readonly<Record<string, unknown>> | false;
  /** An AppArmor profile for sandboxes, used when the host has AppArmor (`/sys/kernel/security/apparmor`). */
  apparmorProfile?: string;
  /**
   * How long a restore (runc restore, so CRIU's restore) may take before it is ended as hung
   * and everything it made is removed. Default 120 s.
   */
  restoreTimeoutMs?: number;
}

/** Where the default seccomp profile lives: data the operator can read, beside the code. */
export const DEFAULT_SECCOMP_PROFILE = join(
  dirname(fileURLToPath(import.meta.url)),
  '..',
  '..',
  'config',
  'seccomp-default.json',
);

/** Reads a seccomp profile (OCI `linux.seccomp` JSON), refusing one that is not an object with a default action. */
export function loadSeccompProfile(path: string): Readonly<Record<string, unknown>> {
  let parsed: unknown;
  try {
    parsed = JSON.parse(readFileSync(path, 'utf8'));
  } catch (e) {
    throw new DormantError(ErrorCode.INVALID_ARGUMENT, `seccomp profile ${path}: ${(e as Error).message}`, {
      status: 400,
      cause: e,
    });
  }
  if (
    typeof parsed !== 'object' ||
    parsed === null ||
    typeof (parsed as Record<string, unknown>).defaultAction !== 'string'
  )
    throw new DormantError(
      ErrorCode.INVALID_ARGUMENT,
      `seccomp profile ${path}: not an OCI linux.seccomp object (no defaultAction)`,
      { status: 400 },
    );
  return Object.freeze(parsed as Record<string, unknown>);
}

interface SandboxRecord {
  spec: Readonly<SandboxSpec>;
  slot: number;
  network: SandboxNetwork;
}

interface RuncState {
  status: string;
  pid: number;
}

/** Where the cgroup hierarchies are mounted (v1: one folder per controller; v2: the one tree). */
const CGROUP_ROOT = '/sys/fs/cgroup';

/** SIGKILL to each pid; one already gone is no error. */
function sigkill(pids: readonly number[]): void {
  for (const pid of pids) {
    try {
      process.kill(pid, 'SIGKILL');
    } catch (e) {
      if (errnoCode(e) !== 'ESRCH') throw e;
    }
  }
}

const DEFAULTS = {
  stateMs: 10_000,
  createMs: 30_000,
  startMs: 10_000,
  execMs: 60_000,
  freezeMs: 10_000,
  checkpointMs: 120_000,
  restoreMs: 120_000,
  killMs: 10_000,
  destroyMs: 30_000,
} as const;

/** How much of the end of a log tailOf reads: a CRIU stuck in a loop writes gigabytes. */
const TAIL_BYTES = 1024 * 1024;

/** The last `bytes` of a file (all of it when shorter). */
async function readEnd(path: string, bytes: number): Promise<string> {
  const fh = await open(path, 'r');
  try {
    const size = (await fh.stat()).size;
    const n = Math.min(size, bytes);
    const buf = Buffer.alloc(n);
    await fh.read(buf, 0, n, size - n);
    return buf.toString('utf8');
  } finally {
    await fh.close();
  }
}

/** The first `bytes` of a file. */
async function readStart(path: string, bytes: number): Promise<string> {
  const fh = await open(path, 'r');
  try {
    const buf = Buffer.alloc(bytes);
    const { bytesRead } = await fh.read(buf, 0, bytes, 0);
    return buf.subarray(0, bytesRead).toString('utf8');
  } finally {
    await fh.close();
  }
}

/** What of a failed restore's CRIU log is kept: its start and its end. */
const KEPT_LOG_HEAD_BYTES = 256 * 1024;
const KEPT_LOG_TAIL_BYTES = 1024 * 1024;

/**
 * A restore whose CRIU log grows past this is taken as stuck: a truncated pages image makes
 * CRIU 4.2 retry a read at the end of the file forever, logging each try ("Advanced iov 0
 * bytes"), until the restore timeout. A healthy restore logs a few MiB at most.
 */
const RESTORE_LOG_LIMIT_BYTES = 64 * 1024 * 1024;

/** How long runc restore may go on after the lazy-pages daemon failed before it is ended. */
const LAZY_FAILURE_GRACE_MS = 3000;

/** A line of the CRIU log or runc log worth putting in an error message. */
async function tailOf(path: string, pattern: RegExp, lines = 12): Promise<string> {
  try {
    const text = await readEnd(path, TAIL_BYTES);
    const hits = text.split('\n').filter((l) => pattern.test(l));
    return hits.slice(-lines).join('\n');
  } catch (e) {
    if (errnoCode(e) === 'ENOENT') return '';
    throw e;
  }
}

/** The spec as sandbox.json keeps it: without the environment (the caller gives it each time). */
function recordSpec(spec: Readonly<SandboxSpec>): Readonly<SandboxSpec> {
  return { ...spec, env: {} };
}

/**
 * Overwrites a file's bytes with zeros in place, then removes it: a config or record written
 * to the data disk by an older version held the environment in clear. (A filesystem that never
 * overwrites in place, copy-on-write or an SSD's remapping, may still keep the old blocks.)
 */
async function scrubFile(path: string): Promise<void> {
  let fh;
  try {
    fh = await open(path, 'r+');
  } catch (e) {
    if (errnoCode(e) === 'ENOENT') return;
    throw e;
  }
  try {
    const { size } = await fh.stat();
    await fh.write(Buffer.alloc(size), 0, size, 0);
    await fh.sync();
  } finally {
    await fh.close();
  }
  await rm(path, { force: true });
}

/** Creates `path` empty if missing, and makes it 0600 (a log runc or a shell appends to). */
async function privateFile(path: string): Promise<void> {
  await (await open(path, 'a', 0o600)).close();
  await chmod(path, 0o600);
}

async function writeFileAtomic(path: string, data: string): Promise<void> {
  try {
    // prepare() runs before every restore: an unchanged file costs a read, not an fsync.
    if ((await readFile(path, 'utf8')) === data) return;
  } catch (e) {
    if (errnoCode(e) !== 'ENOENT') throw e;
  }
  const tmp = `${path}.tmp`;
  const fh = await open(tmp, 'w', 0o600);
  try {
    await fh.writeFile(data);
    await fh.sync();
  } finally {
    await fh.close();
  }
  // rename after fsync: a crash leaves either the old file or the whole new one.
  await rename(tmp, path);
}

/** `fn` timed as `step` when the caller asked for timings. */
function timed<T>(opts: CallOptions, step: string, fn: () => Promise<T>): Promise<T> {
  return opts.timer ? opts.timer.time(step, fn) : fn();
}

async function exists(path: string): Promise<boolean> {
  try {
    await stat(path);
    return true;
  } catch (e) {
    if (errnoCode(e) === 'ENOENT') return false;
    throw e;
  }
}

export class RuncRuntime implements Runtime {
  private readonly stateDir: string;
  private readonly runcPath: string;
  private readonly criuPath: string;
  private readonly env: Record<string, string>;
  private readonly subnet: Subnet;
  private readonly cgroupParent: string;
  private readonly netSlotDir: string;
  private readonly checkpointTimeoutMs: number;
  private readonly bundleRoot: string;
  /**
   * The config last written for each sandbox, kept in this process's memory (never on disk):
   * stop() removes the file, and a restore() with no prepare() since (same process) writes it
   * again from here.
   */
  private readonly configs = new Map<string, string>();
  private readonly seccomp: Readonly<Record<string, unknown>> | undefined;
  private readonly apparmorProfile: string | undefined;
  private readonly restoreTimeoutMs: number;

  constructor(options: RuncRuntimeOptions) {
    if (!options.stateDir.startsWith('/'))
      throw new DormantError(ErrorCode.INVALID_ARGUMENT, 'RuncRuntime: stateDir must be absolute', {
        status: 400,
      });
    this.stateDir = options.stateDir;
    this.runcPath = options.runcPath ?? 'runc';
    this.criuPath = options.criuPath ?? 'criu';
    this.checkpointTimeoutMs = options.checkpointTimeoutMs ?? DEFAULTS.checkpointMs;
    this.restoreTimeoutMs = options.restoreTimeoutMs ?? DEFAULTS.restoreMs;
    const path = process.env.PATH ?? '/usr/bin:/bin';
    this.env = {
      CRIU_FAULT: '130',
      // CRIU's network lock runs iptables-restore, which lives in sbin.
      PATH: path.includes('/usr/sbin') ? path : `/usr/local/sbin:/usr/sbin:/sbin:${path}`,
      ...options.criuEnv,
    };
    this.subnet = parseSubnet(options.subnet ?? '10.213.0.0/16');
    this.cgroupParent = options.cgroupParent ?? '/dormant';
    this.netSlotDir = options.netSlotDir ?? '/var/lib/dormant-net';
    this.bundleRoot =
      options.bundleDir ??
      `/dev/shm/dormant-bundles-${createHash('sha256').update(options.stateDir).digest('hex').slice(0, 12)}`;
    this.seccomp =
      options.seccomp === false
        ? undefined
        : (options.seccomp ?? loadSeccompProfile(DEFAULT_SECCOMP_PROFILE));
    // AppArmor only where the host has it (and the operator named a profile it loaded).
    this.apparmorProfile =
      options.apparmorProfile !== undefined && hostHasAppArmor() ? options.apparmorProfile : undefined;
  }

  // ---- paths -------------------------------------------------------------------------

  private dir(id: string): string {
    return join(this.stateDir, 'sandboxes', id);
  }
  private runcRoot(): string {
    return join(this.stateDir, 'runc');
  }
  /**
   * Address reservations are host-wide, not per state folder: interface names and addresses are
   * host-wide too, so two daemons (or test runs) on one host must never take the same slot.
   */
  private netDir(): string {
    return this.netSlotDir;
  }
  /** The sandbox's writable layer: its filesystem diff, to archive. */
  upperDir(id: string): string {
    return join(this.dir(id), 'fs', 'upper');
  }
  logPath(id: string): string {
    return join(this.dir(id), 'log', 'output.log');
  }
  private bundle(id: string): string {
    return join(this.dir(id), 'bundle');
  }
  /** The folder runc is given as the bundle: config.json only, on tmpfs (see the top). */
  private configBundle(id: string): string {
    return join(this.bundleRoot, id);
  }
  /** cgroup path of a sandbox, relative to each hierarchy's root. */
  cgroupPath(id: string): string {
    return `${this.cgroupParent}/${id}`;
  }

  private runcArgs(id: string, args: string[]): string[] {
    return [
      '--root',
      this.runcRoot(),
      '--log',
      join(this.dir(id), 'runc.log'),
      '--log-format',
      'json',
      '--criu',
      this.criuPath,
      ...args,
    ];
  }

  private async runc(
    id: string,
    args: string[],
    opts: CallOptions & { okExitCodes?: number[]; input?: string | Buffer },
    defaultTimeoutMs: number,
  ): Promise<RunResult> {
    return timed(opts, `runc ${args[0] ?? ''}`, () =>
      run(this.runcPath, this.runcArgs(id, args), {
        timeoutMs: opts.timeoutMs ?? defaultTimeoutMs,
        signal: opts.signal,
        env: this.env,
        okExitCodes: opts.okExitCodes,
        input: opts.input,
      }),
    );
  }

  /**
   * runc with the sandbox's log pipe as stdin=/dev/null, stdout and stderr: what runc create
   * and runc restore hand to the sandbox. A shell opens the pipe (`/proc/<keeper>/fd/1`)
   * because run() gives its children socketpairs, which CRIU could not dump.
   */
  private async runcWithLogPipe(
    id: string,
    args: string[],
    opts: CallOptions,
    defaultTimeoutMs: number,
  ): Promise<RunResult> {
    const collector = await ensureCollector(join(this.dir(id), 'log'), opts.signal);
    return timed(opts, `runc ${args[0] ?? ''}`, () =>
      run(
        'sh',
        [
          '-c',
          'exec "$@" </dev/null >>"$DORMANT_LOG_PIPE" 2>&1',
          'sh',
          this.runcPath,
          ...this.runcArgs(id, args),
        ],
        {
          timeoutMs: opts.timeoutMs ?? defaultTimeoutMs,
          signal: opts.signal,
          env: { ...this.env, DORMANT_LOG_PIPE: collector.pipePath },
        },
      ),
    );
  }

  // ---- records -----------------------------------------------------------------------

  private async readRecord(id: string): Promise<SandboxRecord> {
    try {
      return JSON.parse(await readFile(join(this.dir(id), 'sandbox.json'), 'utf8')) as SandboxRecord;
    } catch (e) {
      if (errnoCode(e) === 'ENOENT')
        throw new DormantError(
          ErrorCode.RUNTIME_SANDBOX_NOT_FOUND,
          `sandbox ${id} does not exist on this node`,
          {
            status: 404,
          },
        );
      throw e;
    }
  }

  private async runcState(id: string, opts: CallOptions = {}): Promise<RuncState | undefined> {
    const r = await this.runc(id, ['state', id], { ...opts, okExitCodes: [0, 1] }, DEFAULTS.stateMs);
    if (r.exitCode !== 0) {
      if (
        /does not exist/.test(r.stderr + (await tailOf(join(this.dir(id), 'runc.log'), /does not exist/, 1)))
      )
        return undefined;
      throw new DormantError(ErrorCode.COMMAND_FAILED, `runc state ${id} failed: ${r.stderr.trim()}`);
    }
    return JSON.parse(r.stdout) as RuncState;
  }

  private async requireStatus(
    id: string,
    allowed: SandboxStatus[],
    action: string,
    opts: CallOptions = {},
  ): Promise<SandboxState> {
    const s = await this.state(id, opts);
    if (!allowed.includes(s.status))
      throw new DormantError(
        ErrorCode.RUNTIME_INVALID_STATE,
        `cannot ${action} sandbox ${id}: it is ${s.status} (needs ${allowed.join(' or ')})`,
        { status: 409 },
      );
    return s;
  }

  private async runcLogSince(id: string, offset: number): Promise<string> {
    try {
      const buf = await readFile(join(this.dir(id), 'runc.log'));
      const lines = buf.subarray(offset).toString('utf8').split('\n').filter(Boolean);
      return lines
        .map((l) => {
          try {
            const j = JSON.parse(l) as { level?: string; msg?: string };
            return j.level === 'error' || j.level === 'fatal' ? (j.msg ?? '') : '';
          } catch {
            return l;
          }
        })
        .filter(Boolean)
        .slice(-8)
        .join('\n');
    } catch (e) {
      if (errnoCode(e) === 'ENOENT') return '';
      throw e;
    }
  }

  private async runcLogSize(id: string): Promise<number> {
    try {
      return (await stat(join(this.dir(id), 'runc.log'))).size;
    } catch (e) {
      if (errnoCode(e) === 'ENOENT') return 0;
      throw e;
    }
  }

  /** Everything a container needs on the host: network, log collector, mounted rootfs. */
  private async ensureHostSide(rec: SandboxRecord, signal?: AbortSignal, mount = true): Promise<void> {
    const id = rec.spec.id;
    await setUpNetwork(rec.network, rec.spec.ports ?? [], {
      markerPath: join(this.dir(id), 'network.done'),
      signal,
    });
    await ensureCollector(join(this.dir(id), 'log'), signal);
    if (!mount) return;
    await mountOverlay(
      {
        lower: rec.spec.rootfs,
        upper: this.upperDir(id),
        work: join(this.dir(id), 'fs', 'work'),
        target: join(this.bundle(id), 'rootfs'),
      },
      signal,
    );
  }

  // ---- the OCI config (holds the environment: tmpfs only) ------------------------------

  /**
   * Writes config.json into the sandbox's bundle on tmpfs (a private folder of ours, checked
   * each time: it is in /dev/shm by default) with the rootfs given as an absolute path, as
   * the overlay stays mounted under the sandbox's folder. A config an older version left on
   * the data disk is scrubbed.
   */
  private async writeConfig(id: string, config: object): Promise<void> {
    const bundle = await this.configDir(id);
    const c = config as { root?: { path: string; readonly?: boolean } };
    const full = { ...c, root: { ...c.root, path: join(this.bundle(id), 'rootfs') } };
    const text = JSON.stringify(full, null, 2);
    this.configs.set(id, text);
    await writeFileAtomic(join(bundle, 'config.json'), text);
    await scrubFile(join(this.bundle(id), 'config.json'));
  }

  /** The sandbox's bundle folder on tmpfs, made (0700) if missing. */
  private async configDir(id: string): Promise<string> {
    const bundle = this.configBundle(id);
    for (let attempt = 0; ; attempt++) {
      try {
        await privateFolder(this.bundleRoot);
        await mkdir(bundle, { mode: 0o700 }).catch((e: unknown) => {
          if (errnoCode(e) !== 'EEXIST') throw e;
        });
        break;
      } catch (e) {
        // The shared folder was removed with another sandbox between the two mkdirs.
        if (errnoCode(e) !== 'ENOENT' || attempt > 0) throw e;
      }
    }
    return bundle;
  }

  /** Removes config.json once the container is gone (runc reads it only for create, restore, exec). */
  private async dropConfig(id: string): Promise<void> {
    await rm(join(this.configBundle(id), 'config.json'), { force: true });
  }

  /** Before runc restore: the config stop() removed, from memory; without it, prepare() first. */
  private async ensureConfig(id: string): Promise<void> {
    if (await exists(join(this.configBundle(id), 'config.json'))) return;
    const text = this.configs.get(id);
    if (text === undefined)
      throw new DormantError(
        ErrorCode.RUNTIME_INVALID_STATE,
        `cannot restore sandbox ${id}: it is not prepared (its config is written by prepare)`,
        { status: 409 },
      );
    await writeFileAtomic(join(await this.configDir(id), 'config.json'), text);
  }

  /**
   * Removes the bundles of sandboxes this runtime no longer has (a destroy cut short); those
   * of sandboxes that still exist stay, as their running containers need them for exec.
   */
  async dropStaleConfigs(): Promise<void> {
    const live = new Set(await this.list());
    let names: string[];
    try {
      names = await readdir(this.bundleRoot);
    } catch (e) {
      if (errnoCode(e) === 'ENOENT') return;
      throw e;
    }
    await assertOwnFolder(this.bundleRoot);
    for (const n of names)
      if (!live.has(n)) await rm(join(this.bundleRoot, n), { recursive: true, force: true });
  }

  /**
   * Replaces sandbox.json and overwrites the old file's bytes (held open across the rename) so
   * what it held does not stay in free blocks of the data disk.
   */
  private async rewriteRecord(path: string, data: string): Promise<void> {
    const old = await open(path, 'r+');
    try {
      // The new file is renamed over the old one (a crash leaves one or the other, whole);
      // the old one's bytes are then overwritten through the descriptor still open on it.
      await writeFileAtomic(path, data);
      const { size } = await old.stat();
      await old.write(Buffer.alloc(size), 0, size, 0);
      await old.sync();
    } finally {
      await old.close();
    }
  }

  // ---- the port ----------------------------------------------------------------------

  async prepare(raw: SandboxSpec, opts: PrepareOptions = {}): Promise<SandboxState> {
    const spec = compileSandboxSpec(raw);
    const id = spec.id;
    const dir = this.dir(id);
    const recordPath = join(dir, 'sandbox.json');
    let rec: SandboxRecord;
    if (await exists(recordPath)) {
      rec = await this.readRecord(id);
      if (Object.keys(rec.spec.env ?? {}).length > 0) {
        // Written by a version that kept the environment here: rewritten without it.
        rec = { ...rec, spec: recordSpec(rec.spec) };
        await this.rewriteRecord(recordPath, JSON.stringify(rec, null, 2));
      }
      if (JSON.stringify(rec.spec) !== JSON.stringify(recordSpec(spec)))
        throw new DormantError(
          ErrorCode.RUNTIME_SANDBOX_EXISTS,
          `sandbox ${id} already exists with another spec`,
          {
            status: 409,
          },
        );
    } else {
      try {
        if (!(await stat(spec.rootfs)).isDirectory()) throw new Error('not a directory');
      } catch (e) {
        throw new DormantError(
          ErrorCode.INVALID_ARGUMENT,
          `sandbox ${id}: rootfs ${spec.rootfs} is not a folder`,
          {
            status: 400,
            cause: e,
          },
        );
      }
      await mkdir(join(this.stateDir, 'sandboxes'), { recursive: true, mode: 0o700 });
      await mkdir(dir, { mode: 0o700 }).catch((e: unknown) => {
        if (errnoCode(e) !== 'EEXIST') throw e;
      });
      const slot = await reserveSlot(this.netDir(), id, this.subnet);
      rec = { spec: recordSpec(spec), slot, network: slotNetwork(id, this.subnet, slot) };
      await writeFileAtomic(recordPath, JSON.stringify(rec, null, 2));
    }
    // The disk quota: the writable layer's image is mounted at fs/ before upper/ and work/
    // are made in it.
    const diskBytes = spec.limits?.diskBytes;
    if (diskBytes !== undefined) {
      await mkdir(join(dir, 'fs'), { recursive: true, mode: 0o700 });
      await timed(opts, 'disk quota', () => ensureLayer(dir, diskBytes, opts.signal));
    }
    for (const d of ['bundle/rootfs', 'fs/upper', 'fs/work', 'log'])
      await mkdir(join(dir, d), { recursive: true, mode: 0o700 });
    await privateFile(this.logPath(id));
    await privateFile(join(dir, 'runc.log'));
    const criuConf = join(dir, 'criu.conf');
    await writeFileAtomic(criuConf, criuConfigText());
    const config = buildOciConfig({
      spec,
      netnsPath: `/var/run/netns/${rec.network.netns}`,
      cgroupsPath: this.cgroupPath(id),
      criuConfigPath: criuConf,
      ...(this.seccomp !== undefined ? { seccomp: this.seccomp } : {}),
      ...(this.apparmorProfile !== undefined ? { apparmorProfile: this.apparmorProfile } : {}),
    });
    await this.writeConfig(id, config);
    await timed(opts, 'host side', () => this.ensureHostSide(rec, opts.signal, opts.mountRootfs !== false));
    return this.state(id, opts);
  }

  async create(spec: SandboxSpec, opts: CallOptions = {}): Promise<SandboxState> {
    await this.prepare(spec, opts);
    const id = spec.id;
    const current = await this.runcState(id, opts);
    if (current !== undefined && current.status !== 'stopped') return this.state(id, opts);
    // A container whose processes are gone (its command exited, or the node rebooted) is
    // only a record in runc's state: clear it so the sandbox starts afresh.
    if (current !== undefined) await this.runc(id, ['delete', '--force', id], opts, DEFAULTS.destroyMs);
    const offset = await this.runcLogSize(id);
    try {
      await this.runcWithLogPipe(
        id,
        ['create', '--bundle', this.configBundle(id), id],
        opts,
        DEFAULTS.createMs,
      );
    } catch (e) {
      const why = await this.runcLogSince(id, offset);
      throw new DormantError(
        ErrorCode.RUNTIME_CREATE_FAILED,
        `runc could not create sandbox ${id}${why ? `: ${why}` : ''}`,
        { cause: e, details: { runcLog: why } },
      );
    }
    return this.state(id, opts);
  }

  async start(id: string, opts: CallOptions = {}): Promise<void> {
    await this.requireStatus(id, ['created'], 'start', opts);
    await this.runc(id, ['start', id], opts, DEFAULTS.startMs);
  }

  async state(id: string, opts: CallOptions = {}): Promise<SandboxState> {
    const rec = await this.readRecord(id);
    const rs = await this.runcState(id, opts);
    const status: SandboxStatus =
      rs === undefined
        ? 'absent'
        : rs.status === 'created' || rs.status === 'running' || rs.status === 'paused'
          ? rs.status
          : 'stopped';
    return {
      id,
      status,
      pid: rs !== undefined && rs.pid > 0 ? rs.pid : undefined,
      network: rec.network,
      logPath: this.logPath(id),
      upperDir: this.upperDir(id),
    };
  }

  async exec(id: string, args: readonly string[], opts: ExecOptions = {}): Promise<ExecResult> {
    if (args.length === 0)
      throw new DormantError(ErrorCode.INVALID_ARGUMENT, `exec in ${id}: a command is required`, {
        status: 400,
      });
    await this.requireStatus(id, ['running'], 'exec in', opts);
    const flags: string[] = [];
    if (opts.cwd !== undefined) flags.push('--cwd', opts.cwd);
    for (const [k, v] of Object.entries(opts.env ?? {})) flags.push('--env', `${k}=${v}`);
    // runc exec (not detached, no terminal) gives the command pipes of its own and copies
    // them to ours until every holder closes them: a command that leaves a process in the
    // background holding its stdout/stderr keeps the exec open until that process exits or
    // the timeout ends it. Background processes should redirect their output.
    const timeoutMs = opts.timeoutMs ?? DEFAULTS.execMs;
    const r = await this.runc(
      id,
      ['exec', ...flags, id, ...args],
      {
        timeoutMs,
        signal: opts.signal,
        input: opts.input,
        okExitCodes: Array.from({ length: 256 }, (_, i) => i),
      },
      DEFAULTS.execMs,
    ).catch((e: unknown) => {
      throw execError(e, id, args, timeoutMs);
    });
    return { stdout: r.stdout, stderr: r.stderr, exitCode: r.exitCode ?? 255, durationMs: r.durationMs };
  }

  procsFiles(id: string): string[] {
    // cgroup v2 (unified), else the v1 pids or freezer hierarchy runc also placed it in.
    return [
      join(CGROUP_ROOT, this.cgroupPath(id)),
      join(CGROUP_ROOT, 'pids', this.cgroupPath(id)),
      join(CGROUP_ROOT, 'freezer', this.cgroupPath(id)),
    ].map((dir) => join(dir, 'cgroup.procs'));
  }

  async pids(id: string): Promise<number[]> {
    for (const file of this.procsFiles(id)) {
      let text: string;
      try {
        text = await readFile(file, 'utf8');
      } catch (e) {
        if (errnoCode(e) === 'ENOENT') continue;
        throw e;
      }
      return text
        .split('\n')
        .filter((l) => l !== '')
        .map(Number);
    }
    return [];
  }

  async freeze(id: string, opts: CallOptions = {}): Promise<void> {
    // The cgroup freezer directly: what `runc pause` does, without two runc starts (its own
    // and a `runc state`), ~0.1 s each here. runc reads the freezer back, so it sees `paused`.
    if (await timed(opts, 'cgroup freeze', () => this.freezeCgroup(id, opts))) return;
    const s = await this.requireStatus(id, ['running', 'paused'], 'freeze', opts);
    if (s.status === 'running') await this.runc(id, ['pause', id], opts, DEFAULTS.freezeMs);
  }

  /** Thaws the sandbox's cgroup (what `runc resume` does); false when there is no such cgroup. */
  private async thawCgroup(id: string): Promise<boolean> {
    for (const [path, value] of [
      [join(CGROUP_ROOT, 'freezer', this.cgroupPath(id), 'freezer.state'), 'THAWED'],
      [join(CGROUP_ROOT, this.cgroupPath(id), 'cgroup.freeze'), '0'],
    ] as const) {
      try {
        await writeFile(path, value, { flag: 'r+' });
        return true;
      } catch (e) {
        if (errnoCode(e) !== 'ENOENT') throw e;
      }
    }
    return false;
  }

  /**
   * Freezes the sandbox's cgroup (v1 freezer.state, v2 cgroup.freeze) and waits until every
   * task is frozen. False when there is no such cgroup (no container: the caller falls back
   * to runc, which says why); on a timeout the cgroup is thawed again and the call throws.
   */
  private async freezeCgroup(id: string, opts: CallOptions): Promise<boolean> {
    const v1 = join(CGROUP_ROOT, 'freezer', this.cgroupPath(id), 'freezer.state');
    const v2 = join(CGROUP_ROOT, this.cgroupPath(id));
    const write = async (path: string, value: string): Promise<boolean> => {
      try {
        await writeFile(path, value, { flag: 'r+' });
        return true;
      } catch (e) {
        if (errnoCode(e) === 'ENOENT') return false;
        throw e;
      }
    };
    let frozen: () => Promise<boolean>;
    let thaw: () => Promise<unknown>;
    if (await write(v1, 'FROZEN')) {
      // Written again while it reads FREEZING, as runc pause does: a task forked mid-freeze
      // can otherwise leave the cgroup FREEZING for good.
      frozen = async () =>
        (await readFile(v1, 'utf8')).trim() === 'FROZEN' || ((await write(v1, 'FROZEN')) && false);
      thaw = () => write(v1, 'THAWED');
    } else if (await write(join(v2, 'cgroup.freeze'), '1')) {
      frozen = async () => /^frozen 1$/m.test(await readFile(join(v2, 'cgroup.events'), 'utf8'));
      thaw = () => write(join(v2, 'cgroup.freeze'), '0');
    } else return false;
    const deadline = Date.now() + (opts.timeoutMs ?? DEFAULTS.freezeMs);
    for (let wait = 1; !(await frozen()); wait = Math.min(wait * 2, 50)) {
      if (Date.now() > deadline || opts.signal?.aborted) {
        await thaw().catch(() => undefined);
        throw new DormantError(
          ErrorCode.COMMAND_TIMEOUT,
          `sandbox ${id} did not freeze within ${opts.timeoutMs ?? DEFAULTS.freezeMs} ms (a task in uninterruptible sleep?); it was thawed again`,
        );
      }
      await new Promise((r) => setTimeout(r, wait));
    }
    return true;
  }

  async thaw(id: string, opts: CallOptions = {}): Promise<void> {
    if (await timed(opts, 'cgroup thaw', () => this.thawCgroup(id))) return;
    const s = await this.requireStatus(id, ['running', 'paused'], 'thaw', opts);
    if (s.status === 'paused') await this.runc(id, ['resume', id], opts, DEFAULTS.freezeMs);
  }

  async checkpoint(id: string, options: CheckpointOptions): Promise<CheckpointResult> {
    // runc runs criu from the bundle folder: relative paths would land there.
    const opts = { ...options, imagesDir: resolve(options.imagesDir), workDir: resolve(options.workDir) };
    // No `runc state` first (~0.1 s): runc checkpoint refuses a container that is not running
    // or paused, and the status is looked up then, for the error.
    const rec = await this.readRecord(id);
    await mkdir(opts.imagesDir, { recursive: true, mode: 0o700 });
    await mkdir(opts.workDir, { recursive: true, mode: 0o700 });
    const args = ['checkpoint', '--image-path', opts.imagesDir, '--work-path', opts.workDir];
    if (opts.leaveRunning === true) args.push('--leave-running');
    const logPath = join(opts.workDir, 'dump.log');
    const offset = await this.runcLogSize(id);
    const timeoutMs = opts.timeoutMs ?? this.checkpointTimeoutMs;
    let r: RunResult;
    try {
      r = await this.runc(id, [...args, id], { ...opts, timeoutMs }, DEFAULTS.checkpointMs);
    } catch (e) {
      // CRIU unfreezes the tasks when a dump fails, and runc keeps the container; a lock
      // left on the network would still cut the sandbox off, so clear it. A hung dump was
      // ended with its whole process group (runc and criu) by run()'s timeout.
      const after = await this.runcState(id).catch(() => undefined);
      if (after === undefined || (after.status !== 'running' && after.status !== 'paused')) {
        const status = after === undefined ? 'absent' : after.status === 'created' ? 'created' : 'stopped';
        throw new DormantError(
          ErrorCode.RUNTIME_INVALID_STATE,
          `cannot checkpoint sandbox ${id}: it is ${status} (needs running or paused)`,
          { status: 409, cause: e },
        );
      }
      await clearCriuNetworkLock(rec.network);
      const hung = isDormantError(e, ErrorCode.COMMAND_TIMEOUT);
      const why = hung
        ? // A hang has no error line: the last lines show where criu stopped.
          (await tailOf(logPath, /./, 8)) || (await this.runcLogSince(id, offset))
        : (await tailOf(logPath, /Error|error/)) || (await this.runcLogSince(id, offset));
      const what = hung
        ? `checkpoint of sandbox ${id} hung: criu did not finish within ${String(Math.round(timeoutMs / 1000))} s and was ended`
        : `checkpoint of sandbox ${id} failed`;
      throw new DormantError(
        ErrorCode.RUNTIME_CHECKPOINT_FAILED,
        `${what} (the sandbox is ${after.status})${why ? `:\n${why}` : hung ? ' (criu wrote no log)' : ''}`,
        { cause: e, details: { criuLog: logPath, sandboxStatus: after.status, hung } },
      );
    }
    // runc removed the container; the rootfs is unmounted so the writable layer is at rest
    // (and can be archived) while the sandbox sleeps. restore() mounts it again.
    if (opts.leaveRunning !== true) await this.stop(id);
    return { durationMs: r.durationMs, logPath };
  }

  async restore(id: string, options: RestoreOptions): Promise<RestoreResult> {
    const opts = { ...options, imagesDir: resolve(options.imagesDir), workDir: resolve(options.workDir) };
    const rec = await this.readRecord(id);
    await mkdir(opts.workDir, { recursive: true, mode: 0o700 });
    // The lazy-pages daemon needs only the images: it starts (~0.1-0.3 s, CRIU's own start)
    // while the container's state and host side are checked.
    const starting =
      opts.lazyPages === true ? timed(opts, 'lazy-pages start', () => this.startLazyPages(opts)) : undefined;
    starting?.catch(() => undefined);
    const logPath = join(opts.workDir, 'restore.log');
    const pidFile = join(opts.workDir, 'restore.pid');
    let offset: number;
    try {
      const current = await this.runcState(id, opts);
      if (current !== undefined) {
        if (current.status !== 'stopped')
          throw new DormantError(
            ErrorCode.RUNTIME_INVALID_STATE,
            `cannot restore sandbox ${id}: it is ${current.status}`,
            { status: 409 },
          );
        await this.runc(id, ['delete', '--force', id], opts, DEFAULTS.destroyMs);
      }
      await timed(opts, 'host side', () => this.ensureHostSide(rec, opts.signal));
      await this.ensureConfig(id);
      offset = await this.runcLogSize(id);
      await rm(pidFile, { force: true });
    } catch (e) {
      const l = await starting?.catch(() => undefined);
      l?.abort.abort();
      await l?.done.catch(() => undefined);
      throw e;
    }
    const lazy = await starting;
    let r: RunResult;
    // Ends runc (and its criu) early when the restore cannot succeed: CRIU stuck in a loop,
    // or the lazy-pages daemon gone. Else only the restore timeout would.
    const watch = this.watchRestore(logPath, lazy?.done, opts.signal);
    try {
      r = await this.runcWithLogPipe(
        id,
        [
          'restore',
          '--detach',
          ...(lazy ? ['--lazy-pages'] : []),
          '--pid-file',
          pidFile,
          '--image-path',
          opts.imagesDir,
          '--work-path',
          opts.workDir,
          '--bundle',
          this.configBundle(id),
          id,
        ],
        { ...opts, signal: watch.signal, timeoutMs: opts.timeoutMs ?? this.restoreTimeoutMs },
        DEFAULTS.restoreMs,
      );
    } catch (e) {
      watch.stop();
      lazy?.abort.abort();
      await lazy?.done.catch(() => undefined);
      const hung = isDormantError(e, ErrorCode.COMMAND_TIMEOUT) || watch.stuck() !== undefined;
      const why = hung
        ? // A hang has no error line: the last lines show where criu stopped.
          (await tailOf(logPath, /./, 8)) || (await this.runcLogSince(id, offset))
        : (await tailOf(logPath, /Error|error/)) || (await this.runcLogSince(id, offset));
      // Kept before the caller wipes the work dir with the images: the one place an admin
      // can read why CRIU refused.
      const kept = await this.keepRestoreLog(id, opts.workDir).catch(() => undefined);
      const left = await this.cleanUpFailedRestore(id, rec, opts.workDir);
      const stuck = watch.stuck();
      const what =
        stuck !== undefined
          ? `restore of sandbox ${id} failed: ${stuck}; criu was ended`
          : hung
            ? `restore of sandbox ${id} hung: criu did not finish within ${String(Math.round((opts.timeoutMs ?? this.restoreTimeoutMs) / 1000))} s and was ended`
            : `restore of sandbox ${id} failed`;
      throw new DormantError(
        ErrorCode.RUNTIME_RESTORE_FAILED,
        `${what}${why ? `:\n${why}` : ''}${left.length > 0 ? `\n(left behind: ${left.join(', ')})` : ''}`,
        {
          cause: e,
          ...(kept ? { hint: `criu's log of this restore is kept in ${kept}` } : {}),
          details: { ...(kept ? { criuLog: kept } : {}), hung, leftBehind: left },
        },
      );
    }
    watch.stop();
    let pid: number;
    try {
      // The pid file saves a `runc state` (a process start) on the resume path.
      pid = Number((await readFile(pidFile, 'utf8').catch(() => '')).trim());
      if (!Number.isInteger(pid) || pid <= 0)
        throw new DormantError(
          ErrorCode.RUNTIME_RESTORE_FAILED,
          `restore of sandbox ${id}: runc wrote no pid`,
        );
      // CRIU brings back the uts namespace as it was dumped; a sandbox restored from another's
      // checkpoint (a fork) must still answer to its own hostname. Set from the host: the
      // sandbox itself has no CAP_SYS_ADMIN.
      const hostname = rec.spec.hostname ?? id;
      await timed(opts, 'hostname', () =>
        run('nsenter', ['--target', String(pid), '--uts', 'hostname', hostname], {
          timeoutMs: DEFAULTS.stateMs,
          signal: opts.signal,
        }),
      );
    } catch (e) {
      // The container may be up: a half-restored sandbox is ended and removed like a failed one.
      lazy?.abort.abort();
      await lazy?.done.catch(() => undefined);
      await this.cleanUpFailedRestore(id, rec, opts.workDir);
      throw e;
    }
    return {
      durationMs: r.durationMs,
      pid,
      logPath,
      pagesLoaded: lazy ? lazy.done : Promise.resolve(),
    };
  }

  /**
   * Watches a running restore: aborts (through the returned signal, which also follows
   * `outer`) when CRIU's log passes RESTORE_LOG_LIMIT_BYTES or the lazy-pages daemon fails
   * before the restore is done. `stuck()` says which.
   */
  private watchRestore(
    logPath: string,
    lazyDone: Promise<void> | undefined,
    outer: AbortSignal | undefined,
  ): { signal: AbortSignal; stuck(): string | undefined; stop(): void } {
    const abort = new AbortController();
    let why: string | undefined;
    let stopped = false;
    let spins = 0;
    const end = (reason: string): void => {
      if (stopped || why !== undefined) return;
      why = reason;
      abort.abort(new Error(reason));
    };
    const onOuter = (): void => abort.abort(outer?.reason);
    if (outer?.aborted) abort.abort(outer.reason);
    outer?.addEventListener('abort', onOuter, { once: true });
    // Only its failure: a daemon that copied every page may exit before runc restore does.
    // And a grace: the daemon also fails when the restore does, and CRIU's own error (which
    // runc is about to return) says more than the daemon's.
    lazyDone?.then(
      () => undefined,
      () => {
        setTimeout(
          () => end('the lazy-pages daemon failed before the processes were restored'),
          LAZY_FAILURE_GRACE_MS,
        ).unref();
      },
    );
    const timer = setInterval(() => {
      stat(logPath).then(
        async (st) => {
          // The loop's own line, all over the log's end, twice in a row: stuck, whatever the load.
          if (st.size > 64 * 1024) {
            const tailText = await readEnd(logPath, 16 * 1024).catch(() => '');
            const lines = tailText.split('\n').slice(1, -1);
            const looping = lines.length > 100 && lines.every((l) => /Advanced iov 0 bytes/.test(l));
            spins = looping ? spins + 1 : 0;
            if (spins >= 2) end('criu is stuck in a loop reading a pages image (is it truncated?)');
          }
          if (st.size > RESTORE_LOG_LIMIT_BYTES)
            end(
              `criu's log passed ${String(RESTORE_LOG_LIMIT_BYTES >> 20)} MiB (criu is stuck in a loop; a damaged image?)`,
            );
        },
        (e: unknown) => {
          if (errnoCode(e) !== 'ENOENT') end(`criu's log cannot be read: ${(e as Error).message}`);
        },
      );
    }, 200);
    timer.unref();
    return {
      signal: abort.signal,
      stuck: () => why,
      stop: () => {
        stopped = true;
        clearInterval(timer);
        outer?.removeEventListener('abort', onOuter);
      },
    };
  }

  /** Where the CRIU log of the sandbox's last failed restore is kept (one per sandbox). */
  restoreLogPath(id: string): string {
    return join(this.dir(id), 'restore-failed.log');
  }

  /**
   * Copies the CRIU logs of a failed restore (criu restore's, then the lazy-pages daemon's)
   * out of the work dir, which is wiped with the images, into the sandbox's folder (0600,
   * replacing the previous one). Returns its path.
   */
  private async keepRestoreLog(id: string, workDir: string): Promise<string> {
    const parts: string[] = [];
    for (const name of ['restore.log', 'lazy-pages.log']) {
      try {
        // Bounded: the head says what was restored, the end why it stopped.
        const path = join(workDir, name);
        const size = (await stat(path)).size;
        const text =
          size <= KEPT_LOG_HEAD_BYTES + KEPT_LOG_TAIL_BYTES
            ? await readFile(path, 'utf8')
            : `${await readStart(path, KEPT_LOG_HEAD_BYTES)}\n[... ${String(size - KEPT_LOG_HEAD_BYTES - KEPT_LOG_TAIL_BYTES)} bytes left out ...]\n${await readEnd(path, KEPT_LOG_TAIL_BYTES)}`;
        parts.push(`==> ${name} <==\n${text}`);
      } catch (e) {
        if (errnoCode(e) !== 'ENOENT') throw e;
      }
    }
    const path = this.restoreLogPath(id);
    const tmp = `${path}.tmp`;
    await rm(tmp, { force: true });
    const fh = await open(tmp, 'wx', 0o600);
    try {
      await fh.writeFile(parts.length > 0 ? parts.join('\n') : 'criu wrote no log\n');
    } finally {
      await fh.close();
    }
    await rename(tmp, path);
    return path;
  }

  /**
   * Undoes what a failed `runc restore` made, whatever stage it died at: the half-made
   * container (runc's state), its processes and cgroups in every hierarchy, the mounts runc
   * makes under the rootfs while CRIU restores (and the overlay itself: a sandbox that is not
   * running keeps its layer at rest), CRIU's cgroup yard in the work dir, a lazy-pages daemon
   * still serving the work dir, and CRIU's network lock. Every step runs even when an earlier
   * one fails. Returns what could not be removed (empty when all is clean).
   */
  private async cleanUpFailedRestore(id: string, rec: SandboxRecord, workDir: string): Promise<string[]> {
    const left: string[] = [];
    const step = async (what: string, fn: () => Promise<unknown>): Promise<void> => {
      try {
        await fn();
      } catch (e) {
        left.push(`${what}: ${(e as Error).message.split('\n')[0] ?? ''}`);
      }
    };
    await step('lazy-pages', () => this.endLazyPages(workDir));
    await step('runc delete', async () => {
      const r = await this.runc(id, ['delete', '--force', id], { okExitCodes: [0, 1] }, DEFAULTS.destroyMs);
      if (r.exitCode !== 0 && !/does not exist/.test(r.stderr + (await this.runcLogSince(id, 0))))
        throw new Error(r.stderr.trim() || 'runc delete failed');
    });
    await step('cgroups', async () => {
      const busy = await removeCgroupEverywhere(this.cgroupPath(id), { timeoutMs: DEFAULTS.killMs });
      if (busy.length > 0) throw new Error(`still busy: ${busy.join(' ')}`);
    });
    // runc killed mid-restore can leave a state folder that `runc delete` cannot read; with
    // the processes gone and the cgroups removed, it is only a record.
    await step('runc state', async () => {
      if ((await this.runcState(id).catch(() => 'broken' as const)) !== undefined)
        await rm(join(this.runcRoot(), id), { recursive: true, force: true });
    });
    await step('rootfs mounts', async () => {
      const still = await unmountAll(join(this.bundle(id), 'rootfs'));
      if (still.length > 0) throw new Error(`still mounted: ${still.join(' ')}`);
    });
    await step('work dir mounts', async () => {
      const still = await unmountAll(resolve(workDir));
      if (still.length > 0) throw new Error(`still mounted: ${still.join(' ')}`);
    });
    await step('network lock', () => clearCriuNetworkLock(rec.network));
    return left;
  }

  /**
   * Starts `criu lazy-pages` for a lazy restore and waits until it listens: it and the
   * restoring criu meet on `lazy-pages.socket` in the shared work dir.
   */
  private async startLazyPages(
    opts: RestoreOptions,
  ): Promise<{ abort: AbortController; done: Promise<void> }> {
    const abort = new AbortController();
    opts.signal?.addEventListener('abort', () => abort.abort(), { once: true });
    let exited: unknown = undefined;
    let finished = false;
    const done = run(
      this.criuPath,
      [
        'lazy-pages',
        '--images-dir',
        opts.imagesDir,
        '--work-dir',
        opts.workDir,
        '-o',
        'lazy-pages.log',
        '-v2',
        ...(opts.pageServer
          ? ['--page-server', '--address', opts.pageServer.address, '--port', String(opts.pageServer.port)]
          : []),
      ],
      { timeoutMs: opts.pagesTimeoutMs ?? 120_000, signal: abort.signal, env: this.env },
    ).then(
      () => {
        finished = true;
      },
      (e: unknown) => {
        finished = true;
        exited = e;
        throw new DormantError(
          ErrorCode.RUNTIME_RESTORE_FAILED,
          `criu lazy-pages for ${opts.imagesDir} failed: ${(e as Error).message}`,
          { cause: e, details: { criuLog: join(opts.workDir, 'lazy-pages.log') } },
        );
      },
    );
    // Nobody may be listening yet; keep an early failure from becoming an unhandled rejection.
    done.catch(() => undefined);
    const socket = join(opts.workDir, 'lazy-pages.socket');
    const deadline = Date.now() + 10_000;
    while (!(await exists(socket))) {
      if (finished || Date.now() > deadline) {
        abort.abort();
        await done.catch(() => undefined);
        throw new DormantError(
          ErrorCode.RUNTIME_RESTORE_FAILED,
          `criu lazy-pages did not start for ${opts.imagesDir}`,
          {
            cause: exited,
            details: { criuLog: join(opts.workDir, 'lazy-pages.log') },
          },
        );
      }
      await new Promise((res) => setTimeout(res, 10));
    }
    return { abort, done };
  }

  async endLazyPages(workDir: string): Promise<number[]> {
    const dir = resolve(workDir);
    const pids: number[] = [];
    for (const p of await readdir('/proc').catch(() => [] as string[])) {
      if (!/^\d+$/.test(p) || Number(p) === process.pid) continue;
      const argv = (await readFile(`/proc/${p}/cmdline`, 'utf8').catch(() => '')).split('\0');
      const at = argv.indexOf('--work-dir');
      if (argv.includes('lazy-pages') && at >= 0 && argv[at + 1] === dir) pids.push(Number(p));
    }
    sigkill(pids);
    // Gone (or a zombie for its parent to reap) before the caller goes on.
    const deadline = Date.now() + 5000;
    for (const pid of pids) {
      while (Date.now() < deadline) {
        const st = await readFile(`/proc/${pid}/stat`, 'utf8').catch(() => '');
        if (st === '' || / Z /.test(st.slice(st.lastIndexOf(')')))) break;
        await new Promise((res) => setTimeout(res, 10));
      }
    }
    return pids;
  }

  async stop(id: string, opts: CallOptions = {}): Promise<void> {
    await this.readRecord(id);
    // delete --force kills every process of the container (thawing a paused one first). No
    // `runc state` first (~0.1 s): a container that is not there is what stop wants anyway.
    const r = await this.runc(
      id,
      ['delete', '--force', id],
      { ...opts, okExitCodes: [0, 1] },
      DEFAULTS.destroyMs,
    );
    if (r.exitCode !== 0 && (await this.runcState(id, opts)) !== undefined)
      throw new DormantError(
        ErrorCode.COMMAND_FAILED,
        `runc delete ${id} failed: ${r.stderr.trim() || (await this.runcLogSince(id, 0))}`,
      );
    await timed(opts, 'unmount', () => unmount(join(this.bundle(id), 'rootfs'), opts.signal));
    await this.dropConfig(id);
    // The writable layer stays at rest and reachable: after a reboot its disk image is
    // mounted again here, before the daemon empties or refills it.
    await remountLayer(this.dir(id), opts.signal);
  }

  async endProcesses(id: string, opts: CallOptions = {}): Promise<void> {
    // SIGKILL to every task of the cgroup, then a thaw (a frozen task dies only once thawed),
    // then wait until the cgroup is empty: what `runc delete --force` does first, without a
    // runc start (~0.15 s here). Tasks forked meanwhile are killed on the next round. A
    // frozen task cannot exit, so on the first round no listed pid can have been reused.
    const deadline = Date.now() + (opts.timeoutMs ?? DEFAULTS.destroyMs);
    for (let wait = 1; ; wait = Math.min(wait * 2, 20)) {
      const pids = await this.pids(id);
      if (pids.length === 0) break;
      sigkill(pids);
      await this.thawCgroup(id);
      if (Date.now() > deadline || opts.signal?.aborted)
        throw new DormantError(
          ErrorCode.COMMAND_TIMEOUT,
          `the processes of sandbox ${id} did not end within ${String(opts.timeoutMs ?? DEFAULTS.destroyMs)} ms of SIGKILL (${String(pids.length)} left)`,
        );
      await new Promise((r) => setTimeout(r, wait));
    }
    await timed(opts, 'unmount', () => unmount(join(this.bundle(id), 'rootfs'), opts.signal));
    // The empty cgroups go too (what is still charged to them, page cache and kernel memory,
    // is released with them); `runc delete` later finds them gone, which it accepts.
    await this.removeCgroups(id);
    await this.dropConfig(id);
  }

  /** Removes the sandbox's (empty) cgroup in every hierarchy; one still busy is left to runc. */
  private async removeCgroups(id: string): Promise<void> {
    const path = this.cgroupPath(id);
    const roots = [CGROUP_ROOT, ...(await readdir(CGROUP_ROOT)).map((h) => join(CGROUP_ROOT, h))];
    await Promise.all(
      roots.map((r) =>
        rmdir(join(r, path)).catch((e: unknown) => {
          const code = errnoCode(e);
          if (code !== 'ENOENT' && code !== 'ENOTDIR' && code !== 'EBUSY' && code !== 'ENOTEMPTY') throw e;
        }),
      ),
    );
  }

  async kill(id: string, signal: NodeJS.Signals = 'SIGKILL', opts: CallOptions = {}): Promise<void> {
    await this.requireStatus(id, ['created', 'running', 'paused'], 'kill', opts);
    await this.runc(id, ['kill', id, signal.replace(/^SIG/, '')], opts, DEFAULTS.killMs);
  }

  async destroy(id: string, opts: CallOptions = {}): Promise<void> {
    const dir = this.dir(id);
    if (!(await exists(dir))) return;
    let rec: SandboxRecord | undefined;
    try {
      rec = await this.readRecord(id);
    } catch (e) {
      if (!isDormantError(e, ErrorCode.RUNTIME_SANDBOX_NOT_FOUND)) throw e;
    }
    // A runc state that cannot be read (runc killed mid-restore) must not stop the removal:
    // the processes go with the cgroups below, and the state folder with them.
    const current = await this.runcState(id, opts).catch(() => 'broken' as const);
    if (current !== undefined)
      await this.runc(id, ['delete', '--force', id], { ...opts, okExitCodes: [0, 1] }, DEFAULTS.destroyMs);
    const busy = await removeCgroupEverywhere(this.cgroupPath(id), { timeoutMs: DEFAULTS.killMs });
    if (busy.length > 0)
      throw new DormantError(
        ErrorCode.COMMAND_FAILED,
        `sandbox ${id}: its cgroups could not be removed (${busy.join(', ')})`,
      );
    await rm(join(this.runcRoot(), id), { recursive: true, force: true });
    // Everything under the sandbox's folder: the overlay and whatever a failed restore left
    // in it (runc's mounts under the rootfs), lazily when still busy.
    const still = await unmountAll(dir, opts.signal);
    if (still.length > 0)
      throw new DormantError(
        ErrorCode.COMMAND_FAILED,
        `sandbox ${id}: could not unmount ${still.join(', ')}`,
      );
    // The disk quota's image, after the overlay on it (unmountAll took the mount; this frees
    // its loop device if still held); the file goes with the folder.
    await releaseLayer(dir, opts.signal);
    // After the container: killing the collector first would leave the sandbox writing
    // into a pipe nobody reads.
    await stopCollector(join(dir, 'log'));
    const slot = rec?.slot ?? (await findSlot(this.netDir(), id));
    if (rec)
      await tearDownNetwork(rec.network, { markerPath: join(dir, 'network.done'), signal: opts.signal });
    if (slot !== undefined) await releaseSlot(this.netDir(), slot);
    await rm(dir, { recursive: true, force: true });
    await rm(this.configBundle(id), { recursive: true, force: true });
    this.configs.delete(id);
    // The shared folder goes with its last sandbox (a daemon wipes and re-creates it at start).
    await rmdir(this.bundleRoot).catch((e: unknown) => {
      const code = errnoCode(e);
      if (code !== 'ENOENT' && code !== 'ENOTEMPTY' && code !== 'EEXIST') throw e;
    });
  }

  async list(): Promise<string[]> {
    try {
      return (await readdir(join(this.stateDir, 'sandboxes'))).sort();
    } catch (e) {
      if (errnoCode(e) === 'ENOENT') return [];
      throw e;
    }
  }

  /** True when the sandbox's root filesystem is mounted (it is not while hibernated). */
  async rootfsMounted(id: string): Promise<boolean> {
    return isMountPoint(join(this.bundle(id), 'rootfs'));
  }
}

/**
 * An exec's failure as the sandbox's user may see it: the command they ran, never runc's
 * command line (the daemon's folders, its state root); the original stays as the cause.
 */
function execError(e: unknown, id: string, args: readonly string[], timeoutMs: number): unknown {
  if (!isDormantError(e)) return e;
  const what =
    `exec in ${id}: ${args.map((a) => (a.length > 80 ? `${a.slice(0, 80)}...` : a)).join(' ')}`.slice(0, 400);
  const raw = e.details?.['output'];
  const output = typeof raw === 'string' ? raw.slice(-2000) : '';
  if (e.code === ErrorCode.COMMAND_TIMEOUT)
    return new DormantError(ErrorCode.COMMAND_TIMEOUT, `${what}: killed after ${timeoutMs} ms timeout`, {
      status: 504,
      cause: e,
      ...(output !== '' ? { details: { output } } : {}),
    });
  if (e.code === ErrorCode.COMMAND_ABORTED)
    return new DormantError(e.code, `${what}: aborted`, { status: e.status, cause: e });
  if (e.code === ErrorCode.COMMAND_FAILED || e.code === ErrorCode.COMMAND_NOT_FOUND)
    return new DormantError(
      ErrorCode.RUNTIME_EXEC_FAILED,
      `${what}: the runtime could not run it${output !== '' ? `: ${lastLine(output)}` : ''}`,
      { status: 500, cause: e },
    );
  return e;
}

function lastLine(text: string): string {
  const lines = text.split('\n').filter((l) => l.trim() !== '');
  return (lines[lines.length - 1] ?? '').slice(0, 300);
}

function hostHasAppArmor(): boolean {
  try {
    accessSync('/sys/kernel/security/apparmor');
    return true;
  } catch {
    return false;
  }
}
