/**
 * A fleet's control loop at size: what one node's renewal, own-sandbox listing, wake placement
 * and claim, and taking back a lost node cost, on a real PostgreSQL holding S sandboxes over N
 * nodes, at a small fleet and a big one with the same sandboxes per node (and a third point with
 * ten times as many per node). The claim checked: a node's cost per change follows the
 * changes and its own sandboxes, not the fleet's size. The runtimes are fakes
 * (control/testing/fakes.ts): what is measured is the database side the controller pays.
 */
import { mkdir, mkdtemp, rm } from 'node:fs/promises';
import { loadavg } from 'node:os';
import { join } from 'node:path';
import pg from 'pg';
import { LifecycleContext } from '../control/context.js';
import { reclaimLostNode } from '../control/ops/nodes.js';
import { FakeHost, FakeRuntime, FakeVault, Faults, VaultData, noGpu } from '../control/testing/fakes.js';
import { placeWake, type NodeCapacity } from '../domain/node.js';
import { DEFAULT_POLICY, type Sandbox } from '../domain/sandbox.js';
import { openPostgresStore, type PostgresStateStore } from '../state/postgres.js';
import type { FleetStore } from '../state/store.js';
import { pgMissing, startPostgres, type TestPostgres } from '../state/testing/postgres.js';
import type { BenchRow, BenchSuite } from './harness.js';

/** One fleet size. */
interface Point {
  sandboxes: number;
  nodes: number;
}

/** Milliseconds per operation, p50 and p95, over the repetitions. */
interface Dist {
  p50: number;
  p95: number;
  n: number;
}

type Op = 'renew' | 'own' | 'place' | 'claim' | 'reclaim';
type Figures = Record<Op, Dist>;

const LEASE_MS = 30_000;
const MiB = 1024 ** 2;
const CAPACITY: NodeCapacity = { memoryBytes: 64 * 1024 * MiB, cpus: 32, arch: 'x86_64', runtimes: ['runc'] };

const nodeName = (i: number): string => `n${String(i).padStart(3, '0')}`;

function pct(xs: number[], q: number): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor(s.length * q))]!;
}

function dist(xs: number[]): Dist {
  return { p50: pct(xs, 0.5), p95: pct(xs, 0.95), n: xs.length };
}

async function times(n: number, fn: (i: number) => Promise<unknown>): Promise<number[]> {
  const ms: number[] = [];
  for (let i = 0; i < n; i++) {
    const t0 = performance.now();
    await fn(i);
    ms.push(performance.now() - t0);
  }
  return ms;
}

/**
 * Sandbox `i` of the fleet: on node i mod N; of each node's sandboxes three in ten running
 * (with memory in use), the rest hibernated; every one has a memory checkpoint (what a lost
 * node's go back to).
 */
function sandboxRow(i: number, nodes: number): Sandbox {
  const running = Math.floor(i / nodes) % 10 < 3;
  const id = `sb-${String(i).padStart(12, '0')}`;
  return {
    id,
    tenant: `t${i % 20}`,
    name: `box-${i}`,
    state: running ? 'running' : 'hibernated',
    node: nodeName(i % nodes),
    spec: {
      source: { kind: 'rootfs', path: '/srv/rootfs' },
      command: ['sh', '-c', 'sleep 1000'],
      env: { A: 'b' },
      ports: [{ port: 8080, public: false }],
      memoryBytes: 256 * MiB,
      cpus: 1,
      policy: { ...DEFAULT_POLICY },
      labels: { team: `team-${i % 7}` },
    },
    createdAt: 1_700_000_000_000 + i,
    stateSince: 1_700_000_000_000 + i,
    lastActiveAt: 1_700_000_000_000 + i,
    memoryBytes: running ? 200 * MiB : 0,
    ...(running ? {} : { checkpointId: `ck-${id}` }),
  };
}

/** Registers the nodes and inserts the sandboxes (with their checkpoints), then lets the planner see them. */
async function populate(store: PostgresStateStore, url: string, p: Point): Promise<void> {
  const fleet = store.fleet;
  for (let n = 0; n < p.nodes; n++)
    await fleet.registerNode(
      {
        name: nodeName(n),
        url: `http://10.0.${n >> 8}.${n & 255}:7420`,
        capacity: CAPACITY,
        startedAt: Date.now(),
      },
      LEASE_MS,
    );
  // A few connections at once: filling is not what is measured.
  const lanes = 4;
  await Promise.all(
    Array.from({ length: lanes }, async (_, lane) => {
      for (let i = lane; i < p.sandboxes; i += lanes) {
        const s = sandboxRow(i, p.nodes);
        await store.insertSandbox(s, 'bench');
        await store.insertCheckpoint({
          id: `ck-${s.id}`,
          sandboxId: s.id,
          tenant: s.tenant,
          createdAt: s.createdAt + 1,
          kind: 'memory',
          logicalBytes: 256 * MiB,
          storedBytes: 40 * MiB,
          meta: { arch: 'x86_64' },
        });
      }
    }),
  );
  // A database that has been running a while has its statistics and visibility map; a fresh
  // one would be planned blind.
  const c = new pg.Client({ connectionString: url });
  await c.connect();
  try {
    await c.query('VACUUM ANALYZE');
  } finally {
    await c.end();
  }
}

