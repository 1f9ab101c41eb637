/**
 * The Runtime port on runc (1.1.x) with CRIU. runc is called directly, through sys/exec's
 * run(), with a private state root so dormant's containers never mix with anyone else's.
 *
 * The host side (each sandbox's folder, record and OCI config, runc's invocation) is RuncHost
 * (runc-host.ts), which this class extends; what a restore needs of CRIU beyond runc is in
 * runc-restore.ts.
 */
import { mkdir, readFile, readdir, rm, rmdir, stat, writeFile } from 'node:fs/promises';
import { join, resolve } from 'node:path';
import { DormantError, ErrorCode, asError, errnoCode, isDormantError } from '../domain/errors.js';
import { run, type RunResult } from '../sys/exec.js';
import { stopCollector } from './log-collector.js';
import {
  clearCriuNetworkLock,
  findSlot,
  releaseSlot,
  reserveSlot,
  releaseNetwork,
  slotNetwork,
  tearDownNetwork,
} from './network.js';
import { buildOciConfig, compileSandboxSpec, criuConfigText } from './oci.js';
import { isMountPoint, unmountAll } from './rootfs.js';
import { removeCgroupEverywhere } from '../sys/cgroup.js';
import { assertOwnFolder } from './staging.js';
import { commitLayer, ensureLayer, releaseLayer, remountLayer } from './quota.js';
import { copyFolder, emptyFolder, packFilesystem, unpackFilesystem } from './layer.js';
import { endPageServer, servePages, type ServedPages } from './pages.js';
import { setImagesHostname } from '../criu/images/utsns.js';
import type {
  CallOptions,
  CheckpointOptions,
  CheckpointResult,
  ExecOptions,
  ExecResult,
  RestoreOptions,
  RestoreResult,
  Runtime,
  SandboxSpec,
  SandboxState,
  SandboxStatus,
  PrepareOptions,
} from './runtime.js';
import {
  CGROUP_ROOT,
  DEFAULTS,
  RuncHost,
  recordSpec,
  sigkill,
  tailOf,
  timed,
  writeFileAtomic,
  privateFile,
  type SandboxRecord,
} from './runc-host.js';
import { exists } from '../sys/fs.js';
import { engineBindsOf, ensureEngineBinds } from './engine-binds.js';
import { endLazyPagesIn, keepRestoreLog, startLazyPages, watchRestore } from './runc-restore.js';
import { agentStarter, endOutsideTimeNamespace } from './runc-agent.js';
import { imagesHaveUserNamespace, ownImages } from './userns.js';

export { DEFAULT_SECCOMP_PROFILE, loadSeccompProfile, type RuncRuntimeOptions } from './runc-host.js';

export class RuncRuntime extends RuncHost implements Runtime {
  /** Page servers of lazy restores in flight, by sandbox (with the restore's work folder). */
  private readonly pageServers = new Map<string, ServedPages & { workDir: string }>();
  /** The toolbox agent (runc-agent.ts), started with runc as this runtime runs it. */
  readonly ensureAgent = agentStarter(this, (id, a) => [this.runcPath, this.runcArgs(id, a), this.env]);

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

  // ---- the port ----------------------------------------------------------------------

  async prepare(raw: SandboxSpec, opts: PrepareOptions = {}): Promise<SandboxState> {
    await this.prepareBundle(raw, opts);
    return this.state(raw.id, opts);
  }

  /**
   * False when runc has no container of this id: its state folder is absent (what `runc state`
   * would read to say "does not exist"). True asks runc itself.
   */
  private async runcMayKnow(id: string): Promise<boolean> {
    try {
      await stat(join(this.runcRoot(), id));
      return true;
    } catch (e) {
      if (errnoCode(e) === 'ENOENT') return false;
      throw e;
    }
  }

