/**
 * Egress throughput: a download through the sandbox's NAT (its veth, the host's forward and
 * MASQUERADE, the policy chain) against the host's own download from the same server, a
 * test-made "outside" namespace in 198.18.0.0/15 (api/testing/outside.ts). The same client
 * (busybox wget, timing itself) on both sides, rounds alternated; a download and an upload.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { cpus, loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { RuncRuntime } from '../runtime/runc.js';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';
import { run } from '../sys/exec.js';
import { startOutside } from '../api/testing/outside.js';
import type { BenchSuite } from './harness.js';
import { median } from './harness.js';

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
    const rows = {
      download: { sandbox: [] as number[], host: [] as number[] },
      upload: { sandbox: [] as number[], host: [] as number[] },
    };
    // The client times itself (/proc/uptime, 10 ms steps, around busybox wget), on both sides
    // alike: the exec's own start is not in the sandbox's figure.
    const clock = "cut -d' ' -f1 /proc/uptime";
    const script = (bb: string, dir: string) => ({
      download: `a=$(${clock}); ${bb} wget -q -O /dev/null ${url}; echo $a $(${clock})`,
      upload: `a=$(${clock}); ${bb} wget -q -O /dev/null --post-file ${dir}/up http://${outside.address}:8080/; echo $a $(${clock})`,
    });
    const hostBusybox = join(rootfs, 'bin', 'busybox');
    try {
      await rt.create({ id, rootfs, args: ['sleep', '100000'], egress: { mode: 'internet' } });
      await rt.start(id);
      await rt.exec(id, ['sh', '-c', `head -c ${mib * 1024 * 1024} /dev/zero > /tmp/up`]);
      await run('sh', ['-c', `head -c ${mib * 1024 * 1024} /dev/zero > ${tmp}/up`], { timeoutMs: 60_000 });
      const inside = script('busybox', '/tmp');
      const onHost = script(hostBusybox, tmp);
      const elapsedMs = (out: string): number => {
        const [a, b] = out.trim().split(/\s+/).map(Number);
        return (b! - a!) * 1000;
      };
      for (let i = 0; i < (quick ? 3 : 5); i++) {
        for (const what of ['download', 'upload'] as const) {
          const sandboxRun = async () =>
            rows[what].sandbox.push(
              rate(elapsedMs((await rt.exec(id, ['sh', '-c', inside[what]], { timeoutMs: 120_000 })).stdout)),
            );
          const hostRun = async () =>
            rows[what].host.push(
              rate(elapsedMs((await run('sh', ['-c', onHost[what]], { timeoutMs: 120_000 })).stdout)),
            );
          if (i % 2 === 0) {
            await sandboxRun();
            await hostRun();
          } else {
            await hostRun();
            await sandboxRun();
          }
        }
      }
    } finally {
      await rt.destroy(id).catch(() => undefined);
      await outside.close();
      await rm(tmp, { recursive: true, force: true });
    }
    return {
      title: 'Egress: throughput through the NAT',
      description: `A ${mib} MiB download and a ${mib} MiB upload (HTTP POST) with busybox wget to an HTTP server in a network namespace on 198.18.0.0/15, from inside a sandbox (policy internet: its veth, the host's forward chains, MASQUERADE, its policy chain) and from the host itself, ${rows.download.sandbox.length} rounds alternated; the client times itself; medians in MiB/s.`,
      rows: (['download', 'upload'] as const).map((what) => ({
        name: `${what} ${mib} MiB`,
        dormant: median(rows[what].sandbox),
        peer: median(rows[what].host),
        peerName: "the host's own",
        unit: 'MiB/s',
        better: 'higher' as const,
      })),
      notes: [
        `Each round, download: sandbox ${rows.download.sandbox.join(', ')}, host ${rows.download.host.join(', ')}; upload: sandbox ${rows.upload.sandbox.join(', ')}, host ${rows.upload.host.join(', ')} MiB/s. Load average at the start: ${loadAtStart.toFixed(1)} on ${String(cpus().length)} cores.`,
      ],
    };
  },
};
