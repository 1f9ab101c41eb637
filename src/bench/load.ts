/**
 * Load: many small sandboxes (a python server with a counter and a random token in memory)
 * created, hibernated and resumed through the HTTP API with bounded concurrency, while a
 * second process polls `GET /v1/sandboxes` the whole time. Every sandbox must come back with
 * its memory (counter + token) intact. The peer figure for the API is the same poll on the
 * idle daemon before the load: how much slower the API answers while it works.
 */
import { spawn } from 'node:child_process';
import { loadavg } from 'node:os';
import { monitorEventLoopDelay } from 'node:perf_hooks';
import { mkdtemp, rm } from 'node:fs/promises';
import { join } from 'node:path';
import type { SandboxInfo } from '../sdk/client.js';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';
import { stepMedians, type BenchRow, type BenchSuite } from './harness.js';
import type { OperationTimings } from '../domain/timings.js';
import { COUNTER_SERVER_PY } from '../api/testing/servers.js';
import { startTestDaemon } from '../api/testing/daemon.js';
import { eventually, httpGet } from '../api/testing/host.js';

/** The poller: a separate node process, so its timings are not the daemon's event loop's. */
const POLLER = `
const [url, token, intervalMs] = process.argv.slice(1);
const lat = []; let errors = 0; let stop = false;
process.on('SIGTERM', () => { stop = true; });
(async () => {
  while (!stop) {
    const t0 = performance.now();
    try {
      const r = await fetch(url + '/v1/sandboxes', { headers: { authorization: 'Bearer ' + token } });
      await r.text();
      if (r.ok) lat.push(performance.now() - t0); else errors++;
    } catch { errors++; }
    await new Promise((r) => setTimeout(r, Number(intervalMs)));
  }
  process.stdout.write(JSON.stringify({ lat, errors }));
})();
`;

/** Runs `work` over `items`, at most `limit` at a time. */
async function pool<T>(items: T[], limit: number, work: (item: T) => Promise<void>): Promise<void> {
  let next = 0;
  const lane = async (): Promise<void> => {
    while (next < items.length) await work(items[next++]!);
  };
  await Promise.all(Array.from({ length: Math.min(limit, items.length) }, lane));
}

function pct(xs: number[], q: number): number {
  const s = [...xs].sort((a, b) => a - b);
  return Math.round(s[Math.min(s.length - 1, Math.floor(q * s.length))] ?? 0);
}

