/**
 * What the default seccomp profile costs: the same sandbox life (create + start, an exec, a
 * checkpoint, a restore, and a syscall-heavy loop inside) on two RuncRuntimes, one with the
 * profile (dormant's default) and one without it (the peer), alternated so that the machine's
 * drift falls on both.
 */
import { mkdtemp, rm } from 'node:fs/promises';
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

export const confineSuite: BenchSuite = {
  name: 'confine',
  async run({ quick }) {
    const loadAtStart = loadavg()[0] ?? 0;
    const tmp = await mkdtemp(join(tmpdir(), 'dormant-bench-confine-'));
    const shm = await mkdtemp('/dev/shm/dormant-bench-confine-');
    const rootfs = join(tmp, 'rootfs');
    await buildBusyboxRootfs(rootfs, { 'srv/syscalls.py': SYSCALLS_PY });
    const runtimes = {
      profile: new RuncRuntime({ stateDir: join(tmp, 'with'), criuPath: '/usr/local/bin/criu' }),
      none: new RuncRuntime({
        stateDir: join(tmp, 'without'),
        criuPath: '/usr/local/bin/criu',
        seccomp: false,
      }),
    };
    const times: Record<'profile' | 'none', Record<string, number[]>> = { profile: {}, none: {} };
    const add = (k: 'profile' | 'none', what: string, ms: number) => (times[k][what] ??= []).push(ms);
    const rounds = quick ? 3 : 7;
    try {
      for (let i = 0; i < rounds; i++) {
        for (const k of i % 2 === 0 ? (['profile', 'none'] as const) : (['none', 'profile'] as const)) {
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
    const rows: BenchRow[] = Object.keys(times.profile).map((what) => ({
      name: what,
      dormant: median(times.profile[what]!),
      peer: median(times.none[what]!),
      peerName: 'no seccomp profile',
      unit: 'ms',
      better: 'lower',
    }));
    return {
      title: 'Confinement: the cost of the default seccomp profile',
      description: `The same busybox sandbox (python3 from a read-only /usr) created and started, an exec, 200,000 getppid calls inside, a runc checkpoint and a restore, ${rounds} rounds alternating a runtime with config/seccomp-default.json and one without; medians.`,
      rows,
      notes: [
        `Load average at the start: ${loadAtStart.toFixed(1)} on ${String(cpus().length)} cores. On this VM under load, runs of the same code differ by up to about 25% either way; the 200k-calls row is where a per-call cost of the filter would show.`,
      ],
    };
  },
};
