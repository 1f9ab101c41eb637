/**
 * The composition root: `dormant serve`'s daemon, built from its configuration. SQLite state,
 * the local vault and a master key under the data directory, the runc runtime, CRIU staging in
 * /dev/shm, the HTTP API, the meter, the wake proxy and the policy loop. On start it reconciles
 * every sandbox with what really exists.
 */
import { createHash } from 'node:crypto';
import { chmod, mkdir, readdir, rmdir } from 'node:fs/promises';
import { join, resolve } from 'node:path';
import { availableParallelism, hostname, totalmem } from 'node:os';
import type { FastifyInstance } from 'fastify';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';
import { NODE_NAME_PATTERN, proxyUrlProblem } from '../domain/node.js';
import { checkpointFacts } from '../domain/compat.js';
import { NodeMembership } from '../control/fleet.js';
import { DEFAULTS } from './defaults.js';
import { placeWakeFor, type FleetHooks } from '../api/fleet.js';
import type { Sandbox } from '../domain/sandbox.js';
import type { PriceSheet } from '../domain/cost.js';
import { formatTimings, type OperationTimings } from '../domain/timings.js';
import { cgroupUsage } from '../sys/cgroup.js';
import { createLogger, type LogLevel, type LogSink, type Logger } from '../sys/log.js';
import { cpuFacts, diskFacts, userfaultfdFacts } from '../sys/node-facts.js';
import { SqliteStateStore } from '../state/sqlite.js';
import { lockStateForNode, openPostgresStore, type NodeLock } from '../state/postgres.js';
import type { StateStore } from '../state/store.js';
import { TenantSecrets, openVault, type MasterKeySource, type Vault } from '../vault/index.js';
import { criuFeature, getCriu } from '../criu/criu.js';
import { RuncRuntime, loadSeccompProfile, type RuncRuntimeOptions } from '../runtime/runc.js';
import {
  DEFAULT_USER_NAMESPACE,
  idMapsOf,
  lazyRestoreInUserNamespace,
  walkableTo,
} from '../runtime/userns.js';
import { RunscRuntime, type RunscPlatform } from '../runtime/runsc.js';
import { which } from '../sys/exec.js';
import { RuntimeDispatch } from '../runtime/runsc-dispatch.js';
import { prepareStaging, privateFolder, releaseStaging } from '../runtime/staging.js';
import { SandboxController, systemClock, type ControllerOptions } from '../control/sandboxes.js';
import type { PolicyDefaults } from '../control/policy.js';
import { TrackingController } from '../control/activity.js';
import { Meter, priceSheet } from '../control/meter.js';
import { startWakeServices, type PolicyConfig, type ProxyConfig, type WakeServices } from '../api/wake.js';
import { ADMIN_TENANT, ensureAdminToken, hashToken } from '../api/auth.js';
import { buildServer, type ServerOptions } from '../api/server.js';
import { registerCostRoutes } from '../api/routes-cost.js';
import { registerImageRoutes } from '../api/routes-images.js';
import { ImageService, type ImageServiceOptions } from '../control/images.js';
import { registerE2bInfo, startE2bFront, type E2bFront } from '../api/e2b/front.js';
import { defaultConfig, type DaemonConfig, type E2bTemplateConfig, type S3VaultConfig } from './config.js';
import { s3VaultStore, vaultLocksFor } from './vault-store.js';
import type { VaultLocks } from '../vault/index.js';

/** What the daemon hands to the controller as the operator set it (documented on ControllerOptions). */
const CONTROLLER_SETTINGS = [
  'readonlyBinds',
  'defaultDiskBytes',
  'defaultEgress',
  'defaultRuntime',
  'allowedSourceRoots',
  'keepCheckpoints',
  'templateCacheBytes',
  'importLimits',
  'lazyRestore',
  'servePagesFromVault',
  'pagesFromVaultAboveBytes',
  'lazyRestoreProbe',
  'onTimings',
  'failAt',
  'clock',
  'gpu',
] as const satisfies readonly (keyof ControllerOptions)[];
type ControllerSettings = Pick<ControllerOptions, (typeof CONTROLLER_SETTINGS)[number]>;
/** ... to the runtime (documented on RuncRuntimeOptions). */
type RuntimeSettings = Pick<
  RuncRuntimeOptions,
  | 'checkpointTimeoutMs'
  | 'restoreTimeoutMs'
  | 'apparmorProfile'
  | 'egressResolvers'
  | 'egressRefreshMinMs'
  | 'userNamespace'
  | 'subnet'
