/**
 * The wake proxy against connecting to the sandbox directly, through the real daemon: requests
 * per second and p50/p99 latency under keep-alive load from a second process on loopback, for a
 * python server and a node server inside sandboxes; for the node server also against haproxy
 * (when installed) as an HTTP reverse proxy and a TCP relay to the same sandbox, with each
 * relay's CPU time per request; and the time to first byte of a request that wakes a frozen and
 * a hibernated sandbox, against resuming by API and then requesting.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { request } from 'node:http';
import { loadavg } from 'node:os';
import { fileURLToPath } from 'node:url';
import { dirname, join } from 'node:path';
import { run, which } from '../sys/exec.js';
import type { SandboxInfo } from '../sdk/client.js';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';
import type { BenchRow, BenchSuite } from './harness.js';
import { startTestDaemon } from '../api/testing/daemon.js';
import { freePort } from '../api/testing/host.js';
import { counterServer } from '../api/testing/servers.js';

/** The counter, keeping connections open, as a load generator's client wants. */
const PY = counterServer({ keepAlive: true, backlog: 256 });

const NODE = `
import { createServer } from 'node:http';
let count = 0;
createServer((req, res) => {
  count++;
  res.writeHead(200, { 'content-type': 'text/plain' });
  res.end(String(count));
}).listen(8081, '0.0.0.0');
`;

interface Load {
  requests: number;
  errors: number;
  rps: number;
  p50Ms: number;
  p99Ms: number;
  /** Requests completed including the warm-up. */
  total: number;
  /** CPU time of the relay (the daemon, or the peer proxy) per request, µs; 0 for direct. */
  relayCpuUs: number;
}

const LOADGEN = join(dirname(fileURLToPath(import.meta.url)), 'loadgen.js');

/** CPU time (user + system) in µs of the relay a load goes through. */
type CpuClock = () => Promise<number>;

/** The daemon runs in this process; the load generator is a child, not counted. */
const selfCpu: CpuClock = () => {
  const u = process.cpuUsage();
  return Promise.resolve(u.user + u.system);
};

/** A process's CPU time from /proc (clock ticks, 100 per second on Linux). */
function procCpu(pid: number): CpuClock {
  return async () => {
    const stat = await readFile(`/proc/${pid}/stat`, 'utf8');
    // After "pid (comm) ": state is field 3, utime and stime are fields 14 and 15.
    const v = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    return (Number(v[11]) + Number(v[12])) * 10_000;
  };
}

async function load(
  spec: {
    host: string;
    port: number;
    headers: Record<string, string>;
    durationMs: number;
    connections: number;
  },
  cpu: CpuClock | undefined,
): Promise<Load> {
  const before = cpu ? await cpu() : 0;
  const r = await run(process.execPath, [LOADGEN, JSON.stringify({ ...spec, warmupMs: 500 })], {
    timeoutMs: spec.durationMs + 30_000,
  });
  const l = JSON.parse(r.stdout) as Omit<Load, 'relayCpuUs'>;
  const used = cpu ? (await cpu()) - before : 0;
  return { ...l, relayCpuUs: l.total > 0 ? used / l.total : 0 };
}

interface PeerProxy {
  name: string;
  http: { host: string; port: number; headers: Record<string, string> };
  tcp: { host: string; port: number; headers: Record<string, string> };
  cpu: CpuClock;
  stop(): Promise<void>;
}

/**
 * haproxy as a keep-alive HTTP reverse proxy (routing by Host, Authorization removed,
 * X-Forwarded-* added: the work dormant's proxy does, less the token lookup) and as a TCP relay,
 * both to `upstream`, in its own process with its own config in `dir`; one thread, like the
 * daemon's event loop. A string says why there is none.
 */
