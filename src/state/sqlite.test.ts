import { after, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { DEFAULT_POLICY, type Sandbox } from '../domain/sandbox.js';
import { SqliteStateStore } from './sqlite.js';

function sandbox(id: string, tenant = 't1', name = id): Sandbox {
  return {
    id,
    tenant,
    name,
    state: 'creating',
    spec: {
      source: { kind: 'rootfs', path: '/srv/rootfs' },
      command: ['sh', '-c', 'sleep 1000'],
      env: { A: 'b' },
      ports: [{ port: 8080, public: false }],
      memoryBytes: 512 * 1024 ** 2,
      cpus: 1,
      policy: { ...DEFAULT_POLICY },
    },
    createdAt: 1000,
    stateSince: 1000,
    lastActiveAt: 1000,
    memoryBytes: 0,
  };
}

describe('SqliteStateStore', () => {
  const dirs: string[] = [];
  after(async () => {
    for (const d of dirs) await rm(d, { recursive: true, force: true });
  });

  test('sandboxes, transitions and checkpoints survive a reopen (a daemon restart)', async () => {
    const dir = await mkdtemp(join(tmpdir(), 'dormant-state-'));
    dirs.push(dir);
    const file = join(dir, 'state.db');
    let db = new SqliteStateStore(file);
    db.insertSandbox(sandbox('sb-a'), 'created');
    assert.equal(
      db.transition('sb-a', 'creating', 'running', 'started', 2000, { address: '10.88.0.2' }),
      true,
    );
    db.insertCheckpoint({
      id: 'ck-1',
      sandboxId: 'sb-a',
      tenant: 't1',
      createdAt: 3000,
      kind: 'memory',
      logicalBytes: 100,
      storedBytes: 40,
      meta: { arch: 'x86_64' },
    });
    db.close();

    db = new SqliteStateStore(file);
    const s = db.getSandbox('sb-a');
    assert.equal(s?.state, 'running');
    assert.equal(s?.stateSince, 2000);
    assert.equal(s?.address, '10.88.0.2');
    assert.deepEqual(s?.spec.command, ['sh', '-c', 'sleep 1000']);
    assert.deepEqual(
      db.transitions({ sandboxId: 'sb-a' }).map((t) => [t.from, t.to, t.reason]),
      [
        [null, 'creating', 'created'],
        ['creating', 'running', 'started'],
      ],
    );
    assert.equal(db.listCheckpoints({ sandboxId: 'sb-a' })[0]?.storedBytes, 40);
    db.close();
  });

  test('a transition from a state the sandbox has left changes nothing', () => {
    const db = new SqliteStateStore(':memory:');
    db.insertSandbox(sandbox('sb-b'), 'created');
    assert.equal(db.transition('sb-b', 'creating', 'running', 'started', 2), true);
    assert.equal(db.transition('sb-b', 'creating', 'failed', 'late', 3), false);
    assert.equal(db.getSandbox('sb-b')?.state, 'running');
    assert.equal(db.transitions({ sandboxId: 'sb-b' }).length, 2);
    db.close();
  });

  test('names are unique per tenant, not across tenants', () => {
    const db = new SqliteStateStore(':memory:');
    db.insertSandbox(sandbox('sb-c', 't1', 'web'), 'created');
    db.insertSandbox(sandbox('sb-d', 't2', 'web'), 'created');
    assert.throws(() => db.insertSandbox(sandbox('sb-e', 't1', 'web'), 'created'), /UNIQUE/);
    assert.deepEqual(
      db.listSandboxes('t1').map((s) => s.id),
      ['sb-c'],
    );
    db.close();
  });

  test('deleting a sandbox removes its checkpoints and records the end', () => {
    const db = new SqliteStateStore(':memory:');
    db.insertSandbox(sandbox('sb-f'), 'created');
    db.insertCheckpoint({
      id: 'ck-2',
      sandboxId: 'sb-f',
      tenant: 't1',
      createdAt: 1,
      kind: 'memory',
      logicalBytes: 1,
      storedBytes: 1,
      meta: {},
    });
    db.deleteSandbox('sb-f', 'rm', 5);
    assert.equal(db.getSandbox('sb-f'), undefined);
    assert.equal(db.getCheckpoint('ck-2'), undefined);
    assert.equal(db.transitions({ sandboxId: 'sb-f' }).at(-1)?.to, 'deleting');
    db.close();
  });
});

describe('metering facts in SQLite', () => {
  test('samples and deleted checkpoints persist, so a restart reports the same cost', async () => {
    const { computeCost } = await import('../domain/cost.js');
    const dir = await mkdtemp(join(tmpdir(), 'dormant-state-meter-'));
    try {
      const file = join(dir, 'state.db');
      let db = new SqliteStateStore(file);
      db.insertSandbox({ ...sandbox('sb-m'), createdAt: 0, stateSince: 0 }, 'created');
      db.transition('sb-m', 'creating', 'running', 'started', 1000);
      db.insertSamples([
        { sandboxId: 'sb-m', at: 1000, memoryBytes: 1024 ** 3, cpuUsageUsec: 0 },
        { sandboxId: 'sb-m', at: 61_000, memoryBytes: 1024 ** 3, cpuUsageUsec: 2_000_000 },
      ]);
      db.insertCheckpoint({
        id: 'ck-m',
        sandboxId: 'sb-m',
        tenant: 't1',
        createdAt: 61_000,
        kind: 'memory',
        logicalBytes: 10,
        storedBytes: 1024 ** 3,
        meta: {},
      });
      db.transition('sb-m', 'running', 'hibernated', 'policy', 62_000);
      db.deleteCheckpoint('ck-m', 100_000);
      assert.equal(db.getCheckpoint('ck-m'), undefined, 'a deleted checkpoint is not listed');
      const prices = {
        currency: 'USD',
        nodeCostPerHour: 1,
        nodeVcpus: 1,
        nodeMemoryBytes: 1024 ** 3,
        cpuShare: 0.5,
        storagePerGiBMonth: 1,
      };
      const report = () =>
        computeCost({
          transitions: db.transitions(),
          samples: db.samples(),
          checkpoints: db.checkpointHistory().map((c) => ({
            sandboxId: c.sandboxId,
            createdAt: c.createdAt,
            storedBytes: c.storedBytes,
            ...(c.deletedAt !== undefined ? { deletedAt: c.deletedAt } : {}),
          })),
          prices,
          since: 0,
          until: 200_000,
        });
      const before = report();
      db.close();
      db = new SqliteStateStore(file);
      const after = report();
      assert.deepEqual(after, before);
      const s = after.sandboxes[0]!;
      assert.equal(s.cpuSeconds, 2);
      assert.equal(s.memoryGiBSeconds, 62, '1 s creating (backfilled) + 61 s running at 1 GiB');
      assert.ok(
        Math.abs(s.storageGiBMonths - 39 / (30 * 86400)) < 1e-12,
        'storage only while the checkpoint existed',
      );
      db.close();
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});

describe('GPU columns', () => {
  test('a database from before GPU sandboxes keeps its rows: no GPUs, policy keep-running', async () => {
    const dir = await mkdtemp(join(tmpdir(), 'dormant-state-gpu-'));
    try {
      const file = join(dir, 'state.db');
      // A database as the previous release left it: three migrations, one sandbox.
      const Database = (await import('better-sqlite3')).default;
      const old = new Database(file);
      old.exec(`CREATE TABLE sandboxes (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, name TEXT NOT NULL,
        state TEXT NOT NULL, spec TEXT NOT NULL, created_at INTEGER NOT NULL, state_since INTEGER NOT NULL,
        last_active_at INTEGER NOT NULL, checkpoint_id TEXT, last_error TEXT,
        memory_bytes INTEGER NOT NULL DEFAULT 0, address TEXT, UNIQUE (tenant, name));
        CREATE TABLE transitions (id INTEGER PRIMARY KEY AUTOINCREMENT, sandbox_id TEXT NOT NULL,
        tenant TEXT NOT NULL, from_state TEXT, to_state TEXT NOT NULL, at INTEGER NOT NULL, reason TEXT NOT NULL);
        CREATE TABLE checkpoints (id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL, tenant TEXT NOT NULL,
        created_at INTEGER NOT NULL, kind TEXT NOT NULL, logical_bytes INTEGER NOT NULL,
        stored_bytes INTEGER NOT NULL, meta TEXT NOT NULL);
        CREATE TABLE tokens (hash TEXT PRIMARY KEY, tenant TEXT NOT NULL, admin INTEGER NOT NULL,
        created_at INTEGER NOT NULL, revoked_at INTEGER);
        CREATE TABLE samples (sandbox_id TEXT NOT NULL, at INTEGER NOT NULL, memory_bytes INTEGER NOT NULL,
        cpu_usage_usec INTEGER NOT NULL);
        ALTER TABLE checkpoints ADD COLUMN deleted_at INTEGER;`);
      const s = sandbox('sb-old');
      old
        .prepare(
          'INSERT INTO sandboxes (id, tenant, name, state, spec, created_at, state_since, last_active_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)',
        )
        .run(s.id, s.tenant, s.name, 'running', JSON.stringify(s.spec), 1, 1, 1);
      old.pragma('user_version = 3');
      old.close();

      const db = new SqliteStateStore(file);
      const got = db.getSandbox('sb-old');
      assert.equal(got?.state, 'running');
      assert.equal(got.gpuPolicy, 'keep-running');
      assert.equal(got.gpus, undefined);
      db.insertSandbox({ ...sandbox('sb-gpu'), gpus: '0,1', gpuPolicy: 'filesystem-only' }, 'create');
      assert.deepEqual(
        [db.getSandbox('sb-gpu')?.gpus, db.getSandbox('sb-gpu')?.gpuPolicy],
        ['0,1', 'filesystem-only'],
      );
      db.updateSandbox('sb-gpu', { gpuPolicy: 'checkpoint' });
      assert.equal(db.getSandbox('sb-gpu')?.gpuPolicy, 'checkpoint');
      // A note is an event without a state change.
      db.note('sb-old', 'policy: not hibernated (GPU)', 5);
      const last = db.transitions({ sandboxId: 'sb-old' }).at(-1);
      assert.deepEqual(
        [last?.from, last?.to, last?.reason],
        ['running', 'running', 'policy: not hibernated (GPU)'],
      );
      assert.equal(db.getSandbox('sb-old')?.stateSince, 1, 'a note does not restart the state clock');
      db.close();
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});

describe('the lazy-restore marker', () => {
  test('survives a reopen until cleared, and a transition clears it with the state change', async () => {
    const dir = await mkdtemp(join(tmpdir(), 'dormant-state-'));
    try {
      const file = join(dir, 'state.db');
      let db = new SqliteStateStore(file);
      db.insertSandbox(sandbox('sb-a'), 'created');
      assert.equal(db.getSandbox('sb-a')?.lazyRestoreOf, undefined, 'none on a new sandbox');
      db.updateSandbox('sb-a', { lazyRestoreOf: 'ck-1' });
      db.close();
      db = new SqliteStateStore(file);
      assert.equal(db.getSandbox('sb-a')?.lazyRestoreOf, 'ck-1', 'durable: a restarted daemon sees it');
      db.transition('sb-a', 'creating', 'hibernated', 'back to its checkpoint', 3000, {
        lazyRestoreOf: undefined,
      });
      assert.equal(db.getSandbox('sb-a')?.lazyRestoreOf, undefined);
      assert.equal(db.getSandbox('sb-a')?.state, 'hibernated');
      db.close();
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});

describe('the sandbox query (GET /v1/sandboxes)', () => {
  const store = new SqliteStateStore(':memory:');
  const add = (
    id: string,
    o: { tenant?: string; at: number; state?: Sandbox['state']; labels?: Record<string, string> },
  ) => {
    const s = sandbox(id, o.tenant ?? 't1');
    s.createdAt = o.at;
    s.state = o.state ?? 'running';
    if (o.labels) s.spec.labels = o.labels;
    store.insertSandbox(s, 'create');
  };
  add('sb-c', { at: 2, labels: { team: 'search', tier: 'gold' } });
  add('sb-a', { at: 2, state: 'paused', labels: { team: 'search' } });
  add('sb-b', { at: 1, tenant: 't2', labels: { team: 'ads' } });
  add('sb-d', { at: 3, state: 'hibernated' });
  const ids = (q: Partial<Parameters<typeof store.querySandboxes>[0]>) =>
    store.querySandboxes({ limit: 100, ...q }).map((s) => s.id);

  test('filters by tenant, state, name and labels (value or presence), all together', () => {
    assert.deepEqual(ids({}), ['sb-b', 'sb-a', 'sb-c', 'sb-d'], 'created first, then by id');
    assert.deepEqual(ids({ tenant: 't1' }), ['sb-a', 'sb-c', 'sb-d']);
    assert.deepEqual(ids({ states: ['running'] }), ['sb-b', 'sb-c']);
    assert.deepEqual(ids({ states: ['paused', 'hibernated'] }), ['sb-a', 'sb-d']);
    assert.deepEqual(ids({ states: [] }), [], 'no state given: none matches');
    assert.deepEqual(ids({ name: 'sb-d' }), ['sb-d']);
    assert.deepEqual(ids({ labels: [['team', 'search']] }), ['sb-a', 'sb-c']);
    assert.deepEqual(ids({ labels: [['team']] }), ['sb-b', 'sb-a', 'sb-c']);
    assert.deepEqual(
      ids({
        labels: [
          ['team', 'search'],
          ['tier', 'gold'],
        ],
      }),
      ['sb-c'],
    );
    assert.deepEqual(
      ids({
        labels: [
          ['team', 'search'],
          ['tier', 'silver'],
        ],
      }),
      [],
    );
    assert.deepEqual(ids({ labels: [['team', 'search']], states: ['paused'], tenant: 't1' }), ['sb-a']);
  });

  test('pages: after a place in the order, at most limit, nothing twice', () => {
    const seen: string[] = [];
    let after: { createdAt: number; id: string } | undefined;
    for (;;) {
      const page = store.querySandboxes({ limit: 1, ...(after ? { after } : {}) });
      if (page.length === 0) break;
      seen.push(...page.map((s) => s.id));
      after = { createdAt: page[0]!.createdAt, id: page[0]!.id };
    }
    assert.deepEqual(seen, ['sb-b', 'sb-a', 'sb-c', 'sb-d']);
  });

  test("one sandbox's samples from a time on, led by the one before, with the disk's use", () => {
    store.insertSamples([
      { sandboxId: 'sb-a', at: 10, memoryBytes: 1, cpuUsageUsec: 100 },
      { sandboxId: 'sb-c', at: 15, memoryBytes: 9, cpuUsageUsec: 900 },
      { sandboxId: 'sb-a', at: 20, memoryBytes: 2, cpuUsageUsec: 200, diskBytes: 4096 },
      { sandboxId: 'sb-a', at: 30, memoryBytes: 3, cpuUsageUsec: 300, diskBytes: 8192 },
    ]);
    const got = store.sandboxSamples('sb-a', { since: 20, limit: 10 });
    assert.deepEqual(
      got.map((x) => [x.at, x.diskBytes]),
      [
        [10, undefined],
        [20, 4096],
        [30, 8192],
      ],
    );
    assert.deepEqual(
      store.sandboxSamples('sb-a', { since: 0, limit: 10 }).map((x) => x.at),
      [10, 20, 30],
    );
  });
});
