/**
 * The behaviour every StateStore implementation must show, as callers rely on it: one suite
 * that SQLite (sqlite.test.ts) and PostgreSQL (postgres.test.ts) each run. Only what the port
 * documents (state/store.ts, state/templates.ts) is held here; what one implementation adds
 * is tested beside it. Test-only.
 */
import { afterEach, beforeEach, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { DormantError } from '../domain/errors.js';
import { DEFAULT_POLICY, type Sandbox } from '../domain/sandbox.js';
import type { CheckpointRecord, StateStore } from './store.js';
import type { TemplateRecord } from './templates.js';

export interface OpenedStore {
  store: StateStore;
  close(): Promise<void>;
}

export function sandbox(id: string, over: Partial<Sandbox> = {}): Sandbox {
  return {
    id,
    tenant: 't1',
    name: id,
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
    ...over,
  };
}

function checkpoint(id: string, sandboxId: string, createdAt: number, over: Partial<CheckpointRecord> = {}) {
  return {
    id,
    sandboxId,
    tenant: 't1',
    createdAt,
    kind: 'memory' as const,
    logicalBytes: 5 * 1024 ** 3,
    storedBytes: 40,
    meta: { arch: 'x86_64', criu: { version: '4.1' } },
    ...over,
  };
}

function template(id: string, over: Partial<TemplateRecord> = {}): TemplateRecord {
  return {
    id,
    tenant: 't1',
    name: id,
    public: false,
    checkpointId: `ck-${id}`,
    spec: sandbox('sb-x').spec,
    origin: 'sandbox sb-x',
    createdAt: 1000,
    ...over,
  };
}

const ids = (xs: readonly { id: string }[]): string[] => xs.map((x) => x.id);
const code = (c: string) => (e: unknown) => e instanceof DormantError && e.code === c;

/** `open` answers a fresh, empty store (and how to close it and drop what it made) per test. */
export function stateStoreContract(name: string, open: () => Promise<OpenedStore>): void {
  void describe(`StateStore contract: ${name}`, () => {
    let opened: OpenedStore;
    let store: StateStore;
    beforeEach(async () => {
      opened = await open();
      store = opened.store;
    });
    afterEach(async () => {
      await opened.close();
    });

    void test('a sandbox reads back as written, its optional fields only when set, its first transition recorded', async () => {
      const full = sandbox('sb-full', {
        state: 'running',
        checkpointId: 'ck-1',
        lastError: 'oops',
        address: '10.88.0.2',
        gpus: '0,1',
        gpuPolicy: 'filesystem-only',
        memoryBytes: 3 * 1024 ** 3,
        spec: { ...sandbox('x').spec, labels: { team: 'a' }, diskBytes: 10 * 1024 ** 3 },
      });
      await store.insertSandbox(full, 'imported');
      await store.insertSandbox(sandbox('sb-bare'), 'created');
      assert.deepEqual(await store.getSandbox('sb-full'), full);
      // Keys in the order written: code compares JSON.stringify of specs.
      assert.equal(JSON.stringify((await store.getSandbox('sb-full'))?.spec), JSON.stringify(full.spec));
      // The store fills in the default GPU policy; nothing else appears.
      assert.deepEqual(await store.getSandbox('sb-bare'), {
        ...sandbox('sb-bare'),
        gpuPolicy: 'keep-running',
      });
      assert.equal(await store.getSandbox('sb-none'), undefined);
      const t = await store.transitions();
      assert.deepEqual(
        t.map((x) => [x.sandboxId, x.tenant, x.from, x.to, x.at, x.reason]),
        [
          ['sb-full', 't1', null, 'running', 1000, 'imported'],
          ['sb-bare', 't1', null, 'creating', 1000, 'created'],
        ],
      );
    });

    void test('a name is unique within a tenant, not across tenants', async () => {
      await store.insertSandbox(sandbox('sb-1', { name: 'web' }), 'created');
      await assert.rejects(store.insertSandbox(sandbox('sb-2', { name: 'web' }), 'created'));
      await store.insertSandbox(sandbox('sb-3', { name: 'web', tenant: 't2' }), 'created');
      assert.deepEqual(ids(await store.listSandboxes()), ['sb-1', 'sb-3']);
      // The refused insert recorded nothing.
      assert.deepEqual(
        (await store.transitions()).map((x) => x.sandboxId),
        ['sb-1', 'sb-3'],
      );
    });

    void test('listSandboxes orders by createdAt, then id (byte order), for all or one tenant', async () => {
      await store.insertSandbox(sandbox('sb-b', { createdAt: 2000 }), 'c');
      await store.insertSandbox(sandbox('sb-a', { createdAt: 2000, tenant: 't2' }), 'c');
      await store.insertSandbox(sandbox('sb-Z', { createdAt: 2000 }), 'c');
      await store.insertSandbox(sandbox('sb-c', { createdAt: 1500 }), 'c');
      assert.deepEqual(ids(await store.listSandboxes()), ['sb-c', 'sb-Z', 'sb-a', 'sb-b']);
      assert.deepEqual(ids(await store.listSandboxes('t1')), ['sb-c', 'sb-Z', 'sb-b']);
      assert.deepEqual(await store.listSandboxes('t9'), []);
    });

    void test('querySandboxes selects by tenant, states, name and labels, pages with after, stops at limit', async () => {
      const labelled = (id: string, labels: Record<string, string>, over: Partial<Sandbox> = {}) =>
        sandbox(id, { ...over, spec: { ...sandbox(id).spec, labels } });
      await store.insertSandbox(labelled('sb-1', { team: 'a', env: 'prod' }, { state: 'running' }), 'c');
      await store.insertSandbox(
        labelled('sb-2', { team: 'b' }, { state: 'hibernated', createdAt: 1001 }),
        'c',
      );
      await store.insertSandbox(labelled('sb-3', { team: 'a' }, { tenant: 't2', createdAt: 1001 }), 'c');
      await store.insertSandbox(sandbox('sb-4', { state: 'paused', createdAt: 1002, name: 'web' }), 'c');
      await store.insertSandbox(labelled('sb-5', { env: '' }, { createdAt: 1002 }), 'c');
      const q = async (over: Partial<Parameters<StateStore['querySandboxes']>[0]>) =>
        ids(await store.querySandboxes({ limit: 100, ...over }));

      assert.deepEqual(await q({}), ['sb-1', 'sb-2', 'sb-3', 'sb-4', 'sb-5']);
      assert.deepEqual(await q({ tenant: 't2' }), ['sb-3']);
      assert.deepEqual(await q({ states: ['running', 'paused'] }), ['sb-1', 'sb-4']);
      assert.deepEqual(await q({ states: [] }), []);
      assert.deepEqual(await q({ name: 'web' }), ['sb-4']);
      assert.deepEqual(await q({ labels: [['team', 'a']] }), ['sb-1', 'sb-3']);
      assert.deepEqual(await q({ labels: [['team', 'a']], tenant: 't1' }), ['sb-1']);
      assert.deepEqual(await q({ labels: [['env']] }), ['sb-1', 'sb-5']);
      assert.deepEqual(await q({ labels: [['env', '']] }), ['sb-5']);
      assert.deepEqual(
        await q({
          labels: [
            ['team', 'a'],
            ['env', 'prod'],
          ],
        }),
        ['sb-1'],
      );
      assert.deepEqual(
        await q({
          labels: [
            ['team', 'a'],
            ['env', 'dev'],
          ],
        }),
        [],
      );
      assert.deepEqual(await q({ labels: [['nope']] }), []);
      assert.deepEqual(await q({ limit: 2 }), ['sb-1', 'sb-2']);

      // Pages of two, each after the last of the one before, walk the whole listing once.
      const seen: string[] = [];
      let after: { createdAt: number; id: string } | undefined;
      for (;;) {
        const page = await store.querySandboxes({ limit: 2, ...(after ? { after } : {}) });
        if (page.length === 0) break;
        seen.push(...ids(page));
        const last = page[page.length - 1]!;
        after = { createdAt: last.createdAt, id: last.id };
      }
      assert.deepEqual(seen, ['sb-1', 'sb-2', 'sb-3', 'sb-4', 'sb-5']);
      assert.deepEqual(await q({ after: { createdAt: 1001, id: 'sb-2' }, states: ['paused', 'creating'] }), [
        'sb-3',
        'sb-4',
        'sb-5',
      ]);
    });

    void test('transition is a compare-and-set: it moves and records once, applies its patch, and refuses a stale state', async () => {
      await store.insertSandbox(sandbox('sb-1', { state: 'running' }), 'created');
      const before = store.sandboxVersion;
      assert.equal(
        await store.transition('sb-1', 'running', 'hibernated', 'idle', 5000, {
          checkpointId: 'ck-9',
          memoryBytes: 0,
          address: undefined,
          lastActiveAt: 4000,
        }),
        true,
      );
      if (before !== undefined)
        assert.ok(store.sandboxVersion! > before, 'sandboxVersion goes up on a change');
      const s = await store.getSandbox('sb-1');
      assert.equal(s?.state, 'hibernated');
      assert.equal(s?.stateSince, 5000);
      assert.equal(s?.checkpointId, 'ck-9');
      assert.equal(s?.lastActiveAt, 4000);
      assert.equal(s?.createdAt, 1000);
      assert.equal(s?.address, undefined);

      // Stale `from`, and an unknown sandbox: false, and nothing changed or recorded.
      assert.equal(await store.transition('sb-1', 'running', 'paused', 'late', 6000), false);
      assert.equal(await store.transition('sb-none', 'running', 'paused', 'late', 6000), false);
      assert.equal((await store.getSandbox('sb-1'))?.state, 'hibernated');
      assert.deepEqual(
        (await store.transitions({ sandboxId: 'sb-1' })).map((x) => [x.from, x.to, x.at, x.reason]),
        [
          [null, 'running', 1000, 'created'],
          ['running', 'hibernated', 5000, 'idle'],
        ],
      );

      // Callers racing on the same sandbox and state: exactly one wins.
      const wins = await Promise.all(
        Array.from({ length: 8 }, (_, i) =>
          store.transition('sb-1', 'hibernated', 'resuming', `r${i}`, 7000),
        ),
      );
      assert.equal(wins.filter(Boolean).length, 1);
      assert.equal(
        (await store.transitions({ sandboxId: 'sb-1' })).filter((x) => x.to === 'resuming').length,
        1,
      );
    });

    void test('updateSandbox changes only the fields given; undefined clears an optional one', async () => {
      await store.insertSandbox(sandbox('sb-1', { address: '10.0.0.1', lastError: 'x' }), 'c');
      await store.updateSandbox('sb-1', { lastActiveAt: 9000, lastError: undefined, memoryBytes: 4096 });
      await store.updateSandbox('sb-1', {});
      await store.updateSandbox('sb-none', { lastActiveAt: 1 });
      const s = await store.getSandbox('sb-1');
      assert.ok(s);
      assert.equal(s.lastActiveAt, 9000);
      assert.equal(s.memoryBytes, 4096);
      assert.equal(s.address, '10.0.0.1');
      assert.equal('lastError' in s, false);
      assert.equal(s.state, 'creating');
      const spec = { ...s.spec, labels: { k: 'v' } };
      await store.updateSandbox('sb-1', { spec, lazyRestoreOf: 'ck-0' });
      assert.deepEqual((await store.getSandbox('sb-1'))?.spec, spec);
      assert.equal((await store.getSandbox('sb-1'))?.lazyRestoreOf, 'ck-0');
      await store.updateSandbox('sb-1', { lazyRestoreOf: undefined });
      assert.equal('lazyRestoreOf' in (await store.getSandbox('sb-1'))!, false);
    });

    void test('deleteSandbox removes it, marks its checkpoints deleted and records the end', async () => {
      await store.insertSandbox(sandbox('sb-1', { state: 'hibernated' }), 'c');
      await store.insertSandbox(sandbox('sb-2'), 'c');
      await store.insertCheckpoint(checkpoint('ck-1', 'sb-1', 2000));
      await store.insertCheckpoint(checkpoint('ck-2', 'sb-1', 2500));
      await store.insertCheckpoint(checkpoint('ck-3', 'sb-2', 2600));
      await store.deleteCheckpoint('ck-1', 2700);
      await store.deleteSandbox('sb-1', 'removed', 3000);
      await store.deleteSandbox('sb-none', 'removed', 3000);
      assert.equal(await store.getSandbox('sb-1'), undefined);
      assert.deepEqual(ids(await store.listCheckpoints()), ['ck-3']);
      assert.deepEqual(
        (await store.checkpointHistory()).map((c) => [c.id, c.deletedAt]),
        [
          ['ck-1', 2700],
          ['ck-2', 3000],
          ['ck-3', undefined],
        ],
      );
      const t = await store.transitions();
      assert.deepEqual(
        t.slice(2).map((x) => [x.sandboxId, x.tenant, x.from, x.to, x.at, x.reason]),
        [['sb-1', 't1', 'hibernated', 'deleting', 3000, 'removed']],
      );
    });

    void test('note records a transition from the state to itself; nothing for an unknown sandbox', async () => {
      await store.insertSandbox(sandbox('sb-1', { state: 'running' }), 'c');
      await store.note('sb-1', 'idle policy: a GPU sandbox', 4000);
      await store.note('sb-none', 'nothing', 4000);
      const t = await store.transitions();
      assert.deepEqual(
        t.map((x) => [x.sandboxId, x.from, x.to, x.at, x.reason]),
        [
          ['sb-1', null, 'running', 1000, 'c'],
          ['sb-1', 'running', 'running', 4000, 'idle policy: a GPU sandbox'],
        ],
      );
      assert.equal((await store.getSandbox('sb-1'))?.stateSince, 1000);
    });

    void test('transitions page by sinceId, filter by sandbox and stop at limit, in id order', async () => {
      await store.insertSandbox(sandbox('sb-1'), 'c1');
      await store.insertSandbox(sandbox('sb-2'), 'c2');
      await store.transition('sb-1', 'creating', 'running', 'r1', 2000);
      await store.transition('sb-2', 'creating', 'running', 'r2', 2001);
      await store.transition('sb-1', 'running', 'paused', 'p1', 2002);
      const all = await store.transitions();
      assert.deepEqual(
        all.map((x) => x.reason),
        ['c1', 'c2', 'r1', 'r2', 'p1'],
      );
      for (let i = 1; i < all.length; i++) assert.ok(all[i]!.id > all[i - 1]!.id);
      assert.deepEqual(
        (await store.transitions({ sinceId: all[1]!.id })).map((x) => x.reason),
        ['r1', 'r2', 'p1'],
      );
      assert.deepEqual(
        (await store.transitions({ sinceId: all[1]!.id, limit: 2 })).map((x) => x.reason),
        ['r1', 'r2'],
      );
      assert.deepEqual(
        (await store.transitions({ sandboxId: 'sb-1' })).map((x) => x.reason),
        ['c1', 'r1', 'p1'],
      );
      assert.deepEqual(
        (await store.transitions({ sandboxId: 'sb-1', sinceId: all[2]!.id, limit: 5 })).map((x) => x.reason),
        ['p1'],
      );
      assert.deepEqual(await store.transitions({ sinceId: all[4]!.id }), []);
    });

    void test('checkpoints: read back whole, newest first, filtered; a deleted one is kept only in the history', async () => {
      const ck = checkpoint('ck-1', 'sb-1', 2000, { kind: 'filesystem' });
      await store.insertCheckpoint(ck);
      await store.insertCheckpoint(checkpoint('ck-3', 'sb-1', 3000));
      await store.insertCheckpoint(checkpoint('ck-2', 'sb-1', 3000));
      await store.insertCheckpoint(checkpoint('ck-4', 'sb-2', 2500, { tenant: 't2' }));
      await assert.rejects(store.insertCheckpoint(checkpoint('ck-1', 'sb-9', 1)));
      assert.deepEqual(await store.getCheckpoint('ck-1'), ck);
      assert.equal(JSON.stringify((await store.getCheckpoint('ck-1'))?.meta), JSON.stringify(ck.meta));
      assert.equal(await store.getCheckpoint('ck-none'), undefined);
      assert.deepEqual(ids(await store.listCheckpoints()), ['ck-3', 'ck-2', 'ck-4', 'ck-1']);
      assert.deepEqual(ids(await store.listCheckpoints({ sandboxId: 'sb-1' })), ['ck-3', 'ck-2', 'ck-1']);
      assert.deepEqual(ids(await store.listCheckpoints({ tenant: 't2' })), ['ck-4']);
      assert.deepEqual(ids(await store.listCheckpoints({ tenant: 't2', sandboxId: 'sb-1' })), []);

      await store.deleteCheckpoint('ck-3', 4000);
      await store.deleteCheckpoint('ck-3', 5000); // the first deletion time stays
      const t0 = Date.now();
      await store.deleteCheckpoint('ck-4');
      assert.equal(await store.getCheckpoint('ck-3'), undefined);
      assert.deepEqual(ids(await store.listCheckpoints()), ['ck-2', 'ck-1']);
      const h = await store.checkpointHistory();
      // Oldest first; the order of two made in the same ms is not part of the port.
      assert.deepEqual(
        h.map((c) => c.createdAt),
        [2000, 2500, 3000, 3000],
      );
      assert.deepEqual(ids(h).sort(), ['ck-1', 'ck-2', 'ck-3', 'ck-4']);
      assert.equal(h.find((c) => c.id === 'ck-3')?.deletedAt, 4000);
      assert.ok(h.find((c) => c.id === 'ck-4')!.deletedAt! >= t0);
      assert.equal('deletedAt' in h.find((c) => c.id === 'ck-1')!, false);
      assert.deepEqual(h[0], ck);
    });

    void test('samples: by time range; one sandbox from since on, preceded by the one before', async () => {
      await store.insertSamples([]);
      await store.insertSamples([
        { sandboxId: 'sb-1', at: 1000, memoryBytes: 100.4, cpuUsageUsec: 10.6 },
        { sandboxId: 'sb-2', at: 1000, memoryBytes: 7, cpuUsageUsec: 1 },
        { sandboxId: 'sb-1', at: 2000, memoryBytes: 200, cpuUsageUsec: 20, diskBytes: 5000.2 },
        { sandboxId: 'sb-1', at: 3000, memoryBytes: 300, cpuUsageUsec: 30, egressBytes: 9, egressCounter: 4 },
        { sandboxId: 'sb-1', at: 4000, memoryBytes: 400, cpuUsageUsec: 40 },
      ]);
      assert.deepEqual(await store.samples({ since: 1000, until: 2000 }), [
        { sandboxId: 'sb-1', at: 1000, memoryBytes: 100, cpuUsageUsec: 11 },
        { sandboxId: 'sb-2', at: 1000, memoryBytes: 7, cpuUsageUsec: 1 },
        { sandboxId: 'sb-1', at: 2000, memoryBytes: 200, cpuUsageUsec: 20 },
      ]);
      assert.equal((await store.samples()).length, 5);
      assert.deepEqual(await store.samples({ since: 4001 }), []);

      // From 2500: the 2000 sample first (a rate needs the one before), then at most `limit`.
      assert.deepEqual(await store.sandboxSamples('sb-1', { since: 2500, limit: 1 }), [
        { sandboxId: 'sb-1', at: 2000, memoryBytes: 200, cpuUsageUsec: 20, diskBytes: 5000 },
        { sandboxId: 'sb-1', at: 3000, memoryBytes: 300, cpuUsageUsec: 30, egressBytes: 9, egressCounter: 4 },
      ]);
      assert.deepEqual(
        (await store.sandboxSamples('sb-1', { since: 2500, limit: 10 })).map((s) => s.at),
        [2000, 3000, 4000],
      );
      // Nothing before `since`: from `since` on.
      assert.deepEqual(
        (await store.sandboxSamples('sb-1', { since: 500, limit: 10 })).map((s) => s.at),
        [1000, 2000, 3000, 4000],
      );
      // A sample exactly at `since` counts as from it; the one before still comes first.
      assert.deepEqual(
        (await store.sandboxSamples('sb-1', { since: 3000, limit: 10 })).map((s) => s.at),
        [2000, 3000, 4000],
      );
      assert.deepEqual(await store.sandboxSamples('sb-none', { since: 0, limit: 10 }), []);
    });

    void test('tokens: listed oldest first, revoked once (a second revoke is false)', async () => {
      await store.insertToken({ hash: 'h2', tenant: 't1', admin: false, createdAt: 2000 });
      await store.insertToken({ hash: 'h1', tenant: 'admin', admin: true, createdAt: 1000 });
      await store.insertToken({ hash: 'h3', tenant: 't2', admin: false, createdAt: 3000, revokedAt: 3500 });
      assert.equal(await store.revokeToken('h2', 5000), true);
      assert.equal(await store.revokeToken('h2', 6000), false);
      assert.equal(await store.revokeToken('h3', 6000), false);
      assert.equal(await store.revokeToken('h-none', 6000), false);
      assert.deepEqual(await store.listTokens(), [
        { hash: 'h1', tenant: 'admin', admin: true, createdAt: 1000 },
        { hash: 'h2', tenant: 't1', admin: false, createdAt: 2000, revokedAt: 5000 },
        { hash: 'h3', tenant: 't2', admin: false, createdAt: 3000, revokedAt: 3500 },
      ]);
    });

    void test('registry credentials: put replaces, listed by tenant then host, deleted once', async () => {
      const cred = (tenant: string, host: string, username: string, createdAt: number) => ({
        tenant,
        host,
        username,
        sealed: `sealed:${username}`,
        createdAt,
      });
      await store.putRegistryCredential(cred('t1', 'ghcr.io', 'old', 1000));
      await store.putRegistryCredential(cred('t1', 'docker.io', 'd', 1100));
      await store.putRegistryCredential(cred('t0', 'quay.io', 'q', 1200));
      await store.putRegistryCredential(cred('t1', 'ghcr.io', 'new', 2000));
      assert.deepEqual(await store.listRegistryCredentials('t1'), [
        cred('t1', 'docker.io', 'd', 1100),
        cred('t1', 'ghcr.io', 'new', 2000),
      ]);
      assert.deepEqual(
        (await store.listRegistryCredentials()).map((r) => [r.tenant, r.host]),
        [
          ['t0', 'quay.io'],
          ['t1', 'docker.io'],
          ['t1', 'ghcr.io'],
        ],
      );
      assert.equal(await store.deleteRegistryCredential('t1', 'ghcr.io'), true);
      assert.equal(await store.deleteRegistryCredential('t1', 'ghcr.io'), false);
      assert.equal(await store.deleteRegistryCredential('t0', 'docker.io'), false);
      assert.deepEqual(await store.listRegistryCredentials('t9'), []);
    });

    void test('templates: a name unique per tenant (TEMPLATE_NAME_TAKEN), public ones seen by all, removed once', async () => {
      const tpl = store.templates();
      const a = template('tp-a', { createdAt: 1000 });
      await tpl.insertTemplate(a);
      await tpl.insertTemplate(template('tp-b', { tenant: 't2', createdAt: 2000 }));
      await tpl.insertTemplate(template('tp-c', { tenant: 't3', createdAt: 3000, public: true }));
      await assert.rejects(
        tpl.insertTemplate(template('tp-d', { name: 'tp-a' })),
        code('TEMPLATE_NAME_TAKEN'),
      );
      await tpl.insertTemplate(template('tp-e', { name: 'tp-a', tenant: 't2', createdAt: 4000 }));
      assert.deepEqual(await tpl.getTemplate('tp-a'), a);
      assert.equal(await tpl.getTemplate('tp-d'), undefined);
      assert.deepEqual(ids(await tpl.listTemplates()), ['tp-a', 'tp-b', 'tp-c', 'tp-e']);
      assert.deepEqual(ids(await tpl.listTemplates('t1')), ['tp-a', 'tp-c']);
      await tpl.setTemplatePublic('tp-b', true);
      await tpl.setTemplatePublic('tp-c', false);
      assert.deepEqual(ids(await tpl.listTemplates('t1')), ['tp-a', 'tp-b']);
      assert.equal((await tpl.getTemplate('tp-b'))?.public, true);
      assert.equal(await tpl.deleteTemplate('tp-a'), true);
      assert.equal(await tpl.deleteTemplate('tp-a'), false);
      // The name is free again.
      await tpl.insertTemplate(template('tp-f', { name: 'tp-a', createdAt: 5000 }));
      assert.deepEqual(ids(await tpl.listTemplates('t1')), ['tp-b', 'tp-f']);
    });

    void test('atomically: every write of the callback lands, and its result is returned', async () => {
      const out = await store.atomically(async (tx) => {
        await tx.insertSandbox(sandbox('sb-1'), 'c');
        await tx.transition('sb-1', 'creating', 'running', 'started', 2000);
        await tx.insertCheckpoint(checkpoint('ck-1', 'sb-1', 2000));
        await tx.templates().insertTemplate(template('tp-1'));
        // Reads through the transaction see its own writes.
        return (await tx.getSandbox('sb-1'))?.state;
      });
      assert.equal(out, 'running');
      assert.equal((await store.getSandbox('sb-1'))?.state, 'running');
      assert.deepEqual(ids(await store.listCheckpoints()), ['ck-1']);
      assert.deepEqual(ids(await store.templates().listTemplates()), ['tp-1']);
    });

    void test('atomically: a throw after awaited writes rolls every one of them back', async () => {
      await store.insertSandbox(sandbox('sb-0', { state: 'running' }), 'c');
      const boom = new Error('boom');
      await assert.rejects(
        store.atomically(async (tx) => {
          await tx.insertSandbox(sandbox('sb-1'), 'c');
          await tx.transition('sb-0', 'running', 'paused', 'p', 2000, { memoryBytes: 5 });
          await tx.insertCheckpoint(checkpoint('ck-1', 'sb-1', 2000));
          await tx.deleteSandbox('sb-0', 'gone', 2500);
          await tx.templates().insertTemplate(template('tp-1'));
          await tx.insertToken({ hash: 'h', tenant: 't1', admin: false, createdAt: 1 });
          await tx.insertSamples([{ sandboxId: 'sb-1', at: 1, memoryBytes: 1, cpuUsageUsec: 1 }]);
          await new Promise((r) => setTimeout(r, 5));
          throw boom;
        }),
        (e) => e === boom,
      );
      assert.deepEqual(ids(await store.listSandboxes()), ['sb-0']);
      assert.equal((await store.getSandbox('sb-0'))?.state, 'running');
      assert.deepEqual(await store.listCheckpoints(), []);
      assert.deepEqual(await store.templates().listTemplates(), []);
      assert.deepEqual(await store.listTokens(), []);
      assert.deepEqual(await store.samples(), []);
      assert.equal((await store.transitions()).length, 1);
      // The store works on after the rollback.
      assert.equal(await store.transition('sb-0', 'running', 'paused', 'p', 3000), true);
    });

    void test('atomically on a transaction runs in it: committed with it, rolled back with it', async () => {
      await store.atomically(async (tx) => {
        await tx.insertSandbox(sandbox('sb-1'), 'c');
        const inner = await tx.atomically(async (tx2) => {
          await tx2.insertSandbox(sandbox('sb-2'), 'c');
          return 'inner';
        });
        assert.equal(inner, 'inner');
        assert.equal((await tx.getSandbox('sb-2'))?.id, 'sb-2');
      });
      assert.deepEqual(ids(await store.listSandboxes()), ['sb-1', 'sb-2']);

      await assert.rejects(
        store.atomically(async (tx) => {
          await tx.atomically(async (tx2) => {
            await tx2.insertSandbox(sandbox('sb-3'), 'c');
          });
          await tx.insertSandbox(sandbox('sb-4'), 'c');
          throw new Error('outer fails');
        }),
        /outer fails/,
      );
      assert.deepEqual(ids(await store.listSandboxes()), ['sb-1', 'sb-2']);
    });
  });
}
