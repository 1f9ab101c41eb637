/**
 * fenceNode over a fake runtime and store (the ports it uses): what it freezes, what waits
 * behind it, how each end (thaw, end, keep) leaves each sandbox, and that lifting it never
 * waits on an operation that held a sandbox when the fence came. The real thing is in
 * api/fleet.test.ts (a node cut off from PostgreSQL).
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { KeyedMutex } from './mutex.js';
import { fenceNode } from './ops/nodes.js';
import type { LifecycleContext } from './context.js';

type Status = 'running' | 'paused' | 'stopped' | 'gone';

function world(boxes: Record<string, Status>, owners: Record<string, string | undefined> = {}) {
  const status = new Map(Object.entries(boxes));
  const log: string[] = [];
  const locks = new KeyedMutex();
  const ctx = {
    node: 'me',
    locks,
    opts: { warn: (m: string) => log.push(`warn ${m}`) },
    runtime: {
      list: () => Promise.resolve([...status.keys()]),
      state: (id: string) => Promise.resolve({ status: status.get(id) }),
      freeze: (id: string) => {
        log.push(`freeze ${id}`);
        status.set(id, 'paused');
        return Promise.resolve();
      },
      thaw: (id: string) => {
        log.push(`thaw ${id}`);
        status.set(id, 'running');
        return Promise.resolve();
      },
      destroy: (id: string) => {
        log.push(`destroy ${id} (${status.get(id)})`);
        status.set(id, 'gone');
        return Promise.resolve();
      },
    },
    store: {
      getSandbox: (id: string) =>
        Promise.resolve(id in owners ? { id, node: owners[id] } : { id, node: 'me' }),
    },
  } as unknown as LifecycleContext;
  return { ctx, status, log, locks };
}

/** An operation that holds sandbox `id`'s lock until `release` is called. */
function holding(locks: KeyedMutex, id: string, log: string[]) {
  let release!: () => void;
  const done = locks.run(id, async () => {
    log.push(`op on ${id} begins`);
    await new Promise<void>((r) => (release = r));
    log.push(`op on ${id} ends`);
  });
  return { release: () => release(), done };
}

test('the fence freezes what runs and holds it: an operation waits until a renewal in time thaws it', async () => {
  const w = world({ a: 'running', b: 'running', c: 'stopped' });
  const f = await fenceNode(w.ctx);
  assert.deepEqual([...f.ids].sort(), ['a', 'b']);
  assert.equal(w.status.get('c'), 'stopped');
  let ran = false;
  const op = w.locks.run('a', () => {
    ran = true;
    return Promise.resolve();
  });
  await sleep(50);
  assert.equal(ran, false, 'no operation starts on a fenced sandbox');
  await f.lift('thaw');
  await op;
  assert.equal(ran, true);
  assert.deepEqual([w.status.get('a'), w.status.get('b')], ['running', 'running']);
});

test('lost: copies no longer this node’s are ended frozen, never thawed; its own are thawed', async () => {
  const w = world({ a: 'running', b: 'running', c: 'running' }, { a: 'other', c: undefined });
  const f = await fenceNode(w.ctx);
  await f.lift('end');
  assert.ok(w.log.includes('destroy a (paused)'), w.log.join('; '));
  assert.ok(!w.log.includes('thaw a'));
  assert.equal(w.status.get('b'), 'running', 'still this node’s: goes on');
  // A sandbox with no node (from before the fleet) is this node's.
  assert.equal(w.status.get('c'), 'running');
});

test('a sandbox busy when the fence comes is frozen once its operation lets go, without the fence waiting', async () => {
  const w = world({ a: 'running', b: 'running' });
  const op = holding(w.locks, 'b', w.log);
  await sleep(10);
  const f = await fenceNode(w.ctx);
  assert.deepEqual(f.ids, ['a'], 'b is not waited for');
  assert.equal(w.status.get('b'), 'running');
  op.release();
  await op.done;
  await sleep(10);
  assert.equal(w.status.get('b'), 'paused', 'frozen as soon as its operation let go');
  assert.deepEqual([...f.ids].sort(), ['a', 'b']);
  await f.lift('thaw');
  assert.deepEqual([w.status.get('a'), w.status.get('b')], ['running', 'running']);
});

test('lifting never waits on an operation still holding a sandbox; what it held is settled after', async () => {
  const w = world({ a: 'running', b: 'running' }, { b: 'other' });
  const op = holding(w.locks, 'b', w.log);
  await sleep(10);
  const f = await fenceNode(w.ctx);
  const lifted = f.lift('end');
  const first = await Promise.race([lifted.then(() => 'lifted'), sleep(500).then(() => 'waited')]);
  assert.equal(first, 'lifted', 'the renewal loop is not held by the operation');
  assert.equal(w.status.get('b'), 'running');
  op.release();
  await op.done;
  await sleep(10);
  // Taken back meanwhile: ended once the operation let go (not frozen first: the fence was decided).
  assert.ok(w.log.includes('destroy b (running)'), w.log.join('; '));
  assert.ok(!w.log.includes('freeze b'));
});

test('a daemon closing while fenced keeps its sandboxes frozen', async () => {
  const w = world({ a: 'running' });
  const f = await fenceNode(w.ctx);
  await f.lift('keep');
  assert.equal(w.status.get('a'), 'paused');
  assert.ok(!w.log.some((l) => l.startsWith('thaw') || l.startsWith('destroy')));
});
