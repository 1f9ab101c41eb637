import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import pg from 'pg';
import { DormantError } from '../domain/errors.js';
import { AWAKE_STATES } from '../domain/node.js';
import { sandbox, stateStoreContract } from './contract.js';
import { lockStateForNode, openPostgresStore, PG_MIGRATIONS, type NodeLock } from './postgres.js';
import { redactUrl } from './redact.js';
import type { StateStore } from './store.js';
import { pgMissing, startPostgres, type TestPostgres } from './testing/postgres.js';

const missing = await pgMissing();
if (missing !== undefined) process.stderr.write(`skipping the PostgreSQL state tests: ${missing}\n`);

let server: TestPostgres;
let n = 0;
const code = (c: string) => (e: unknown) => e instanceof DormantError && e.code === c;

/** The node lock, once the server has noticed its last holder is gone (it ends that session). */
async function eventuallyLocked(url: string, node: string, holder: string): Promise<NodeLock> {
  for (let i = 0; ; i++) {
    try {
      return await lockStateForNode(url, node, holder);
    } catch (e) {
      if (i >= 50 || !code('STATE_IN_USE')(e)) throw e;
      await new Promise((r) => setTimeout(r, 100));
    }
  }
}

/** A fresh database on the test server. */
async function freshDb(): Promise<{ name: string; url: string }> {
  const name = `db${++n}`;
  return { name, url: await server.createDatabase(name) };
}

async function dropDb(name: string): Promise<void> {
  const admin = new pg.Client({ connectionString: server.url('postgres') });
  await admin.connect();
  try {
    await admin.query(`DROP DATABASE IF EXISTS ${pg.escapeIdentifier(name)} WITH (FORCE)`);
  } finally {
    await admin.end();
  }
}

/** Runs `fn` with a plain client on `url`: what another tool or an operator would see. */
async function raw<T>(url: string, fn: (c: pg.Client) => Promise<T>): Promise<T> {
  const c = new pg.Client({ connectionString: url });
  await c.connect();
  try {
    return await fn(c);
  } finally {
    await c.end();
  }
}

