/**
 * The Runtime port on gVisor (runsc): the sandbox's processes run on gVisor's own kernel, in
 * user space, so a sandbox meets the host kernel only through that kernel's small set of host
 * calls; hibernate is runsc's own checkpoint (no CRIU).
 *
 * runsc speaks runc's command line (create, start, state, exec, pause, resume, kill, delete,
 * checkpoint, restore), so this adapter is RuncRuntime with runsc in runc's place: the same
 * sandbox folder, writable layer on an overlay (with the same disk quota), network namespace
 * and veth (gVisor's network stack takes over the namespace's eth0 and routes, so the firewall,
 * egress rules and the wake proxy are unchanged), log collector and OCI config. What differs:
 *
 * - runsc's own state root (`<stateDir>/runsc`) and its global flags (the platform; the root
 *   filesystem without gVisor's in-memory overlay, so writes reach the writable layer on the
 *   host, which a checkpoint packs and a fork copies as for runc);
 * - freeze and thaw are `runsc pause`/`resume` (gVisor stops its tasks itself: a host freezer
 *   cgroup would also stop the sentry, which a checkpoint then could not talk to);
 * - checkpoint writes one state file (gVisor's kernel and memory) into the images folder; a
 *   restore reads it back. Neither knows CRIU, lazy pages or hostname rewrites: a lazy restore
 *   asked for is done eagerly, and a fork keeps its origin's hostname in memory;
 * - no toolbox agent yet: runc's is handed to `runc exec` as an inherited descriptor, which
 *   runsc exec cannot pass (toolbox calls fail with TOOLBOX_UNAVAILABLE).
 */
import { copyFile, link, mkdir, readdir, readFile, rm } from 'node:fs/promises';
import { join, resolve } from 'node:path';
import { DormantError, ErrorCode, errnoCode, isDormantError } from '../domain/errors.js';
import { run, type RunResult } from '../sys/exec.js';
import { exists } from '../sys/fs.js';
import { listeningPorts } from '../sys/listening.js';
import { ensureCollector } from './log-collector.js';
import { describeFlows, trackedFlows } from './runsc-flows.js';
import { applyInbound, removeInbound } from './runsc-inbound.js';
import { AgentError, type AgentAddress } from './agent-client.js';
import { RuncRuntime, type RuncRuntimeOptions } from './runc.js';
import { DEFAULTS, timed, type RuncState, type SandboxRecord } from './runc-host.js';
import type {
  CallOptions,
  CheckpointOptions,
  CheckpointResult,
  RestoreOptions,
  RestoreResult,
  SandboxState,
  SandboxStatus,
} from './runtime.js';

/** Where gVisor's sentry runs the sandbox's code: see runscPlatforms (doctor) for which work. */
export type RunscPlatform = 'ptrace' | 'kvm' | 'systrap';

export interface RunscRuntimeOptions extends Omit<RuncRuntimeOptions, 'runcPath' | 'criuPath' | 'criuEnv'> {
  /** Default `runsc` on PATH. */
  runscPath?: string;
  /** Default `ptrace` (works everywhere, slowest); `kvm` needs /dev/kvm. */
  platform?: RunscPlatform;
}

export class RunscRuntime extends RuncRuntime {
  readonly platform: RunscPlatform;

  /**
   * Sandboxes checkpointed with `leaveRunning` whose sentry has ended (see checkpoint): the
   * folder holding a hard link to their state file, by id. Such a sandbox reads as paused
   * until it is thawed (restored from that file) or ended.
   */
  private readonly parked = new Map<string, string>();

  constructor(options: RunscRuntimeOptions) {
    super({ ...options, runcPath: options.runscPath ?? 'runsc', criuEnv: {} });
    this.platform = options.platform ?? 'ptrace';
  }

  /** Whether sandbox `id` is one of this runtime's (prepared and not destroyed). */
  async holds(id: string): Promise<boolean> {
    return exists(join(this.dir(id), 'sandbox.json'));
  }

  /** runsc's containers never mix with runc's: a state root of their own. */
  protected override runcRoot(): string {
    return join(this.stateDir, 'runsc');
  }

  protected override runcArgs(id: string, args: string[]): string[] {
    return [
      '--root',
      this.runcRoot(),
      '--log',
      join(this.dir(id), 'runc.log'),
      '--log-format',
      'json',
      '--platform',
      this.platform,
      // The root filesystem as given (the host overlay), not wrapped in gVisor's own
      // in-memory overlay: writes land in the writable layer, which dormant packs and copies.
      '--overlay2',
      'none',
      ...args,
    ];
  }

