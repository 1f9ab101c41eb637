import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { Sandbox } from '../domain/sandbox.js';
import { MIGRATIONS, SqliteStateStore } from './sqlite.js';
import type { StateStore } from './store.js';
import { sandbox as fixture, stateStoreContract } from './contract.js';

const sandbox = (id: string, tenant = 't1', name = id): Sandbox => fixture(id, { tenant, name });

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
    await db.insertSandbox(sandbox('sb-a'), 'created');
    assert.equal(
      await db.transition('sb-a', 'creating', 'running', 'started', 2000, { address: '10.88.0.2' }),
      true,
    );
    await db.insertCheckpoint({
      id: 'ck-1',
      sandboxId: 'sb-a',
      tenant: 't1',
      createdAt: 3000,
      kind: 'memory',
      logicalBytes: 100,
      storedBytes: 40,
      meta: { arch: 'x86_64' },
    });
    await db.close();

    db = new SqliteStateStore(file);
    const s = await db.getSandbox('sb-a');
    assert.equal(s?.state, 'running');
    assert.equal(s?.stateSince, 2000);
    assert.equal(s?.address, '10.88.0.2');
    assert.deepEqual(s?.spec.command, ['sh', '-c', 'sleep 1000']);
    assert.deepEqual(
      (await db.transitions({ sandboxId: 'sb-a' })).map((t) => [t.from, t.to, t.reason]),
      [
        [null, 'creating', 'created'],
        ['creating', 'running', 'started'],
      ],
    );
    assert.equal((await db.listCheckpoints({ sandboxId: 'sb-a' }))[0]?.storedBytes, 40);
    await db.close();
  });

  test('a transition from a state the sandbox has left changes nothing', async () => {
    const db = new SqliteStateStore(':memory:');
    await db.insertSandbox(sandbox('sb-b'), 'created');
    assert.equal(await db.transition('sb-b', 'creating', 'running', 'started', 2), true);
    assert.equal(await db.transition('sb-b', 'creating', 'failed', 'late', 3), false);
    assert.equal((await db.getSandbox('sb-b'))?.state, 'running');
    assert.equal((await db.transitions({ sandboxId: 'sb-b' })).length, 2);
    await db.close();
  });

  test('names are unique per tenant, not across tenants', async () => {
    const db = new SqliteStateStore(':memory:');
    await db.insertSandbox(sandbox('sb-c', 't1', 'web'), 'created');
    await db.insertSandbox(sandbox('sb-d', 't2', 'web'), 'created');
    await assert.rejects(db.insertSandbox(sandbox('sb-e', 't1', 'web'), 'created'), /UNIQUE/);
    assert.deepEqual(
      (await db.listSandboxes('t1')).map((s) => s.id),
      ['sb-c'],
    );
    await db.close();
  });

  test('deleting a sandbox removes its checkpoints and records the end', async () => {
    const db = new SqliteStateStore(':memory:');
    await db.insertSandbox(sandbox('sb-f'), 'created');
    await db.insertCheckpoint({
      id: 'ck-2',
      sandboxId: 'sb-f',
      tenant: 't1',
      createdAt: 1,
      kind: 'memory',
      logicalBytes: 1,
      storedBytes: 1,
      meta: {},
    });
    await db.deleteSandbox('sb-f', 'rm', 5);
    assert.equal(await db.getSandbox('sb-f'), undefined);
    assert.equal(await db.getCheckpoint('ck-2'), undefined);
    assert.equal((await db.transitions({ sandboxId: 'sb-f' })).at(-1)?.to, 'deleting');
    await db.close();
  });
});

