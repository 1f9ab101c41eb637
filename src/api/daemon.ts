/**
 * `dormant serve`: the daemon on its embedded defaults. SQLite state, the local vault and a
 * master key under the data directory, the runc runtime, CRIU staging in /dev/shm, and the
 * HTTP API. On start it reconciles every sandbox with what really exists.
 */
import { createHash } from 'node:crypto';
import { chmod, mkdir, rmdir } from 'node:fs/promises';
import { errnoCode } from '../domain/errors.js';
import { join, resolve } from 'node:path';
import type { FastifyInstance } from 'fastify';
import { criuFeature, getCriu } from '../criu/criu.js';
import { cgroupUsage } from '../sys/cgroup.js';
import type { GpuNode } from '../control/gpu.js';
import { cpuFacts, diskFacts, userfaultfdFacts } from '../sys/node-facts.js';
import { SqliteStateStore } from '../state/sqlite.js';
import { TenantSecrets, openVault, type Vault } from '../vault/index.js';
import { RuncRuntime, loadSeccompProfile } from '../runtime/runc.js';
import { prepareStaging, privateFolder, releaseStaging } from '../runtime/staging.js';
import type { ReadonlyBind } from '../runtime/runtime.js';
import { SandboxController, systemClock, type Clock, type ControllerOptions } from '../control/sandboxes.js';
import { TrackingController } from '../control/activity.js';
import { startWakeServices, type PolicyConfig, type ProxyConfig, type WakeServices } from './wake.js';
import { ADMIN_TENANT, ensureAdminToken, hashToken } from './auth.js';
import { buildServer } from './server.js';
import { registerCostRoutes } from './routes-cost.js';
import { Meter, priceSheet } from '../control/meter.js';
import type { PriceSheet } from '../domain/cost.js';
import { formatTimings, type OperationTimings } from '../domain/timings.js';

export interface DaemonOptions {
  dataDir: string;
  /** host:port; port 0 picks a free one. Default 127.0.0.1:7420. */
  listen?: string;
  masterKeyFile?: string;
  /** Read-only host folders mounted into every sandbox (tests use /usr for python3). */
  readonlyBinds?: ReadonlyBind[];
  /** Disk quota of a sandbox's writable layer when its create names none. Default 10 GiB. */
  defaultDiskBytes?: number;
  /** Host folders a tenant's rootfs, image and archive paths may come from; empty: none (admins: any). */
  allowedSourceRoots?: string[];
  /** A seccomp profile file (OCI `linux.seccomp` JSON) instead of config/seccomp-default.json. */
  seccompProfile?: string;
  /** An AppArmor profile loaded on the host, for every sandbox (ignored where the host has no AppArmor). */
  apparmorProfile?: string;
  clock?: Clock;
  logger?: boolean;
  /** Printed warnings (master key generated, ...). Default: stderr. */
  warn?: (message: string) => void;
  /** The price sheet (defaults derived from this node's size; docs/COST.md). */
  prices?: Partial<PriceSheet>;
  /** How often the meter samples each sandbox's cgroup. Default 15 s. */
  meterIntervalMs?: number;
  /**
   * Resume hibernated sandboxes with CRIU lazy pages (userfaultfd). Default true; on a node
   * without userfaultfd (or CRIU's support for it) resumes are eager, with one warning.
   */
  lazyRestore?: boolean;
  /**
   * With lazy restore, serve the pages straight from the vault (default true); false: the
   * pages images go to staging and CRIU's lazy-pages daemon reads them there.
   */
  servePagesFromVault?: boolean;
  /** Only checkpoints bigger than this are served from the vault (default 256 MiB; 0: all). */
  pagesFromVaultAboveBytes?: number;
  /**
   * Whether lazy restore works on this node: undefined when it does, else why not. Default:
   * userfaultfd in the kernel and `criu check --feature uffd-noncoop` (what `dormant doctor` reports).
   */
  lazyRestoreProbe?: () => Promise<string | undefined>;
  /** How long CRIU's dump may run before it is ended as hung. Default 120 s. */
  checkpointTimeoutMs?: number;
  /**
   * Step timings of every hibernate, resume and fork. Default: printed to stderr when the
   * environment variable DORMANT_DEBUG contains `timings`, else dropped.
   */
  onTimings?: (t: OperationTimings) => void;
  /** Fault injection for crash tests. */
  failAt?: (step: string) => void;
  /** Caps on what an imported archive may unpack to (defaults in checkpoint/archive.ts). */
  importLimits?: ControllerOptions['importLimits'];
  /** The wake proxy (default: on, API port + 1); false: none. */
  proxy?: ProxyConfig | false;
  /** The idle policy loop (default: every 5 s); false: none. */
  policy?: PolicyConfig | false;
  /** This node's GPUs (tests describe one they do not run on). Default: the real node. */
  gpu?: GpuNode;
}