  /** runsc's state, or undefined when it has no such container (its exit code then is 128). */
  protected override async runcState(id: string, opts: CallOptions = {}): Promise<RuncState | undefined> {
    const r = await this.runc(id, ['state', id], { ...opts, okExitCodes: [0, 1, 128] }, DEFAULTS.stateMs);
    if (r.exitCode === 0) return JSON.parse(r.stdout) as RuncState;
    if (/does not exist/.test(r.stdout + r.stderr)) return undefined;
    throw new DormantError(
      ErrorCode.COMMAND_FAILED,
      `runsc state ${id} failed: ${(r.stdout + r.stderr).trim()}`,
    );
  }

  /**
   * runsc start and restore copy the network namespace's interfaces into gVisor's stack, and
   * first refuse a namespace in which /proc/sys/net/core/rmem_default exists, taking it for the
   * host's: true of the root namespace only on kernels before 6.x, where that setting was not
   * yet per namespace, and of every namespace since. The command runs in a mount namespace of
   * its own (slave: the host's unmounts still reach it) in which the sandbox namespace's folder
   * is an empty tmpfs, so the check sees what it expects of a sandbox's namespace; nothing of
   * the host changes. `tail` is appended to the exec (a redirection).
   */
  private async inSandboxNetns(id: string, argv: string[], tail = ''): Promise<[string, string[]]> {
    const { network } = await this.readRecord(id);
    // runsc moves eth0's address and routes into gVisor's stack, deleting them from the
    // namespace: a restore (which copies them again) finds them only if they are put back.
    const n = network;
    await run('ip', ['-n', n.netns, 'addr', 'replace', `${n.address}/${n.prefixLength}`, 'dev', 'eth0'], {
      timeoutMs: DEFAULTS.stateMs,
    });
    await run('ip', ['-n', n.netns, 'route', 'replace', 'default', 'via', n.hostAddress], {
      timeoutMs: DEFAULTS.stateMs,
    });
    // The mount is made from inside the sandbox's namespace (each network namespace has its
    // own /proc/sys/net entries); runsc itself stays in ours, where its control socket is.
    const script =
      'nsenter --net="$1" mount -t tmpfs -o size=4k,mode=0555 dormant-runsc /proc/sys/net/core || exit 125; ' +
      `shift; exec "$@"${tail}`;
    return [
      'unshare',
      [
        '--mount',
        '--propagation',
        'slave',
        'sh',
        '-c',
        script,
        'sh',
        `/var/run/netns/${network.netns}`,
        ...argv,
      ],
    ];
  }

  protected override async runc(
    id: string,
    args: string[],
    opts: CallOptions & { okExitCodes?: number[]; input?: string | Buffer },
    defaultTimeoutMs: number,
  ): Promise<RunResult> {
    if (args[0] !== 'start') return super.runc(id, args, opts, defaultTimeoutMs);
    const [cmd, argv] = await this.inSandboxNetns(id, [this.runcPath, ...this.runcArgs(id, args)]);
    return timed(opts, 'runsc start', () =>
      run(cmd, argv, {
        timeoutMs: opts.timeoutMs ?? defaultTimeoutMs,
        signal: opts.signal,
        env: this.env,
        okExitCodes: opts.okExitCodes,
      }),
    );
  }

  override async state(id: string, opts: CallOptions = {}): Promise<SandboxState> {
    const s = await super.state(id, opts);
    return this.parked.has(id) && s.status === 'absent' ? { ...s, status: 'paused', pid: undefined } : s;
  }

  override async pids(id: string): Promise<number[]> {
    return this.parked.has(id) ? [] : super.pids(id);
  }

  private async status(id: string, opts: CallOptions): Promise<SandboxStatus> {
    return (await this.state(id, opts)).status;
  }

  /** Forgets a parked sandbox's state file (its processes are to end anyway). */
  private async unpark(id: string): Promise<void> {
    const dir = this.parked.get(id);
    if (dir === undefined) return;
    this.parked.delete(id);
    await rm(dir, { recursive: true, force: true });
  }

  private invalidState(id: string, action: string, status: SandboxStatus): DormantError {
    return new DormantError(
      ErrorCode.RUNTIME_INVALID_STATE,
      `cannot ${action} sandbox ${id}: it is ${status} (needs running or paused)`,
      { status: 409 },
    );
  }