async function startHaproxy(
  dir: string,
  upstream: { host: string; port: number },
  hostHeader: string,
  headers: Record<string, string>,
): Promise<PeerProxy | string> {
  const bin = await which('haproxy', `${process.env.PATH ?? ''}:/usr/sbin:/sbin`);
  if (bin === undefined)
    return 'haproxy is not installed (scripts/setup.sh installs it): no peer proxy measured';
  const version = (await run(bin, ['-v'])).stdout.match(/version (\d+\.\d+(?:\.\d+)?)/)?.[1] ?? '?';
  const [httpPort, tcpPort] = [await freePort(), await freePort()];
  const server = `${upstream.host}:${upstream.port}`;
  const cfg = join(dir, 'haproxy.cfg');
  await writeFile(
    cfg,
    [
      'global',
      '  nbthread 1',
      '  maxconn 1024',
      'defaults',
      '  timeout connect 5s',
      '  timeout client 60s',
      '  timeout server 60s',
      '  timeout http-keep-alive 60s',
      'frontend http',
      '  mode http',
      `  bind 127.0.0.1:${httpPort}`,
      '  option http-keep-alive',
      '  option forwardfor',
      `  acl sandbox hdr(host) -i ${hostHeader}`,
      '  http-request deny deny_status 404 unless sandbox',
      '  http-request del-header authorization',
      '  http-request set-header x-forwarded-host %[req.hdr(host)]',
      '  http-request set-header x-forwarded-proto http',
      '  default_backend sandbox',
      'backend sandbox',
      '  mode http',
      '  http-reuse always',
      `  server s ${server}`,
      'listen tcp',
      '  mode tcp',
      `  bind 127.0.0.1:${tcpPort}`,
      `  server s ${server}`,
      '',
    ].join('\n'),
  );
  // In the foreground, ended by its PID: no system service, no pid file of the host's.
  const child: ChildProcess = spawn(bin, ['-db', '-f', cfg], { stdio: ['ignore', 'ignore', 'pipe'] });
  let stderr = '';
  child.stderr?.on('data', (d: Buffer) => (stderr += d.toString()));
  const exited = new Promise<void>((r) => child.once('exit', () => r()));
  const stop = async (): Promise<void> => {
    if (child.exitCode === null && child.signalCode === null && child.pid !== undefined) {
      process.kill(child.pid, 'SIGTERM');
    }
    await exited;
  };
  try {
    await new Promise<void>((resolve, reject) => {
      child.once('spawn', resolve);
      child.once('error', reject);
    });
    const deadline = Date.now() + 10_000;
    for (;;) {
      try {
        await ttfb('127.0.0.1', httpPort, { host: hostHeader, ...headers });
        break;
      } catch (e) {
        if (child.exitCode !== null || Date.now() > deadline) {
          throw new Error(`haproxy did not serve: ${stderr.trim() || String(e)}`);
        }
        await new Promise((r) => setTimeout(r, 100));
      }
    }
  } catch (e) {
    await stop();
    throw e;
  }
  return {
    name: `haproxy ${version}`,
    http: { host: '127.0.0.1', port: httpPort, headers: { host: hostHeader, ...headers } },
    tcp: { host: '127.0.0.1', port: tcpPort, headers: {} },
    cpu: procCpu(child.pid!),
    stop,
  };
}

/** Milliseconds to the first byte of the response (status line and headers in). */
function ttfb(host: string, port: number, headers: Record<string, string>): Promise<number> {
  const t = performance.now();
  return new Promise((resolve, reject) => {
    const req = request({ host, port, path: '/', headers, agent: false, timeout: 60_000 }, (res) => {
      const ms = performance.now() - t;
      res.resume();
      res.on('end', () =>
        res.statusCode === 200 ? resolve(ms) : reject(new Error(`HTTP ${res.statusCode}`)),
      );
    });
    req.on('timeout', () => req.destroy(new Error('timeout')));
    req.on('error', reject);
    req.end();
  });
}

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)]!;
}

async function untilServing(host: string, port: number): Promise<void> {
  const deadline = Date.now() + 20_000;
  for (;;) {
    try {
      await ttfb(host, port, {});
      return;
    } catch (e) {
      if (Date.now() > deadline) throw e;
      await new Promise((r) => setTimeout(r, 100));
    }
  }
}