/** One fleet size: populate, then time each operation as one node (n000's neighbours) would. */
async function measure(server: TestPostgres, p: Point, dir: string, quick: boolean): Promise<Figures> {
  const url = await server.createDatabase(`fleet_${p.sandboxes}_${p.nodes}`);
  const store = await openPostgresStore(url);
  try {
    await populate(store, url, p);
    const fleet: FleetStore = store.fleet;
    const perNode = p.sandboxes / p.nodes;
    const ctxFor = async (node: string): Promise<LifecycleContext> => {
      const hostDir = join(dir, `host-${p.sandboxes}-${p.nodes}-${node}`);
      await mkdir(hostDir, { recursive: true });
      const faults = new Faults();
      return new LifecycleContext({
        store,
        node,
        runtime: new FakeRuntime(new FakeHost(hostDir), faults),
        vault: new FakeVault(new VaultData(), faults),
        stagingDir: join(hostDir, 'staging'),
        gpu: noGpu,
        lazyRestore: false,
      });
    };
    const me = nodeName(1);
    const ctx = await ctxFor(me);
    const reps = quick ? 0.3 : 1;
    const r = (n: number): number => Math.max(5, Math.round(n * reps));

    // (a) A renewal tick: the lease extended, and the expired nodes looked for.
    const renew = await times(r(300), async () => {
      await fleet.renewNode(me, LEASE_MS);
      await fleet.expiredNodes();
    });
    // (b) The node's own sandboxes: what reconcile, the idle policy and the meter go over.
    const own = await times(r(60), async () => {
      const xs = await ctx.own();
      if (xs.length !== perNode) throw new Error(`node ${me} lists ${xs.length} sandboxes, not ${perNode}`);
    });
    // (c) A wake: placement (the nodes with their counts, then placeWake) for a sleeping
    // sandbox of another node, then the claim (hibernated to resuming, becoming this node's).
    // Each claim is undone afterwards, untimed, so the fleet stays as it was.
    const sleeping = (k: number): Sandbox => {
      // The (10m + 5)th sandbox of node k mod N: a hibernated one (sandboxRow).
      const m = (k * 37) % (perNode / 10);
      return sandboxRow((m * 10 + 5) * p.nodes + (k % p.nodes), p.nodes);
    };
    const place = await times(r(100), async (k) => {
      const s = sleeping(k);
      const at = placeWake(await fleet.listNodes({ counts: false }), s.node, me);
      if (at === undefined) throw new Error('no node to wake on');
    });
    const claim: number[] = [];
    for (let k = 0; k < r(200); k++) {
      const s = sleeping(k * 13);
      const t0 = performance.now();
      const won = await store.transition(
        s.id,
        'hibernated',
        'resuming',
        'bench wake',
        Date.now(),
        ctx.placed(),
      );
      claim.push(performance.now() - t0);
      if (!won) throw new Error(`claim of ${s.id} lost`);
      await store.transition(s.id, 'resuming', 'hibernated', 'bench undo', Date.now(), { node: s.node! });
    }
    // (d) Lost nodes taken back, one after another, each by another node: its lease made to
    // have run out, then reclaimLostNode (the mark, and each awake sandbox back to its
    // checkpoint). Per sandbox of the lost node (its sleeping ones move in the mark's statement).
    const reclaim: number[] = [];
    const losses = Math.min(quick ? 2 : 8, p.nodes - 2);
    for (let k = 0; k < losses; k++) {
      const lost = nodeName(p.nodes - 1 - k);
      await fleet.renewNode(lost, -1_000);
      const t0 = performance.now();
      const back = await reclaimLostNode(ctx, lost);
      const ms = performance.now() - t0;
      const awake = (perNode * 3) / 10;
      if (back.length !== awake || back.some((b) => b.to !== 'hibernated'))
        throw new Error(`node ${lost}: ${back.length} sandboxes taken back, expected about ${awake}`);
      reclaim.push(ms / perNode);
    }
    return {
      renew: dist(renew),
      own: dist(own),
      place: dist(place),
      claim: dist(claim),
      reclaim: dist(reclaim),
    };
  } finally {
    await store.close();
  }
}

