/**
 * gVisor (runsc) against runc, so users can choose: hibernate and resume of one sandbox
 * holding N MiB on runsc, against raw `runsc checkpoint` / `runsc restore` of the same sandbox
 * (no vault) and against dormant on runc; and the cost of gVisor's user-space kernel for work
 * that is mostly system calls (files, processes), the same commands on each runtime.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';
import type { RuntimeKind } from '../runtime/runtime.js';
import type { BenchRow, BenchSuite } from './harness.js';
import { median } from './harness.js';
import { startTestDaemon } from '../api/testing/daemon.js';
import { eventually, httpGet } from '../api/testing/host.js';
import { pythonServer } from '../api/testing/servers.js';

const HOLDER = pythonServer({
  setup: `
import os, sys
mib = int(sys.argv[1])
# Half random, half a repeated pattern per MiB, as the sandbox suite's holder.
blob = bytearray()
for i in range(mib):
    blob += os.urandom(1 << 19) + bytes([i & 255]) * (1 << 19)`,
  answer: 'str(len(blob))',
});

/** 5,000 small files written, then each stat-ed and read back: system calls, little compute. */
const FILES = `
import os
d = '/tmp/bench-files'
os.makedirs(d, exist_ok=True)
for i in range(5000):
    with open(f'{d}/{i}', 'w') as f:
        f.write('x' * 100)
for i in range(5000):
    os.stat(f'{d}/{i}')
    with open(f'{d}/{i}') as f:
        f.read()
for i in range(5000):
    os.unlink(f'{d}/{i}')
`;

/** 200 processes started and waited for, one after the other (what a small build does most). */
const SPAWN = 'i=0; while [ $i -lt 200 ]; do /bin/true; i=$((i+1)); done';

