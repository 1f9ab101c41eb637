/**
 * Egress throughput: a download through the sandbox's NAT (its veth, the host's forward and
 * MASQUERADE, the policy chain) against the host's own download from the same server, a
 * test-made "outside" namespace in 198.18.0.0/15 (api/testing/outside.ts). The same client
 * (busybox wget) on both sides, rounds alternated.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { cpus, loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { RuncRuntime } from '../runtime/runc.js';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';
import { run } from '../sys/exec.js';
import { startOutside } from '../api/testing/outside.js';
import type { BenchSuite } from './harness.js';
import { median, timed } from './harness.js';

export const egressSuite: BenchSuite = {
  name: 'egress',
  async run({ quick }) {
    const loadAtStart = loadavg()[0] ?? 0;
    const tmp = await mkdtemp(join(tmpdir(), 'dormant-bench-egress-'));
    const rootfs = join(tmp, 'rootfs');
    await buildBusyboxRootfs(rootfs);
    const outside = await startOutside(() => ({}));
    const rt = new RuncRuntime({
      stateDir: join(tmp, 'state'),
      criuPath: '/usr/local/bin/criu',
      egressResolvers: [outside.address],
    });
    const id = 'bench-egress';
    const mib = quick ? 64 : 256;
    const url = `http://${outside.address}:8080/bytes/${mib * 1024 * 1024}`;
    const rate = (ms: number): number => Math.round((mib / (ms / 1000)) * 10) / 10;
    const sandbox: number[] = [];
    const host: number[] = [];
    try {
      await rt.create({ id, rootfs, args: ['sleep', '100000'], egress: { mode: 'internet' } });
      await rt.start(id);
      const wget = ['wget', '-q', '-O', '/dev/null', url];
      for (let i = 0; i < (quick ? 3 : 5); i++) {
        const inside = () => rt.exec(id, wget, { timeoutMs: 120_000 });
        const onHost = () => run(join(rootfs, 'bin', 'busybox'), wget, { timeoutMs: 120_000 });
        if (i % 2 === 0) {
          sandbox.push(rate(await timed(inside)));
          host.push(rate(await timed(onHost)));
        } else {
          host.push(rate(await timed(onHost)));
          sandbox.push(rate(await timed(inside)));
        }
      }
    } finally {
      await rt.destroy(id).catch(() => undefined);
      await outside.close();
      await rm(tmp, { recursive: true, force: true });
    }
    return {
      title: 'Egress: throughput through the NAT',
      description: `A ${mib} MiB download with busybox wget from an HTTP server in a network namespace on 198.18.0.0/15, from inside a sandbox (policy internet: veth, forward, MASQUERADE, its policy chain) and from the host itself, ${sandbox.length} rounds alternated; medians in MiB/s (the exec's start is in the sandbox's time).`,
      rows: [
        {
          name: `download ${mib} MiB`,
          dormant: median(sandbox),
          peer: median(host),
          peerName: "the host's own",
          unit: 'MiB/s',
          better: 'higher',
        },
      ],
      notes: [
        `Each round, sandbox ${sandbox.join(', ')}; host ${host.join(', ')} MiB/s. Load average at the start: ${loadAtStart.toFixed(1)} on ${String(cpus().length)} cores.`,
      ],
    };
  },
};