const OPS: { op: Op; name: (p: Point) => string }[] = [
  { op: 'renew', name: () => '(a) renewal tick: renewNode + expiredNodes' },
  { op: 'own', name: (p) => `(b) own sandboxes (querySandboxes node, ${p.sandboxes / p.nodes} of them)` },
  { op: 'place', name: () => '(c) wake placement: listNodes + placeWake' },
  { op: 'claim', name: () => '(c) wake claim: hibernated to resuming, node set' },
  { op: 'reclaim', name: () => '(d) lost node taken back, per sandbox of it' },
];

const label = (p: Point): string =>
  `${p.sandboxes >= 1000 ? `${p.sandboxes / 1000}k` : p.sandboxes}/${p.nodes}`;

export const fleetSuite: BenchSuite = {
  name: 'fleet',
  async run({ quick }) {
    const title = 'A fleet control loop at 10k sandboxes and 100 nodes';
    const missing = await pgMissing();
    if (missing !== undefined)
      return { title, description: 'not run', rows: [], notes: [`not run: ${missing}`] };
    const small: Point = { sandboxes: 1000, nodes: 10 };
    const big: Point = { sandboxes: 10_000, nodes: 100 };
    const dense: Point = { sandboxes: 10_000, nodes: 10 };
    const loadAtStart = loadavg()[0] ?? 0;
    const dir = await mkdtemp('/tmp/dormant-bench-fleet-');
    let server: TestPostgres | undefined;
    const figs = new Map<Point, Figures>();
    const started = performance.now();
    try {
      server = await startPostgres();
      for (const p of [small, big, dense]) {
        process.stderr.write(`bench: fleet ${label(p)}...\n`);
        figs.set(p, await measure(server, p, dir, quick));
      }
    } finally {
      await server?.stop().catch(() => undefined);
      await rm(dir, { recursive: true, force: true });
    }
    const loadAtEnd = loadavg()[0] ?? 0;
    const round = (x: number): number => Math.round(x * 1000) / 1000;
    const rows: BenchRow[] = [];
    const compare = (a: Point, b: Point, ops: Op[]): void => {
      for (const { op, name } of OPS.filter((o) => ops.includes(o.op)))
        for (const q of ['p50', 'p95'] as const)
          rows.push({
            name: `${name(a)}, ${q}: ${label(a)} vs ${label(b)}`,
            dormant: round(figs.get(a)![op][q]),
            peer: round(figs.get(b)![op][q]),
            peerName: label(b),
            unit: 'ms',
            better: 'lower',
          });
    };
    compare(big, small, ['renew', 'own', 'place', 'claim', 'reclaim']);
    compare(dense, big, ['own', 'place', 'reclaim']);
    const growth = (a: Point, b: Point, ops: Op[]): string =>
      ops.map((op) => `${op} ${(figs.get(a)![op].p50 / figs.get(b)![op].p50).toFixed(2)}x`).join(', ');
    const reps = (p: Point): string => OPS.map(({ op }) => `${op} ${figs.get(p)![op].n}`).join(', ');
    return {
      title,
      description: `One node's control loop on a private PostgreSQL (loopback, fsync off, as the tests run it) holding S sandboxes over N nodes (three in ten running, the rest hibernated, each with a memory checkpoint; VACUUM ANALYZE after filling), written as S/N: ${label(small)} and ${label(big)} (100 sandboxes per node both), and ${label(dense)} (1000 per node). The controller's LifecycleContext over fake runtimes, node set, for the own-sandbox listing and reclaimLostNode; the store's calls the controller makes for the rest. ms per operation, p50 and p95. The dormant column is the bigger fleet, the peer column the smaller; the last column is the smaller's figure over the bigger's ("0.50x worse": the bigger fleet costs twice as much), and the notes give the growth as big over small.`,
      rows,
      notes: [
        `growth at p50, ${label(big)} over ${label(small)} (same sandboxes per node, ten times the fleet): ${growth(big, small, ['renew', 'own', 'place', 'claim', 'reclaim'])}; ${label(dense)} over ${label(big)} (same fleet, ten times the sandboxes per node): ${growth(dense, big, ['own', 'place', 'reclaim'])}`,
        `(d) a whole lost node at p50: ${[small, big, dense].map((p) => `${(figs.get(p)!.reclaim.p50 * (p.sandboxes / p.nodes)).toFixed(0)} ms for ${p.sandboxes / p.nodes} sandboxes (${label(p)})`).join(', ')}`,
        `repetitions: ${reps(small)} at ${label(small)}; ${reps(big)} at ${label(big)}; ${reps(dense)} at ${label(dense)} ((d): one lost node each, its time divided by its sandboxes)`,
        `load average ${loadAtStart.toFixed(1)} at the start, ${loadAtEnd.toFixed(1)} at the end (2 cores shared with the server; the lead may have been running the full CI meanwhile): absolute figures move with it, the ratios less`,
        `the suite took ${((performance.now() - started) / 1000).toFixed(0)} s, filling the databases included`,
      ],
    };
  },
};