describe('transactions (atomically)', () => {
  /** Lets every pending callback and timer run. */
  const quiet = () => new Promise((r) => setTimeout(r, 20));
  const isInternal = (e: unknown) => (e as { code?: string }).code === 'INTERNAL';

  test('a throw after awaits rolls back every write of the callback', async () => {
    const db = new SqliteStateStore(':memory:');
    await db.insertSandbox(sandbox('sb-keep'), 'created');
    await assert.rejects(
      db.atomically(async (tx) => {
        await tx.insertSandbox(sandbox('sb-gone'), 'created');
        await quiet();
        await tx.transition('sb-keep', 'creating', 'running', 'started', 2);
        await tx.templates().insertTemplate({
          id: 'tp-1',
          tenant: 't1',
          name: 'tpl',
          public: false,
          checkpointId: 'ck-1',
          spec: sandbox('x').spec,
          origin: 'test',
          createdAt: 1,
        });
        await quiet();
        throw new Error('changed my mind');
      }),
      /changed my mind/,
    );
    assert.equal(await db.getSandbox('sb-gone'), undefined);
    assert.equal((await db.getSandbox('sb-keep'))?.state, 'creating');
    assert.equal(await db.templates().getTemplate('tp-1'), undefined);
    assert.equal((await db.transitions()).length, 1, 'only the first insert is recorded');
    // And a callback that returns commits, its value passed on.
    const got = await db.atomically(async (tx) => {
      await tx.transition('sb-keep', 'creating', 'running', 'started', 2);
      return (await tx.getSandbox('sb-keep'))?.state;
    });
    assert.equal(got, 'running');
    assert.equal((await db.getSandbox('sb-keep'))?.state, 'running');
    await db.close();
  });

  test("another caller's calls wait for the open transaction: its write lands after it, not inside it", async () => {
    const db = new SqliteStateStore(':memory:');
    let release = (): void => undefined;
    const held = new Promise<void>((r) => (release = r));
    let opened = (): void => undefined;
    const open = new Promise<void>((r) => (opened = r));
    const tx = db.atomically(async (t) => {
      await t.insertSandbox(sandbox('sb-in-tx'), 'created');
      opened();
      await held;
      throw new Error('rolled back');
    });
    await open;
    // A second caller, outside the callback: it must not see the uncommitted row, nor write into
    // the transaction (whose rollback would take its write with it).
    const order: string[] = [];
    const read = db.getSandbox('sb-in-tx').then((s) => order.push(`read ${s ? 'seen' : 'none'}`));
    const write = db.insertSandbox(sandbox('sb-outside'), 'created').then(() => order.push('write'));
    await quiet();
    assert.deepEqual(order, [], 'both wait while the transaction is open');
    release();
    await assert.rejects(tx, /rolled back/);
    await Promise.all([read, write]);
    assert.deepEqual(order, ['read none', 'write']);
    assert.equal(await db.getSandbox('sb-in-tx'), undefined, 'rolled back');
    assert.equal((await db.getSandbox('sb-outside'))?.id, 'sb-outside', 'landed after the rollback');
    // Two transactions from two callers run one after the other.
    const log: string[] = [];
    await Promise.all(
      ['a', 'b'].map((k) =>
        db.atomically(async (t) => {
          log.push(`${k} begins`);
          await quiet();
          await t.note('sb-outside', k, 1);
          log.push(`${k} ends`);
        }),
      ),
    );
    assert.deepEqual(log, ['a begins', 'a ends', 'b begins', 'b ends']);
    await db.close();
  });

  test('the store itself called inside its callback (not the tx) is refused with INTERNAL, not a deadlock', async () => {
    const db = new SqliteStateStore(':memory:');
    await assert.rejects(
      db.atomically(async (tx) => {
        await tx.insertSandbox(sandbox('sb-x'), 'created');
        await db.getSandbox('sb-x');
      }),
      (e) => isInternal(e) && /must use the tx it is handed/.test((e as Error).message),
    );
    await assert.rejects(
      db.atomically(() => db.atomically(async () => undefined)),
      isInternal,
      'a nested atomically on the store, too',
    );
    assert.equal(await db.getSandbox('sb-x'), undefined, 'the transaction rolled back');
    // A tx kept past its transaction's end is refused too.
    let kept: StateStore | undefined;
    await db.atomically(async (tx) => {
      kept = tx;
    });
    await assert.rejects(kept!.listSandboxes(), isInternal);
    await db.close();
  });

  test('atomically on the tx runs in the same transaction; its throw undoes only its own writes', async () => {
    const db = new SqliteStateStore(':memory:');
    await db.atomically(async (tx) => {
      await tx.insertSandbox(sandbox('sb-outer'), 'created');
      await tx
        .atomically(async (inner) => {
          await inner.insertSandbox(sandbox('sb-inner'), 'created');
          throw new Error('inner fails');
        })
        .catch(() => undefined);
      await tx.atomically(async (inner) => inner.note('sb-outer', 'nested', 2));
    });
    assert.ok(await db.getSandbox('sb-outer'));
    assert.equal(await db.getSandbox('sb-inner'), undefined);
    assert.deepEqual(
      (await db.transitions({ sandboxId: 'sb-outer' })).map((t) => t.reason),
      ['created', 'nested'],
    );
    await db.close();
  });
});

