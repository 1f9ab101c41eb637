/**
 * `dormant doctor`: this node's capability matrix. Every row says supported, degraded or
 * missing, what was found, and what to do about it. A missing row that hibernate/resume
 * needs makes the whole report fail (the CLI exits 1).
 */
import { readFile } from 'node:fs/promises';
import { formatBytes } from '../domain/units.js';
import { versionAtLeast } from '../domain/version.js';
import {
  CRIU_INSTALL_HINT,
  MIN_CRIU_VERSION,
  criuCheck,
  criuEnvironment,
  criuFeature,
  criuVersion,
  locateCriu,
} from '../criu/criu.js';
import { runscFacts } from '../runtime/runsc.js';
import { lazyRestoreInUserNamespace } from '../runtime/userns.js';
import { run, which } from '../sys/exec.js';
import { cudaHelperCandidates, cudaInfo, locateCudaHelper } from '../sys/gpu.js';
import {
  cgroupFacts,
  cpuFacts,
  diskFacts,
  kernelRelease,
  nvidiaFacts,
  probeFreezer,
  userfaultfdFacts,
} from '../sys/node-facts.js';

export type RowStatus = 'supported' | 'degraded' | 'missing';

export interface DoctorRow {
  id: string;
  name: string;
  status: RowStatus;
  /** What was found, short. */
  value: string;
  detail?: string;
  /** What to do about a degraded or missing row. */
  fix?: string;
  /** Hibernate/resume cannot work without this row. */
  required: boolean;
}

export interface DoctorReport {
  ok: boolean;
  rows: DoctorRow[];
  /** Environment dormant adds to every criu call on this node. */
  criuEnv: Record<string, string>;
}

export interface DoctorOptions {
  env?: NodeJS.ProcessEnv;
  dataDir: string;
}

const SETUP = 'run scripts/setup.sh as root';
const MIN_FREE_BYTES = 1024 ** 3;
const LOW_FREE_BYTES = 10 * 1024 ** 3;

async function versionOf(path: string, args: string[], re: RegExp, env: NodeJS.ProcessEnv): Promise<string> {
  const r = await run(path, args, { timeoutMs: 15_000, env: { PATH: env.PATH } });
  return re.exec(`${r.stdout}\n${r.stderr}`)?.[1] ?? 'unknown';
}

async function isScriptSetting(path: string, variable: string): Promise<boolean> {
  try {
    const head = await readFile(path, { encoding: 'latin1' });
    return head.startsWith('#!') && head.includes(variable);
  } catch {
    return false;
  }
}

/** The prefix install records the package files it unpacked; their names carry versions. */
async function privatePackageVersion(pkg: string): Promise<string | undefined> {
  try {
    const list = await readFile('/opt/dormant/criu/.packages', 'utf8');
    return new RegExp(`^${pkg}_([^_]+)_`, 'm').exec(list)?.[1];
  } catch {
    return undefined;
  }
}