>;
/** ... to the API server (documented on ServerOptions). */
type ServerSettings = Pick<ServerOptions, 'bodyLimitBytes' | 'execBodyLimitBytes' | 'maxUploadBytes'>;

/**
 * A daemon as code embeds it (tests, the benchmark); `dormant serve` builds these from its
 * configuration with optionsFromConfig. What is not given is the configuration's default.
 */
export interface DaemonOptions extends ControllerSettings, RuntimeSettings, ServerSettings {
  dataDir: string;
  /** host:port; port 0 picks a free one. */
  listen?: string;
  /** The vault's master key. Default `<dataDir>/master.key`. */
  masterKey?: MasterKeySource;
  /** Checkpoints in an S3-compatible bucket instead of `<dataDir>/vault` (docs/VAULT.md). */
  vault?: S3VaultConfig;
  /** The database of record in PostgreSQL instead of `<dataDir>/state.db` (docs/STATE.md). */
  state?: { url: string };
  /** This node in a fleet (with `state`): name (default the host name), advertised URL, lease. */
  node?: { name?: string; url?: string; leaseMs?: number };
  /** A seccomp profile file (OCI `linux.seccomp` JSON) for every sandbox. */
  seccompProfile?: string;
  /** gVisor's platform for runsc sandboxes (runsc.ts). Default ptrace. */
  runscPlatform?: RunscPlatform;
  /** The runsc binary; false: no gVisor on this node. Default `runsc` on PATH, when there. */
  runscPath?: string | false;
  /** A line for each API request in the log. */
  logger?: boolean;
  /** The daemon's log. Default: warnings and errors only, as JSON on stderr. */
  log?: Logger;
  /** Printed warnings (master key generated, ...). Default: the log's warn. */
  warn?: (message: string) => void;
  /** The price sheet over the defaults derived from this node's size (docs/COST.md). */
  prices?: Partial<PriceSheet>;
  /** How often the meter samples each sandbox's cgroup. */
  meterIntervalMs?: number;
  /** The wake proxy; false: none. */
  proxy?: ProxyConfig | false;
  /** The idle policy loop; false: none. */
  policy?: PolicyConfig | false;
  /** Registry pulls and the image cache's collector (docs/IMAGES.md). */
  images?: Pick<ImageServiceOptions, 'insecureRegistries' | 'pullTimeoutMs' | 'maxPullBytes'> & {
    /** How often what no sandbox uses is removed; 0: only on POST /v1/images/prune. */
    gcIntervalMs?: number;
  };
  /** The E2B front (docs/E2B.md); false: none (the default). */
  e2b?: { listen: string; templates?: Record<string, E2bTemplateConfig> } | false;
}

export interface Daemon {
  url: string;
  adminToken: string;
  controller: SandboxController;
  store: StateStore;
  vault: Vault;
  runtime: RuncRuntime;
  /** The gVisor runtime, when runsc is installed (its sandboxes: `runtime: 'runsc'`). */
  runsc: RunscRuntime | undefined;
  app: FastifyInstance;
  /** The wake proxy and the policy loop, when running. */
  wake: WakeServices;
  reconciled: { id: string; from: string; to: string }[];
  meter: Meter;
  log: Logger;
  /** The E2B front, when on. */
  e2b: E2bFront | undefined;
  /** Applies settings that change live (`dormant serve` on SIGHUP), from the next use on. */
  reconfigure(s: LiveSettings): void;
  close(): Promise<void>;
}

/**
 * What a running daemon changes without a restart. Each is read where it is used (a create,
 * an import, a policy pass, a cost report, a log line), so a new value takes effect there from
 * the next use on; what is built once at start (listeners, the runtime, body limits of routes,
 * loops' timers) needs a restart (docs/CONFIG.md, "Reloading").
 */