export const runscSuite: BenchSuite = {
  name: 'runsc',
  async run({ quick }) {
    const sizes = quick ? [64] : [64, 256];
    const reps = quick ? 1 : 3;
    const dir = await mkdtemp('/tmp/dormant-bench-runsc-');
    const rows: BenchRow[] = [];
    const notes: string[] = [];
    // Eager resume on both runtimes: gVisor has no lazy restore, so runc's is not the peer.
    const { daemon: d } = await startTestDaemon({ dataDir: join(dir, 'data'), lazyRestore: false });
    const listening = (id: string): Promise<true> =>
      eventually(
        'the holder to listen',
        async () => {
          if ((await d.controller.listensOn(id, 8080)) !== true) throw new Error('not yet');
          return true as const;
        },
        120_000,
      );
    try {
      const gvisor = d.runsc;
      if (gvisor === undefined) throw new Error('runsc is not installed (scripts/setup.sh)');
      await buildBusyboxRootfs(join(dir, 'rootfs'), { 'srv/holder.py': HOLDER });
      const create = (runtime: RuntimeKind, command: string[], mib: number) =>
        d.controller.create({
          tenant: 'bench',
          admin: true,
          rootfs: join(dir, 'rootfs'),
          command,
          ports: [{ port: 8080, public: false }],
          memoryBytes: (mib + 512) * 1024 * 1024,
          runtime,
        });
      for (const mib of sizes) {
        const hib = new Map<RuntimeKind, number>();
        const res = new Map<RuntimeKind, number>();
        let rawCk = 0;
        let rawRs = 0;
        for (const runtime of ['runsc', 'runc'] as const) {
          const sb = await create(runtime, ['/usr/bin/python3', '/srv/holder.py', String(mib)], mib);
          // Listening is read without connecting: gVisor (this build) cannot checkpoint a
          // sandbox with a TCP connection open or closing (docs/RUNTIME.md).
          await listening(sb.id);
          if (runtime === 'runsc') {
            const rt = gvisor;
            const images = join('/dev/shm', `dormant-bench-${sb.id}`);
            let t0 = performance.now();
            await rt.checkpoint(sb.id, {
              imagesDir: join(images, 'img'),
              workDir: join(images, 'work'),
            });
            rawCk = performance.now() - t0;
            t0 = performance.now();
            await rt.restore(sb.id, {
              imagesDir: join(images, 'img'),
              workDir: join(images, 'work2'),
            });
            rawRs = performance.now() - t0;
            await rm(images, { recursive: true, force: true });
            await listening(sb.id);
          }
          let t0 = performance.now();
          await d.controller.hibernate(sb.id);
          hib.set(runtime, performance.now() - t0);
          t0 = performance.now();
          await d.controller.resume(sb.id);
          res.set(runtime, performance.now() - t0);
          // Its memory came back whole: the holder answers its size.
          const answer = await eventually('holder', () => httpGet(sb.address!, 8080), 60_000);
          if (answer.trim() !== String(mib * 1024 * 1024))
            throw new Error(`${runtime} ${mib} MiB: the holder answered ${answer}`);
          const ck = (await d.store.listCheckpoints({ sandboxId: sb.id }))[0];
          notes.push(
            `${mib} MiB on ${runtime}: checkpoint ${((ck?.logicalBytes ?? 0) / 1024 ** 2).toFixed(0)} MiB logical, ${((ck?.storedBytes ?? 0) / 1024 ** 2).toFixed(0)} MiB stored.`,
          );
          await d.controller.remove(sb.id);
        }
        const ms = (n: number | undefined): number => Math.round(n ?? 0);
        rows.push(
          {
            name: `hibernate on runsc, ${mib} MiB resident`,
            dormant: ms(hib.get('runsc')),
            peer: ms(rawCk),
            peerName: 'runsc checkpoint',
            unit: 'ms',
            better: 'lower',
          },
          {
            name: `resume on runsc, ${mib} MiB resident`,
            dormant: ms(res.get('runsc')),
            peer: ms(rawRs),
            peerName: 'runsc restore',
            unit: 'ms',
            better: 'lower',
          },
          {
            name: `hibernate, runsc vs runc, ${mib} MiB resident`,
            dormant: ms(hib.get('runsc')),
            peer: ms(hib.get('runc')),
            peerName: 'dormant on runc',
            unit: 'ms',
            better: 'lower',
          },
          {
            name: `resume (eager), runsc vs runc, ${mib} MiB resident`,
            dormant: ms(res.get('runsc')),
            peer: ms(res.get('runc')),
            peerName: 'dormant on runc',
            unit: 'ms',
            better: 'lower',
          },
        );
      }

      // System-call-heavy work: the same commands through exec on each runtime.
      const took = new Map<string, number>();
      for (const runtime of ['runsc', 'runc'] as const) {
        const sb = await create(runtime, ['sleep', '3600'], 256);
        for (const [what, args] of [
          ['files', ['/usr/bin/python3', '-c', FILES]],
          ['spawn', ['sh', '-c', SPAWN]],
        ] as const) {
          const rt = runtime === 'runsc' ? gvisor : d.runtime;
          const times: number[] = [];
          for (let i = 0; i < reps; i++) {
            const t0 = performance.now();
            const r = await rt.exec(sb.id, args, { timeoutMs: 300_000 });
            if (r.exitCode !== 0) throw new Error(`${runtime} ${what}: exit ${r.exitCode}: ${r.stderr}`);
            times.push(performance.now() - t0);
          }
          took.set(`${runtime} ${what}`, median(times));
        }
        await d.controller.remove(sb.id);
      }
      rows.push(
        {
          name: '5,000 small files written, stat-ed, read, removed (python, via exec)',
          dormant: Math.round(took.get('runsc files')!),
          peer: Math.round(took.get('runc files')!),
          peerName: 'runc',
          unit: 'ms',
          better: 'lower',
        },
        {
          name: '200 processes started one after another (sh loop of /bin/true, via exec)',
          dormant: Math.round(took.get('runsc spawn')!),
          peer: Math.round(took.get('runc spawn')!),
          peerName: 'runc',
          unit: 'ms',
          better: 'lower',
        },
      );
      notes.push(
        "gVisor compresses its state file itself (its logical size above is about what the vault stores of runc's checkpoint); the vault's zstd then finds nothing to gain, so runsc's stored size equals its logical size.",
        `Each exec-timed row is the median of ${reps} and includes one \`runsc exec\` / \`runc exec\` (a few hundred ms on runsc's ptrace platform).`,
      );
    } finally {
      for (const s of await d.controller.list()) await d.controller.remove(s.id).catch(() => undefined);
      await d.close();
      await rm(dir, { recursive: true, force: true });
    }
    return {
      title: 'gVisor (runsc) against runc',
      description:
        "The \"dormant\" column is the sandbox on gVisor (runsc, ptrace platform, bookworm's 2022-12 build). Hibernate and resume: one sandbox running a python server that holds N MiB (as the sandbox suite's), hibernated once fresh and resumed eagerly (gVisor has no lazy restore, so runc's sandbox resumes eagerly too), against raw `runsc checkpoint` then `runsc restore` of the same sandbox with its state file on /dev/shm (through the runtime adapter, no vault), and against the same on runc through dormant. System-call-heavy work: the same command run through exec in a sandbox on each runtime.",
      rows,
      notes,
    };
  },
};