  override async freeze(id: string, opts: CallOptions = {}): Promise<void> {
    const s = await this.status(id, opts);
    if (s === 'paused') return;
    if (s !== 'running') throw this.invalidState(id, 'freeze', s);
    await this.runc(id, ['pause', id], opts, DEFAULTS.freezeMs);
  }

  override async thaw(id: string, opts: CallOptions = {}): Promise<void> {
    const dir = this.parked.get(id);
    if (dir !== undefined) {
      // The sandbox left running by a checkpoint comes back from its state file now.
      this.parked.delete(id);
      try {
        await this.restore(id, { ...opts, imagesDir: dir, workDir: dir });
      } finally {
        await rm(dir, { recursive: true, force: true });
      }
      return;
    }
    const s = await this.status(id, opts);
    if (s === 'running') return;
    if (s !== 'paused') throw this.invalidState(id, 'thaw', s);
    await this.runc(id, ['resume', id], opts, DEFAULTS.freezeMs);
  }

  /**
   * `runsc checkpoint` saves the sandbox (gVisor's kernel with every task and its memory) as
   * one state file in `imagesDir`, and its sentry ends. This build's `--leave-running` does not
   * work (it restarts the container and fails), so a `leaveRunning` checkpoint parks the
   * sandbox instead: its state file is hard-linked into its private config folder (tmpfs,
   * like the images) and it reads as paused, its filesystem at rest and consistent with the
   * saved memory (what a hibernate packs next). A thaw restores it from that file; an end of
   * its processes (the hibernate's next step) only drops the file, so a hibernate costs no
   * restore. A paused sandbox is resumed just before (runsc pauses it again itself to save
   * it): this build cannot delete a container whose sentry ended while paused.
   */
  override async checkpoint(id: string, options: CheckpointOptions): Promise<CheckpointResult> {
    const imagesDir = resolve(options.imagesDir);
    await this.readRecord(id);
    const s = await this.status(id, options);
    if (s !== 'running' && s !== 'paused') throw this.invalidState(id, 'checkpoint', s);
    if (this.parked.has(id))
      throw new DormantError(
        ErrorCode.RUNTIME_INVALID_STATE,
        `cannot checkpoint sandbox ${id}: it is parked by a checkpoint (thaw it first)`,
        { status: 409 },
      );
    await this.refuseOpenConnections(id, s);
    for (const d of [imagesDir, options.workDir]) await mkdir(d, { recursive: true, mode: 0o700 });
    if (s === 'paused') await this.runc(id, ['resume', id], options, DEFAULTS.freezeMs);
    const offset = await this.runcLogSize(id);
    const timeoutMs = options.timeoutMs ?? this.checkpointTimeoutMs;
    let r: RunResult;
    try {
      r = await this.runc(
        id,
        ['checkpoint', '--image-path', imagesDir, id],
        { ...options, timeoutMs },
        DEFAULTS.checkpointMs,
      );
    } catch (e) {
      const after = await this.status(id, {}).catch(() => 'absent' as const);
      if (s === 'paused' && after === 'running')
        await this.runc(id, ['pause', id], {}, DEFAULTS.freezeMs).catch(() => undefined);
      const why = await this.runcLogSince(id, offset);
      // gVisor's refusal of a connection names the endpoint after a dump of its whole state.
      const tcp = /unsupported networking state: ([^\n]*)/.exec(why)?.[1];
      const reason = tcp
        ? `: gVisor cannot save a TCP connection (${tcp.replace(/:$/, '')}), and ends a sandbox whose save failed`
        : why
          ? `:\n${why}`
          : '';
      throw new DormantError(
        ErrorCode.RUNTIME_CHECKPOINT_FAILED,
        `checkpoint of sandbox ${id} failed (the sandbox is ${after})${reason}`,
        { cause: e, details: { sandboxStatus: after, hung: isDormantError(e, ErrorCode.COMMAND_TIMEOUT) } },
      );
    }
    if (options.leaveRunning === true) {
      const dir = join(await this.configDir(id), 'parked');
      await rm(dir, { recursive: true, force: true });
      await mkdir(dir, { mode: 0o700 });
      for (const name of await readdir(imagesDir))
        await link(join(imagesDir, name), join(dir, name)).catch((e: unknown) => {
          if (errnoCode(e) !== 'EXDEV') throw e;
          return copyFile(join(imagesDir, name), join(dir, name));
        });
      // Only the container's record goes: the rootfs, network and config stay for the thaw.
      await this.runc(id, ['delete', '--force', id], { okExitCodes: [0, 1] }, DEFAULTS.destroyMs);
      this.parked.set(id, dir);
    } else await this.stop(id);
    return { durationMs: r.durationMs, logPath: join(this.dir(id), 'runc.log') };
  }