describe('metering facts in SQLite', () => {
  test('samples and deleted checkpoints persist, so a restart reports the same cost', async () => {
    const { computeCost } = await import('../domain/cost.js');
    const dir = await mkdtemp(join(tmpdir(), 'dormant-state-meter-'));
    try {
      const file = join(dir, 'state.db');
      let db = new SqliteStateStore(file);
      await db.insertSandbox({ ...sandbox('sb-m'), createdAt: 0, stateSince: 0 }, 'created');
      await db.transition('sb-m', 'creating', 'running', 'started', 1000);
      await db.insertSamples([
        { sandboxId: 'sb-m', at: 1000, memoryBytes: 1024 ** 3, cpuUsageUsec: 0 },
        { sandboxId: 'sb-m', at: 61_000, memoryBytes: 1024 ** 3, cpuUsageUsec: 2_000_000 },
      ]);
      await db.insertCheckpoint({
        id: 'ck-m',
        sandboxId: 'sb-m',
        tenant: 't1',
        createdAt: 61_000,
        kind: 'memory',
        logicalBytes: 10,
        storedBytes: 1024 ** 3,
        meta: {},
      });
      await db.transition('sb-m', 'running', 'hibernated', 'policy', 62_000);
      await db.deleteCheckpoint('ck-m', 100_000);
      assert.equal(await db.getCheckpoint('ck-m'), undefined, 'a deleted checkpoint is not listed');
      const prices = {
        currency: 'USD',
        nodeCostPerHour: 1,
        nodeVcpus: 1,
        nodeMemoryBytes: 1024 ** 3,
        cpuShare: 0.5,
        storagePerGiBMonth: 1,
      };
      const report = async () =>
        computeCost({
          transitions: await db.transitions(),
          samples: await db.samples(),
          checkpoints: (await db.checkpointHistory()).map((c) => ({
            sandboxId: c.sandboxId,
            createdAt: c.createdAt,
            storedBytes: c.storedBytes,
            ...(c.deletedAt !== undefined ? { deletedAt: c.deletedAt } : {}),
          })),
          prices,
          since: 0,
          until: 200_000,
        });
      const before = await report();
      await db.close();
      db = new SqliteStateStore(file);
      const after = await report();
      assert.deepEqual(after, before);
      const s = after.sandboxes[0]!;
      assert.equal(s.cpuSeconds, 2);
      assert.equal(s.memoryGiBSeconds, 62, '1 s creating (backfilled) + 61 s running at 1 GiB');
      assert.ok(
        Math.abs(s.storageGiBMonths - 39 / (30 * 86400)) < 1e-12,
        'storage only while the checkpoint existed',
      );
      await db.close();
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
      const got = await db.getSandbox('sb-old');
      assert.equal(got?.state, 'running');
      assert.equal(got.gpuPolicy, 'keep-running');
      assert.equal(got.gpus, undefined);
      await db.insertSandbox({ ...sandbox('sb-gpu'), gpus: '0,1', gpuPolicy: 'filesystem-only' }, 'create');
      assert.deepEqual(
        [(await db.getSandbox('sb-gpu'))?.gpus, (await db.getSandbox('sb-gpu'))?.gpuPolicy],
        ['0,1', 'filesystem-only'],
      );
      await db.updateSandbox('sb-gpu', { gpuPolicy: 'checkpoint' });
      assert.equal((await db.getSandbox('sb-gpu'))?.gpuPolicy, 'checkpoint');
      // A note is an event without a state change.
      await db.note('sb-old', 'policy: not hibernated (GPU)', 5);
      const last = (await db.transitions({ sandboxId: 'sb-old' })).at(-1);
      assert.deepEqual(
        [last?.from, last?.to, last?.reason],
        ['running', 'running', 'policy: not hibernated (GPU)'],
      );
      assert.equal((await db.getSandbox('sb-old'))?.stateSince, 1, 'a note does not restart the state clock');
      await db.close();
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
      await db.insertSandbox(sandbox('sb-a'), 'created');
      assert.equal((await db.getSandbox('sb-a'))?.lazyRestoreOf, undefined, 'none on a new sandbox');
      await db.updateSandbox('sb-a', { lazyRestoreOf: 'ck-1' });
      await db.close();
      db = new SqliteStateStore(file);
      assert.equal(
        (await db.getSandbox('sb-a'))?.lazyRestoreOf,
        'ck-1',
        'durable: a restarted daemon sees it',
      );
      await db.transition('sb-a', 'creating', 'hibernated', 'back to its checkpoint', 3000, {
        lazyRestoreOf: undefined,
      });
      assert.equal((await db.getSandbox('sb-a'))?.lazyRestoreOf, undefined);
      assert.equal((await db.getSandbox('sb-a'))?.state, 'hibernated');
      await db.close();
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});

describe('the sandbox query (GET /v1/sandboxes)', () => {
  const store = new SqliteStateStore(':memory:');
  const add = async (
    id: string,
    o: { tenant?: string; at: number; state?: Sandbox['state']; labels?: Record<string, string> },
  ) => {
    const s = sandbox(id, o.tenant ?? 't1');
    s.createdAt = o.at;
    s.state = o.state ?? 'running';
    if (o.labels) s.spec.labels = o.labels;
    await store.insertSandbox(s, 'create');
  };
  before(async () => {
    await add('sb-c', { at: 2, labels: { team: 'search', tier: 'gold' } });
    await add('sb-a', { at: 2, state: 'paused', labels: { team: 'search' } });
    await add('sb-b', { at: 1, tenant: 't2', labels: { team: 'ads' } });
    await add('sb-d', { at: 3, state: 'hibernated' });
  });
  const ids = async (q: Partial<Parameters<typeof store.querySandboxes>[0]>) =>
    (await store.querySandboxes({ limit: 100, ...q })).map((s) => s.id);

  test('filters by tenant, state, name and labels (value or presence), all together', async () => {
    assert.deepEqual(await ids({}), ['sb-b', 'sb-a', 'sb-c', 'sb-d'], 'created first, then by id');
    assert.deepEqual(await ids({ tenant: 't1' }), ['sb-a', 'sb-c', 'sb-d']);
    assert.deepEqual(await ids({ states: ['running'] }), ['sb-b', 'sb-c']);
    assert.deepEqual(await ids({ states: ['paused', 'hibernated'] }), ['sb-a', 'sb-d']);
    assert.deepEqual(await ids({ states: [] }), [], 'no state given: none matches');
    assert.deepEqual(await ids({ name: 'sb-d' }), ['sb-d']);
    assert.deepEqual(await ids({ labels: [['team', 'search']] }), ['sb-a', 'sb-c']);
    assert.deepEqual(await ids({ labels: [['team']] }), ['sb-b', 'sb-a', 'sb-c']);
    assert.deepEqual(
      await ids({
        labels: [
          ['team', 'search'],
          ['tier', 'gold'],
        ],
      }),
      ['sb-c'],
    );
    assert.deepEqual(
      await ids({
        labels: [
          ['team', 'search'],
          ['tier', 'silver'],
        ],
      }),
      [],
    );
    assert.deepEqual(await ids({ labels: [['team', 'search']], states: ['paused'], tenant: 't1' }), ['sb-a']);
  });

  test('pages: after a place in the order, at most limit, nothing twice', async () => {
    const seen: string[] = [];
    let after: { createdAt: number; id: string } | undefined;
    for (;;) {
      const page = await store.querySandboxes({ limit: 1, ...(after ? { after } : {}) });
      if (page.length === 0) break;
      seen.push(...page.map((s) => s.id));
      after = { createdAt: page[0]!.createdAt, id: page[0]!.id };
    }
    assert.deepEqual(seen, ['sb-b', 'sb-a', 'sb-c', 'sb-d']);
  });

  test("one sandbox's samples from a time on, led by the one before, with the disk's use", async () => {
    await store.insertSamples([
      { sandboxId: 'sb-a', at: 10, memoryBytes: 1, cpuUsageUsec: 100 },
      { sandboxId: 'sb-c', at: 15, memoryBytes: 9, cpuUsageUsec: 900 },
      { sandboxId: 'sb-a', at: 20, memoryBytes: 2, cpuUsageUsec: 200, diskBytes: 4096 },
      { sandboxId: 'sb-a', at: 30, memoryBytes: 3, cpuUsageUsec: 300, diskBytes: 8192 },
    ]);
    const got = await store.sandboxSamples('sb-a', { since: 20, limit: 10 });
    assert.deepEqual(
      got.map((x) => [x.at, x.diskBytes]),
      [
        [10, undefined],
        [20, 4096],
        [30, 8192],
      ],
    );
    assert.deepEqual(
      (await store.sandboxSamples('sb-a', { since: 0, limit: 10 })).map((x) => x.at),
      [10, 20, 30],
    );
  });
});

describe('schema version guard', () => {
  test('a database from a newer dormant is refused, untouched; an older one is kept as a .bak before migrating', async () => {
    const dir = await mkdtemp(join(tmpdir(), 'dormant-state-version-'));
    try {
      const Database = (await import('better-sqlite3')).default;
      const newer = join(dir, 'newer.db');
      const n = new Database(newer);
      n.exec('CREATE TABLE future (x INTEGER)');
      n.pragma('user_version = 99');
      n.close();
      assert.throws(
        () => new SqliteStateStore(newer),
        (e: Error) => /schema version 99, newer than this dormant's \d+/.test(e.message),
      );
      const again = new Database(newer);
      assert.equal(again.pragma('user_version', { simple: true }), 99, 'nothing changed');
      again.close();

      // An older database, as the release before the newest migration left it.
      const older = join(dir, 'older.db');
      const o = new Database(older);
      const was = MIGRATIONS.length - 1;
      for (const m of MIGRATIONS.slice(0, was)) o.exec(m);
      o.pragma(`user_version = ${was}`);
      o.close();
      await new SqliteStateStore(older).close();
      const bak = new Database(`${older}.v${was}.bak`, { readonly: true });
      assert.equal(
        bak.pragma('user_version', { simple: true }),
        was,
        'the copy is the database before migrating',
      );
      bak.close();
      const now = new Database(older, { readonly: true });
      assert.equal(now.pragma('user_version', { simple: true }), MIGRATIONS.length);
      now.close();
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});

stateStoreContract('SQLite', () => {
  const store = new SqliteStateStore(':memory:');
  return Promise.resolve({ store, close: () => store.close() });
});
