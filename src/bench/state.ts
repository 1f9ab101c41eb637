/**
 * The database of record in PostgreSQL against SQLite, in one run: the store's own calls (what
 * each API request and lifecycle step pays for its rows) on both, and the API's create,
 * hibernate, resume and listing on two daemons, one per store. PostgreSQL is a private server
 * on loopback (src/state/testing/postgres.ts, fsync off as tests run it): the figures are the
 * store's and the driver's cost, not a network's or a disk's.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { loadavg } from 'node:os';
import { join } from 'node:path';
import type { Daemon } from '../daemon/daemon.js';
import { DEFAULT_POLICY, type Sandbox } from '../domain/sandbox.js';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';
import { startTestDaemon, stopTestDaemon } from '../api/testing/daemon.js';
import { DormantClient } from '../sdk/client.js';
import { openPostgresStore } from '../state/postgres.js';
import { SqliteStateStore } from '../state/sqlite.js';
import type { StateStore } from '../state/store.js';
import { pgMissing, startPostgres, type TestPostgres } from '../state/testing/postgres.js';
import type { BenchRow, BenchSuite } from './harness.js';
import { median } from './harness.js';

type Side = 'sqlite' | 'postgres';
const SIDES: readonly Side[] = ['sqlite', 'postgres'];

function sandboxRow(i: number): Sandbox {
  return {
    id: `sb-${String(i).padStart(12, '0')}`,
    tenant: `t${i % 10}`,
    name: `box-${i}`,
    state: 'running',
    spec: {
      source: { kind: 'rootfs', path: '/srv/rootfs' },
      command: ['sh', '-c', 'sleep 1000'],
      env: { A: 'b' },
      ports: [{ port: 8080, public: false }],
      memoryBytes: 256 * 1024 ** 2,
      cpus: 1,
      policy: { ...DEFAULT_POLICY },
      labels: { team: `team-${i % 7}`, tier: i % 2 ? 'gold' : 'free' },
    },
    createdAt: 1_700_000_000_000 + i,
    stateSince: 1_700_000_000_000 + i,
    lastActiveAt: 1_700_000_000_000 + i,
    memoryBytes: 0,
  };
}

/** Median µs per call of `fn(i)` over `n` calls. */
async function perCallUs(n: number, fn: (i: number) => Promise<unknown>): Promise<number> {
  const us: number[] = [];
  for (let i = 0; i < n; i++) {
    const t0 = performance.now();
    await fn(i);
    us.push((performance.now() - t0) * 1000);
  }
  return median(us);
}

/** The store's calls, each timed alone, on `n` sandboxes. */
async function storeCalls(store: StateStore, n: number): Promise<Record<string, number>> {
  const out: Record<string, number> = {};
  out.insert = await perCallUs(n, (i) => store.insertSandbox(sandboxRow(i), 'bench'));
  out.get = await perCallUs(n, (i) => store.getSandbox(sandboxRow((i * 7919) % n).id));
  out.transition = await perCallUs(n, (i) =>
    store.transition(sandboxRow(i).id, 'running', 'paused', 'bench', 1_800_000_000_000 + i),
  );
  out.atomically = await perCallUs(n, (i) =>
    store.atomically(async (tx) => {
      const s = await tx.getSandbox(sandboxRow(i).id);
      await tx.updateSandbox(sandboxRow(i).id, { lastActiveAt: (s?.lastActiveAt ?? 0) + 1 });
    }),
  );
  out.page = await perCallUs(50, () =>
    store.querySandboxes({ tenant: 't3', labels: [['tier', 'gold']], limit: 100 }),
  );
  out.list = await perCallUs(20, () => store.listSandboxes());
  out.events = await perCallUs(50, (i) => store.transitions({ sinceId: (i * 37) % n, limit: 100 }));
  return out;
}