export interface LiveSettings {
  logLevel: LogLevel;
  policyDefaults: PolicyDefaults;
  allowedSourceRoots: string[];
  defaultDiskBytes: number;
  defaultEgress: NonNullable<ControllerOptions['defaultEgress']>;
  keepCheckpoints: number;
  importLimits: NonNullable<ControllerOptions['importLimits']>;
  maxUploadBytes: number;
  prices: Partial<PriceSheet>;
}

/** The live part of a configuration. */
export function liveSettings(c: DaemonConfig): LiveSettings {
  return {
    logLevel: c.logLevel,
    policyDefaults: { node: c.policy.defaults, tenants: c.policy.tenants },
    allowedSourceRoots: c.sandbox.allowedSourceRoots,
    defaultDiskBytes: c.sandbox.diskBytes,
    defaultEgress: { node: c.egress.default, tenants: c.egress.tenants },
    keepCheckpoints: c.checkpoint.keep,
    importLimits: c.importLimits,
    maxUploadBytes: c.api.maxUploadBytes,
    prices: c.meter.prices,
  };
}

/** The vault's master key as the configuration names it (a command runs with /bin/sh -c). */
export function masterKeySource(c: DaemonConfig): MasterKeySource {
  return 'command' in c.masterKey ? { command: '/bin/sh', args: ['-c', c.masterKey.command] } : c.masterKey;
}

/** The one place the configuration becomes the daemon's options; `sink`: the log's file, if any. */
export function optionsFromConfig(c: DaemonConfig, sink?: LogSink): DaemonOptions {
  const log = createLogger({
    level: c.logLevel,
    ...(c.logFormat !== 'auto' ? { format: c.logFormat } : {}),
    ...(sink !== undefined ? { sink } : {}),
  });
  return {
    dataDir: c.dataDir,
    listen: c.listen,
    masterKey: masterKeySource(c),
    ...(c.vault ? { vault: c.vault } : {}),
    ...(c.state ? { state: c.state } : {}),
    node: c.node,
    logger: c.log,
    log,
    seccompProfile: c.sandbox.seccompProfile,
    ...(c.sandbox.apparmorProfile !== undefined ? { apparmorProfile: c.sandbox.apparmorProfile } : {}),
    userNamespace: c.sandbox.userNamespace,
    ...(c.sandbox.subnet !== undefined ? { subnet: c.sandbox.subnet } : {}),
    allowedSourceRoots: c.sandbox.allowedSourceRoots,
    defaultDiskBytes: c.sandbox.diskBytes,
    defaultEgress: { node: c.egress.default, tenants: c.egress.tenants },
    defaultRuntime: { node: c.runtime.default, tenants: c.runtime.tenants },
    runscPlatform: c.runtime.runscPlatform,
    ...(c.egress.dns.length > 0 ? { egressResolvers: c.egress.dns } : {}),
    keepCheckpoints: c.checkpoint.keep,
    checkpointTimeoutMs: c.checkpoint.timeoutMs,
    templateCacheBytes: c.checkpoint.templateCacheBytes,
    restoreTimeoutMs: c.restore.timeoutMs,
    lazyRestore: c.restore.lazy,
    servePagesFromVault: c.restore.pagesFromVault,
    pagesFromVaultAboveBytes: c.restore.pagesFromVaultAboveBytes,
    importLimits: c.importLimits,
    bodyLimitBytes: c.api.bodyLimitBytes,
    execBodyLimitBytes: c.api.execBodyLimitBytes,
    maxUploadBytes: c.api.maxUploadBytes,
    prices: c.meter.prices,
    meterIntervalMs: c.meter.intervalMs,
    images: c.images,
    proxy: c.proxy.enabled
      ? {
          listen: c.proxy.listen,
          domain: c.proxy.domain,
          wakeTimeoutMs: c.proxy.wakeTimeoutMs,
          tcp: c.proxy.tcp,
        }
      : false,
    policy: c.policy.enabled
      ? {
          intervalMs: c.policy.intervalMs,
          cpuActiveShare: c.policy.cpuActiveShare,
          defaults: { node: c.policy.defaults, tenants: c.policy.tenants },
        }
      : false,
    e2b: c.e2b.listen !== undefined ? { listen: c.e2b.listen, templates: c.e2b.templates } : false,
    ...(c.debug.includes('timings')
      ? {
          onTimings: (t: OperationTimings) =>
            log.info({ op: t.op, sandbox: t.sandboxId, steps: formatTimings(t) }, `${t.op} steps`),
        }
      : {}),
  };
}

