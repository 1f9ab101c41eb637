/**
 * Fencing, over fakes: a node that cannot renew its lease freezes its sandboxes before the
 * lease can run out, thaws them when a renewal succeeds in time, and leaves them frozen for
 * release when the fleet marked it lost. The real thing (a node cut off from PostgreSQL with
 * real sandboxes) is in api/fleet.test.ts.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { NodeMembership, type FleetTarget } from './fleet.js';
import type { FenceEnd } from './ops/nodes.js';
import type { FleetStore } from '../state/store.js';
import type { NodeState } from '../domain/node.js';

type Renewal = 'ok' | 'fail' | 'lost';

function world(): {
  fleet: FleetStore;
  target: FleetTarget;
  log: string[];
  set(r: Renewal): void;
  join(): Promise<NodeMembership>;
} {
  let renewal: Renewal = 'ok';
  const log: string[] = [];
  const fleet = {
    registerNode: () => {
      log.push('register');
      return Promise.resolve('active' as NodeState);
    },
    renewNode: () => {
      if (renewal === 'fail') return Promise.reject(new Error('connection refused'));
      if (renewal === 'lost') {
        renewal = 'ok';
        return Promise.resolve(undefined);
      }
      return Promise.resolve('active' as NodeState);
    },
    expiredNodes: () => Promise.resolve([]),
  } as unknown as FleetStore;
  const target: FleetTarget = {
    listOwn: () => Promise.resolve([]),
    hibernate: () => Promise.resolve(undefined),
    reclaimLostNode: () => Promise.resolve([]),
    releaseForeign: () => {
      log.push('release');
      return Promise.resolve([]);
    },
    fence: () => {
      log.push('fence');
      return Promise.resolve({
        ids: ['a', 'b'],
        lift: (how: FenceEnd) => {
          log.push(how);
          return Promise.resolve();
        },
      });
    },
  };
  const join = () =>
    NodeMembership.join({
      fleet,
      target,
      name: 'n1',
      url: 'http://127.0.0.1:1',
      capacity: { memoryBytes: 1, cpus: 1, arch: 'x64', cpuFlags: [], runtimes: ['runc'] },
      leaseMs: 900,
      renewEveryMs: 100,
      fenceAfterMs: 500,
      warn: (m) => log.push(`warn: ${m}`),
    });
  return { fleet, target, log, set: (r) => (renewal = r), join };
}

/** Waits for `cond`, at most 5 s. */
async function until(what: string, cond: () => boolean): Promise<void> {
  const end = Date.now() + 5_000;
  while (!cond()) {
    if (Date.now() > end) throw new Error(`never happened: ${what}`);
    await sleep(10);
  }
}

const events = (log: string[]) => log.filter((l) => !l.startsWith('warn') && l !== 'release');

test('renewing in time: nothing is ever frozen', async () => {
  const w = world();
  const m = await w.join();
  await sleep(1_200);
  await m.close();
  assert.deepEqual(events(w.log), ['register']);
});

test('cut off past the fence: its sandboxes are frozen before the lease runs out, and go on when it renews in time', async () => {
  const w = world();
  const m = await w.join();
  await sleep(150);
  w.set('fail');
  const cut = Date.now();
  await until('fenced', () => w.log.includes('fence'));
  const frozeAfter = Date.now() - cut;
  // The last renewal that succeeded was sent at most 100 ms and a tick before the cut.
  assert.ok(frozeAfter < 900 - 100, `frozen ${frozeAfter} ms after the cut, within the lease`);
  assert.ok(w.log.some((l) => /has not renewed its lease for 500 ms: it froze 2 sandbox/.test(l)));
  await sleep(300);
  assert.deepEqual(events(w.log), ['register', 'fence'], 'frozen once, however many renewals fail');
  w.set('ok');
  await until('thawed', () => w.log.includes('thaw'));
  assert.ok(w.log.some((l) => /renewed its lease in time: 2 sandbox/.test(l)));
  await sleep(700);
  await m.close();
  assert.deepEqual(events(w.log), ['register', 'fence', 'thaw'], 'armed again after the renewal');
});

test('marked lost meanwhile: the frozen sandboxes never run again before release ends them', async () => {
  const w = world();
  const m = await w.join();
  w.set('fail');
  await until('fenced', () => w.log.includes('fence'));
  w.set('lost');
  await until('joined again', () => w.log.includes('register', 1));
  await m.close();
  const seq = w.log.filter((l) => !l.startsWith('warn'));
  const i = seq.indexOf('end');
  assert.ok(i > 0 && seq[i + 1] === 'release', `the frozen copies ended, then released: ${seq.join(', ')}`);
  assert.ok(!seq.includes('thaw'));
});

test('a fenced node that closes leaves its sandboxes frozen', async () => {
  const w = world();
  const m = await w.join();
  w.set('fail');
  await until('fenced', () => w.log.includes('fence'));
  await m.close();
  assert.deepEqual(events(w.log), ['register', 'fence', 'keep']);
});