async function poll(url: string, token: string, during: () => Promise<void>) {
  const child = spawn(process.execPath, ['-e', POLLER, url, token, '100'], {
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  let out = '';
  child.stdout.setEncoding('utf8').on('data', (c: string) => (out += c));
  const done = new Promise<void>((r) => child.once('exit', () => r()));
  try {
    await during();
  } finally {
    child.kill('SIGTERM');
    await done;
  }
  return JSON.parse(out) as { lat: number[]; errors: number };
}

export const loadSuite: BenchSuite = {
  name: 'load',
  async run({ quick }) {
    const count = quick ? 8 : 50;
    const concurrency = 4;
    const dir = await mkdtemp('/tmp/dormant-bench-load-');
    const { daemon: d, client } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      proxy: false,
      policy: false,
    });
    const created: SandboxInfo[] = [];
    try {
      await buildBusyboxRootfs(join(dir, 'rootfs'), { 'srv/server.py': COUNTER_SERVER_PY });
      // Warmed first (the first requests compile the route and load its modules), then 10 s of
      // polls: with 3 s (30 polls) the p99 was the slowest single request, 33-99 ms by run.
      for (let i = 0; i < 20; i++) await client.listSandboxes();
      const idle = await poll(d.url, d.adminToken, () => new Promise((r) => setTimeout(r, 10_000)));
      const times = { create: [] as number[], hibernate: [] as number[], resume: [] as number[] };
      const steps = {
        create: [] as OperationTimings[],
        hibernate: [] as OperationTimings[],
        resume: [] as OperationTimings[],
      };
      const stepsOf = (id: string, op: 'create' | 'hibernate' | 'resume'): void => {
        const t = d.controller.lastTimings(id, op);
        if (t) steps[op].push(t);
      };
      let wrong = 0;
      const failures: string[] = [];
      const started = performance.now();
      // The daemon's event loop (this process's: the bench drives it in-process) while it works:
      // what a request waits before its turn, apart from the CPU the machine lacks.
      const loop = monitorEventLoopDelay({ resolution: 10 });
      loop.enable();
      const busy = await poll(d.url, d.adminToken, () =>
        pool(
          Array.from({ length: count }, (_, i) => i),
          concurrency,
          async (i) => {
            try {
              let t0 = performance.now();
              const sb = await client.createSandbox({
                name: `load-${i}`,
                rootfs: join(dir, 'rootfs'),
                command: ['/usr/bin/python3', '-u', '/srv/server.py'],
                ports: [8080],
                memory: '64M',
              });
              created.push(sb);
              const first = await eventually(`server of ${sb.id}`, () => httpGet(sb.address!, 8080), 120_000);
              times.create.push(performance.now() - t0);
              stepsOf(sb.id, 'create');
              t0 = performance.now();
              await client.hibernate(sb.id);
              times.hibernate.push(performance.now() - t0);
              stepsOf(sb.id, 'hibernate');
              t0 = performance.now();
              await client.resume(sb.id);
              const after = await eventually(`server of ${sb.id}`, () => httpGet(sb.address!, 8080), 120_000);
              times.resume.push(performance.now() - t0);
              stepsOf(sb.id, 'resume');
              const [n, token] = first.split(' ');
              if (after !== `${Number(n) + 1} ${token}`) wrong++;
            } catch (e) {
              // A correctness failure is a finding, not a reason to lose the figures.
              failures.push(`load-${i}: ${e instanceof Error ? e.message.slice(0, 300) : String(e)}`);
            }
          },
        ),
      );
      loop.disable();
      const wallS = (performance.now() - started) / 1000;
      const loopMs = (ns: number): string => (ns / 1e6).toFixed(0);
      const verify = await d.vault.verify();
      const row = (name: string, xs: number[]): BenchRow[] => [
        { name: `${name} p50`, dormant: pct(xs, 0.5), unit: 'ms', better: 'lower' },
        { name: `${name} p95`, dormant: pct(xs, 0.95), unit: 'ms', better: 'lower' },
      ];
      const rows: BenchRow[] = [
        ...row('create (until it answers)', times.create),
        ...row('hibernate', times.hibernate),
        ...row('resume (until it answers)', times.resume),
        {
          name: 'sandboxes through create + hibernate + resume',
          dormant: Number(((count / wallS) * 60).toFixed(1)),
          unit: 'per minute',
          better: 'higher',
        },
        {
          name: 'GET /v1/sandboxes p50, under load vs idle',
          dormant: pct(busy.lat, 0.5),
          peer: pct(idle.lat, 0.5),
          peerName: 'idle daemon',
          unit: 'ms',
          better: 'lower',
        },
        {
          name: 'GET /v1/sandboxes p99, under load vs idle',
          dormant: pct(busy.lat, 0.99),
          peer: pct(idle.lat, 0.99),
          peerName: 'idle daemon',
          unit: 'ms',
          better: 'lower',
        },
      ];
      return {
        title: 'Load: many sandboxes at once',
        description:
          `${count} sandboxes (python HTTP server, 64 MiB limit) created, hibernated and resumed through the HTTP API, ` +
          `${concurrency} at a time, while a second process polls GET /v1/sandboxes every 100 ms (the peer: the same poll for 10 s on the idle daemon, after 20 warm-up requests). ` +
          `Each must answer after its resume with its in-memory counter and token intact.`,
        rows,
        notes: [
          `${count - wrong - failures.length}/${count} sandboxes came back with their memory intact; ${failures.length} failed; ${busy.errors} failed polls of ${busy.lat.length + busy.errors}.`,
          ...failures.map((f) => `failed: ${f}`),
          `vault verify afterwards: ${verify.ok ? 'ok' : `${verify.problems.length} problems`}${verify.problems
            .slice(0, 3)
            .map((p) => `; ${p.object}: ${p.message.slice(0, 200)}`)
            .join('')}.`,
          `wall time ${wallS.toFixed(0)} s.`,
          ...(['create', 'hibernate', 'resume'] as const).map(
            (op) => `${op} steps, median ms: ${stepMedians(steps[op])}`,
          ),
          `the daemon's event loop during the load (this process's, which also drives the bench; resolution 10 ms): delay p50 ${loopMs(loop.percentile(50))} ms, p99 ${loopMs(loop.percentile(99))} ms, max ${loopMs(loop.max)} ms; load average ${loadavg()[0]!.toFixed(1)} at the end (2 cores).`,
        ],
      };
    } finally {
      for (const s of created) await client.remove(s.id).catch(() => undefined);
      await d.close();
      await rm(dir, { recursive: true, force: true });
    }
  },
};