/**
 * `given` over the configuration's defaults: a proxy or policy object given in part keeps the
 * defaults of the fields it leaves out.
 */
function withDefaults(given: DaemonOptions): DaemonOptions {
  // The configuration's log is `dormant serve`'s (info); an embedded daemon that names none
  // logs only warnings and errors (startDaemon).
  const { log: _serveLog, ...base } = optionsFromConfig(defaultConfig(given));
  const out: DaemonOptions = { ...base };
  for (const [k, v] of Object.entries(given) as [keyof DaemonOptions, unknown][]) {
    if (v !== undefined) (out as unknown as Record<string, unknown>)[k] = v;
  }
  if (given.proxy && base.proxy) out.proxy = { ...base.proxy, ...given.proxy };
  if (given.policy && base.policy) out.policy = { ...base.policy, ...given.policy };
  return out;
}

function parseListen(listen: string): { host: string; port: number } {
  const m = /^(.*):(\d+)$/.exec(listen);
  if (!m) throw new Error(`--listen ${listen}: expected HOST:PORT`);
  return { host: m[1]!.replace(/^\[|\]$/g, ''), port: Number(m[2]) };
}

/** Why CRIU cannot restore lazily on this node, or undefined when it can. */
async function lazyRestoreProblem(
  criuPath: string,
  env: Record<string, string>,
  userNamespace: boolean,
): Promise<string | undefined> {
  const uffd = await userfaultfdFacts();
  if (!uffd.available) return uffd.detail;
  if (userNamespace) {
    const why = await lazyRestoreInUserNamespace();
    if (why !== undefined) return why;
  }
  if (!(await criuFeature(criuPath, 'uffd-noncoop', { env })))
    return 'criu check --feature uffd-noncoop fails';
  return undefined;
}

/**
 * CRIU images in flight live in memory, one folder per data directory (however its path is
 * spelled: `data` and `/abs/data/` are the same folder, so a restart finds what a crash left).
 */
export function stagingDirFor(dataDir: string): string {
  return `/dev/shm/dormant-${createHash('sha256').update(resolve(dataDir)).digest('hex').slice(0, 12)}`;
}

/** The sandboxes' OCI configs (their environment in clear) while runc reads them: memory too. */
export function bundleDirFor(dataDir: string): string {
  return `${stagingDirFor(dataDir)}-bundles`;
}

/** Removes the cgroup folder `path` from every hierarchy where it is empty; a busy one stays. */
async function removeEmptyCgroup(path: string): Promise<void> {
  const root = '/sys/fs/cgroup';
  const hierarchies = await readdir(root).catch(() => [] as string[]);
  for (const h of ['', ...hierarchies]) await rmdir(join(root, h, path)).catch(() => undefined);
}

/** A URL the other nodes can reach: a wildcard listen address becomes the host's name. */
function advertised(url: string): string {
  const u = new URL(url);
  if (u.hostname === '0.0.0.0' || u.hostname === '[::]') u.hostname = hostname();
  return u.origin;
}

/** This node's name in a fleet: the one configured, else the host's. */
export function nodeNameOf(opts: Pick<DaemonOptions, 'node'>): string {
  return opts.node?.name ?? hostname();
}

/**
 * The database of record: SQLite in the data folder, or PostgreSQL shared by the fleet, with
 * this node's name held (lockStateForNode: taken before the schema is touched, so a second
 * process started as the same node changes nothing).
 */
async function openState(
  opts: DaemonOptions,
  dataDir: string,
  warn: (m: string) => void,
): Promise<{ store: StateStore; nodeLock: NodeLock | undefined }> {
  if (opts.state === undefined)
    return { store: new SqliteStateStore(join(dataDir, 'state.db')), nodeLock: undefined };
  const nodeLock = await lockStateForNode(
    opts.state.url,
    nodeNameOf(opts),
    `${hostname()} ${resolve(dataDir)}`,
    {
      onLost: warn,
    },
  );
  try {
    const store = await openPostgresStore(opts.state.url, {
      node: nodeNameOf(opts),
      onIdleError: (e) =>
        warn(`state database: an idle connection failed (${e.message}); the next call reconnects`),
    });
    return { store, nodeLock };
  } catch (e) {
    await nodeLock.release();
    throw e;
  }
}

