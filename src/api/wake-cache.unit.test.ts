/**
 * The wake proxy's sandbox lookups (api/wake.ts): kept while the store's sandboxVersion stays
 * the same, and never kept from a store that other processes write too (no sandboxVersion).
 */
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import type { TrackingController } from '../control/activity.js';
import { systemClock } from '../control/options.js';
import type { Sandbox } from '../domain/sandbox.js';
import { sandbox as fixture } from '../state/contract.js';
import { SqliteStateStore } from '../state/sqlite.js';
import type { StateStore } from '../state/store.js';
import { wakeTarget } from './wake.js';

const sandbox = (id: string): Sandbox => fixture(id, { state: 'running' });

/** `db` with its reads counted, and its sandboxVersion as `version` says. */
function counted(
  db: SqliteStateStore,
  version: () => number | undefined,
): { store: StateStore; reads: () => number } {
  let reads = 0;
  const store = new Proxy(db, {
    get(target, prop, receiver) {
      if (prop === 'sandboxVersion') return version();
      const v = Reflect.get(target, prop, receiver) as unknown;
      if (prop === 'getSandbox' || prop === 'listSandboxes') {
        const f = v as (...args: unknown[]) => unknown;
        return (...args: unknown[]) => {
          reads++;
          return f.apply(target, args);
        };
      }
      return typeof v === 'function' ? (v as (...args: unknown[]) => unknown).bind(target) : v;
    },
  });
  return { store, reads: () => reads };
}

/** find never reaches the controller. */
const noController = Object.create(null) as TrackingController;

describe('the wake proxy sandbox lookups', () => {
  test('kept while sandboxVersion stays, read again once it moves', async () => {
    const db = new SqliteStateStore(':memory:');
    await db.insertSandbox(sandbox('sb-a'), 'create');
    const { store, reads } = counted(db, () => db.sandboxVersion);
    const target = wakeTarget(noController, store, systemClock);
    assert.deepEqual(
      (await target.find('sb-a')).map((s) => s.id),
      ['sb-a'],
    );
    const n = reads();
    const again = target.find('sb-a');
    assert.ok(!(again instanceof Promise), 'answered at once from what was kept');
    assert.equal(reads(), n);
    await db.updateSandbox('sb-a', { lastActiveAt: 2 });
    await target.find('sb-a');
    assert.ok(reads() > n, 'read again after a change');
    await db.close();
  });

  test('never kept when the store has no sandboxVersion (other processes write it)', async () => {
    const db = new SqliteStateStore(':memory:');
    await db.insertSandbox(sandbox('sb-a'), 'create');
    const { store, reads } = counted(db, () => undefined);
    const target = wakeTarget(noController, store, systemClock);
    await target.find('sb-a');
    const n = reads();
    const again = target.find('sb-a');
    assert.ok(again instanceof Promise, 'read, not answered from memory');
    assert.deepEqual(
      (await again).map((s) => s.id),
      ['sb-a'],
    );
    assert.ok(reads() > n);
    // A change made elsewhere (here: behind the version's back) is seen at once.
    await db.updateSandbox('sb-a', { address: '10.0.0.9' });
    assert.equal((await target.find('sb-a'))[0]?.address, '10.0.0.9');
    await db.close();
  });
});
