/**
 * Hibernate and resume of one sandbox against the same runc checkpoint / restore without the
 * vault (images on tmpfs), at several sizes of resident memory. The difference is what
 * dormant's vault (chunking, compression, encryption, fsync) and bookkeeping cost.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { stagingDirFor } from '../daemon/daemon.js';
import { SandboxController } from '../control/sandboxes.js';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';
import { formatTimings, type OperationTimings } from '../domain/timings.js';
import type { BenchRow, BenchSuite } from './harness.js';
import { startTestDaemon } from '../api/testing/daemon.js';
import { eventually, httpGet } from '../api/testing/host.js';
import { pythonServer } from '../api/testing/servers.js';

const HOLDER = pythonServer({
  setup: `
import os, sys
mib = int(sys.argv[1])
# Half random, half a repeated pattern per MiB: partly compressible, like a real heap.
blob = bytearray()
for i in range(mib):
    blob += os.urandom(1 << 19) + bytes([i & 255]) * (1 << 19)`,
  answer: 'str(len(blob))',
});

/** Once the holder in the sandbox at `host` answers (polled every 100 ms). */
const answers = (host: string): Promise<string> => eventually('holder', () => httpGet(host, 8080), 120_000);

/** The steps of one operation, for a note: `freeze 60@1, runc checkpoint 850@62, ...`. */
function stepLine(t: OperationTimings): string {
  process.stderr.write(`bench: ${formatTimings(t)}\n`);
  return t.steps.map((s) => `${s.step} ${Math.round(s.ms)}@${Math.round(s.startMs)}`).join(', ');
}

export const sandboxSuite: BenchSuite = {
  name: 'sandbox',
  async run({ quick }) {
    // DORMANT_BENCH_SIZES=256 (MiB, comma-separated) times only those sizes, for a quick look.
    const only = process.env.DORMANT_BENCH_SIZES?.split(',')
      .map(Number)
      .filter((n) => n > 0);
    const sizes = only?.length ? only : quick ? [64] : [64, 256, 1024];
    const dir = await mkdtemp('/tmp/dormant-bench-sandbox-');
    const rows: BenchRow[] = [];
    const notes: string[] = [];
    const { daemon: d } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      // The daemon's controller resumes eagerly; the second one below lazily.
      lazyRestore: false,
    });
    // A second controller over the same store, runtime and vault that resumes lazily.
    const lazy = new SandboxController({
      store: d.store,
      runtime: d.runtime,
      vault: d.vault,
      stagingDir: stagingDirFor(join(dir, 'data')),
      lazyRestore: true,
      readonlyBinds: [{ source: '/usr', destination: '/usr' }],
    });
    try {
      await buildBusyboxRootfs(join(dir, 'rootfs'), { 'srv/holder.py': HOLDER });
      for (const mib of sizes) {
        const sb = await d.controller.create({
          tenant: 'bench',
          // The operator's own bench: its rootfs is a host folder no tenant may name.
          admin: true,
          rootfs: join(dir, 'rootfs'),
          command: ['/usr/bin/python3', '/srv/holder.py', String(mib)],
          ports: [{ port: 8080, public: false }],
          memoryBytes: (mib + 512) * 1024 * 1024,
        });
        await answers(sb.address!);
        const resident = (await d.controller.usage(sb.id))?.memoryBytes ?? 0;

        // Peer: runc checkpoint / restore of the same sandbox, images on tmpfs, no vault.
        const images = join('/dev/shm', `dormant-bench-${sb.id}`);
        let t0 = performance.now();
        await d.runtime.checkpoint(sb.id, { imagesDir: join(images, 'img'), workDir: join(images, 'work') });
        const rawCk = performance.now() - t0;
        t0 = performance.now();
        await d.runtime.restore(sb.id, { imagesDir: join(images, 'img'), workDir: join(images, 'work2') });
        const rawRs = performance.now() - t0;
        await rm(images, { recursive: true, force: true });
        await answers(sb.address!);

        t0 = performance.now();
        await d.controller.hibernate(sb.id);
        const hib = performance.now() - t0;
        const hibSteps = d.controller.lastTimings(sb.id, 'hibernate');
        t0 = performance.now();
        await d.controller.resume(sb.id);
        const res = performance.now() - t0;
        const resSteps = d.controller.lastTimings(sb.id, 'resume');
        await answers(sb.address!);
        // The same resume with CRIU's lazy pages: answered once the processes run.
        await d.controller.hibernate(sb.id);
        t0 = performance.now();
        await lazy.resume(sb.id);
        const lazyRes = performance.now() - t0;
        await answers(sb.address!);
        // Let the pages finish arriving (the sandbox's lock is held until then).
        await lazy.pause(sb.id);
        await lazy.resume(sb.id);
        const lazySteps = lazy.lastTimings(sb.id, 'resume');
        const ck = (await d.store.listCheckpoints({ sandboxId: sb.id }))[0];
        rows.push(
          {
            name: `hibernate, ${mib} MiB resident`,
            dormant: Math.round(hib),
            peer: Math.round(rawCk),
            peerName: 'runc checkpoint',
            unit: 'ms',
            better: 'lower',
          },
          {
            name: `resume, ${mib} MiB resident`,
            dormant: Math.round(res),
            peer: Math.round(rawRs),
            peerName: 'runc restore',
            unit: 'ms',
            better: 'lower',
          },
          {
            name: `resume with lazy pages, ${mib} MiB resident`,
            dormant: Math.round(lazyRes),
            peer: Math.round(rawRs),
            peerName: 'runc restore',
            unit: 'ms',
            better: 'lower',
          },
        );
        notes.push(
          `${mib} MiB: cgroup held ${(resident / 1024 ** 2).toFixed(0)} MiB; checkpoint ${((ck?.logicalBytes ?? 0) / 1024 ** 2).toFixed(0)} MiB logical, ${((ck?.storedBytes ?? 0) / 1024 ** 2).toFixed(0)} MiB stored in the vault.`,
        );
        for (const [what, t] of [
          ['hibernate', hibSteps],
          ['resume', resSteps],
          ['lazy resume', lazySteps],
        ] as const)
          if (t) notes.push(`${mib} MiB ${what} steps (ms, @start): ${stepLine(t)}`);
        await d.controller.remove(sb.id);
      }
    } finally {
      for (const s of await d.controller.list()) await d.controller.remove(s.id).catch(() => undefined);
      await d.close();
      await rm(dir, { recursive: true, force: true });
    }
    return {
      title: 'sandbox hibernate and resume',
      description:
        "One sandbox running a python server that holds N MiB (half random, half a repeated byte per MiB), hibernated once fresh (all its memory new to the vault). Peer: `runc checkpoint` then `runc restore -d` of the same sandbox with images on /dev/shm (through the runtime adapter, no vault). dormant: `hibernate` (freeze, CRIU dump into the daemon's staging tmpfs, huge pages for big files, while the vault chunks, compresses (zstd), encrypts (AES-GCM) and writes with fsync what CRIU has written so far; commit; end processes) and `resume` (eager: vault to staging, runc restore; and with CRIU lazy pages, the daemon's default: above 256 MiB of checkpoint the non-page images to staging, runc restore, every lazy page served from the vault by dormant's page server; up to 256 MiB the whole checkpoint to staging and CRIU's own lazy-pages daemon reading it; timed until the processes run with their pages arriving behind, and the steps show when the last page was in).",
      rows,
      notes,
    };
  },
};