  /** prepare() without its `runc state` at the end: the sandbox's record. */
  private async prepareBundle(raw: SandboxSpec, opts: PrepareOptions): Promise<SandboxRecord> {
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
      const slot = await reserveSlot(this.netDir(), this.slotHolder(id), this.subnet);
      rec = {
        spec: recordSpec(spec),
        slot,
        network: slotNetwork(id, this.subnet, slot, this.node),
        ...(this.userNamespace !== undefined ? { userns: this.userNamespace } : {}),
      };
      await writeFileAtomic(recordPath, JSON.stringify(rec, null, 2));
    }
    // The disk quota: the layer's image is mounted at fs/ before upper/ and work/ go in it.
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
    await writeFileAtomic(
      criuConf,
      criuConfigText(rec.userns !== undefined ? rec.network.hostInterface : undefined),
    );
    const config = buildOciConfig({
      spec,
      engineBindSources: await ensureEngineBinds(dir, spec.engineBinds ?? [], rec.userns),
      netnsPath: `/var/run/netns/${rec.network.netns}`,
      cgroupsPath: this.cgroupPath(id),
      criuConfigPath: criuConf,
      ...(this.seccomp !== undefined ? { seccomp: this.seccomp } : {}),
      ...(this.apparmorProfile !== undefined ? { apparmorProfile: this.apparmorProfile } : {}),
      ...(rec.userns !== undefined ? { userns: rec.userns } : {}),
    });
    await this.writeConfig(id, config);
    await timed(opts, 'host side', () => this.ensureHostSide(rec, opts.signal, opts.mountRootfs !== false));
    return rec;
  }

  async create(spec: SandboxSpec, opts: CallOptions = {}): Promise<SandboxState> {
    // Each `runc state` is a process start (tens of ms, more on a busy node): a new sandbox's
    // create asks runc nothing it can know otherwise (its pid comes from --pid-file).
    const rec = await this.prepareBundle(spec, opts);
    const id = spec.id;
    const current = (await this.runcMayKnow(id)) ? await this.runcState(id, opts) : undefined;
    if (current !== undefined && current.status !== 'stopped') return this.state(id, opts);
    // A container whose processes are gone (exited, reboot) is only a record: cleared.
    if (current !== undefined) await this.runc(id, ['delete', '--force', id], opts, DEFAULTS.destroyMs);
    const offset = await this.runcLogSize(id);
    const pidFile = join(this.dir(id), 'init.pid');
    await rm(pidFile, { force: true });
    try {
      await this.runcWithLogPipe(
        id,
        ['create', '--bundle', this.configBundle(id), '--pid-file', pidFile, id],
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
    const pid = Number((await readFile(pidFile, 'utf8').catch(() => '')).trim());
    // Read once; runc writes it world-readable, and nothing of a sandbox's is left so.
    await rm(pidFile, { force: true });
    if (!Number.isInteger(pid) || pid <= 0)
      throw new DormantError(ErrorCode.RUNTIME_CREATE_FAILED, `runc created sandbox ${id} without a process`);
    // The network namespace runc made inside the sandbox's user namespace gets its veth.
    if (rec.userns !== undefined)
      await timed(opts, 'network', () => this.adoptNetwork(rec, pid, opts.signal));
    return this.stateOf(id, rec, 'created', pid);
  }

  async start(id: string, opts: CallOptions = {}): Promise<void> {
    try {
      await this.runc(id, ['start', id], opts, DEFAULTS.startMs);
    } catch (e) {
      // runc refuses anything but a created container; the error says what it is instead.
      await this.requireStatus(id, ['created'], 'start', opts);
      throw e;
    }
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
    return this.stateOf(id, rec, status, rs !== undefined && rs.pid > 0 ? rs.pid : undefined);
  }

  private stateOf(
    id: string,
    rec: SandboxRecord,
    status: SandboxStatus,
    pid: number | undefined,
  ): SandboxState {
    return {
      id,
      status,
      pid,
      network: rec.network,
      logPath: this.logPath(id),
      upperDir: this.upperDir(id),
      ...engineBindsOf(this.dir(id), rec.spec.engineBinds),
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
    // No `runc state` first (~0.1 s): runc checkpoint refuses one not running or paused.
    const rec = await this.readRecord(id);
    await endOutsideTimeNamespace(this, id); // runc-agent.ts: what CRIU could not restore
    for (const d of [opts.imagesDir, opts.workDir]) await mkdir(d, { recursive: true, mode: 0o700 });
    const args = ['checkpoint', '--image-path', opts.imagesDir, '--work-path', opts.workDir];
    if (opts.leaveRunning === true) args.push('--leave-running');
    const logPath = join(opts.workDir, 'dump.log');
    const offset = await this.runcLogSize(id);
    const timeoutMs = opts.timeoutMs ?? this.checkpointTimeoutMs;
    let r: RunResult | undefined;
    for (let attempt = 1; r === undefined; attempt++)
      try {
        r = await this.runc(id, [...args, id], { ...opts, timeoutMs }, DEFAULTS.checkpointMs);
      } catch (e) {
        if (
          opts.signal?.aborted === true ||
          !(await this.retryCheckpoint(id, rec, e, attempt, opts.imagesDir, logPath))
        )
          throw await this.checkpointError(id, rec, e, { logPath, offset, timeoutMs });
      }
    // runc removed the container; the rootfs is unmounted so the writable layer is at rest
    // (and can be archived) while the sandbox sleeps. restore() mounts it again.
    if (opts.leaveRunning !== true) await this.stop(id);
    return { durationMs: r.durationMs, logPath };
  }

  /**
   * True when a failed dump is worth one more try: CRIU gave up seizing the tasks within its
   * own timeout (a task in uninterruptible sleep: I/O on a busy node), unfroze them, and the
   * sandbox runs on. Its partial images are removed first.
   */
  private async retryCheckpoint(
    id: string,
    rec: SandboxRecord,
    e: unknown,
    attempt: number,
    imagesDir: string,
    logPath: string,
  ): Promise<boolean> {
    if (attempt > 1 || isDormantError(e, ErrorCode.COMMAND_TIMEOUT)) return false;
    if ((await tailOf(logPath, /Timeout reached/, 1)) === '') return false;
    const now = await this.runcState(id).catch(() => undefined);
    if (now?.status !== 'running' && now?.status !== 'paused') return false;
    await clearCriuNetworkLock(rec.network);
    await rm(imagesDir, { recursive: true, force: true });
    await mkdir(imagesDir, { recursive: true, mode: 0o700 });
    return true;
  }

  /** What a failed dump is, as the caller's error (the CRIU log's reason, the sandbox's state). */
  private async checkpointError(
    id: string,
    rec: SandboxRecord,
    e: unknown,
    at: { logPath: string; offset: number; timeoutMs: number },
  ): Promise<DormantError> {
    const { logPath, offset, timeoutMs } = at;
    // CRIU unfreezes the tasks when a dump fails, and runc keeps the container; a lock
    // left on the network would still cut the sandbox off, so clear it. A hung dump was
    // ended with its whole process group (runc and criu) by run()'s timeout.
    const after = await this.runcState(id).catch(() => undefined);
    if (after === undefined || (after.status !== 'running' && after.status !== 'paused')) {
      const status = after === undefined ? 'absent' : after.status === 'created' ? 'created' : 'stopped';
      return new DormantError(
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
    return new DormantError(
      ErrorCode.RUNTIME_CHECKPOINT_FAILED,
      `${what} (the sandbox is ${after.status})${why ? `:\n${why}` : hung ? ' (criu wrote no log)' : ''}`,
      { cause: e, details: { criuLog: logPath, sandboxStatus: after.status, hung } },
    );
  }

  async restore(id: string, options: RestoreOptions): Promise<RestoreResult> {
    const from = options.lazyPages === true ? options.pages : undefined;
    if (from === undefined) return this.restoreFromImages(id, options);
    const served = await timed(options, 'page server', () =>
      servePages({
        source: from.source,
        what: from.what,
        imagesDir: options.imagesDir,
        procsFiles: this.procsFiles(id),
        opts: options,
      }),
    );
    this.pageServers.set(id, { ...served, workDir: resolve(options.workDir) });
    try {
      const r = await this.restoreFromImages(id, {
        ...options,
        pageServer: { address: served.server.address, port: served.server.port },
      });
      // A page that fails to authenticate stops the server (it answers nothing more): the
      // pages then never all arrive, and the sandbox goes back to its checkpoint. Once they
      // are all in, the server goes (its keepers first, before the caller hears of it).
      const pagesLoaded = Promise.race([r.pagesLoaded, served.server.failed]).then(() => this.endPages(id));
      return { ...r, pagesLoaded };
    } catch (e) {
      await this.endPages(id);
      throw e;
    }
  }

  /** Stops the page server of `id`'s lazy restore, if one runs. Call once its tasks are ended or whole. */
  private async endPages(id: string): Promise<void> {
    const p = this.pageServers.get(id);
    if (p === undefined) return;
    this.pageServers.delete(id);
    await endPageServer(p, (what, e) =>
      this.warn?.(`sandbox ${id}: cleanup (${what}) failed: ${asError(e).message.split('\n')[0] ?? ''}`),
    );
  }

  private async restoreFromImages(id: string, options: RestoreOptions): Promise<RestoreResult> {
    const opts = { ...options, imagesDir: resolve(options.imagesDir), workDir: resolve(options.workDir) };
    const rec = await this.readRecord(id);
    await assertSameUserNamespace(id, rec, opts.imagesDir);
    await mkdir(opts.workDir, { recursive: true, mode: 0o700 });
    // CRIU brings back the uts namespace as it was dumped; a sandbox restored from another's
    // checkpoint (a fork, a template) must answer to its own hostname from its first
    // instruction on: the name is written into the images before the restore.
    const hostname = rec.spec.hostname ?? id;
    const renamed = await timed(opts, 'hostname', () => setImagesHostname(opts.imagesDir, hostname));
    // The restored root task reads some images itself, as the sandbox's root (userns.ts).
    if (rec.userns !== undefined)
      await timed(opts, 'images owner', () => ownImages(opts.imagesDir, rec.userns!));
    // The lazy-pages daemon needs only the images: it starts (~0.1-0.3 s, CRIU's own start)
    // while the container's state and host side are checked.
    const starting =
      opts.lazyPages === true
        ? timed(opts, 'lazy-pages start', () => startLazyPages(this.criuPath, this.env, opts))
        : undefined;
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
      // CRIU makes the network namespace and its veth pair again, under the same names.
      if (rec.userns !== undefined)
        await releaseNetwork(rec.network, {
          markerPath: join(this.dir(id), 'network.done'),
          signal: opts.signal,
        });
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
    const watch = watchRestore(logPath, lazy?.done, opts.signal);
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
      const kept = await keepRestoreLog(this.restoreLogPath(id), opts.workDir).catch(() => undefined);
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
      // A checkpoint without a UTS namespace image of its own (none was rewritten): set
      // from the host, after the fact (the sandbox itself has no CAP_SYS_ADMIN).
      if (renamed === 0)
        await timed(opts, 'hostname', () =>
          run('nsenter', ['--target', String(pid), '--uts', 'hostname', hostname], {
            timeoutMs: DEFAULTS.stateMs,
            signal: opts.signal,
          }),
        );
      if (rec.userns !== undefined)
        await timed(opts, 'network', () => this.adoptNetwork(rec, pid, opts.signal));
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

  /** Where the CRIU log of the sandbox's last failed restore is kept (one per sandbox). */
  restoreLogPath(id: string): string {
    return join(this.dir(id), 'restore-failed.log');
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
      // The overlay first, then the idmapped lower layer under it (a user namespace's).
      const still = [
        ...(await unmountAll(join(this.bundle(id), 'rootfs'))),
        ...(await unmountAll(this.idmappedLower(id))),
      ];
      if (still.length > 0) throw new Error(`still mounted: ${still.join(' ')}`);
    });
    await step('work dir mounts', async () => {
      const still = await unmountAll(resolve(workDir));
      if (still.length > 0) throw new Error(`still mounted: ${still.join(' ')}`);
    });
    await step('network lock', () => clearCriuNetworkLock(rec.network));
    if (rec.userns !== undefined)
      await step('network', () =>
        releaseNetwork(rec.network, { markerPath: join(this.dir(id), 'network.done') }),
      );
    return left;
  }

  async packLayer(id: string, tarPath: string, opts: CallOptions = {}): Promise<void> {
    await packFilesystem(this.upperDir(id), tarPath, opts.signal);
  }

  async applyLayer(id: string, tarPath: string, opts: CallOptions = {}): Promise<void> {
    await unpackFilesystem(tarPath, this.upperDir(id), opts.signal);
  }

  async emptyLayer(id: string): Promise<void> {
    await emptyFolder(this.upperDir(id));
    // Its blocks back to the host before the hibernate returns (quota.ts).
    await commitLayer(this.dir(id));
  }

  async copyLayer(fromId: string, toId: string): Promise<void> {
    await copyFolder(this.upperDir(fromId), this.upperDir(toId));
  }

  async endLazyPages(workDir: string): Promise<number[]> {
    const ended = await endLazyPagesIn(workDir);
    for (const [id, p] of this.pageServers) if (p.workDir === resolve(workDir)) await this.endPages(id);
    return ended;
  }

  async stop(id: string, opts: CallOptions = {}): Promise<void> {
    const rec = await this.readRecord(id);
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
    // Only now, with its tasks ended: a lazy-pages daemon that lost its page server would
    // fill the missing pages with zeros.
    await this.endPages(id);
    await timed(opts, 'unmount', () => this.unmountRootfs(id, opts.signal));
    if (rec.userns !== undefined) await this.releaseNetwork(rec, opts.signal);
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
    await timed(opts, 'unmount', () => this.unmountRootfs(id, opts.signal));
    const rec = await this.readRecord(id);
    if (rec.userns !== undefined) await this.releaseNetwork(rec, opts.signal);
    // The empty cgroups go too (what is still charged to them, page cache and kernel memory,
    // is released with them); `runc delete` later finds them gone, which it accepts.
    await this.removeCgroups(id);
    await this.dropConfig(id);
  }

  /**
   * A sandbox in a user namespace, its processes gone: its network namespace (runc's or CRIU's)
   * is unpinned, so that it goes with its veth pair and the next restore makes both again.
   */
  private async releaseNetwork(rec: SandboxRecord, signal?: AbortSignal): Promise<void> {
    await releaseNetwork(rec.network, {
      markerPath: join(this.dir(rec.spec.id), 'network.done'),
      ...(signal !== undefined ? { signal } : {}),
    });
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
    const slot = rec?.slot ?? (await findSlot(this.netDir(), this.slotHolder(id)));
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
 * A checkpoint is restored only into a sandbox with the same user namespace setting: CRIU makes
 * the namespaces the images record, whatever the sandbox's config says, so a checkpoint taken
 * without one would come back with the host's root, and one taken in one would not find the
 * network namespace a sandbox without one has.
 */
async function assertSameUserNamespace(id: string, rec: SandboxRecord, imagesDir: string): Promise<void> {
  const images = await imagesHaveUserNamespace(imagesDir);
  if (images === (rec.userns !== undefined)) return;
  throw new DormantError(
    ErrorCode.RUNTIME_RESTORE_FAILED,
    images
      ? `restore of sandbox ${id} refused: its checkpoint was taken in a user namespace, and the sandbox has none`
      : `restore of sandbox ${id} refused: its checkpoint was taken without a user namespace (before the node gave sandboxes one, or imported from elsewhere), and the sandbox has one`,
    {
      hint: images
        ? 'resume it on a daemon that gives sandboxes user namespaces (the default)'
        : 'a checkpoint from before sandboxes had user namespaces (a template, or the origin of a fork, made then): make the template again from a new sandbox, or archive the origin and resume it (it restarts from its files), or create from it on a daemon run with --no-user-namespace',
    },
  );
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
