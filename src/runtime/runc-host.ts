/**
 * The host side of runc sandboxes, under RuncRuntime (runc.ts): each sandbox's folder, its
 * record, its OCI config, and how runc is called for it.
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
import { chmod, mkdir, open, readFile, readdir, rename, rm, stat, writeFile } from 'node:fs/promises';
import { createHash } from 'node:crypto';
import { dirname, join } from 'node:path';
import { accessSync, readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';
import { run, type RunResult } from '../sys/exec.js';
import { exists } from '../sys/fs.js';
import { ensureCollector } from './log-collector.js';
import type { EgressPolicy } from '../domain/egress.js';
import { egressCounters, nodeResolvers, resolvConfText, resolveHosts } from './egress.js';
import { ipv4, parseSubnet, setUpNetwork, type EgressSetUp, type Subnet } from './network.js';
import { resolvConfPath } from './oci.js';
import { mountOverlay, unmount } from './rootfs.js';
import {
  DEFAULT_USER_NAMESPACE,
  checkUserNamespace,
  locateIdmapHelper,
  mountIdmapped,
  ownLayerRoot,
  walkableTo,
  type UserNamespace,
} from './userns.js';
import { privateFolder } from './staging.js';
import type { CallOptions, SandboxNetwork, SandboxSpec } from './runtime.js';

export interface RuncRuntimeOptions {
  /** Where sandboxes, runc's state and the network reservations live. Keep it root-only. */
  stateDir: string;
  /** Hears cleanups that failed and were carried on past (a page server that would not close). */
  warn?: (message: string) => void;
  /** Default `runc` on PATH. */
  runcPath?: string;
  /** The criu binary runc should run. Default `criu` on PATH. */
  criuPath?: string;
  /**
   * Environment for runc (and so criu). Default `{ CRIU_FAULT: '130' }`: no hardware
   * breakpoints, which fail on some VMs (criu/criu.ts).
   */
  criuEnv?: Record<string, string>;
  /** The IPv4 subnet sandboxes get /30s from. Default 10.213.0.0/16. */
  subnet?: string;
  /** Parent of every sandbox's cgroup. Default `/dormant`. */
  cgroupParent?: string;
  /**
   * In a fleet, this node's name: the sandbox's address reservation and network namespace are
   * this node's own (network.ts slotNetwork), so another node on the same host holding the
   * same sandbox never shares them.
   */
  node?: string;
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
  /**
   * The resolvers sandboxes with egress use (their /etc/resolv.conf, and the node's lookups of
   * an egress list's host names). Default: the node's own non-loopback ones (egress.ts).
   */
  egressResolvers?: readonly string[];
  /**
   * Keep the host names of egress lists current: every sandbox's names are resolved again when
   * their TTL (30 s to 5 min) runs out, and its rules rewritten when the answer changed.
   * Default false (the daemon turns it on).
   */
  egressRefresh?: boolean;
  /** The shortest time a name's answer is kept, whatever its TTL. Default 30 s. */
  egressRefreshMinMs?: number;
  /**
   * A user namespace for every new sandbox (userns.ts): `true` maps its ids 0..65535 to host
   * ids from 100000 (DEFAULT_USER_NAMESPACE), an object to another range. Default false. A
   * sandbox keeps what it was made with: one made without keeps running (and restoring)
   * without, whatever this says later.
   */
  userNamespace?: boolean | UserNamespace;
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

export interface SandboxRecord {
  spec: Readonly<SandboxSpec>;
  slot: number;
  network: SandboxNetwork;
  /**
   * The sandbox's user namespace, fixed when it is made: the files of its writable layer are
   * owned by these host ids and its checkpoints are dumped in it. Absent: none.
   */
  userns?: UserNamespace;
}

export interface RuncState {
  status: string;
  pid: number;
}

/** Where the cgroup hierarchies are mounted (v1: one folder per controller; v2: the one tree). */
export const CGROUP_ROOT = '/sys/fs/cgroup';

/** SIGKILL to each pid; one already gone is no error. */
export function sigkill(pids: readonly number[]): void {
  for (const pid of pids) {
    try {
      process.kill(pid, 'SIGKILL');
    } catch (e) {
      if (errnoCode(e) !== 'ESRCH') throw e;
    }
  }
}

