/**
 * What the default confinement costs: the same sandbox life (create + start, an exec, a
 * checkpoint, a restore, and a syscall-heavy loop inside) on two RuncRuntimes alternated so that
 * the machine's drift falls on both: with the seccomp profile against without (`confine`), with
 * a user namespace against without (`userns`).
 */
import { chmod, mkdtemp, rm } from 'node:fs/promises';
import { cpus, loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { RuncRuntime } from '../runtime/runc.js';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';
import type { BenchRow, BenchSuite } from './harness.js';
import { median, timed } from './harness.js';

/** 200k getppid calls through libc: where a filter's per-syscall cost would show. */
const SYSCALLS_PY = `
import ctypes, time
libc = ctypes.CDLL(None)
t = time.perf_counter()
for _ in range(200000): libc.getppid()
print(time.perf_counter() - t)
`;

/**
 * The same sandbox life on two runtimes, alternated round by round: create + start, an exec,
 * the syscall loop, a checkpoint to tmpfs and a restore. Medians per step, `dormant` against
 * `peer`.
 */
async function compareRuntimes(
  label: string,
  quick: boolean,
  make: (tmp: string) => { dormant: RuncRuntime; peer: RuncRuntime },
): Promise<{ rows: Record<string, { dormant: number; peer: number }>; rounds: number }> {
  const tmp = await mkdtemp(join(tmpdir(), `dormant-bench-${label}-`));
  const shm = await mkdtemp(`/dev/shm/dormant-bench-${label}-`);
  // Searchable by others: a sandbox's mapped root walks through it (user namespaces).
  await chmod(tmp, 0o711);
  const rootfs = join(tmp, 'rootfs');
  await buildBusyboxRootfs(rootfs, { 'srv/syscalls.py': SYSCALLS_PY });
  const runtimes = make(tmp);
  const times: Record<'dormant' | 'peer', Record<string, number[]>> = { dormant: {}, peer: {} };
  const add = (k: 'dormant' | 'peer', what: string, ms: number) => (times[k][what] ??= []).push(ms);
  const rounds = quick ? 3 : 7;
  try {
    for (let i = 0; i < rounds; i++) {
      for (const k of i % 2 === 0 ? (['dormant', 'peer'] as const) : (['peer', 'dormant'] as const)) {
        const rt = runtimes[k];
        const id = `bench-${k}-${i}`;
        add(
          k,
          'create + start',
          await timed(async () => {
            await rt.create({
              id,
              rootfs,
              args: ['sleep', '100000'],
              readonlyBinds: [{ source: '/usr', destination: '/usr' }],
            });
            await rt.start(id);
          }),
        );
        add(k, 'exec true', await timed(() => rt.exec(id, ['true'])));
        const r = await rt.exec(id, ['/usr/bin/python3', '/srv/syscalls.py']);
        add(k, '200k syscalls inside', Number(r.stdout.trim()) * 1000);
        const imagesDir = join(shm, id);
        add(
          k,
          'checkpoint',
          await timed(() => rt.checkpoint(id, { imagesDir, workDir: join(tmp, `w-${id}`) })),
        );
        add(k, 'restore', await timed(() => rt.restore(id, { imagesDir, workDir: join(tmp, `r-${id}`) })));
        await rt.destroy(id);
        await rm(imagesDir, { recursive: true, force: true });
      }
    }
  } finally {
    for (const rt of Object.values(runtimes)) for (const id of await rt.list()) await rt.destroy(id);
    await rm(tmp, { recursive: true, force: true });
    await rm(shm, { recursive: true, force: true });
  }
  const rows: Record<string, { dormant: number; peer: number }> = {};
  for (const what of Object.keys(times.dormant))
    rows[what] = { dormant: median(times.dormant[what]!), peer: median(times.peer[what]!) };
  return { rows, rounds };
}

function asRows(rows: Record<string, { dormant: number; peer: number }>, peerName: string): BenchRow[] {
  return Object.entries(rows).map(([name, r]) => ({ name, ...r, peerName, unit: 'ms', better: 'lower' }));
}

const CRIU_PATH = '/usr/local/bin/criu';

export const confineSuite: BenchSuite = {
  name: 'confine',
  async run({ quick }) {
    const loadAtStart = loadavg()[0] ?? 0;
    const { rows, rounds } = await compareRuntimes('confine', quick, (tmp) => ({
      dormant: new RuncRuntime({ stateDir: join(tmp, 'with'), criuPath: CRIU_PATH }),
      peer: new RuncRuntime({ stateDir: join(tmp, 'without'), criuPath: CRIU_PATH, seccomp: false }),
    }));
    return {
      title: 'Confinement: the cost of the default seccomp profile',
      description: `The same busybox sandbox (python3 from a read-only /usr) created and started, an exec, 200,000 getppid calls inside, a runc checkpoint and a restore, ${rounds} rounds alternating a runtime with config/seccomp-default.json and one without; medians.`,
      rows: asRows(rows, 'no seccomp profile'),
      notes: [
        `Load average at the start: ${loadAtStart.toFixed(1)} on ${String(cpus().length)} cores. On this VM under load, runs of the same code differ by up to about 25% either way; the 200k-calls row is where a per-call cost of the filter would show.`,
      ],
    };
  },
};

export const usernsSuite: BenchSuite = {
  name: 'userns',
  async run({ quick }) {
    const loadAtStart = loadavg()[0] ?? 0;
    const { rows, rounds } = await compareRuntimes('userns', quick, (tmp) => ({
      dormant: new RuncRuntime({ stateDir: join(tmp, 'with'), criuPath: CRIU_PATH, userNamespace: true }),
      peer: new RuncRuntime({ stateDir: join(tmp, 'without'), criuPath: CRIU_PATH }),
    }));
    return {
      title: "User namespaces: the cost of the daemon's default",
      description: `The same busybox sandbox (python3 from a read-only /usr, the seccomp profile on both) created and started, an exec, 200,000 getppid calls inside, a runc checkpoint to tmpfs and an eager restore, ${rounds} rounds alternating a runtime that gives each sandbox a user namespace (the daemon's default) and one that gives none; medians.`,
      rows: asRows(rows, 'no user namespace'),
      notes: [
        `Load average at the start: ${loadAtStart.toFixed(1)} on ${String(cpus().length)} cores.`,
        'Where the extra time goes (runtime/userns.ts): create mounts the rootfs idmapped through a short-lived process in a new user namespace and adopts the network namespace runc made (ip netns attach, then the veth wired); restore chowns the images to the mapped root and rewires the new network namespace CRIU made.',
      ],
    };
  },
};
