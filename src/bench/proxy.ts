/**
 * The wake proxy against connecting to the sandbox directly, through the real daemon: requests
 * per second and p50/p99 latency under keep-alive load from a second process on loopback, for a
 * python server and a node server inside sandboxes; and the time to first byte of a request
 * that wakes a frozen and a hibernated sandbox, against resuming by API and then requesting.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { request } from 'node:http';
import { fileURLToPath } from 'node:url';
import { dirname, join } from 'node:path';
import { run } from '../sys/exec.js';
import { startDaemon } from '../api/daemon.js';
import { DormantClient, type SandboxInfo } from '../sdk/client.js';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';
import type { BenchRow, BenchSuite } from './harness.js';

const PY = `
import http.server, os
count = 0
token = os.urandom(8).hex()
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        global count
        count += 1
        body = ("%d %s" % (count, token)).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
class S(http.server.ThreadingHTTPServer):
    request_queue_size = 256
S(("0.0.0.0", 8080), H).serve_forever()
`;

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
}

const LOADGEN = join(dirname(fileURLToPath(import.meta.url)), 'loadgen.js');

async function load(spec: {
  host: string;
  port: number;
  headers: Record<string, string>;
  durationMs: number;
  connections: number;
}): Promise<Load> {
  const r = await run(process.execPath, [LOADGEN, JSON.stringify({ ...spec, warmupMs: 500 })], {
    timeoutMs: spec.durationMs + 30_000,
  });
  return JSON.parse(r.stdout) as Load;
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
    const daemon = await startDaemon({
      dataDir: join(dir, 'data'),
      listen: '127.0.0.1:0',
      readonlyBinds: [{ source: '/usr', destination: '/usr' }],
      warn: () => undefined,
      policy: false,
      proxy: { domain: 'dormant.bench' },
    });
    const client = new DormantClient({ url: daemon.url, token: daemon.adminToken });
    const rows: BenchRow[] = [];
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
      for (const [label, sb, port] of servers) {
        await untilServing(sb.address!, port);
        const tcp = (await client.sandboxUrl(sb.id, port)).tcp;
        if (tcp === null) throw new Error(`${label}: no TCP listener for port ${port}`);
        const [tcpHost, tcpPort] = tcp.split(':');
        const ways = {
          direct: { host: sb.address!, port, headers: {} },
          http: {
            host: '127.0.0.1',
            port: proxyPort,
            headers: { host: `${port}-${sb.id}.dormant.bench`, ...auth },
          },
          tcp: { host: tcpHost!, port: Number(tcpPort), headers: {} },
        };
        const got: Record<keyof typeof ways, Load[]> = { direct: [], http: [], tcp: [] };
        for (let i = 0; i < rounds; i++) {
          // Rotate the order: the machine warms up and drifts during a run.
          const order = (['direct', 'http', 'tcp'] as const).map((_, k, a) => a[(k + i) % a.length]!);
          for (const w of order) got[w].push(await load({ ...ways[w], durationMs, connections }));
        }
        const errors = [...got.direct, ...got.http, ...got.tcp].reduce((n, l) => n + l.errors, 0);
        if (errors > 0) throw new Error(`${label}: ${errors} requests failed under load`);
        const m = (ls: Load[], k: 'rps' | 'p50Ms' | 'p99Ms') => median(ls.map((l) => l[k]));
        for (const [way, what] of [
          ['http', 'HTTP proxy'],
          ['tcp', 'TCP forward'],
        ] as const) {
          rows.push(
            {
              name: `${label}, ${what}: requests/s, ${connections} connections`,
              dormant: Math.round(m(got[way], 'rps')),
              peer: Math.round(m(got.direct, 'rps')),
              peerName: 'direct',
              unit: 'req/s',
              better: 'higher',
            },
            {
              name: `${label}, ${what}: p50 latency`,
              dormant: m(got[way], 'p50Ms'),
              peer: m(got.direct, 'p50Ms'),
              peerName: 'direct',
              unit: 'ms',
              better: 'lower',
            },
            {
              name: `${label}, ${what}: p99 latency`,
              dormant: m(got[way], 'p99Ms'),
              peer: m(got.direct, 'p99Ms'),
              peerName: 'direct',
              unit: 'ms',
              better: 'lower',
            },
          );
        }
      }
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
        `in runc sandboxes. Then the time to first byte of a request that wakes a frozen and a hibernated sandbox (${quick ? 1 : 3} rounds, median), ` +
        'against `POST /resume` followed by the same request direct.',
      rows,
      notes: [
        'The load generator, the daemon (with the proxy) and the sandbox share the same CPUs; the proxy pays for its CPU out of the same budget.',
        'A hibernated wake is a CRIU restore from the encrypted vault; a frozen one is a cgroup thaw.',
      ],
    };
  },
};