describe('PostgresStateStore', { skip: missing }, () => {
  before(async () => {
    server = await startPostgres();
  });
  after(async () => {
    await server?.stop();
  });

  stateStoreContract('PostgreSQL', async () => {
    const db = await freshDb();
    const store = await openPostgresStore(db.url);
    return {
      store,
      close: async () => {
        await store.close();
        await dropDb(db.name);
      },
    };
  });

  test('two nodes racing the same transition: exactly one wins each round, with one transitions row', async () => {
    const db = await freshDb();
    const a = await openPostgresStore(db.url);
    const b = await openPostgresStore(db.url);
    try {
      await a.insertSandbox(sandbox('sb-1', { state: 'hibernated' }), 'c');
      const rounds = 200;
      const winners = { a: 0, b: 0 };
      for (let i = 0; i < rounds; i++) {
        const [wa, wb] = await Promise.all([
          a.transition('sb-1', 'hibernated', 'resuming', `a${i}`, 2000 + i),
          b.transition('sb-1', 'hibernated', 'resuming', `b${i}`, 2000 + i),
        ]);
        assert.equal(Number(wa) + Number(wb), 1, `round ${i}: a=${wa} b=${wb}`);
        winners[wa ? 'a' : 'b']++;
        // Back to hibernated for the next round (one node, no race).
        assert.equal(
          await (i % 2 ? a : b).transition('sb-1', 'resuming', 'hibernated', 'back', 2000 + i),
          true,
        );
      }
      const t = await a.transitions({ sandboxId: 'sb-1' });
      const resumes = t.filter((x) => x.to === 'resuming');
      assert.equal(resumes.length, rounds);
      // One row per round, named for that round's winner.
      for (let i = 0; i < rounds; i++)
        assert.equal(resumes.filter((x) => x.reason.slice(1) === String(i)).length, 1);
      assert.equal(t.length, 1 + 2 * rounds);
      process.stdout.write(`race: a won ${winners.a}, b won ${winners.b} of ${rounds}\n`);
    } finally {
      await a.close();
      await b.close();
      await dropDb(db.name);
    }
  });

  test('fleet: nodes register and renew leases on the database clock; an expired node is marked lost once, its sleeping sandboxes handed over', async () => {
    const db = await freshDb();
    const a = await openPostgresStore(db.url);
    const b = await openPostgresStore(db.url);
    const capacity = { memoryBytes: 1024, cpus: 2, arch: 'x86_64', runtimes: ['runc'] };
    try {
      assert.equal(
        await a.fleet.registerNode({ name: 'na', url: 'http://a', capacity, startedAt: 1 }, 60_000),
        'active',
      );
      assert.equal(
        await b.fleet.registerNode({ name: 'nb', url: 'http://b', capacity, startedAt: 1 }, 300),
        'active',
      );
      await a.insertSandbox(sandbox('sb-run', { state: 'running', node: 'nb' }), 'c');
      await a.insertSandbox(sandbox('sb-hib', { state: 'hibernated', node: 'nb' }), 'c');
      await a.insertSandbox(sandbox('sb-own', { state: 'running', node: 'na' }), 'c');
      assert.deepEqual(
        (await a.querySandboxes({ node: 'nb', limit: 10 })).map((s) => s.id),
        ['sb-run', 'sb-hib'].sort(),
      );
      // Drain survives a re-registration; a renewal answers the state.
      assert.equal(await a.fleet.setNodeState('na', 'draining'), true);
      assert.equal(await a.fleet.renewNode('na', 60_000), 'draining');
      assert.equal(
        await a.fleet.registerNode({ name: 'na', url: 'http://a2', capacity, startedAt: 2 }, 60_000),
        'draining',
      );
      assert.equal(await a.fleet.setNodeState('na', 'active'), true);
      assert.deepEqual(await a.fleet.expiredNodes(), []);
      await new Promise((r) => setTimeout(r, 400));
      assert.deepEqual(await a.fleet.expiredNodes(), ['nb']);
      const listed = await a.fleet.listNodes();
      assert.deepEqual(
        listed.map((n) => [n.name, n.state, n.expired, n.sandboxes]),
        [
          ['na', 'active', false, { running: 1 }],
          ['nb', 'active', true, { running: 1, hibernated: 1 }],
        ],
      );
      // One node alone counts its own sandboxes only.
      assert.deepEqual((await a.fleet.getNode('nb'))?.sandboxes, { running: 1, hibernated: 1 });
      assert.deepEqual((await a.fleet.getNode('na'))?.sandboxes, { running: 1 });
      // Two nodes marking it at once: one does.
      const marks = await Promise.all([
        a.atomically((tx) => tx.fleet!.markNodeLost('nb', 'na', 5)),
        b.atomically((tx) => tx.fleet!.markNodeLost('nb', 'nb2', 5)),
      ]);
      assert.deepEqual(marks.map(Number).sort(), [0, 1]);
      assert.equal((await a.fleet.getNode('nb'))?.state, 'lost');
      // Its sleeping sandbox is the marker's now; its awake one is left to the caller (reclaimLostNode).
      const winner = marks[0] ? 'na' : 'nb2';
      assert.equal((await a.getSandbox('sb-hib'))?.node, winner);
      assert.equal((await a.getSandbox('sb-run'))?.node, 'nb');
      // A lost node cannot renew (it learns it was lost), and comes back by registering.
      assert.equal(await b.fleet.renewNode('nb', 60_000), undefined);
      assert.equal(
        await b.fleet.registerNode({ name: 'nb', url: 'http://b', capacity, startedAt: 3 }, 60_000),
        'active',
      );
      assert.equal(await a.fleet.setNodeState('nobody', 'draining'), false);
    } finally {
      await a.close();
      await b.close();
      await dropDb(db.name);
    }
  });

  test('fleet: each node’s awake sandboxes and their memory follow every change, kept by the database; a registration counts afresh', async () => {
    const db = await freshDb();
    const a = await openPostgresStore(db.url);
    const b = await openPostgresStore(db.url);
    const capacity = { memoryBytes: 64 * 1024 ** 3, cpus: 2, arch: 'x86_64', runtimes: ['runc'] };
    const MiB = 1024 ** 2;
    const mem = (n: number) => ({ ...sandbox('x').spec, memoryBytes: n * MiB });
    // What placement reads (the nodes alone) against the sandboxes themselves.
    const usage = async () =>
      Object.fromEntries(
        (await a.fleet.listNodes({ counts: false })).map((n) => [
          n.name,
          [n.awakeSandboxes, n.memoryUsedBytes / MiB],
        ]),
      );
    const truth = async () => {
      const out: Record<string, number[]> = { na: [0, 0], nb: [0, 0] };
      for (const s of await a.listSandboxes())
        if (s.node && AWAKE_STATES.includes(s.state)) {
          out[s.node]![0]!++;
          out[s.node]![1]! += s.spec.memoryBytes / MiB;
        }
      return out;
    };
    const check = async (what: string) => assert.deepEqual(await usage(), await truth(), what);
    try {
      await a.fleet.registerNode({ name: 'na', url: 'http://a', capacity, startedAt: 1 }, 60_000);
      await b.fleet.registerNode({ name: 'nb', url: 'http://b', capacity, startedAt: 1 }, 60_000);
      await a.insertSandbox(sandbox('s1', { state: 'running', node: 'na', spec: mem(100) }), 'c');
      await a.insertSandbox(sandbox('s2', { state: 'hibernated', node: 'na', spec: mem(200) }), 'c');
      await a.insertSandbox(sandbox('s3', { state: 'running', node: 'nb', spec: mem(300) }), 'c');
      await a.insertSandbox(sandbox('s4', { state: 'creating', node: 'nb', spec: mem(400) }), 'c');
      assert.deepEqual(await usage(), { na: [1, 100], nb: [2, 700] });
      await check('inserts');
      assert.ok(await a.transition('s1', 'running', 'hibernating', 'h', 2));
      await check('still awake while hibernating');
      assert.ok(await a.transition('s1', 'hibernating', 'hibernated', 'h', 3));
      assert.deepEqual((await usage()).na, [0, 0], 'asleep: nothing reserved');
      // A wake on the other node: the claim moves it, awake, there.
      assert.ok(await b.transition('s2', 'hibernated', 'resuming', 'r', 4, { node: 'nb' }));
      await check('claimed by nb');
      await a.updateSandbox('s3', { spec: mem(1000) });
      await check('its limit changed');
      await a.deleteSandbox('s4', 'rm', 5);
      assert.deepEqual(await usage(), { na: [0, 0], nb: [2, 1200] });
      // Both nodes changing sandboxes at once, each on its own connection: exact.
      for (let i = 0; i < 20; i++)
        await a.insertSandbox(
          sandbox(`r${i}`, { state: 'running', node: i % 2 ? 'na' : 'nb', spec: mem(10) }),
          'c',
        );
      await Promise.all(
        Array.from({ length: 20 }, (_, i) =>
          (i % 3 ? a : b).transition(`r${i}`, 'running', i % 4 ? 'paused' : 'hibernated', 'x', 6),
        ),
      );
      await check('after concurrent changes');
      // Counters that went wrong (a row edited by hand) come right when the node registers.
      const c = new pg.Client({ connectionString: db.url });
      await c.connect();
      await c.query("UPDATE nodes SET awake_sandboxes = 99, reserved_bytes = 1 WHERE name = 'nb'");
      await c.end();
      assert.deepEqual((await usage()).nb, [99, 1 / MiB]);
      await b.fleet.registerNode({ name: 'nb', url: 'http://b', capacity, startedAt: 2 }, 60_000);
      await check('recounted at registration');
      // The full listing (node ls) agrees with the counters.
      for (const n of await a.fleet.listNodes())
        assert.equal(
          n.awakeSandboxes,
          AWAKE_STATES.reduce((k, st) => k + (n.sandboxes[st] ?? 0), 0),
        );
    } finally {
      await a.close();
      await b.close();
      await dropDb(db.name);
    }
  });

  test('fleet: a node’s store moves an awake sandbox only while it is that node’s, unless taking it over', async () => {
    const db = await freshDb();
    const na = await openPostgresStore(db.url, { node: 'na' });
    const nb = await openPostgresStore(db.url, { node: 'nb' });
    try {
      await na.insertSandbox(sandbox('s1', { state: 'running', node: 'nb' }), 'c');
      await na.insertSandbox(sandbox('s2', { state: 'hibernated', node: 'nb' }), 'c');
      // Work node na queued before it lost the sandbox to nb: it changes nothing.
      assert.equal(await na.transition('s1', 'running', 'hibernating', 'stale', 2), false);
      assert.equal((await na.getSandbox('s1'))?.state, 'running');
      assert.equal(await na.atomically((tx) => tx.transition('s1', 'running', 'paused', 'stale', 2)), false);
      // Its own node may; so may a takeover that names where it goes (a lost node's sandbox).
      assert.equal(await nb.transition('s1', 'running', 'paused', 'mine', 3), true);
      assert.equal(await na.transition('s1', 'paused', 'hibernated', 'taken back', 4, { node: 'na' }), true);
      // A sleeping sandbox is any node's to wake (the claim sets the node).
      assert.equal(await na.transition('s2', 'hibernated', 'resuming', 'claim', 5, { node: 'na' }), true);
      assert.equal(await na.transition('s2', 'resuming', 'running', 'woke', 6), true);
      // A store without a node (one node alone) is not held to it.
      const plain = await openPostgresStore(db.url);
      try {
        assert.equal(await plain.transition('s2', 'running', 'paused', 'p', 7), true);
      } finally {
        await plain.close();
      }
    } finally {
      await na.close();
      await nb.close();
      await dropDb(db.name);
    }
  });

  test('nodes opening a fresh database at once all succeed; the schema is migrated once', async () => {
    const db = await freshDb();
    const stores = await Promise.all(Array.from({ length: 4 }, () => openPostgresStore(db.url)));
    try {
      const versions = await raw(db.url, async (c) =>
        (await c.query<{ version: number }>('SELECT version FROM dormant_schema ORDER BY version')).rows.map(
          (r) => r.version,
        ),
      );
      assert.deepEqual(
        versions,
        PG_MIGRATIONS.map((_, i) => i + 1),
      );
      // Each works on the same tables: a write of one is seen by the others.
      await stores[0]!.insertSandbox(sandbox('sb-1'), 'c');
      for (const s of stores) assert.equal((await s.getSandbox('sb-1'))?.id, 'sb-1');
      // Opening again changes nothing.
      await (await openPostgresStore(db.url)).close();
    } finally {
      for (const s of stores) await s.close();
      await dropDb(db.name);
    }
  });

  test("a node waits for another's migration past its statement timeout", async () => {
    const db = await freshDb();
    const holder = new pg.Client({ connectionString: db.url });
    await holder.connect();
    try {
      // Another node in the middle of a migration: it holds the schema lock.
      await holder.query('BEGIN');
      await holder.query(`SELECT pg_advisory_xact_lock(hashtext('dormant schema'))`);
      const t0 = Date.now();
      const opening = openPostgresStore(db.url, { statementTimeoutMs: 500 });
      setTimeout(() => void holder.query('COMMIT'), 2_500);
      const s = await opening;
      assert.ok(Date.now() - t0 >= 2_000, `opened after ${Date.now() - t0} ms`);
      await s.insertSandbox(sandbox('sb-1'), 'c');
      await s.close();
    } finally {
      await holder.end();
      await dropDb(db.name);
    }
  });

  test('a database from a newer dormant is refused and left as it was', async () => {
    const db = await freshDb();
    const s = await openPostgresStore(db.url);
    await s.insertSandbox(sandbox('sb-1'), 'c');
    await s.close();
    const newer = PG_MIGRATIONS.length + 1;
    await raw(db.url, (c) =>
      c.query('INSERT INTO dormant_schema (version, applied_at) VALUES ($1, 0)', [newer]),
    );
    const snapshot = async (c: pg.Client) => [
      (
        await c.query(
          `SELECT table_name FROM information_schema.tables WHERE table_schema = 'public' ORDER BY 1`,
        )
      ).rows,
      (await c.query('SELECT * FROM dormant_schema ORDER BY version')).rows,
      (await c.query('SELECT id, state FROM sandboxes')).rows,
    ];
    const before = await raw(db.url, snapshot);
    await assert.rejects(
      openPostgresStore(db.url),
      (e: unknown) =>
        code('INVALID_ARGUMENT')(e) &&
        (e as Error).message.includes(
          `schema version ${newer}, newer than this dormant's ${PG_MIGRATIONS.length}`,
        ) &&
        !(e as Error).message.includes(server.password) &&
        /nothing was changed/.test((e as DormantError).hint ?? ''),
    );
    assert.deepEqual(await raw(db.url, snapshot), before);
    await dropDb(db.name);
  });

  test('a wrong password, a missing database or no server: a clear error naming the URL without its password', async () => {
    const db = await freshDb();
    const badPassword = db.url.replace(encodeURIComponent(server.password), 'wrong-password');
    await assert.rejects(
      openPostgresStore(badPassword),
      (e: unknown) =>
        code('STATE_UNAVAILABLE')(e) &&
        (e as Error).message.includes(`refused the login`) &&
        (e as Error).message.includes(`127.0.0.1:${server.port}/${db.name}`) &&
        !(e as Error).message.includes('wrong-password') &&
        /user and password/.test((e as DormantError).hint ?? ''),
    );
    await assert.rejects(
      openPostgresStore(server.url('no_such_db')),
      (e: unknown) => code('STATE_UNAVAILABLE')(e) && /createdb/.test((e as DormantError).hint ?? ''),
    );
    // A port nobody listens on (the test server's, once stopped, is not ours to stop here).
    const t0 = Date.now();
    await assert.rejects(
      openPostgresStore(`postgres://u:secret@127.0.0.1:1/x`, { connectTimeoutMs: 1_000 }),
      (e: unknown) =>
        code('STATE_UNAVAILABLE')(e) &&
        (e as Error).message.startsWith('cannot reach PostgreSQL at postgres://u@127.0.0.1:1/x') &&
        !(e as Error).message.includes('secret'),
    );
    assert.ok(Date.now() - t0 < 5_000);
    assert.equal(
      redactUrl('postgres://me:pw@db:5432/d?sslmode=require'),
      'postgres://me@db:5432/d?sslmode=require',
    );
    assert.equal(redactUrl('host=db password=pw user=me'), 'host=db password=*** user=me');
    assert.equal(
      redactUrl('postgres://db/d?password=pw&sslpassword=k'),
      'postgres://db/d?password=***&sslpassword=***',
    );
    // A name that resolves to several addresses, none listening: still a clear message.
    await assert.rejects(
      openPostgresStore(`postgres://u:secret@localhost:1/x`, { connectTimeoutMs: 1_000 }),
      (e: unknown) =>
        code('STATE_UNAVAILABLE')(e) &&
        /^cannot reach PostgreSQL at postgres:\/\/u@localhost:1\/x: \S/.test((e as Error).message),
    );
    await dropDb(db.name);
  });

  test('a transaction: unseen by another node until it commits; a name clash caught inside it lets it go on', async () => {
    const db = await freshDb();
    const a = await openPostgresStore(db.url);
    const b = await openPostgresStore(db.url);
    try {
      await a.templates().insertTemplate({
        id: 'tp-1',
        tenant: 't1',
        name: 'base',
        public: false,
        checkpointId: 'ck-1',
        spec: sandbox('x').spec,
        origin: 'o',
        createdAt: 1,
      });
      await a.atomically(async (tx) => {
        await tx.insertSandbox(sandbox('sb-1'), 'c');
        assert.equal(await b.getSandbox('sb-1'), undefined);
        await assert.rejects(
          tx.templates().insertTemplate({
            id: 'tp-2',
            tenant: 't1',
            name: 'base',
            public: false,
            checkpointId: 'ck-2',
            spec: sandbox('x').spec,
            origin: 'o',
            createdAt: 2,
          }),
          code('TEMPLATE_NAME_TAKEN'),
        );
        await assert.rejects(
          tx.insertSandbox(sandbox('sb-2', { name: 'sb-1' }), 'c'),
          code('SANDBOX_NAME_TAKEN'),
        );
        await tx.insertSandbox(sandbox('sb-3'), 'c');
      });
      assert.deepEqual(
        (await b.listSandboxes()).map((s) => s.id),
        ['sb-1', 'sb-3'],
      );
      // A store bound to a finished transaction refuses to be used, rather than use a
      // connection the pool has given to someone else.
      let kept: StateStore | undefined;
      await a.atomically(async (tx) => {
        kept = tx;
      });
      await assert.rejects(kept!.getSandbox('sb-1'), /transaction that has ended/);
      assert.equal(a.sandboxVersion, undefined);
    } finally {
      await a.close();
      await b.close();
      await dropDb(db.name);
    }
  });

  test('a read-then-write in atomically is not undone by another node writing between the two', async () => {
    const db = await freshDb();
    const a = await openPostgresStore(db.url);
    const b = await openPostgresStore(db.url);
    try {
      await a.insertSandbox(sandbox('sb-1'), 'c');
      // markActive's shape: read the row, then write what was computed from it.
      const bump = (s: StateStore) =>
        s.atomically(async (tx) => {
          const cur = await tx.getSandbox('sb-1');
          await new Promise((r) => setTimeout(r, 1));
          await tx.updateSandbox('sb-1', { memoryBytes: cur!.memoryBytes + 1 });
        });
      await Promise.all(Array.from({ length: 40 }, (_, i) => bump(i % 2 ? a : b)));
      assert.equal((await b.getSandbox('sb-1'))?.memoryBytes, 40);
    } finally {
      await a.close();
      await b.close();
      await dropDb(db.name);
    }
  });

  test('statements started together on a transaction run one after another on its connection', async () => {
    const db = await freshDb();
    const s = await openPostgresStore(db.url);
    const warnings: Error[] = [];
    const onWarning = (w: Error) => warnings.push(w);
    process.on('warning', onWarning);
    try {
      await s.atomically(async (tx) => {
        await Promise.all([
          tx.insertSandbox(sandbox('sb-1'), 'c'),
          tx.insertSandbox(sandbox('sb-2', { name: 'sb-1' }), 'c').catch((e: unknown) => e),
          tx.insertSandbox(sandbox('sb-3'), 'c'),
          tx.insertToken({ hash: 'h', tenant: 't1', admin: false, createdAt: 1 }),
          tx.listSandboxes(),
        ]);
      });
      assert.deepEqual(
        (await s.listSandboxes()).map((x) => x.id),
        ['sb-1', 'sb-3'],
      );
      await new Promise((r) => setImmediate(r));
      assert.deepEqual(
        warnings.map((w) => w.message),
        [],
      );
    } finally {
      process.off('warning', onWarning);
      await s.close();
      await dropDb(db.name);
    }
  });

  test('a reader paging transitions by sinceId sees every one, also one that commits after a later id', async () => {
    const db = await freshDb();
    const a = await openPostgresStore(db.url);
    const b = await openPostgresStore(db.url);
    let release: () => void = () => undefined;
    const held = new Promise<void>((r) => (release = r));
    let slow: Promise<void> = Promise.resolve();
    try {
      await a.insertSandbox(sandbox('sb-0'), 'c');
      const seen: string[] = [];
      let cursor = (await a.transitions()).at(-1)!.id;
      // Takes its id first and commits last.
      slow = a.atomically(async (tx) => {
        await tx.insertSandbox(sandbox('sb-slow'), 'slow');
        await held;
      });
      await new Promise((r) => setTimeout(r, 100));
      const t0 = Date.now();
      await b.insertSandbox(sandbox('sb-fast'), 'fast');
      // A writer is not held up by the open transaction (nor by readers).
      assert.ok(Date.now() - t0 < 500, `a write took ${Date.now() - t0} ms`);
      const reading = b.transitions({ sinceId: cursor });
      setTimeout(release, 200);
      for (const t of await reading) {
        seen.push(t.reason);
        cursor = t.id;
      }
      await slow;
      for (const t of await b.transitions({ sinceId: cursor })) seen.push(t.reason);
      assert.deepEqual(seen.sort(), ['fast', 'slow']);
    } finally {
      release();
      await slow.catch(() => undefined);
      await a.close();
      await b.close();
      await dropDb(db.name);
    }
  });

  test('a reader facing a transaction that stays open answers nothing new, not a page with a hole', async () => {
    const db = await freshDb();
    const a = await openPostgresStore(db.url);
    const b = await openPostgresStore(db.url);
    let release: () => void = () => undefined;
    const held = new Promise<void>((r) => (release = r));
    let slow: Promise<void> = Promise.resolve();
    try {
      await a.insertSandbox(sandbox('sb-0'), 'c');
      const cursor = (await a.transitions()).at(-1)!.id;
      slow = a.atomically(async (tx) => {
        await tx.insertSandbox(sandbox('sb-slow'), 'slow');
        await held;
      });
      await new Promise((r) => setTimeout(r, 100));
      await b.insertSandbox(sandbox('sb-fast'), 'fast');
      const t0 = Date.now();
      assert.deepEqual(await b.transitions({ sinceId: cursor }), []);
      assert.ok(Date.now() - t0 < 4_000, `answered after ${Date.now() - t0} ms`);
      // Read whole (no cursor to move past anything): what is committed now.
      assert.deepEqual(
        (await b.transitions()).map((t) => t.reason),
        ['c', 'fast'],
      );
      release();
      await slow;
      assert.deepEqual(
        (await b.transitions({ sinceId: cursor })).map((t) => t.reason),
        ['slow', 'fast'],
      );
    } finally {
      release();
      await slow.catch(() => undefined);
      await a.close();
      await b.close();
      await dropDb(db.name);
    }
  });

  test('one process per node name: a second is refused naming the holder, another name is not; a release or a crash of the holder frees it', async () => {
    const db = await freshDb();
    const first = await lockStateForNode(db.url, 'n1', 'node-a /srv/a');
    await assert.rejects(
      lockStateForNode(db.url, 'n1', 'node-b /srv/b'),
      (e: unknown) =>
        code('STATE_IN_USE')(e) &&
        (e as Error).message.includes('node n1 is already running') &&
        (e as Error).message.includes('dormant node node-a /srv/a') &&
        !(e as Error).message.includes(server.password),
    );
    // Another node on the same database: its own name, its own lock.
    const other = await lockStateForNode(db.url, 'n2', 'node-b /srv/b');
    await other.release();
    await first.release();
    const second = await lockStateForNode(db.url, 'n1', 'node-b /srv/b');
    await second.release();
    // A holder killed outright: the server ends its session, and the lock with it.
    const child = spawn(
      process.execPath,
      [
        '--input-type=module',
        '-e',
        `const { lockStateForNode } = await import(${JSON.stringify(new URL('./postgres.js', import.meta.url).href)});
         await lockStateForNode(process.env.URL, 'n1', 'node-c');
         process.stdout.write('locked\\n');
         setInterval(() => {}, 1000);`,
      ],
      { env: { ...process.env, URL: db.url }, stdio: ['ignore', 'pipe', 'inherit'] },
    );
    try {
      const [line] = (await once(child.stdout, 'data')) as [Buffer];
      assert.equal(line.toString().trim(), 'locked');
      await assert.rejects(lockStateForNode(db.url, 'n1', 'node-d'), code('STATE_IN_USE'));
    } finally {
      child.kill('SIGKILL');
      await once(child, 'exit');
    }
    const after = await eventuallyLocked(db.url, 'n1', 'node-d');
    await after.release();
    await dropDb(db.name);
  });

  test('a hung server: a call fails within its bounds instead of hanging, and works once the server goes on', async () => {
    const db = await freshDb();
    const s = await openPostgresStore(db.url, { connectTimeoutMs: 1_000, statementTimeoutMs: 1_000 });
    try {
      await s.insertSandbox(sandbox('sb-1'), 'c');
      await server.freeze();
      const hung = (e: unknown) =>
        code('STATE_UNAVAILABLE')(e) &&
        (e as Error).message.startsWith(`cannot reach PostgreSQL at ${redactUrl(db.url)}`);
      // On the pooled connection: the client's read bound (statement timeout + 2 s).
      let t0 = Date.now();
      await assert.rejects(s.getSandbox('sb-1'), hung);
      assert.ok(Date.now() - t0 < 6_000, `failed after ${Date.now() - t0} ms`);
      // On a new connection (the hung one was dropped): the connect bound.
      t0 = Date.now();
      await assert.rejects(s.listSandboxes(), hung);
      assert.ok(Date.now() - t0 < 4_000, `failed after ${Date.now() - t0} ms`);
    } finally {
      await server.thaw();
    }
    try {
      assert.equal((await s.getSandbox('sb-1'))?.id, 'sb-1');
    } finally {
      await s.close();
      await dropDb(db.name);
    }
  });

  // Last: it takes the server down and brings it back.
  test('a server that goes down mid-use: calls fail clearly and in bounded time; after a restart stores work', async () => {
    const db = await freshDb();
    const idleErrors: Error[] = [];
    const s = await openPostgresStore(db.url, {
      connectTimeoutMs: 1_000,
      statementTimeoutMs: 2_000,
      onIdleError: (e) => idleErrors.push(e),
    });
    try {
      await s.insertSandbox(sandbox('sb-1', { state: 'running' }), 'c');
      await server.halt();
      const unreachable = (e: unknown) =>
        code('STATE_UNAVAILABLE')(e) &&
        (e as Error).message.startsWith(`cannot reach PostgreSQL at ${redactUrl(db.url)}`) &&
        !(e as Error).message.includes(server.password) &&
        /up and reachable/.test((e as DormantError).hint ?? '');
      for (const call of [
        () => s.getSandbox('sb-1'),
        () => s.transition('sb-1', 'running', 'paused', 'p', 2000),
        () => s.atomically((tx) => tx.note('sb-1', 'n', 2000)),
        () => s.getSandbox('sb-1'),
      ]) {
        const t0 = Date.now();
        await assert.rejects(call(), unreachable);
        assert.ok(Date.now() - t0 < 5_000, `failed after ${Date.now() - t0} ms`);
      }
      await server.start();
      // The store that saw the outage connects again by itself; a new one opens as usual.
      assert.equal(await s.transition('sb-1', 'running', 'paused', 'p', 3000), true);
      const fresh = await openPostgresStore(db.url);
      assert.equal((await fresh.getSandbox('sb-1'))?.state, 'paused');
      await fresh.close();
    } finally {
      await s.close();
      await dropDb(db.name);
    }
  });
});