export const stateSuite: BenchSuite = {
  name: 'state',
  async run({ quick }) {
    const title = 'PostgreSQL state against SQLite';
    const missing = await pgMissing();
    if (missing !== undefined)
      return { title, description: 'not run', rows: [], notes: [`not run: ${missing}`] };
    const loadAtStart = loadavg()[0] ?? 0;
    const n = quick ? 300 : 1000;
    const rounds = quick ? 3 : 7;
    const dir = await mkdtemp('/tmp/dormant-bench-state-');
    let server: TestPostgres | undefined;
    const calls = {} as Record<Side, Record<string, number>>;
    const api: Record<Side, Record<'create' | 'hibernate' | 'resume' | 'list', number[]>> = {
      sqlite: { create: [], hibernate: [], resume: [], list: [] },
      postgres: { create: [], hibernate: [], resume: [], list: [] },
    };
    const daemons: Partial<Record<Side, Daemon>> = {};
    try {
      server = await startPostgres();
      // The store on its own: a fresh database each.
      const sqlite = new SqliteStateStore(join(dir, 'calls.db'));
      calls.sqlite = await storeCalls(sqlite, n);
      await sqlite.close();
      const pg = await openPostgresStore(await server.createDatabase('calls'));
      calls.postgres = await storeCalls(pg, n);
      await pg.close();

      // Through the API, a daemon per store, rounds alternated.
      const rootfs = join(dir, 'rootfs');
      await buildBusyboxRootfs(rootfs);
      daemons.sqlite = (await startTestDaemon({ dataDir: join(dir, 'sqlite') })).daemon;
      daemons.postgres = (
        await startTestDaemon({
          dataDir: join(dir, 'postgres'),
          state: { url: await server.createDatabase('node') },
        })
      ).daemon;
      const clients = Object.fromEntries(
        SIDES.map((s) => [s, new DormantClient({ url: daemons[s]!.url, token: daemons[s]!.adminToken })]),
      ) as Record<Side, DormantClient>;
      const timed = async (side: Side, op: keyof (typeof api)['sqlite'], fn: () => Promise<unknown>) => {
        await new Promise((r) => setTimeout(r, 300));
        const t0 = performance.now();
        await fn();
        api[side][op].push(performance.now() - t0);
      };
      for (let r = 0; r < rounds; r++) {
        for (const side of SIDES) {
          const c = clients[side];
          let id = '';
          await timed(side, 'create', async () => {
            id = (
              await c.createSandbox({
                rootfs,
                command: ['/bin/sh', '-c', 'while true; do sleep 1; done'],
                memory: '64M',
              })
            ).id;
          });
          await timed(side, 'hibernate', () => c.hibernate(id));
          await timed(side, 'resume', () => c.resume(id));
          await timed(side, 'list', () => c.listSandboxes());
        }
      }
    } finally {
      for (const side of SIDES) await stopTestDaemon(daemons[side]).catch(() => undefined);
      await server?.stop().catch(() => undefined);
      await rm(dir, { recursive: true, force: true });
    }

    const callRow = (name: string, k: string): BenchRow => ({
      name,
      dormant: Math.round(calls.postgres[k]!),
      peer: Math.round(calls.sqlite[k]!),
      peerName: 'SQLite',
      unit: 'µs',
      better: 'lower',
    });
    const apiRow = (name: string, k: keyof (typeof api)['sqlite']): BenchRow => ({
      name,
      dormant: Math.round(median(api.postgres[k])),
      peer: Math.round(median(api.sqlite[k])),
      peerName: 'SQLite',
      unit: 'ms',
      better: 'lower',
    });
    const rows = [
      callRow('insertSandbox', 'insert'),
      callRow('getSandbox', 'get'),
      callRow('transition (compare-and-set and its event row)', 'transition'),
      callRow('atomically: read a sandbox, write it back', 'atomically'),
      callRow(`querySandboxes: a tenant's page of 100 by label, of ${n}`, 'page'),
      callRow(`listSandboxes: all ${n}`, 'list'),
      callRow('transitions: a page of 100 events after an id', 'events'),
      apiRow('API create (busybox, a shell loop)', 'create'),
      apiRow('API hibernate', 'hibernate'),
      apiRow('API resume', 'resume'),
      apiRow(`API list (the daemon's sandboxes)`, 'list'),
    ];
    return {
      title,
      description: `The state store's calls, each timed alone (median µs), on ${n} sandboxes in a fresh SQLite file (the peer; WAL, synchronous=FULL) and in a fresh PostgreSQL database on a private loopback server (fsync off, as the tests run it); then two daemons, one per store, each creating, hibernating, resuming and listing a small sandbox through the API, ${rounds} rounds alternated, medians. dormant column: PostgreSQL.`,
      rows,
      notes: [
        `load average ${loadAtStart.toFixed(1)} at the start (2 cores, shared with the server): figures move with it`,
        'PostgreSQL is reached over TCP on loopback: every call is a round trip to another process, where SQLite reads its file in this one. A fleet pays that for sharing one database between nodes; a node alone keeps SQLite',
      ],
    };
  },
};
