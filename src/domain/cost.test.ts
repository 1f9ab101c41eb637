import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { capacity, computeCost, unitPrices, type MeterSample, type PriceSheet } from './cost.js';
import type { SandboxState, Transition } from './sandbox.js';

const GIB = 1024 ** 3;
const S = 1000;
const prices: PriceSheet = {
  currency: 'USD',
  nodeCostPerHour: 3.6,
  nodeVcpus: 2,
  nodeMemoryBytes: 4 * GIB,
  cpuShare: 0.5,
  storagePerGiBMonth: 1,
};

let nextId = 1;
function script(sandboxId: string, tenant: string, steps: [number, SandboxState][]): Transition[] {
  let from: SandboxState | null = null;
  return steps.map(([at, to]) => {
    const t: Transition = { id: nextId++, sandboxId, tenant, from, to, at: at * S, reason: 'test' };
    from = to;
    return t;
  });
}
const sample = (sandboxId: string, at: number, gib: number, cpuSec: number): MeterSample => ({
  sandboxId,
  at: at * S,
  memoryBytes: gib * GIB,
  cpuUsageUsec: cpuSec * 1e6,
});

const transitions = [
  ...script('sb-a', 't1', [
    [0, 'creating'],
    [10, 'running'],
    [1000, 'hibernating'],
    [1010, 'hibernated'],
    [3000, 'resuming'],
    [3005, 'running'],
  ]),
  ...script('sb-b', 't2', [
    [0, 'creating'],
    [1, 'running'],
  ]),
];
const samples = [
  sample('sb-a', 10, 1, 0),
  sample('sb-a', 500, 1, 10),
  sample('sb-a', 1000, 2, 20),
  // After the restore: a new cgroup, its CPU counter starts from 0.
  sample('sb-a', 3005, 1, 0),
  sample('sb-a', 4000, 1, 5),
  sample('sb-b', 1, 0.5, 0),
  sample('sb-b', 4000, 0.5, 100),
];
const checkpoints = [{ sandboxId: 'sb-a', createdAt: 1008 * S, storedBytes: 0.5 * GIB }];

function close(actual: number, expected: number, what: string): void {
  assert.ok(Math.abs(actual - expected) < 1e-9, `${what}: ${actual} != ${expected}`);
}

describe('cost', () => {
  test('unit prices follow from the node', () => {
    const u = unitPrices(prices);
    close(u.perVcpuSecond, 0.00025, 'per vCPU-second');
    close(u.perGiBSecond, 0.000125, 'per GiB-second');
    assert.equal(u.perGiBMonth, 1);
  });

  test('exact figures to the second for scripted transitions and samples', () => {
    const r = computeCost({ transitions, samples, checkpoints, prices, since: 0, until: 4000 * S });
    const a = r.sandboxes.find((s) => s.sandboxId === 'sb-a')!;
    assert.deepEqual(a.secondsByState, {
      creating: 10,
      running: 1985,
      hibernating: 10,
      hibernated: 1990,
      resuming: 5,
    });
    assert.equal(a.existedSeconds, 4000);
    close(a.cpuSeconds, 25, 'cpu seconds (the counter reset at restore is not a negative)');
    // 10 (creating, first sample backfilled) + 990 + 20 (hibernating at the last value) + 10 + 995
    close(a.memoryGiBSeconds, 2025, 'memory GiB-seconds');
    close(a.storageGiBMonths, (0.5 * 2992) / (30 * 86400), 'storage GiB-months');
    const spent = 25 * 0.00025 + 2025 * 0.000125 + (0.5 * 2992) / (30 * 86400);
    close(a.spent, spent, 'spent');
    const warm = 25 * 0.00025 + (2025 / 2010) * 4000 * 0.000125;
    close(a.alwaysWarm, warm, 'always warm');
    close(a.saved, warm - spent, 'saved');
    close(a.memoryHoursFreed, ((2025 / 2010) * 4000 - 2025) / 3600, 'memory-hours freed');
    assert.equal(a.slept, true);

    const b = r.sandboxes.find((s) => s.sandboxId === 'sb-b')!;
    close(b.spent, 100 * 0.00025 + 2000 * 0.000125, 'b spent');
    close(b.saved, 0, 'a sandbox that never slept saved nothing');
    assert.deepEqual(r.neverSlept, [{ sandboxId: 'sb-b', tenant: 't2', spent: b.spent }]);

    close(r.totals.spent, a.spent + b.spent, 'total spent');
    close(r.totals.savedRatio, (a.saved + b.saved) / (a.alwaysWarm + b.alwaysWarm), 'saved ratio');
    assert.deepEqual(
      r.tenants.map((t) => t.tenant),
      ['t1', 't2'],
    );
  });

  test('a window counts only what happened inside it', () => {
    const r = computeCost({ transitions, samples, checkpoints, prices, since: 2000 * S, until: 4000 * S });
    const a = r.sandboxes.find((s) => s.sandboxId === 'sb-a')!;
    assert.deepEqual(a.secondsByState, { hibernated: 1000, resuming: 5, running: 995 });
    close(a.cpuSeconds, 5, 'cpu in window');
    close(a.memoryGiBSeconds, 2 * 5 + 995, 'memory in window');
    close(a.storageGiBMonths, (0.5 * 2000) / (30 * 86400), 'storage in window');
  });

  test('a deleted sandbox stops counting at its deletion', () => {
    const ts = script('sb-c', 't1', [
      [0, 'creating'],
      [0, 'running'],
      [100, 'deleting'],
    ]);
    const r = computeCost({
      transitions: ts,
      samples: [sample('sb-c', 0, 1, 0)],
      checkpoints: [],
      prices,
      since: 0,
      until: 4000 * S,
    });
    assert.equal(r.sandboxes[0]!.existedSeconds, 100);
    close(r.sandboxes[0]!.memoryGiBSeconds, 100, 'memory until deletion');
  });

  test('capacity: warm is bounded by memory, hibernated by disk', () => {
    const c = capacity({
      nodeMemoryBytes: 24 * GIB,
      freeDiskBytes: 80 * GIB,
      residentBytes: [GIB, 3 * GIB],
      storedBytes: [GIB / 4],
    });
    assert.equal(c.warm, 12);
    assert.equal(c.hibernated, 320);
  });
});