export interface Daemon {
  url: string;
  adminToken: string;
  controller: SandboxController;
  store: SqliteStateStore;
  vault: Vault;
  runtime: RuncRuntime;
  app: FastifyInstance;
  /** The wake proxy and the policy loop, when running. */
  wake: WakeServices;
  reconciled: { id: string; from: string; to: string }[];
  meter: Meter;
  close(): Promise<void>;
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
): Promise<string | undefined> {
  const uffd = await userfaultfdFacts();
  if (!uffd.available) return uffd.detail;
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

export async function startDaemon(opts: DaemonOptions): Promise<Daemon> {
  const warn = opts.warn ?? ((m: string) => process.stderr.write(`dormant: warning: ${m}\n`));
  // First of all, before the database is even opened: what a daemon killed mid-operation left
  // in staging (plaintext CRIU images of a hibernate that never committed, a checkpoint
  // fetched for a resume) is wiped.
  const stagingDir = stagingDirFor(opts.dataDir);
  await prepareStaging(stagingDir);
  // The OCI configs of containers that still run are kept (runc exec reads them); those of
  // sandboxes gone are removed once the runtime is up.
  const bundleDir = bundleDirFor(opts.dataDir);
  await privateFolder(bundleDir);
  await mkdir(opts.dataDir, { recursive: true, mode: 0o700 });
  // Private whatever an older version (or the operator's mkdir) made it: it holds tenant data.
  await chmod(opts.dataDir, 0o700);
  const store = new SqliteStateStore(join(opts.dataDir, 'state.db'));
  const admin = await ensureAdminToken(join(opts.dataDir, 'admin-token'));
  if (!store.listTokens().some((t) => t.hash === hashToken(admin.token))) {
    store.insertToken({
      hash: hashToken(admin.token),
      tenant: ADMIN_TENANT,
      admin: true,
      createdAt: Date.now(),
    });
  }
  const masterKey = {
    file: opts.masterKeyFile ?? process.env.DORMANT_MASTER_KEY_FILE ?? join(opts.dataDir, 'master.key'),
  };
  const vault = await openVault({ dir: join(opts.dataDir, 'vault'), masterKey, onWarning: warn });
  // --env values are sealed in the database with the tenant's key from the vault.
  const secrets = await TenantSecrets.open({ store: vault.store, masterKey });
  const criu = await getCriu();
  const cpu = await cpuFacts();
  const runtime = new RuncRuntime({
    stateDir: join(opts.dataDir, 'runtime'),
    criuPath: criu.path,
    criuEnv: criu.env,
    bundleDir,
    ...(opts.checkpointTimeoutMs !== undefined ? { checkpointTimeoutMs: opts.checkpointTimeoutMs } : {}),
    ...(opts.seccompProfile !== undefined ? { seccomp: loadSeccompProfile(opts.seccompProfile) } : {}),
    ...(opts.apparmorProfile !== undefined ? { apparmorProfile: opts.apparmorProfile } : {}),
  });
  await runtime.dropStaleConfigs();
  const controller = new TrackingController({
    store,
    runtime,
    vault,
    stagingDir,
    secrets,
    imageCacheDir: join(opts.dataDir, 'images'),
    ...(opts.readonlyBinds ? { readonlyBinds: opts.readonlyBinds } : {}),
    ...(opts.defaultDiskBytes !== undefined ? { defaultDiskBytes: opts.defaultDiskBytes } : {}),
    ...(opts.allowedSourceRoots ? { allowedSourceRoots: opts.allowedSourceRoots } : {}),
    ...(opts.clock ? { clock: opts.clock } : {}),
    ...(opts.failAt ? { failAt: opts.failAt } : {}),
    ...(opts.importLimits ? { importLimits: opts.importLimits } : {}),
    lazyRestore: opts.lazyRestore !== false,
    ...(opts.servePagesFromVault === false ? { servePagesFromVault: false } : {}),
    ...(opts.pagesFromVaultAboveBytes !== undefined
      ? { pagesFromVaultAboveBytes: opts.pagesFromVaultAboveBytes }
      : {}),
    lazyRestoreProbe: opts.lazyRestoreProbe ?? (() => lazyRestoreProblem(criu.path, criu.env)),
    warn,
    ...(opts.gpu ? { gpu: opts.gpu } : {}),
    ...(opts.onTimings
      ? { onTimings: opts.onTimings }
      : /(^|,)timings(,|$)/.test(process.env.DORMANT_DEBUG ?? '')
        ? {
            onTimings: (t: OperationTimings) =>
              process.stderr.write(`dormant: timings: ${formatTimings(t)}\n`),
          }
        : {}),
    // runc puts each sandbox in <cgroupParent>/<id>; the runtime's default parent is /dormant.
    usage: (id) => cgroupUsage(`/dormant/${id}`),
    platform: async () => ({ arch: cpu.arch, criuVersion: criu.version, cpuFlags: cpu.flags }),
  });
  // Rows from before sealing: their values sealed now, and the database rewritten so the old
  // pages and WAL frames holding them in clear are gone from its files.
  if ((await controller.sealStoredEnv((env) => TenantSecrets.isSealed(env))) > 0) store.compact();
  const reconciled = await controller.reconcile();
  const app = buildServer({
    controller,
    store,
    checkpointVault: vault,
    logger: opts.logger ?? false,
    hostPaths: [opts.dataDir, stagingDir],
  });
  const meter = new Meter({
    source: controller,
    store,
    clock: opts.clock ?? systemClock,
    prices: priceSheet(opts.prices),
    intervalMs: opts.meterIntervalMs ?? 15_000,
    freeDiskBytes: async () => (await diskFacts(opts.dataDir)).freeBytes,
    attribution: () => vault.attribution(),
  });
  registerCostRoutes(app, meter);
  meter.start();
  const wake = await startWakeServices({
    controller,
    store,
    app,
    clock: opts.clock ?? systemClock,
    dataDir: opts.dataDir,
    apiListen: opts.listen ?? '127.0.0.1:7420',
    ...(opts.proxy !== undefined ? { proxy: opts.proxy } : {}),
    ...(opts.policy !== undefined ? { policy: opts.policy } : {}),
  });
  const { host, port } = parseListen(opts.listen ?? '127.0.0.1:7420');
  await app.listen({ host, port });
  const addr = app.server.address();
  const url =
    typeof addr === 'object' && addr
      ? `http://${host.includes(':') ? `[${host}]` : host}:${addr.port}`
      : `http://${host}:${port}`;
  return {
    url,
    adminToken: admin.token,
    controller,
    store,
    vault,
    runtime,
    app,
    wake,
    meter,
    reconciled,
    async close() {
      // Pages still streaming from the vault's page server: let them finish first.
      await controller.settleLazyRestores();
      await meter.close();
      await wake.close();
      await app.close();
      // What answered requests left running (removing a hibernated sandbox's container).
      await controller.settle();
      await vault.close();
      store.close();
      secrets.close();
      await releaseStaging(stagingDir);
      // Empty unless containers still run (their configs stay for runc exec after a restart).
      await rmdir(bundleDir).catch((e: unknown) => {
        if (errnoCode(e) !== 'ENOTEMPTY' && errnoCode(e) !== 'ENOENT') throw e;
      });
    },
  };
}
