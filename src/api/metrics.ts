/**
 * GET /metrics (Prometheus text; admin token): sandboxes by state, memory held, transitions,
 * hibernate and resume durations, HTTP requests.
 *
 * Transition counters and the duration histograms are read from the store's transitions
 * (the record every state change already leaves) rather than by hooking the controller:
 * at each scrape the new transitions since the last one are folded in, and a hibernate's
 * duration is the time between entering `hibernating` and leaving it for `hibernated`
 * (a resume's: `resuming` to `running`). Counts start when the daemon starts.
 */
import type { FastifyInstance } from 'fastify';
import { Counter, Gauge, Histogram, Registry, collectDefaultMetrics } from 'prom-client';
import type { SandboxController } from '../control/sandboxes.js';
import type { SandboxState } from '../domain/sandbox.js';
import type { StateStore } from '../state/store.js';
import { requireAdmin } from './routes-tokens.js';

export interface MetricsOptions {
  store: StateStore;
  controller: SandboxController;
  /** Node process metrics (heap, event loop lag). Default true. */
  processMetrics?: boolean;
}

const STATES: SandboxState[] = [
  'creating',
  'running',
  'paused',
  'hibernating',
  'hibernated',
  'resuming',
  'archived',
  'deleting',
  'failed',
];

/** Seconds: a hibernate of a small sandbox takes about 1 s, a large one a minute. */
const DURATION_BUCKETS = [0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300];

export function registerMetrics(app: FastifyInstance, opts: MetricsOptions): Registry {
  const { store, controller } = opts;
  // A registry per server: tests run several daemons in one process.
  const registry = new Registry();
  if (opts.processMetrics ?? true) collectDefaultMetrics({ register: registry, prefix: 'dormant_process_' });

  new Gauge({
    name: 'dormant_sandboxes',
    help: 'Sandboxes by state',
    labelNames: ['state'] as const,
    registers: [registry],
    async collect() {
      const counts = new Map<string, number>(STATES.map((s) => [s, 0]));
      for (const s of await store.listSandboxes()) counts.set(s.state, (counts.get(s.state) ?? 0) + 1);
      for (const [state, n] of counts) this.set({ state }, n);
    },
  });
  new Gauge({
    name: 'dormant_sandbox_memory_bytes',
    help: 'Memory held by running and paused sandboxes, from their cgroups',
    registers: [registry],
    async collect() {
      let total = 0;
      for (const s of await store.listSandboxes()) {
        if (s.state !== 'running' && s.state !== 'paused') continue;
        // A sandbox that stops or goes between the list and the read holds nothing: 0 is right.
        total += (await controller.usage(s.id).catch(() => undefined))?.memoryBytes ?? 0;
      }
      this.set(total);
    },
  });
  new Gauge({
    name: 'dormant_sandbox_egress_bytes',
    help: 'Bytes the current sandboxes sent beyond the node, from their egress counters (docs/NETWORK.md)',
    registers: [registry],
    async collect() {
      let total = 0;
      for (const n of (await controller.egressBytes().catch(() => new Map<string, number>())).values())
        total += n;
      this.set(total);
    },
  });

  const transitions = new Counter({
    name: 'dormant_transitions_total',
    help: 'State transitions since the daemon started',
    labelNames: ['from', 'to'] as const,
    registers: [registry],
  });
  const hibernate = new Histogram({
    name: 'dormant_hibernate_duration_seconds',
    help: 'From entering hibernating to hibernated',
    buckets: DURATION_BUCKETS,
    registers: [registry],
  });
  const resume = new Histogram({
    name: 'dormant_resume_duration_seconds',
    help: 'From entering resuming to running',
    buckets: DURATION_BUCKETS,
    registers: [registry],
  });
  // Transitions since the daemon started: counted from after the newest one on record then.
  const start = store.transitions({ limit: 1_000_000 }).then((all) => all.at(-1)?.id ?? 0);
  start.catch(() => undefined); // told by the first scrape, which waits for it
  let cursor: number | undefined;
  /** When each sandbox entered its current in-between state (hibernating, resuming). */
  const entered = new Map<string, number>();
  const foldOnce = async (): Promise<void> => {
    cursor ??= await start;
    for (;;) {
      const batch = await store.transitions({ sinceId: cursor, limit: 1000 });
      for (const t of batch) {
        cursor = t.id;
        transitions.inc({ from: t.from ?? 'none', to: t.to });
        const since = entered.get(t.sandboxId);
        if (since !== undefined) {
          if (t.from === 'hibernating' && t.to === 'hibernated') hibernate.observe((t.at - since) / 1000);
          if (t.from === 'resuming' && t.to === 'running') resume.observe((t.at - since) / 1000);
        }
        if (t.to === 'hibernating' || t.to === 'resuming') entered.set(t.sandboxId, t.at);
        else entered.delete(t.sandboxId);
      }
      if (batch.length < 1000) return;
    }
  };
  // One fold at a time: two scrapes folding the same batch would count it twice.
  let folded: Promise<void> = Promise.resolve();
  const fold = (): Promise<void> => {
    const run = folded.then(foldOnce);
    folded = run.catch(() => undefined);
    return run;
  };

  const requests = new Counter({
    name: 'dormant_http_requests_total',
    help: 'HTTP requests answered',
    labelNames: ['method', 'route', 'status'] as const,
    registers: [registry],
  });
  const latency = new Histogram({
    name: 'dormant_http_request_duration_seconds',
    help: 'Time to answer an HTTP request (streams: to the headers)',
    labelNames: ['method', 'route'] as const,
    buckets: [0.005, 0.025, 0.1, 0.5, 1, 5, 30, 120],
    registers: [registry],
  });
  app.addHook('onResponse', async (req, reply) => {
    // The route's template (/v1/sandboxes/:id), never the raw URL: ids would explode the series.
    const route = req.routeOptions.url ?? 'unmatched';
    requests.inc({ method: req.method, route, status: String(reply.statusCode) });
    latency.observe({ method: req.method, route }, reply.elapsedTime / 1000);
  });

  app.get('/metrics', async (req, reply) => {
    requireAdmin(req, 'reading metrics');
    await fold();
    const text = await registry.metrics();
    return reply.type(registry.contentType).send(text);
  });
  return registry;
}