export async function startDaemon(given: DaemonOptions): Promise<Daemon> {
  const opts = withDefaults(given);
  const { dataDir } = opts;
  const listen = opts.listen!;
  const log = opts.log ?? createLogger({ level: 'warn' });
  const warn = opts.warn ?? ((m: string) => log.warn(m));
  // First of all, before the database is even opened: what a daemon killed mid-operation left
  // in staging (plaintext CRIU images of a hibernate that never committed, a checkpoint
  // fetched for a resume) is wiped.
  // A folder above the data folder that others cannot search would fail every create of a
  // sandbox with a user namespace: said now, once, before anything is made.
  if (opts.userNamespace === true) {
    await mkdir(dataDir, { recursive: true, mode: 0o700 });
    await walkableTo(resolve(dataDir), resolve(dataDir));
  }
  const stagingDir = stagingDirFor(dataDir);
  await prepareStaging(stagingDir);
  // The OCI configs of containers that still run are kept (runc exec reads them); those of
  // sandboxes gone are removed once the runtime is up.
  const bundleDir = bundleDirFor(dataDir);
  await privateFolder(bundleDir);
  await mkdir(dataDir, { recursive: true, mode: 0o700 });
  // Private whatever an older version (or the operator's mkdir) made it: it holds tenant data.
  // With user namespaces, searchable (not listable) by others: a sandbox's mapped root walks
  // through it to its root filesystem (runtime/userns.ts).
  await chmod(dataDir, opts.userNamespace === true ? 0o701 : 0o700);
  // In a fleet (the state in PostgreSQL), this node's name; undefined on a node alone.
  const nodeName = opts.state !== undefined ? nodeNameOf(opts) : undefined;
  if (nodeName !== undefined && !NODE_NAME_PATTERN.test(nodeName))
    throw new DormantError(
      ErrorCode.INVALID_ARGUMENT,
      `node name ${JSON.stringify(nodeName)} (the host name) is not a usable node name`,
      { hint: 'name the node: --node NAME (letters, digits, ".", "_", "-")' },
    );
  // Its sandboxes' cgroups under a folder of its own: nodes sharing one host (scripts/fleet.sh)
  // never end each other's processes through a sandbox's cgroup.
  const cgroupParent = nodeName !== undefined ? `/dormant/${nodeName}` : '/dormant';
  const { store, nodeLock } = await openState(opts, dataDir, warn).catch(async (e: unknown) => {
    // Refused (the node's name held elsewhere, the database out of reach): nothing of this
    // start stays behind, the staging tmpfs included.
    await releaseStaging(stagingDir).catch(() => undefined);
    await rmdir(bundleDir).catch(() => undefined);
    throw e;
  });
  let membership: NodeMembership | undefined;
  let vaultLocks: VaultLocks | undefined;
  // A node starting again renews its lease from the moment it holds its name: a start slower
  // than the lease (a big reconcile, a slow vault) must not get it marked lost by the others
  // (who would take back the sandboxes it still runs). Until it joins, below.
  const leaseMs = opts.node?.leaseMs ?? DEFAULTS.node.leaseMs;
  let earlyRenewal: NodeJS.Timeout | undefined;
  if (nodeName !== undefined && store.fleet !== undefined) {
    const fleet = store.fleet;
    const renew = (): void =>
      void fleet
        .renewNode(nodeName, leaseMs)
        .catch((e: unknown) => warn(`node ${nodeName}: renewal failed: ${String(e)}`));
    renew();
    earlyRenewal = setInterval(renew, Math.max(200, Math.floor(leaseMs / 3)));
    earlyRenewal.unref();
  }
  try {
    const admin = await ensureAdminToken(join(dataDir, 'admin-token'));
    if (!(await store.listTokens()).some((t) => t.hash === hashToken(admin.token))) {
      await store.insertToken({
        hash: hashToken(admin.token),
        tenant: ADMIN_TENANT,
        admin: true,
        createdAt: Date.now(),
      });
    }
    const masterKey = opts.masterKey!;
    const vaultDir = join(dataDir, 'vault');
    // Nodes sharing a bucket prefix and a database arbitrate the vault in the database.
    vaultLocks = await vaultLocksFor(opts.state, opts.vault, warn);
    const s3 = opts.vault ? await s3VaultStore(opts.vault, vaultDir, warn, vaultLocks) : undefined;
    const vault = await openVault({
      dir: vaultDir,
      masterKey,
      onWarning: warn,
      ...(s3 ? { store: s3 } : {}),
      ...(vaultLocks ? { locks: vaultLocks } : {}),
    });
    // --env values are sealed in the database with the tenant's key from the vault.
    const secrets = await TenantSecrets.open({ store: vault.store, masterKey });
    const criu = await getCriu();
    const cpu = await cpuFacts();
    const runtime = new RuncRuntime({
      warn,
      stateDir: join(dataDir, 'runtime'),
      criuPath: criu.path,
      criuEnv: criu.env,
      bundleDir,
      checkpointTimeoutMs: opts.checkpointTimeoutMs,
      restoreTimeoutMs: opts.restoreTimeoutMs,
      seccomp: loadSeccompProfile(opts.seccompProfile!),
      ...(opts.apparmorProfile !== undefined ? { apparmorProfile: opts.apparmorProfile } : {}),
      ...(opts.userNamespace !== undefined ? { userNamespace: opts.userNamespace } : {}),
      ...(opts.egressResolvers !== undefined ? { egressResolvers: opts.egressResolvers } : {}),
      ...(opts.egressRefreshMinMs !== undefined ? { egressRefreshMinMs: opts.egressRefreshMinMs } : {}),
      egressRefresh: true,
      cgroupParent,
      ...(nodeName !== undefined ? { node: nodeName } : {}),
      ...(opts.subnet !== undefined ? { subnet: opts.subnet } : {}),
    });
    await runtime.dropStaleConfigs();
    // gVisor beside runc when runsc is installed: its own state folder and config folder (each
    // adapter's dropStaleConfigs keeps only its own sandboxes'), the same network and cgroups.
    const runscPath = opts.runscPath === false ? undefined : await which(opts.runscPath ?? 'runsc');
    const runsc =
      runscPath === undefined
        ? undefined
        : new RunscRuntime({
            warn,
            runscPath,
            platform: opts.runscPlatform ?? 'ptrace',
            stateDir: join(dataDir, 'runtime-runsc'),
            bundleDir: `${bundleDir}-runsc`,
            checkpointTimeoutMs: opts.checkpointTimeoutMs,
            restoreTimeoutMs: opts.restoreTimeoutMs,
            seccomp: false,
            ...(opts.egressResolvers !== undefined ? { egressResolvers: opts.egressResolvers } : {}),
            ...(opts.egressRefreshMinMs !== undefined ? { egressRefreshMinMs: opts.egressRefreshMinMs } : {}),
            egressRefresh: true,
            cgroupParent,
            ...(nodeName !== undefined ? { node: nodeName } : {}),
            ...(opts.subnet !== undefined ? { subnet: opts.subnet } : {}),
          });
    await runsc?.dropStaleConfigs();
    const { gcIntervalMs, ...pulls } = opts.images ?? {};
    const images = new ImageService({
      ...pulls,
      store,
      secrets,
      cacheDir: join(dataDir, 'images'),
      stagingDir,
    });
    images.start(gcIntervalMs ?? 0, warn);
    const settings: Partial<Record<keyof ControllerSettings, unknown>> = {};
    for (const k of CONTROLLER_SETTINGS) if (opts[k] !== undefined) settings[k] = opts[k];
    // Kept, with the policy's defaults, the prices and the server's options below: reconfigure
    // replaces the live settings in these objects, which their users read on each use.
    const controllerOpts: ControllerOptions = {
      ...(settings as ControllerSettings),
      // An imported checkpoint must then carry the sandboxes' user namespace, mapped as theirs.
      ...(opts.userNamespace === true
        ? { checkpointProfile: { userNamespace: idMapsOf(DEFAULT_USER_NAMESPACE) } }
        : {}),
      // One line per create, hibernate, resume and fork, with the request's id when an API call made it.
      onTimings: (t: OperationTimings) => {
        const ms = Math.round(t.totalMs);
        const line = { op: t.op, sandbox: t.sandboxId, ok: t.ok, ms };
        if (t.ok) log.info(line, `${t.op} of ${t.sandboxId} done in ${ms} ms`);
        else log.warn(line, `${t.op} of ${t.sandboxId} failed after ${ms} ms`);
        opts.onTimings?.(t);
      },
      store,
      runtime: new RuntimeDispatch(runtime, runsc),
      vault,
      stagingDir,
      secrets,
      templates: store.templates(),
      imageCacheDir: join(dataDir, 'images'),
      images,
      lazyRestoreProbe:
        opts.lazyRestoreProbe ?? (() => lazyRestoreProblem(criu.path, criu.env, opts.userNamespace === true)),
      warn,
      // runc puts each sandbox in <cgroupParent>/<id>; the runtime's default parent is /dormant.
      usage: (id) => cgroupUsage(`${cgroupParent}/${id}`),
      ...(nodeName !== undefined ? { node: nodeName } : {}),
      platform: async () => ({ arch: cpu.arch, criuVersion: criu.version, cpuFlags: cpu.flags }),
    };
    const controller = new TrackingController(controllerOpts);
    // Rows from before sealing: their values sealed now, and the database rewritten so the old
    // pages and WAL frames holding them in clear are gone from its files.
    if ((await controller.sealStoredEnv((env) => TenantSecrets.isSealed(env))) > 0) await store.compact?.();
    // Rows from before the fleet (no node) that are awake ran here: this node's.
    if (nodeName !== undefined) await store.fleet?.adoptUnplaced(nodeName);
    const reconciled = await controller.reconcile();
    const fleetHooks: FleetHooks | undefined =
      nodeName !== undefined && store.fleet !== undefined
        ? {
            name: nodeName,
            store: store.fleet,
            // Placement wakes a sandbox only on a node with its runtime that can restore its checkpoint.
            wakeNeeds: async (s: Sandbox) => {
              const ck =
                s.state === 'hibernated' && s.checkpointId !== undefined
                  ? await store.getCheckpoint(s.checkpointId)
                  : undefined;
              return { runtime: s.spec.runtime ?? 'runc', facts: ck ? checkpointFacts(ck.meta) : {} };
            },
          }
        : undefined;
    const serverOpts: ServerOptions = {
      controller,
      store,
      checkpointVault: vault,
      logger: opts.logger ?? false,
      log,
      hostPaths: [dataDir, stagingDir],
      bodyLimitBytes: opts.bodyLimitBytes,
      execBodyLimitBytes: opts.execBodyLimitBytes,
      maxUploadBytes: opts.maxUploadBytes,
      ...(fleetHooks ? { fleet: fleetHooks } : {}),
    };
    const app = buildServer(serverOpts);
    const prices = priceSheet(opts.prices);
    const clock = opts.clock ?? systemClock;
    const meter = new Meter({
      source: controller,
      store,
      clock,
      prices,
      intervalMs: opts.meterIntervalMs!,
      freeDiskBytes: async () => (await diskFacts(dataDir)).freeBytes,
      attribution: () => vault.attribution(),
      warn,
    });
    registerCostRoutes(app, meter);
    registerImageRoutes(app, images);
    meter.start();
    const policyDefaults: PolicyDefaults = { ...(opts.policy ? opts.policy.defaults : {}) };
    const wake = await startWakeServices({
      controller,
      store,
      app,
      clock,
      dataDir,
      apiListen: listen,
      ...(fleetHooks
        ? {
            fleet: {
              placeWake: (s: Sandbox) => placeWakeFor(fleetHooks, s),
              token: admin.token,
              node: async (name: string) => await fleetHooks.store.getNode(name, { counts: false }),
            },
          }
        : {}),
      ...(opts.proxy !== undefined ? { proxy: opts.proxy } : {}),
      ...(opts.policy !== undefined
        ? { policy: opts.policy && { ...opts.policy, defaults: policyDefaults } }
        : {}),
      warn,
    });
    let e2b: E2bFront | undefined;
    const proxyDomain = opts.proxy ? opts.proxy.domain : undefined;
    registerE2bInfo(app, () =>
      e2b ? { apiUrl: e2b.url, sandboxUrl: e2b.url, domain: proxyDomain ?? null } : undefined,
    );
    const { host, port } = parseListen(listen);
    await app.listen({ host, port });
    const addr = app.server.address();
    const url =
      typeof addr === 'object' && addr
        ? `http://${host.includes(':') ? `[${host}]` : host}:${addr.port}`
        : `http://${host}:${port}`;
    if (fleetHooks) {
      const proxyAddr = wake.proxy
        ? `http://${wake.proxy.host.includes(':') ? `[${wake.proxy.host}]` : wake.proxy.host}:${wake.proxy.port}`
        : undefined;
      clearInterval(earlyRenewal);
      const problem = proxyUrlProblem(
        opts.node?.url ?? advertised(url),
        proxyAddr !== undefined ? advertised(proxyAddr) : undefined,
      );
      if (problem !== undefined) warn(`node ${fleetHooks.name}: ${problem}`);
      membership = await NodeMembership.join({
        fleet: fleetHooks.store,
        target: controller,
        name: fleetHooks.name,
        url: opts.node?.url ?? advertised(url),
        ...(proxyAddr !== undefined ? { proxyUrl: advertised(proxyAddr) } : {}),
        capacity: {
          memoryBytes: totalmem(),
          cpus: availableParallelism(),
          arch: cpu.arch,
          criuVersion: criu.version,
          cpuFlags: cpu.flags,
          runtimes: runsc ? ['runc', 'runsc'] : ['runc'],
        },
        leaseMs,
        warn,
      });
      fleetHooks.membership = membership;
    }
    if (opts.e2b) {
      e2b = await startE2bFront({
        controller,
        store,
        listen: opts.e2b.listen,
        templates: opts.e2b.templates ?? {},
        accessKey: () => secrets.agentTokenKey(),
        ...(proxyDomain !== undefined ? { domain: proxyDomain } : {}),
        hostPaths: [dataDir, stagingDir],
        logger: opts.logger ?? false,
      });
    }
    return {
      url,
      log,
      adminToken: admin.token,
      controller,
      store,
      vault,
      runtime,
      runsc,
      app,
      wake,
      meter,
      reconciled,
      e2b,
      reconfigure(s: LiveSettings) {
        log.level = s.logLevel;
        app.log.level = s.logLevel;
        policyDefaults.node = s.policyDefaults.node;
        policyDefaults.tenants = s.policyDefaults.tenants;
        controllerOpts.allowedSourceRoots = s.allowedSourceRoots;
        controllerOpts.defaultDiskBytes = s.defaultDiskBytes;
        controllerOpts.defaultEgress = s.defaultEgress;
        controllerOpts.keepCheckpoints = s.keepCheckpoints;
        controllerOpts.importLimits = s.importLimits;
        serverOpts.maxUploadBytes = s.maxUploadBytes;
        Object.assign(prices, priceSheet(s.prices));
      },
      async close() {
        // Stops renewing: a restart within the lease is seamless (docs/FLEET.md).
        await membership?.close();
        // Pages still streaming from the vault's page server: let them finish first.
        await controller.settleLazyRestores();
        await meter.close();
        await wake.close();
        await e2b?.close();
        await app.close();
        // What answered requests left running (removing a hibernated sandbox's container).
        await controller.settle();
        await images.close();
        await vault.close();
        s3?.destroy();
        await vaultLocks?.close();
        await store.close();
        await nodeLock?.release();
        secrets.close();
        await releaseStaging(stagingDir);
        // The node's cgroup folder, once its sandboxes' are gone (those still running keep it).
        if (nodeName !== undefined) await removeEmptyCgroup(cgroupParent);
        // Empty unless containers still run (their configs stay for runc exec after a restart).
        for (const d of [bundleDir, `${bundleDir}-runsc`])
          await rmdir(d).catch((e: unknown) => {
            if (errnoCode(e) !== 'ENOTEMPTY' && errnoCode(e) !== 'ENOENT') throw e;
          });
      },
    };
  } catch (e) {
    // Nothing else holds the database open: a failed start must not keep the process alive.
    clearInterval(earlyRenewal);
    await membership?.close().catch(() => undefined);
    await vaultLocks?.close().catch(() => undefined);
    await store.close().catch(() => undefined);
    await nodeLock?.release();
    throw e;
  }
}
