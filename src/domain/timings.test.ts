import { test } from 'node:test';
import assert from 'node:assert/strict';
import { StepTimer, formatTimings } from './timings.js';

test('steps keep their start and length, overlap included, and failed steps are recorded', async () => {
  let now = 1000;
  const t = new StepTimer(() => now);
  await t.time('freeze', async () => {
    now += 5;
  });
  // Two steps at once: both start at 5.
  let release!: () => void;
  const slow = t.time('vault put', () => new Promise<void>((r) => (release = r)));
  await t.time('wipe', async () => {
    now += 2;
  });
  now += 10;
  release();
  await slow;
  await assert.rejects(
    t.time('end processes', async () => {
      now += 3;
      throw new Error('boom');
    }),
  );
  t.mark('running');
  const r = t.finish('hibernate', 'sb-1', false);
  assert.equal(r.totalMs, 20);
  assert.deepEqual(
    r.steps.map((s) => [s.step, s.startMs, s.ms]),
    [
      ['freeze', 0, 5],
      ['vault put', 5, 12],
      ['wipe', 5, 2],
      ['end processes', 17, 3],
      ['running', 20, 0],
    ],
  );
  assert.match(formatTimings(r), /^hibernate sb-1 20ms failed: freeze 5@0 \| vault put 12@5/);
});