  /**
   * Refuses a checkpoint, before anything changes, while the sandbox may hold a TCP connection
   * gVisor cannot save (runsc-flows.ts): the save would fail and end the sandbox.
   */
  private async refuseOpenConnections(id: string, status: SandboxStatus): Promise<void> {
    const { network } = await this.readRecord(id);
    const flows = await trackedFlows(network.address);
    if (flows === undefined || flows.length === 0) return;
    // An open connection waits on its peers (the tracker keeps an idle one for days); only
    // closing ones have a known end.
    const open = flows.some((f) => f.state === 'ESTABLISHED');
    const wait = open ? undefined : Math.max(...flows.map((f) => f.secondsLeft));
    throw new DormantError(
      ErrorCode.RUNTIME_CHECKPOINT_FAILED,
      `cannot checkpoint sandbox ${id} on gVisor now: it has TCP connections open or closing ` +
        `(${describeFlows(flows)}), which this runsc cannot save; the sandbox is left ${status}`,
      {
        status: 409,
        hint:
          wait === undefined
            ? 'close its open connections (clients of its ports, or what it connected to), then retry'
            : `retry in ${wait} s, when the host stops tracking its closed connections`,
        details: {
          sandboxStatus: status,
          connections: flows.length,
          ...(wait !== undefined ? { retryAfterS: wait } : {}),
        },
      },
    );
  }

  override async restore(id: string, options: RestoreOptions): Promise<RestoreResult> {
    // No lazy restore on gVisor: a page source handed over is closed (it is ours to close) and
    // the state file, staged in full, is read eagerly.
    await options.pages?.source.close();
    const imagesDir = resolve(options.imagesDir);
    const workDir = resolve(options.workDir);
    await this.readRecord(id);
    await mkdir(workDir, { recursive: true, mode: 0o700 });
    const current = await this.status(id, options);
    if (current !== 'absent') {
      if (current !== 'stopped')
        throw new DormantError(
          ErrorCode.RUNTIME_INVALID_STATE,
          `cannot restore sandbox ${id}: it is ${current}`,
          {
            status: 409,
          },
        );
      await this.runc(id, ['delete', '--force', id], options, DEFAULTS.destroyMs);
    }
    // The host side (network, collector, rootfs overlay) and the config, as runc's restore has.
    await timed(options, 'host side', () => this.prepareHost(id, options.signal));
    await this.ensureConfig(id);
    const pidFile = join(workDir, 'restore.pid');
    await rm(pidFile, { force: true });
    const offset = await this.runcLogSize(id);
    let r: RunResult;
    try {
      // The restored sandbox's stdout and stderr: the log collector's pipe, as at create.
      const collector = await ensureCollector(join(this.dir(id), 'log'), options.signal);
      const args = ['restore', '--detach', '--pid-file', pidFile, '--image-path', imagesDir];
      const [cmd, argv] = await this.inSandboxNetns(
        id,
        [this.runcPath, ...this.runcArgs(id, [...args, '--bundle', this.configBundle(id), id])],
        ' </dev/null >>"$DORMANT_LOG_PIPE" 2>&1',
      );
      r = await timed(options, 'runsc restore', () =>
        run(cmd, argv, {
          timeoutMs: options.timeoutMs ?? this.restoreTimeoutMs,
          signal: options.signal,
          env: { ...this.env, DORMANT_LOG_PIPE: collector.pipePath },
        }),
      );
    } catch (e) {
      const why = await this.runcLogSince(id, offset);
      // Nothing half-made stays: the container (if runsc got that far) and the mounted rootfs.
      await this.stop(id).catch(() => undefined);
      throw new DormantError(
        ErrorCode.RUNTIME_RESTORE_FAILED,
        `restore of sandbox ${id} failed${why ? `:\n${why}` : ''}`,
        { cause: e, details: { hung: isDormantError(e, ErrorCode.COMMAND_TIMEOUT) } },
      );
    }
    const pid = Number((await readFile(pidFile, 'utf8').catch(() => '')).trim());
    if (!Number.isInteger(pid) || pid <= 0) {
      await this.stop(id).catch(() => undefined);
      throw new DormantError(
        ErrorCode.RUNTIME_RESTORE_FAILED,
        `restore of sandbox ${id}: runsc wrote no pid`,
      );
    }
    return {
      durationMs: r.durationMs,
      pid,
      logPath: join(this.dir(id), 'runc.log'),
      pagesLoaded: Promise.resolve(),
    };
  }

