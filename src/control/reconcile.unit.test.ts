/**
 * The daemon dies in the middle of each lifecycle operation, at each port call in turn (the
 * fakes of control/testing/fakes.ts park that call and every later one forever), and starts
 * again: reconcile must leave every sandbox at rest in a state that matches what the node
 * runs, the vault holding exactly the recorded checkpoints, and the user's memory and files
 * where the contract keeps them. Then the same after a reboot, and for lazy restores whose
 * pages were still coming in.
 */
import { after, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { World, quiet } from './testing/world.js';
import { SCENARIOS, assertUserData, runOp, type Scenario } from './testing/scenarios.js';

/** Crash points where reconcile does not (yet) keep the contract, by `scenario | #call name`. */
const KNOWN: Record<string, string> = {};

const worlds: World[] = [];
after(async () => {
  for (const w of worlds) await w.close();
});

async function world(sc?: Scenario): Promise<World> {
  const w = await World.make(sc?.options);
  worlds.push(w);
  return w;
}

async function happyCalls(sc: Scenario): Promise<string[]> {
  const w = await world(sc);
  const source = await sc.setup(w);
  const faults = w.resetFaults();
  const out = await runOp(w, sc, source);
  assert.equal(out.error, undefined, `${sc.name}: ${String(out.error?.stack)}`);
  // The operation's calls only, not those of the checks below.
  const calls = [...faults.calls];
  return calls;
}

/** Waits until the daemon has died at its injected crash (or the operation ended before it). */
async function untilCrashed(w: World, op: Promise<unknown>): Promise<void> {
  let ended = false;
  void op.then(
    () => (ended = true),
    () => (ended = true),
  );
  for (let i = 0; i < 500 && !w.faults.crashed && !ended; i++) await quiet(10);
}

for (const sc of SCENARIOS) {
  describe(`${sc.name}: the daemon dies at each port call`, () => {
    test('after the restart: at rest, consistent, nothing lost', async (t) => {
      const calls = await happyCalls(sc);
      for (let k = 0; k < calls.length; k++) {
        const todo = KNOWN[`${sc.name} | #${k} ${calls[k]}`];
        await t.test(`dies at call ${k}: ${calls[k]}`, todo ? { todo } : {}, async () => {
          const what = `${sc.name}, the daemon dies at call ${k} (${calls[k]})`;
          const w = await world(sc);
          const source = await sc.setup(w);
          w.resetFaults().atCall(k, { kind: 'crash' });
          const op = sc.op(w, source);
          await untilCrashed(w, op);
          await w.restart();
          await w.assertConsistent(what);
          const id = sc.find ? await sc.find(w) : source;
          const s = id !== undefined ? await w.db.getSandbox(id) : undefined;
          if (s && sc.from !== 'none')
            assert.notEqual(s.state, 'failed', `${what}: the sandbox is not failed (${String(s.lastError)})`);
          await assertUserData(w, sc, source, id, what);
          await w.assertConsistent(`${what}, then back to running`);
          // The operation works again on the restarted daemon.
          if (s && sc.from !== 'none' && s.state === sc.from) {
            const again = await runOp(w, sc, id);
            assert.equal(again.error, undefined, `${what}, then retried: ${String(again.error?.message)}`);
            await w.assertConsistent(`${what}, then retried`);
          }
        });
      }
    });
  });
}

describe('a reboot while sandboxes rest or run', () => {
  /** a runs with no checkpoint, b is paused after a resume from one, c is hibernated. */
  async function rebooted(): Promise<{ w: World; a: string; b: string; c: string; changes: string[][] }> {
    const w = await world();
    const a = (await w.createSandbox('a')).id;
    await w.remember(a, 'a1');
    const b = (await w.createSandbox('b')).id;
    await w.remember(b, 'b1');
    await w.controller.hibernate(b);
    await w.controller.resume(b);
    await w.controller.pause(b);
    const c = (await w.createSandbox('c')).id;
    await w.remember(c, 'c1');
    await w.controller.hibernate(c);
    const changes = (await w.restart({ reboot: true })).map((x) => [x.id, x.from, x.to]);
    return { w, a, b, c, changes };
  }

  test('running and paused sandboxes go back to their checkpoint, or to their files without one', async () => {
    const { w, a, b, c, changes } = await rebooted();
    assert.deepEqual(
      changes.sort(),
      [
        [a, 'running', 'archived'],
        [b, 'paused', 'hibernated'],
      ].sort(),
    );
    // b's checkpoint was taken with b1 in memory; a had none, so only its files are back.
    await w.controller.resume(b);
    await w.controller.settle();
    await w.assertRemembers(b, 'b1', 'b');
    await w.controller.resume(c);
    await w.controller.settle();
    await w.assertRemembers(c, 'c1', 'c');
    await w.controller.resume(a);
    assert.equal(await w.exec(a, 'cat', 'notes/a.txt'), 'file a1');
    await w.assertConsistent('all resumed');
  });

  test('a sandbox sent back to its checkpoint keeps no files in its writable layer', async () => {
    const { w } = await rebooted();
    await w.assertConsistent('after a reboot');
  });
});

describe('lazy restore', () => {
  test('pages that never arrive: the sandbox goes back to its checkpoint, and resumes from it', async () => {
    const w = await world({ ...SCENARIOS[0]!, options: { lazyRestore: true } });
    const id = (await w.createSandbox()).id;
    await w.remember(id);
    await w.controller.hibernate(id);
    w.host.lazyPages = 'fail';
    const s = await w.controller.resume(id);
    assert.equal(s.state, 'running', 'answered as soon as the processes are back');
    await w.controller.settle();
    const back = await w.controller.get(id);
    assert.equal(back.state, 'hibernated');
    assert.match(back.lastError ?? '', /lazy restore failed, back to its checkpoint/);
    await w.assertConsistent('after failed pages');
    w.host.lazyPages = 'ok';
    await w.controller.resume(id);
    await w.controller.settle();
    await w.assertRemembers(id, 'v1', 'resumed again');
    await w.assertConsistent('resumed again');
  });

  test('the daemon dies while the pages come in: reconcile ends the processes and hibernates it again', async () => {
    const w = await world({ ...SCENARIOS[0]!, options: { lazyRestore: true } });
    const id = (await w.createSandbox()).id;
    await w.remember(id);
    await w.controller.hibernate(id);
    w.host.lazyPages = 'hang';
    await w.controller.resume(id);
    assert.equal(
      (await w.db.getSandbox(id))?.lazyRestoreOf,
      (await w.db.getSandbox(id))?.checkpointId,
      'marked mid-restore',
    );
    const changes = await w.restart();
    assert.deepEqual(
      changes.map((c) => [c.from, c.to]),
      [['running', 'hibernated']],
    );
    await w.assertConsistent('after the restart');
    w.host.lazyPages = 'ok';
    await w.controller.resume(id);
    await w.controller.settle();
    await w.assertRemembers(id, 'v1', 'resumed after the restart');
  });
});
