/**
 * The wake proxy alone, without sandboxes or the daemon: a node http server in a child process
 * on loopback is the upstream, the proxy runs in this process (so `node --cpu-prof` of this
 * script profiles the proxy and nothing else), and the load generator is a third process.
 * Prints requests/s and p50/p99 of direct, HTTP proxy and TCP forward in rotating rounds, and
 * each way's ratio to direct in the same run.
 *
 * The proxy's own CPU time per request (this process's user+system time over the requests
 * served) is the figure that noise from other processes disturbs least.
 *
 * `node dist/bench/proxy-micro.js [SECONDS] [ROUNDS] [CONNECTIONS] [WAYS]` (WAYS: direct,http,tcp)
 */
import { fileURLToPath } from 'node:url';
import { dirname, join } from 'node:path';
import { run } from '../sys/exec.js';
import { WakeProxy, type ProxiedSandbox } from '../proxy/proxy.js';

const UPSTREAM = `
import { createServer } from 'node:http';
let count = 0;
const s = createServer((req, res) => {
  count++;
  res.writeHead(200, { 'content-type': 'text/plain' });
  res.end(String(count));
}).listen(0, '127.0.0.1', () => process.stdout.write(String(s.address().port) + '\\n'));
`;

const LOADGEN = join(dirname(fileURLToPath(import.meta.url)), 'loadgen.js');

interface Load {
  requests: number;
  errors: number;
  rps: number;
  p50Ms: number;
  p99Ms: number;
}

async function main(): Promise<void> {
  const seconds = Number(process.argv[2] ?? 3);
  const rounds = Number(process.argv[3] ?? 2);
  const connections = Number(process.argv[4] ?? 16);
  const stop = new AbortController();
  let gotPort: (p: number) => void = () => undefined;
  const portP = new Promise<number>((resolve) => (gotPort = resolve));
  const upstream = run(process.execPath, ['--input-type=module', '-e', UPSTREAM], {
    timeoutMs: 3_600_000,
    signal: stop.signal,
    onStdout: (d) => gotPort(Number(d.toString().trim())),
  }).catch(() => undefined);
  try {
    const port = await Promise.race([
      portP,
      upstream.then(() => Promise.reject(new Error('upstream exited'))),
    ]);
    const sb: ProxiedSandbox = {
      id: 'sb-micro',
      name: 'micro',
      tenant: 'default',
      state: 'running',
      address: '127.0.0.1',
      ports: [{ port, public: false }],
    };
    let touches = 0;
    const proxy = await WakeProxy.start({
      listen: '127.0.0.1:0',
      domain: 'dormant.micro',
      tcp: 'all',
      tcpSyncMs: 0,
      target: {
        find: (ref) => (ref === sb.id ? [sb] : []),
        list: () => [sb],
        wake: () => Promise.resolve('127.0.0.1'),
        touch: () => {
          touches++;
          return undefined;
        },
        authenticate: (t) => (t === 'dmt_micro' ? { tenant: 'default', admin: true } : undefined),
      },
    });
    try {
      const tcp = proxy.urlFor(sb, port)?.tcp;
      if (tcp == null) throw new Error('no TCP listener');
      const ways = {
        direct: { host: '127.0.0.1', port, headers: {} },
        http: {
          host: '127.0.0.1',
          port: proxy.port,
          headers: { host: `${port}-${sb.id}.dormant.micro`, authorization: 'Bearer dmt_micro' },
        },
        tcp: { host: '127.0.0.1', port: Number(tcp.split(':')[1]), headers: {} },
      };
      const got: Record<string, Load[]> = { direct: [], http: [], tcp: [] };
      const names = (process.argv[5] ?? 'direct,http,tcp').split(',') as (keyof typeof ways)[];
      const cpu: Record<string, number> = { direct: 0, http: 0, tcp: 0 };
      const served: Record<string, number> = { direct: 0, http: 0, tcp: 0 };
      for (let i = 0; i < rounds; i++) {
        for (let k = 0; k < names.length; k++) {
          const w = names[(k + i) % names.length]!;
          const spec = { ...ways[w], connections, durationMs: seconds * 1000, warmupMs: 500 };
          const before = process.cpuUsage();
          const r = await run(process.execPath, [LOADGEN, JSON.stringify(spec)], {
            timeoutMs: seconds * 1000 + 30_000,
          });
          const used = process.cpuUsage(before);
          const l = JSON.parse(r.stdout) as Load;
          got[w]!.push(l);
          cpu[w]! += used.user + used.system;
          served[w]! += (l.rps * (seconds * 1000 + 500)) / 1000;
        }
      }
      const med = (ls: Load[], k: 'rps' | 'p50Ms' | 'p99Ms'): number => {
        const s = ls.map((l) => l[k]).sort((a, b) => a - b);
        return s[Math.floor(s.length / 2)]!;
      };
      const d = got.direct!.length > 0 ? med(got.direct!, 'rps') : NaN;
      for (const w of names) {
        const ls = got[w]!;
        const errors = ls.reduce((n, l) => n + l.errors, 0);
        process.stdout.write(
          `${w.padEnd(6)} ${med(ls, 'rps').toFixed(0).padStart(6)} req/s  ${(med(ls, 'rps') / d).toFixed(2)}x direct  ` +
            `proxy CPU ${(cpu[w]! / served[w]!).toFixed(1)} µs/req  p50 ${med(ls, 'p50Ms').toFixed(2)} ms  p99 ${med(ls, 'p99Ms').toFixed(2)} ms  errors ${errors}  ` +
            `runs ${ls.map((l) => l.rps.toFixed(0)).join(',')}\n`,
        );
      }
      process.stdout.write(`activity writes: ${touches}\n`);
    } finally {
      await proxy.close();
    }
  } finally {
    stop.abort();
    await upstream;
  }
}

await main();