  /**
   * runc's host side, and the port firewall on the host's end of the veth: the namespace's
   * own does not filter what gVisor's stack receives (runsc-inbound.ts).
   */
  protected override async ensureHostSide(
    rec: SandboxRecord,
    signal?: AbortSignal,
    mount = true,
  ): Promise<void> {
    await super.ensureHostSide(rec, signal, mount);
    await applyInbound(rec.network, rec.spec.ports ?? []);
  }

  /** Network, log collector and the mounted rootfs of a prepared sandbox. */
  private async prepareHost(id: string, signal?: AbortSignal): Promise<void> {
    await this.ensureHostSide(await this.readRecord(id), signal);
  }

  /**
   * Whether the sandbox listens on TCP `port`, read from gVisor's own socket tables inside it.
   * The host's tables of the sentry's namespace (what runc's sandboxes are probed by) never
   * show it: gVisor's stack takes eth0's packets itself and opens no host socket for the
   * sandbox's. undefined when they cannot be read (not running, no `cat` in the image).
   */
  async listening(id: string, port: number, opts: CallOptions = {}): Promise<boolean | undefined> {
    const r = await this.exec(id, ['cat', '/proc/net/tcp', '/proc/net/tcp6'], {
      timeoutMs: DEFAULTS.stateMs,
      ...opts,
    }).catch(() => undefined);
    // cat fails when one table is missing (no IPv6 in the sentry) but prints the other; no
    // table at all (no cat in the image) leaves the question to the caller's probe.
    if (r === undefined || !/^\s*sl\s+local_address/m.test(r.stdout)) return undefined;
    // Two tables one after the other: the second's header is no row in state LISTEN.
    return listeningPorts(r.stdout).has(port);
  }

  /** runsc has no --preserve-fds: the host's read-only agent copy cannot be handed in. */
  override readonly ensureAgent = (id: string): Promise<AgentAddress> =>
    Promise.reject(
      new AgentError(
        'ENOTSUP',
        `agent: sandbox ${id} runs on gVisor (runsc), where dormant does not start the toolbox agent yet; use exec`,
      ),
    );

  /** Every process of the sandbox ends with its sentry: `runsc delete --force`, then stop's cleanup. */
  override async endProcesses(id: string, opts: CallOptions = {}): Promise<void> {
    await this.stop(id, opts);
  }

  override async stop(id: string, opts: CallOptions = {}): Promise<void> {
    await this.unpark(id);
    await super.stop(id, opts);
  }

  override async kill(id: string, signal: NodeJS.Signals = 'SIGKILL', opts: CallOptions = {}): Promise<void> {
    // A parked sandbox has no process to signal; SIGKILL ends it as it would a running one.
    if (this.parked.has(id) && signal === 'SIGKILL') return this.unpark(id);
    await super.kill(id, signal, opts);
  }

  override async destroy(id: string, opts: CallOptions = {}): Promise<void> {
    await this.unpark(id);
    const net = (await this.readRecord(id).catch(() => undefined))?.network;
    try {
      await super.destroy(id, opts);
    } finally {
      // Its slot may go to a runc sandbox next, which this chain must not filter.
      if (net !== undefined) await removeInbound(net);
    }
  }
}

/** `runsc --version`'s first line's version, or undefined when runsc is not installed. */
export async function runscVersion(runscPath = 'runsc'): Promise<string | undefined> {
  const r = await run(runscPath, ['--version'], { timeoutMs: 10_000 }).catch(() => undefined);
  return r === undefined ? undefined : /runsc version (\S+)/.exec(r.stdout)?.[1];
}

/**
 * What `dormant doctor` says of gVisor here: runsc's version (undefined: not installed) and the
 * platforms it can use. ptrace works on any kernel (the runtime's default, the one its tests
 * run); kvm needs /dev/kvm (much faster system calls), which `runtime.runscPlatform` selects.
 */
export async function runscFacts(
  runscPath = 'runsc',
): Promise<{ version: string | undefined; platforms: RunscPlatform[] }> {
  const version = await runscVersion(runscPath);
  const kvm = await exists('/dev/kvm');
  return { version, platforms: version === undefined ? [] : kvm ? ['ptrace', 'kvm'] : ['ptrace'] };
}