export const DEFAULTS = {
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
export const TAIL_BYTES = 1024 * 1024;

/** The last `bytes` of a file (all of it when shorter). */
export async function readEnd(path: string, bytes: number): Promise<string> {
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
export async function readStart(path: string, bytes: number): Promise<string> {
  const fh = await open(path, 'r');
  try {
    const buf = Buffer.alloc(bytes);
    const { bytesRead } = await fh.read(buf, 0, bytes, 0);
    return buf.subarray(0, bytesRead).toString('utf8');
  } finally {
    await fh.close();
  }
}

/** A line of the CRIU log or runc log worth putting in an error message. */
export async function tailOf(path: string, pattern: RegExp, lines = 12): Promise<string> {
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
export function recordSpec(spec: Readonly<SandboxSpec>): Readonly<SandboxSpec> {
  return { ...spec, env: {} };
}

/**
 * Overwrites a file's bytes with zeros in place, then removes it: a config or record written
 * to the data disk by an older version held the environment in clear. (A filesystem that never
 * overwrites in place, copy-on-write or an SSD's remapping, may still keep the old blocks.)
 */
export async function scrubFile(path: string): Promise<void> {
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
export async function privateFile(path: string): Promise<void> {
  await (await open(path, 'a', 0o600)).close();
  await chmod(path, 0o600);
}

export async function writeFileAtomic(path: string, data: string): Promise<void> {
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
export function timed<T>(opts: CallOptions, step: string, fn: () => Promise<T>): Promise<T> {
  return opts.timer ? opts.timer.time(step, fn) : fn();
}

function hostHasAppArmor(): boolean {
  try {
    accessSync('/sys/kernel/security/apparmor');
    return true;
  } catch {
    return false;
  }
}

export class RuncHost {
  protected readonly stateDir: string;

  protected readonly runcPath: string;

  protected readonly criuPath: string;

  protected readonly env: Record<string, string>;

  protected readonly subnet: Subnet;

  protected readonly cgroupParent: string;

  protected readonly netSlotDir: string;
  protected readonly node: string | undefined;

  protected readonly checkpointTimeoutMs: number;

  protected readonly bundleRoot: string;

  /**
   * The config last written for each sandbox, kept in this process's memory (never on disk):
   * stop() removes the file, and a restore() with no prepare() since (same process) writes it
   * again from here.
   */
  protected readonly configs = new Map<string, string>();

  protected readonly seccomp: Readonly<Record<string, unknown>> | undefined;

  protected readonly apparmorProfile: string | undefined;

  protected readonly restoreTimeoutMs: number;

  protected readonly warn: ((message: string) => void) | undefined;

  protected readonly egressResolvers: readonly string[];

  private readonly egressRefreshMinMs: number | undefined;

  /** The user namespace new sandboxes get (undefined: none). */
  protected readonly userNamespace: UserNamespace | undefined;

  private idmapHelper: Promise<string | undefined> | undefined;

  /** Per sandbox with host names in its egress list: what they resolved to, and when next. */
  private readonly egressNames = new Map<string, { addresses: string[]; dueAt: number }>();

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
    this.warn = options.warn;
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
    this.node = options.node;
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
    this.egressResolvers = options.egressResolvers ?? nodeResolvers();
    this.userNamespace =
      options.userNamespace === true
        ? DEFAULT_USER_NAMESPACE
        : options.userNamespace === undefined || options.userNamespace === false
          ? undefined
          : checkUserNamespace(options.userNamespace);
    this.egressRefreshMinMs = options.egressRefreshMinMs;
    if (options.egressRefresh === true)
      // unref: the timer never keeps a process alive; each tick looks at what is due.
      setInterval(
        () => {
          this.refreshEgress().catch((e: unknown) =>
            this.warn?.(`egress: refreshing host names failed: ${(e as Error).message}`),
          );
        },
        Math.min(5_000, this.egressRefreshMinMs ?? 5_000),
      ).unref();
  }

  // ---- egress (egress.ts) --------------------------------------------------------------

  /** The sandbox subnet as a CIDR (what the rules refuse to every sandbox). */
  protected subnetCidr(): string {
    return `${ipv4(this.subnet.base)}/${this.subnet.prefixLength}`;
  }

  /** Resolves a policy's host names: an unresolvable one is EGRESS_HOST_UNRESOLVABLE. */
  async checkEgress(policy: EgressPolicy): Promise<void> {
    if (policy.mode === 'list') await resolveHosts(policy.hosts, this.egressResolvers);
  }

  /** What setUpNetwork needs for a sandbox's egress, its host names resolved now. */
  protected async egressSetUp(rec: SandboxRecord): Promise<EgressSetUp | undefined> {
    const policy = rec.spec.egress;
    if (policy === undefined) return undefined;
    let addresses: string[] = [];
    if (policy.mode === 'list' && policy.hosts.length > 0) {
      const known = this.egressNames.get(rec.spec.id);
      if (known !== undefined && known.dueAt > Date.now()) addresses = known.addresses;
      else {
        const r = await resolveHosts(policy.hosts, this.egressResolvers, this.egressRefreshMinMs);
        addresses = r.addresses;
        this.egressNames.set(rec.spec.id, { addresses, dueAt: Date.now() + r.ttlMs });
      }
    }
    return {
      policy,
      subnet: this.subnetCidr(),
      resolvers: this.egressResolvers,
      addresses,
      resolvConfPath: resolvConfPath(join(this.dir(rec.spec.id), 'criu.conf')),
    };
  }

  /**
   * Resolves again the host names of every set-up sandbox whose answer is due and rewrites its
   * rules when it changed (setUpNetwork: only the host-side chain differs, the rest is kept).
   * A name that fails to resolve keeps its last addresses.
   */
  async refreshEgress(): Promise<void> {
    const ids = await readdir(join(this.stateDir, 'sandboxes')).catch(() => [] as string[]);
    const now = Date.now();
    for (const id of this.egressNames.keys()) if (!ids.includes(id)) this.egressNames.delete(id);
    for (const id of ids) {
      const known = this.egressNames.get(id);
      if (known !== undefined && known.dueAt > now) continue;
      const rec = await this.readRecord(id).catch(() => undefined);
      const policy = rec?.spec.egress;
      if (rec === undefined || policy?.mode !== 'list' || policy.hosts.length === 0) continue;
      // Only sandboxes whose network is up (a destroyed or never-prepared one has none).
      if (!(await exists(join(this.dir(id), 'network.done')))) continue;
      let r: { addresses: string[]; ttlMs: number };
      try {
        r = await resolveHosts(policy.hosts, this.egressResolvers, this.egressRefreshMinMs);
      } catch (e) {
        this.warn?.(`egress of ${id}: ${(e as Error).message}; keeping the last addresses`);
        if (known !== undefined) known.dueAt = now + 30_000;
        continue;
      }
      this.egressNames.set(id, { addresses: r.addresses, dueAt: now + r.ttlMs });
      if (known !== undefined && known.addresses.join() === r.addresses.join()) continue;
      await setUpNetwork(rec.network, rec.spec.ports ?? [], {
        markerPath: join(this.dir(id), 'network.done'),
        egress: (await this.egressSetUp(rec))!,
        onlyIfSetUp: true,
      });
    }
  }

  /** Runtime.setEgress: the record first (a crash leaves it to the next set-up), back if the rules fail. */
  async setEgress(id: string, policy: EgressPolicy): Promise<void> {
    const old = await this.readRecord(id);
    // In compileSandboxSpec's order (egress before devices): prepare compares the JSON text.
    const { devices, ...rest } = old.spec;
    const spec = { ...rest, egress: policy, ...(devices !== undefined ? { devices } : {}) };
    const rec: SandboxRecord = { ...old, spec };
    const path = join(this.dir(id), 'sandbox.json');
    await this.rewriteRecord(path, JSON.stringify(rec, null, 2));
    this.egressNames.delete(id);
    try {
      // Only a network that is up: a released one (asleep, in a user namespace) is set up anew.
      await setUpNetwork(rec.network, rec.spec.ports ?? [], {
        markerPath: join(this.dir(id), 'network.done'),
        egress: (await this.egressSetUp(rec))!,
        onlyIfSetUp: true,
      });
    } catch (e) {
      await this.rewriteRecord(path, JSON.stringify(old, null, 2));
      throw e;
    }
  }

  /** Bytes each sandbox sent beyond the node (its chain's ACCEPT counters), by sandbox id. */
  async egressBytes(): Promise<Map<string, number>> {
    const byIface = await egressCounters();
    const out = new Map<string, number>();
    if (byIface.size === 0) return out;
    const ids = await readdir(join(this.stateDir, 'sandboxes')).catch(() => [] as string[]);
    for (const id of ids) {
      const rec = await this.readRecord(id).catch(() => undefined);
      const bytes = rec !== undefined ? byIface.get(rec.network.hostInterface) : undefined;
      if (bytes !== undefined) out.set(id, bytes);
    }
    return out;
  }

  // ---- paths -------------------------------------------------------------------------

  protected dir(id: string): string {
    return join(this.stateDir, 'sandboxes', id);
  }

  protected runcRoot(): string {
    return join(this.stateDir, 'runc');
  }

  /**
   * Address reservations are host-wide, not per state folder: interface names and addresses are
   * host-wide too, so two daemons (or test runs) on one host must never take the same slot.
   */
  protected netDir(): string {
    return this.netSlotDir;
  }

  /** What a slot's reservation file holds for sandbox `id`: the id, and in a fleet the node too. */
  protected slotHolder(id: string): string {
    return this.node !== undefined ? `${id} ${this.node}` : id;
  }

  /** Where the shared rootfs is mounted idmapped for a sandbox with a user namespace. */
  protected idmappedLower(id: string): string {
    return join(this.dir(id), 'idmapped');
  }

  /** The sandbox's root filesystem (the overlay) is unmounted, then its idmapped lower layer. */
  protected async unmountRootfs(id: string, signal?: AbortSignal): Promise<void> {
    await unmount(join(this.bundle(id), 'rootfs'), signal);
    await unmount(this.idmappedLower(id), signal);
  }

  /** The sandbox's writable layer: its filesystem diff, to archive. */
  upperDir(id: string): string {
    return join(this.dir(id), 'fs', 'upper');
  }

  logPath(id: string): string {
    return join(this.dir(id), 'log', 'output.log');
  }

  protected bundle(id: string): string {
    return join(this.dir(id), 'bundle');
  }

  /** The folder runc is given as the bundle: config.json only, on tmpfs (see the top). */
  protected configBundle(id: string): string {
    return join(this.bundleRoot, id);
  }

  /** cgroup path of a sandbox, relative to each hierarchy's root. */
  cgroupPath(id: string): string {
    return `${this.cgroupParent}/${id}`;
  }

  protected runcArgs(id: string, args: string[]): string[] {
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

  protected async runc(
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
  protected async runcWithLogPipe(
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

  protected async readRecord(id: string): Promise<SandboxRecord> {
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

  protected async runcState(id: string, opts: CallOptions = {}): Promise<RuncState | undefined> {
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

  protected async runcLogSince(id: string, offset: number): Promise<string> {
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

  protected async runcLogSize(id: string): Promise<number> {
    try {
      return (await stat(join(this.dir(id), 'runc.log'))).size;
    } catch (e) {
      if (errnoCode(e) === 'ENOENT') return 0;
      throw e;
    }
  }

  /**
   * A sandbox in a user namespace: its network namespace, made by runc (after create) or CRIU
   * (after restore), pinned and wired (veth, addresses, firewall, egress) from process `pid`.
   */
  protected async adoptNetwork(rec: SandboxRecord, pid: number, signal?: AbortSignal): Promise<void> {
    const egress = await this.egressSetUp(rec);
    await setUpNetwork(rec.network, rec.spec.ports ?? [], {
      markerPath: join(this.dir(rec.spec.id), 'network.done'),
      adoptFrom: pid,
      ...(signal !== undefined ? { signal } : {}),
      ...(egress !== undefined ? { egress } : {}),
    });
  }

  /** Everything a container needs on the host: network, log collector, mounted rootfs. */
  protected async ensureHostSide(rec: SandboxRecord, signal?: AbortSignal, mount = true): Promise<void> {
    const id = rec.spec.id;
    const egress = await this.egressSetUp(rec);
    // With a user namespace the network namespace is runc's or CRIU's, adopted afterwards;
    // the resolv.conf runc binds in must be there before.
    if (rec.userns === undefined)
      await setUpNetwork(rec.network, rec.spec.ports ?? [], {
        markerPath: join(this.dir(id), 'network.done'),
        signal,
        ...(egress !== undefined ? { egress } : {}),
      });
    else if (egress !== undefined)
      await writeFile(egress.resolvConfPath, resolvConfText(egress.policy, egress.resolvers), {
        mode: 0o644,
      });
    await ensureCollector(join(this.dir(id), 'log'), signal);
    if (!mount) return;
    let lower = rec.spec.rootfs;
    if (rec.userns !== undefined) {
      // The shared rootfs through an idmapped mount (owned by the sandbox's root), the layer's
      // top owned by it too, and a path to the overlay the mapped root can walk (runc mounts
      // it from inside the user namespace).
      lower = this.idmappedLower(id);
      this.idmapHelper ??= locateIdmapHelper();
      await mountIdmapped(await this.idmapHelper, rec.userns, rec.spec.rootfs, lower, signal);
      await ownLayerRoot(this.upperDir(id), rec.userns);
      await walkableTo(join(this.bundle(id), 'rootfs'), this.stateDir);
    }
    await mountOverlay(
      {
        lower,
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
  protected async writeConfig(id: string, config: object): Promise<void> {
    const bundle = await this.configDir(id);
    const c = config as { root?: { path: string; readonly?: boolean } };
    const full = { ...c, root: { ...c.root, path: join(this.bundle(id), 'rootfs') } };
    const text = JSON.stringify(full, null, 2);
    this.configs.set(id, text);
    await writeFileAtomic(join(bundle, 'config.json'), text);
    await scrubFile(join(this.bundle(id), 'config.json'));
  }

  /** The sandbox's bundle folder on tmpfs, made (0700) if missing. */
  protected async configDir(id: string): Promise<string> {
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
  protected async dropConfig(id: string): Promise<void> {
    await rm(join(this.configBundle(id), 'config.json'), { force: true });
  }

  /** Before runc restore: the config stop() removed, from memory; without it, prepare() first. */
  protected async ensureConfig(id: string): Promise<void> {
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
   * Replaces sandbox.json and overwrites the old file's bytes (held open across the rename) so
   * what it held does not stay in free blocks of the data disk.
   */
  protected async rewriteRecord(path: string, data: string): Promise<void> {
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
}