async function criuRows(
  env: NodeJS.ProcessEnv,
): Promise<{ rows: DoctorRow[]; criuEnv: Record<string, string> }> {
  const path = await locateCriu(env);
  if (path === undefined) {
    const where = env.DORMANT_CRIU
      ? `DORMANT_CRIU=${env.DORMANT_CRIU} is not executable`
      : 'criu is not on PATH';
    return {
      rows: [
        {
          id: 'criu',
          name: 'CRIU',
          status: 'missing',
          value: 'not found',
          detail: where,
          fix: CRIU_INSTALL_HINT,
          required: true,
        },
      ],
      criuEnv: {},
    };
  }
  const opts = { env: { PATH: env.PATH } };
  const version = await criuVersion(path, opts).catch((e: unknown) => `unusable (${String(e)})`);
  const rows: DoctorRow[] = [];
  const goodVersion = /^\d/.test(version) && versionAtLeast(version, MIN_CRIU_VERSION);
  rows.push({
    id: 'criu',
    name: 'CRIU',
    status: goodVersion ? 'supported' : 'missing',
    value: `${version} at ${path}`,
    ...(goodVersion
      ? {}
      : {
          detail: `dormant needs CRIU ${MIN_CRIU_VERSION} or newer: 3.17 cannot start on current kernels and 4.1 cannot dump TCP sockets on kernels >= 6.16`,
          fix: CRIU_INSTALL_HINT,
        }),
    required: true,
  });
  if (!goodVersion) return { rows, criuEnv: {} };

  const check = await criuCheck(path, opts);
  // The breakpoint warning has a row of its own below.
  const warnings = [
    ...new Set(
      check.output
        .split('\n')
        .filter((l) => /Warn|Error/.test(l) && !/Hardware breakpoints/.test(l))
        .map((l) => l.replace(/^\(\s*\d+\.\d+\)\s*/, '').trim()),
    ),
  ];
  rows.push({
    id: 'criu-check',
    name: 'criu check',
    status: check.ok ? 'supported' : 'missing',
    value: check.ok ? 'Looks good' : 'failed',
    ...(warnings.length > 0 || !check.ok
      ? { detail: check.ok ? warnings.join('; ') : check.output.slice(-1500) }
      : {}),
    ...(check.ok
      ? {}
      : {
          fix: 'read the output above; the kernel may lack CONFIG_CHECKPOINT_RESTORE or a feature criu needs',
        }),
    required: true,
  });

  const criuEnv = criuEnvironment(check);
  const wrapperApplies = await isScriptSetting(path, 'CRIU_FAULT');
  rows.push(
    check.hardwareBreakpointsWork
      ? {
          id: 'hw-breakpoints',
          name: 'hardware breakpoints',
          status: 'supported',
          value: 'working',
          required: false,
        }
      : {
          id: 'hw-breakpoints',
          name: 'hardware breakpoints',
          status: 'degraded',
          value: 'not working (a VM); fallback CRIU_FAULT=130 applied',
          detail:
            'criu would wait for a breakpoint trap that never comes; with CRIU_FAULT=130 it single-steps with PTRACE_SYSCALL instead (slightly slower dumps). ' +
            `dormant sets it on every criu and runc call; the criu on PATH ${wrapperApplies ? 'sets it too (so podman gets it)' : 'does not set it, so podman calls may hang'}`,
          ...(wrapperApplies
            ? {}
            : { fix: `${SETUP} to install a criu wrapper that exports CRIU_FAULT=130` }),
          required: false,
        },
  );

  const [uffd, dirty, uffdNode] = await Promise.all([
    criuFeature(path, 'uffd-noncoop', { ...opts, env: { ...opts.env, ...criuEnv } }),
    criuFeature(path, 'mem_dirty_track', { ...opts, env: { ...opts.env, ...criuEnv } }),
    userfaultfdFacts(),
  ]);
  rows.push({
    id: 'lazy-restore',
    name: 'lazy restore (userfaultfd)',
    status: uffd ? 'supported' : 'degraded',
    value: uffd ? `available (${uffdNode.detail})` : 'unavailable',
    ...(uffd
      ? {}
      : {
          detail: 'resume faults every page in eagerly (slower for large sandboxes)',
          fix: 'a kernel with CONFIG_USERFAULTFD',
        }),
    required: false,
  });
  // The default gives every sandbox a user namespace, in which CRIU's restored task opens the
  // userfaultfd itself: only with vm.unprivileged_userfaultfd = 1 (runtime/userns.ts).
  const usernsLazy = await lazyRestoreInUserNamespace();
  if (uffd)
    rows.push({
      id: 'lazy-restore-userns',
      name: 'lazy restore in user namespaces',
      status: usernsLazy === undefined ? 'supported' : 'degraded',
      value: usernsLazy === undefined ? 'available' : 'unavailable: such sandboxes resume eagerly',
      ...(usernsLazy === undefined
        ? {}
        : {
            detail: `${usernsLazy}; sandboxes without one (serve --no-user-namespace) resume lazily`,
            fix: 'sysctl -w vm.unprivileged_userfaultfd=1 (it lets every local user make a userfaultfd; sandboxes stay refused by seccomp)',
          }),
      required: false,
    });
  rows.push({
    id: 'soft-dirty',
    name: 'incremental checkpoints (soft-dirty)',
    status: dirty ? 'supported' : 'degraded',
    value: dirty ? 'available' : 'off',
    ...(dirty
      ? {}
      : {
          detail:
            'every hibernate writes the full memory image (the vault still deduplicates unchanged pages)',
          fix: 'a kernel with CONFIG_MEM_SOFT_DIRTY (often off in VM kernels)',
        }),
    required: false,
  });
  return { rows, criuEnv };
}

