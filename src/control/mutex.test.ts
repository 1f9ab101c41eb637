import { test } from 'node:test';
import assert from 'node:assert/strict';
import { KeyedMutex } from './mutex.js';

test('operations on one key never overlap and run in arrival order; other keys run alongside', async () => {
  const m = new KeyedMutex();
  let active = 0;
  let maxActive = 0;
  const order: string[] = [];
  const gates: (() => void)[] = [];
  const op = (key: string, name: string) =>
    m.run(key, async () => {
      active++;
      maxActive = Math.max(maxActive, active);
      order.push(`start ${name}`);
      await new Promise<void>((r) => gates.push(r));
      order.push(`end ${name}`);
      active--;
    });
  const a1 = op('a', 'a1');
  const a2 = op('a', 'a2');
  const b1 = op('b', 'b1');
  await new Promise((r) => setImmediate(r));
  assert.deepEqual(order, ['start a1', 'start b1']);
  assert.equal(m.busy('a'), true);
  while (gates.length > 0 || order.length < 6) {
    const g = gates.shift();
    if (g) g();
    await new Promise((r) => setImmediate(r));
  }
  await Promise.all([a1, a2, b1]);
  assert.equal(maxActive, 2, 'a and b overlapped, a1 and a2 did not');
  assert.ok(order.indexOf('end a1') < order.indexOf('start a2'));
  assert.equal(m.busy('a'), false);
});

test('a failing operation releases the key', async () => {
  const m = new KeyedMutex();
  await assert.rejects(
    m.run('k', () => Promise.reject(new Error('boom'))),
    /boom/,
  );
  assert.equal(await m.run('k', () => Promise.resolve(42)), 42);
});

test('idle waits for every operation, those queued or started while it waits too', async () => {
  const m = new KeyedMutex();
  const done: string[] = [];
  const later = (name: string, ms: number) =>
    m.run(name[0]!, async () => {
      await new Promise((r) => setTimeout(r, ms));
      done.push(name);
    });
  void later('a1', 30);
  void later('a2', 10);
  void later('b1', 5);
  // Started while idle() already waits: it is waited for as well.
  setTimeout(() => void later('c1', 40), 20);
  await m.idle();
  assert.deepEqual(done.sort(), ['a1', 'a2', 'b1', 'c1']);
  await m.idle();
});
