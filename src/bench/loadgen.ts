/**
 * A small HTTP load generator, run as its own process so that the load it makes does not
 * share an event loop with the proxy it measures: `node dist/bench/loadgen.js '<json>'` with
 * {host, port, headers, connections, durationMs, warmupMs}; prints one JSON line
 * {requests, errors, rps, p50Ms, p99Ms, total}: `requests` in the measured window, `total`
 * including the warm-up (what a relay's CPU time is divided by). Keep-alive connections, each
 * a closed loop of request, whole response, next request.
 */
import { Agent, request } from 'node:http';

interface LoadSpec {
  host: string;
  port: number;
  path?: string;
  headers?: Record<string, string>;
  connections: number;
  durationMs: number;
  warmupMs?: number;
}

function once(agent: Agent, spec: LoadSpec): Promise<void> {
  return new Promise((resolve, reject) => {
    const req = request(
      { host: spec.host, port: spec.port, path: spec.path ?? '/', headers: spec.headers ?? {}, agent },
      (res) => {
        res.resume();
        res.on('end', () =>
          res.statusCode === 200 ? resolve() : reject(new Error(`HTTP ${res.statusCode}`)),
        );
        res.on('error', reject);
      },
    );
    req.on('error', reject);
    req.end();
  });
}

async function main(): Promise<void> {
  const spec = JSON.parse(process.argv[2] ?? '{}') as LoadSpec;
  const agent = new Agent({ keepAlive: true, maxSockets: spec.connections });
  const start = performance.now();
  const measureFrom = start + (spec.warmupMs ?? 500);
  const end = measureFrom + spec.durationMs;
  const lat: number[] = [];
  let errors = 0;
  let total = 0;
  const worker = async (): Promise<void> => {
    for (;;) {
      const t = performance.now();
      if (t >= end) return;
      try {
        await once(agent, spec);
        total++;
        if (t >= measureFrom) lat.push(performance.now() - t);
      } catch {
        errors++;
      }
    }
  };
  await Promise.all(Array.from({ length: spec.connections }, worker));
  agent.destroy();
  lat.sort((a, b) => a - b);
  const q = (p: number): number => lat[Math.min(lat.length - 1, Math.floor(p * lat.length))] ?? NaN;
  process.stdout.write(
    `${JSON.stringify({ requests: lat.length, errors, rps: lat.length / (spec.durationMs / 1000), p50Ms: q(0.5), p99Ms: q(0.99), total })}\n`,
  );
}

await main();