async function toolRow(
  env: NodeJS.ProcessEnv,
  spec: {
    id: string;
    name: string;
    program: string;
    args: string[];
    re: RegExp;
    required: boolean;
    fix: string;
    why: string;
  },
): Promise<DoctorRow> {
  const path = await which(spec.program, env.PATH);
  if (path === undefined) {
    return {
      id: spec.id,
      name: spec.name,
      status: 'missing',
      value: 'not found',
      detail: spec.why,
      fix: spec.fix,
      required: spec.required,
    };
  }
  let version = await versionOf(path, spec.args, spec.re, env).catch(() => 'unknown');
  if (version === 'unknown' && spec.program === 'checkpointctl')
    version = (await privatePackageVersion('checkpointctl')) ?? 'unknown';
  return {
    id: spec.id,
    name: spec.name,
    status: 'supported',
    value: `${version} at ${path}`,
    required: spec.required,
  };
}

/** The GPU rows: NVIDIA driver, the CUDA checkpoint API, and dormant's helper for it. */
export async function gpuRows(
  f: Awaited<ReturnType<typeof nvidiaFacts>>,
  env: NodeJS.ProcessEnv = process.env,
): Promise<DoctorRow[]> {
  const helper = await locateCudaHelper(env);
  const helperRow: DoctorRow = helper
    ? {
        id: 'cuda-helper',
        name: 'CUDA checkpoint helper',
        status: 'supported',
        value: `built at ${helper}`,
        required: false,
      }
    : {
        id: 'cuda-helper',
        name: 'CUDA checkpoint helper',
        status: 'missing',
        value: 'not built',
        detail: `looked in ${cudaHelperCandidates(env).join(', ')}`,
        fix: 'npm run build (or scripts/setup.sh, which installs it in /opt/dormant/bin); needs gcc',
        required: false,
      };
  if (f.driverVersion === undefined) {
    return [
      {
        id: 'nvidia',
        name: 'NVIDIA driver',
        status: 'missing',
        value: 'no NVIDIA driver',
        detail: 'GPU sandboxes cannot be created here; CPU sandboxes are unaffected',
        required: false,
      },
      {
        id: 'cuda-checkpoint',
        name: 'CUDA checkpoint API',
        status: 'missing',
        value: 'unavailable (no driver)',
        detail: 'GPU sandboxes with --gpu-policy checkpoint would be refused here',
        required: false,
      },
      helperRow,
    ];
  }
  const major = Number.parseInt(f.driverVersion, 10);
  const api = f.checkpointApi && major >= 570;
  let devices = '';
  if (helper) {
    devices = await cudaInfo(helper)
      .then((i) => i.devices.map((d) => `${d.name} (${formatBytes(d.memoryBytes)})`).join(', '))
      .catch(
        (e: unknown) => `the helper could not read the GPUs: ${e instanceof Error ? e.message : String(e)}`,
      );
  }
  return [
    {
      id: 'nvidia',
      name: 'NVIDIA driver',
      status: 'supported',
      value: `driver ${f.driverVersion}`,
      ...(f.libcuda || devices
        ? { detail: [f.libcuda && `libcuda at ${f.libcuda}`, devices].filter(Boolean).join('; ') }
        : {}),
      required: false,
    },
    {
      id: 'cuda-checkpoint',
      name: 'CUDA checkpoint API',
      status: api ? 'supported' : 'missing',
      value: api ? 'cuCheckpointProcess* in libcuda' : 'unavailable',
      ...(api
        ? {}
        : {
            detail: `driver ${f.driverVersion}${f.checkpointApi ? '' : ' exports no cuCheckpointProcessLock'}; GPU sandboxes keep running or are archived, never hibernated`,
            fix: 'NVIDIA driver 570 or newer for the cuCheckpointProcess* driver API',
          }),
      required: false,
    },
    helperRow,
  ];
}

/** gVisor, the optional second runtime: its version and the platforms it can use here. */
function runscRow(f: Awaited<ReturnType<typeof runscFacts>>): DoctorRow {
  return {
    id: 'runsc',
    name: 'runsc (gVisor)',
    status: f.version === undefined ? 'missing' : 'supported',
    value: f.version === undefined ? 'not installed' : `${f.version}, platforms: ${f.platforms.join(', ')}`,
    detail:
      'optional: sandboxes created with --runtime runsc run on its user-space kernel (docs/RUNTIME.md); ' +
      (f.platforms.includes('kvm')
        ? '/dev/kvm is here: runtime.runscPlatform "kvm" is fastest'
        : 'no /dev/kvm: ptrace'),
    ...(f.version === undefined ? { fix: `${SETUP} (installs runsc)` } : {}),
    required: false,
  };
}