export const proxySuite: BenchSuite = {
  name: 'proxy',
  async run({ quick }) {
    const dir = await mkdtemp('/tmp/dormant-bench-proxy-');
    const rootfs = join(dir, 'rootfs');
    await buildBusyboxRootfs(rootfs, { 'srv/server.py': PY, 'srv/server.mjs': NODE });
    const { daemon, client } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      policy: false,
      proxy: { domain: 'dormant.bench' },
    });
    const rows: BenchRow[] = [];
    const notes: string[] = [];
    const durationMs = quick ? 2000 : 5000;
    const rounds = quick ? 1 : 2;
    const connections = 16;
    const proxyPort = daemon.wake.proxy!.port;
    const auth = { authorization: `Bearer ${daemon.adminToken}` };
    try {
      const py = await client.createSandbox({
        name: 'bench-py',
        rootfs,
        command: ['/usr/bin/python3', '-u', '/srv/server.py'],
        ports: [8080],
        memory: '256M',
        cpus: 2,
      });
      const nd = await client.createSandbox({
        name: 'bench-node',
        rootfs,
        command: ['/usr/bin/node', '/srv/server.mjs'],
        env: { UV_USE_IO_URING: '0' },
        ports: [8081],
        memory: '256M',
        cpus: 2,
      });
      const servers: [string, SandboxInfo, number][] = [
        ['python http.server', py, 8080],
        ['node http', nd, 8081],
      ];
      const loadBefore = loadavg()[0]!;
      for (const [label, sb, port] of servers) {
        await untilServing(sb.address!, port);
        const tcp = (await client.sandboxUrl(sb.id, port)).tcp;
        if (tcp === null) throw new Error(`${label}: no TCP listener for port ${port}`);
        const [tcpHost, tcpPort] = tcp.split(':');
        const hostHeader = `${port}-${sb.id}.dormant.bench`;
        type Way = { host: string; port: number; headers: Record<string, string>; cpu?: CpuClock };
        const ways: Record<string, Way> = {
          direct: { host: sb.address!, port, headers: {} },
          http: { host: '127.0.0.1', port: proxyPort, headers: { host: hostHeader, ...auth }, cpu: selfCpu },
          tcp: { host: tcpHost!, port: Number(tcpPort), headers: {}, cpu: selfCpu },
        };
        // The peer proxy only in front of the node server: the python one hides any relay.
        let peer: PeerProxy | undefined;
        if (port === 8081) {
          const p = await startHaproxy(dir, { host: sb.address!, port }, hostHeader, auth);
          if (typeof p === 'string') notes.push(p);
          else {
            peer = p;
            ways.peerHttp = { ...p.http, cpu: p.cpu };
            ways.peerTcp = { ...p.tcp, cpu: p.cpu };
          }
        }
        const names = Object.keys(ways);
        const got: Record<string, Load[]> = Object.fromEntries(names.map((w) => [w, []]));
        try {
          for (let i = 0; i < rounds; i++) {
            // Rotate the order: the machine warms up and drifts during a run.
            for (let k = 0; k < names.length; k++) {
              const w = names[(k + i) % names.length]!;
              const { cpu, ...spec } = ways[w]!;
              got[w]!.push(await load({ ...spec, durationMs, connections }, cpu));
            }
          }
        } finally {
          await peer?.stop();
        }
        const errors = Object.values(got)
          .flat()
          .reduce((n, l) => n + l.errors, 0);
        if (errors > 0) throw new Error(`${label}: ${errors} requests failed under load`);
        const m = (w: string, k: 'rps' | 'p50Ms' | 'p99Ms' | 'relayCpuUs') =>
          median(got[w]!.map((l) => l[k]));
        const compare = (what: string, way: string, against: string, peerName: string): BenchRow[] => [
          {
            name: `${label}, ${what}: requests/s, ${connections} connections`,
            dormant: Math.round(m(way, 'rps')),
            peer: Math.round(m(against, 'rps')),
            peerName,
            unit: 'req/s',
            better: 'higher',
          },
          {
            name: `${label}, ${what}: p50 latency`,
            dormant: m(way, 'p50Ms'),
            peer: m(against, 'p50Ms'),
            peerName,
            unit: 'ms',
            better: 'lower',
          },
          {
            name: `${label}, ${what}: p99 latency`,
            dormant: m(way, 'p99Ms'),
            peer: m(against, 'p99Ms'),
            peerName,
            unit: 'ms',
            better: 'lower',
          },
        ];
        for (const [way, what, peerWay] of [
          ['http', 'HTTP proxy', 'peerHttp'],
          ['tcp', 'TCP forward', 'peerTcp'],
        ] as const) {
          rows.push(...compare(what, way, 'direct', 'direct'));
          if (!peer) continue;
          rows.push(...compare(`${what} vs ${peer.name}`, way, peerWay, peer.name), {
            name: `${label}, ${what}: relay CPU per request (user + system)`,
            dormant: Math.round(m(way, 'relayCpuUs') * 10) / 10,
            peer: Math.round(m(peerWay, 'relayCpuUs') * 10) / 10,
            peerName: peer.name,
            unit: 'µs',
            better: 'lower',
          });
          notes.push(
            `${peer.name} itself, ${what === 'HTTP proxy' ? 'HTTP' : 'TCP'} to the ${label} sandbox: ${(m(peerWay, 'rps') / m('direct', 'rps')).toFixed(2)}x the requests/s of direct (dormant: ${(m(way, 'rps') / m('direct', 'rps')).toFixed(2)}x).`,
          );
        }
      }
      const loadAfter = loadavg()[0]!;
      notes.push(
        `1-minute load average ${loadBefore.toFixed(1)} before the load runs and ${loadAfter.toFixed(1)} after${Math.max(loadBefore, loadAfter) > 3.5 ? ' (other work ran concurrently on this machine besides the three processes measured, so absolute figures are low; compare the ratios within this run)' : ''}.`,
      );
      await client.remove(nd.id);

      // Waking: a request through the proxy, against resume by API and then the same request direct.
      const host = { host: `8080-${py.id}.dormant.bench`, ...auth };
      const wakeRounds = quick ? 1 : 3;
      for (const [tier, put] of [
        ['frozen', (id: string) => client.pause(id)],
        ['hibernated', (id: string) => client.hibernate(id)],
      ] as const) {
        const viaProxy: number[] = [];
        const byApi: number[] = [];
        for (let i = 0; i < wakeRounds; i++) {
          await put(py.id);
          viaProxy.push(await ttfb('127.0.0.1', proxyPort, host));
          await put(py.id);
          const t = performance.now();
          await client.resume(py.id);
          await ttfb(py.address!, 8080, {});
          byApi.push(performance.now() - t);
        }
        rows.push({
          name: `first byte of a request that wakes a ${tier} sandbox`,
          dormant: median(viaProxy),
          peer: median(byApi),
          peerName: 'API resume, then request',
          unit: 'ms',
          better: 'lower',
        });
      }
      await client.remove(py.id);
    } finally {
      for (const s of await client.listSandboxes().catch(() => []))
        await client.remove(s.id).catch(() => undefined);
      await daemon.close();
      await rm(dir, { recursive: true, force: true });
    }
    return {
      title: 'wake proxy overhead and wake latency',
      description:
        `Keep-alive GET load (${connections} connections, ${durationMs / 1000} s after a 0.5 s warm-up, ${rounds} rotating round(s), median) ` +
        'from a second Node process (src/bench/loadgen.ts) on loopback, through the wake proxy (HTTP: each request head parsed, routed by Host, token-checked and rewritten, the rest of the keep-alive connection relayed as bytes; ' +
        "TCP: the sandbox port's host listener, bytes relayed) against straight to the sandbox's address; the upstreams are a threaded python http.server and a node http server " +
        'in runc sandboxes. For the node server also through haproxy, the reference relay (one thread like the daemon; HTTP mode with keep-alive both ways, routing by Host, Authorization removed and X-Forwarded-* added; and TCP mode), ' +
        "to the same sandbox in the same rotation, with each relay's CPU time per request (the daemon's process, haproxy's from /proc). " +
        `Then the time to first byte of a request that wakes a frozen and a hibernated sandbox (${quick ? 1 : 3} rounds, median), ` +
        'against `POST /resume` followed by the same request direct.',
      rows,
      notes: [
        ...notes,
        'The load generator, the daemon (with the proxy) and the sandbox share the same CPUs; the proxy pays for its CPU out of the same budget.',
        'A hibernated wake is a CRIU restore from the encrypted vault; a frozen one is a cgroup thaw.',
      ],
    };
  },
};