export async function runDoctor(opts: DoctorOptions): Promise<DoctorReport> {
  const env = opts.env ?? process.env;
  const [cpu, cgroups, freezer, criu, disk, gpu, runsc, runcRow, iptRow, podmanRow, cpctlRow] =
    await Promise.all([
      cpuFacts(),
      cgroupFacts(),
      probeFreezer(),
      criuRows(env),
      diskFacts(opts.dataDir),
      nvidiaFacts().then((f) => gpuRows(f, env)),
      runscFacts(),
      toolRow(env, {
        id: 'runc',
        name: 'runc',
        program: 'runc',
        args: ['--version'],
        re: /runc version (\S+)/,
        required: true,
        fix: `${SETUP} (installs Debian's runc)`,
        why: 'sandboxes run as OCI containers on runc',
      }),
      toolRow(env, {
        id: 'iptables',
        name: 'iptables-restore',
        program: 'iptables-restore',
        args: ['--version'],
        re: /v(\d+(?:\.\d+)+)/,
        required: true,
        fix: `${SETUP} (installs Debian's iptables)`,
        why: "CRIU locks a sandbox's network namespace with iptables-restore while it dumps",
      }),
      toolRow(env, {
        id: 'podman',
        name: 'podman',
        program: 'podman',
        args: ['--version'],
        re: /version (\S+)/,
        required: false,
        fix: 'optional, used to compare with and import from podman: apt-get install podman/trixie (pulls trixie libc6 and systemd)',
        why: 'optional: checkpoint import/export works without it',
      }),
      toolRow(env, {
        id: 'checkpointctl',
        name: 'checkpointctl',
        program: 'checkpointctl',
        args: ['--version'],
        re: /version (\S+)/,
        required: false,
        fix: `${SETUP} (installs checkpointctl next to criu)`,
        why: 'optional: the reference reader dormant compares its checkpoint inspection with',
      }),
    ]);

  const archOk = cpu.arch === 'x64' || cpu.arch === 'arm64';
  const rows: DoctorRow[] = [
    {
      id: 'platform',
      name: 'architecture / kernel',
      status: archOk ? 'supported' : 'missing',
      value: `${cpu.arch === 'x64' ? 'x86_64' : cpu.arch}, Linux ${kernelRelease()}`,
      detail: `${cpu.cores} x ${cpu.model}`,
      ...(archOk ? {} : { fix: 'dormant supports x86_64 and arm64' }),
      required: true,
    },
    {
      id: 'cgroups',
      name: 'cgroups',
      status: 'supported',
      value:
        cgroups.mode === 'hybrid' ? `v1 + cgroup2 at ${cgroups.unifiedMount ?? '?'} (hybrid)` : cgroups.mode,
      ...(cgroups.v1Controllers.length > 0
        ? { detail: `v1 controllers: ${cgroups.v1Controllers.join(', ')}` }
        : {}),
      required: true,
    },
    {
      id: 'freezer',
      name: 'freezer',
      status: freezer.tested ? 'supported' : 'missing',
      value: freezer.kind === undefined ? 'none' : `cgroup ${freezer.kind}`,
      detail: freezer.detail,
      ...(freezer.tested
        ? {}
        : { fix: 'mount the v1 freezer controller or use a cgroup v2 kernel (4.19+ has cgroup.freeze)' }),
      required: true,
    },
    ...criu.rows,
    runcRow,
    runscRow(runsc),
    iptRow,
    podmanRow,
    cpctlRow,
    ...gpu,
    {
      id: 'data-dir',
      name: 'data directory',
      status:
        disk.freeBytes < MIN_FREE_BYTES
          ? 'missing'
          : disk.freeBytes < LOW_FREE_BYTES
            ? 'degraded'
            : 'supported',
      value: `${formatBytes(disk.freeBytes)} free of ${formatBytes(disk.totalBytes)} at ${opts.dataDir}`,
      ...(disk.measuredAt !== opts.dataDir
        ? { detail: `does not exist yet; measured at ${disk.measuredAt}` }
        : {}),
      ...(disk.freeBytes < LOW_FREE_BYTES
        ? {
            fix: `free space or set DORMANT_DATA_DIR to a larger filesystem (checkpoints need about the sandboxes' memory size)`,
          }
        : {}),
      required: true,
    },
  ];
  const ok = rows.every((r) => !r.required || r.status !== 'missing');
  return { ok, rows, criuEnv: criu.criuEnv };
}
