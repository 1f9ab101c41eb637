/**
 * The idle policy and its loop, driven by a manual clock: every transition, the lease,
 * overrides (sandbox over tenant over node), activity signals, and a daemon restart in the
 * middle of a countdown.
 */
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { DEFAULT_POLICY, type Sandbox, type SandboxPolicy, type SandboxState } from '../domain/sandbox.js';
import { decide, effectivePolicy } from './policy.js';
import { PolicyLoop, type PolicyTarget } from './policy-loop.js';

const S = 1000;
const M = 60 * S;
const H = 60 * M;
const D = 24 * H;
const T0 = Date.UTC(2026, 0, 1);

function sandbox(o: Partial<Sandbox> & { policy?: SandboxPolicy } = {}): Sandbox {
  const { policy, ...rest } = o;
  return {
    id: 'sb-aaaaaaaaaaaaaaaa',
    tenant: 'acme',
    name: 'box',
    state: 'running',
    spec: {
      source: { kind: 'rootfs', path: '/r' },
      command: ['sh'],
      env: {},
      ports: [],
      memoryBytes: 1,
      cpus: 1,
      policy: policy ?? {},
    },
    createdAt: T0,
    stateSince: T0,
    lastActiveAt: T0,
    memoryBytes: 0,
    ...rest,
  };
}

describe('decide', () => {
  test('defaults: hibernate after 15m idle, archive after 7d hibernated, never delete, no lifetime cap', () => {
    const s = sandbox();
    assert.deepEqual(decide(s, T0 + 15 * M - S), { action: 'none', why: 'idle 14m59s', nextAt: T0 + 15 * M });
    assert.equal(decide(s, T0 + 15 * M - 1).action, 'none');
    assert.deepEqual(decide(s, T0 + 15 * M), { action: 'hibernate', reason: 'policy: idle 15m' });
    const h = sandbox({ state: 'hibernated', stateSince: T0 + 15 * M });
    assert.equal(decide(h, T0 + 15 * M + 7 * D - 1).action, 'none');
    assert.deepEqual(decide(h, T0 + 15 * M + 7 * D), { action: 'archive', reason: 'policy: hibernated 7d' });
    const a = sandbox({ state: 'archived', stateSince: T0 + 8 * D });
    assert.deepEqual(decide(a, T0 + 10_000 * D), { action: 'none', why: 'archived 9992d' });
    assert.equal(effectivePolicy(s).lifetimeMs, undefined);
  });

  test('running -> paused after the short idle, then paused -> hibernated', () => {
    const policy = { pauseAfterMs: 2 * M };
    assert.deepEqual(decide(sandbox({ policy }), T0 + 2 * M), { action: 'pause', reason: 'policy: idle 2m' });
    const paused = sandbox({ policy, state: 'paused', stateSince: T0 + 2 * M });
    assert.deepEqual(decide(paused, T0 + 5 * M), { action: 'none', why: 'idle 5m', nextAt: T0 + 15 * M });
    assert.deepEqual(decide(paused, T0 + 15 * M), { action: 'hibernate', reason: 'policy: idle 15m' });
  });

  test('a running sandbox idle past both thresholds hibernates directly; a pause no shorter than hibernate is skipped', () => {
    assert.equal(decide(sandbox({ policy: { pauseAfterMs: 1 * M } }), T0 + 20 * M).action, 'hibernate');
    assert.equal(
      decide(sandbox({ policy: { pauseAfterMs: 20 * M, hibernateAfterMs: 10 * M } }), T0 + 10 * M).action,
      'hibernate',
    );
  });

  test('archived -> deleted when deleteAfter is set', () => {
    const a = sandbox({ state: 'archived', stateSince: T0, policy: { deleteAfterMs: 30 * D } });
    assert.equal(decide(a, T0 + 30 * D - 1).action, 'none');
    assert.deepEqual(decide(a, T0 + 30 * D), { action: 'delete', reason: 'policy: archived 30d' });
  });

  test('lifetime cap archives a running, paused or hibernated sandbox, lease or not', () => {
    const policy = { lifetimeMs: 24 * H };
    for (const state of ['running', 'paused', 'hibernated'] as SandboxState[]) {
      const s = sandbox({ state, policy, lastActiveAt: T0 + 30 * H });
      assert.deepEqual(decide(s, T0 + 24 * H), { action: 'archive', reason: 'policy: lifetime 1d' }, state);
    }
    assert.equal(decide(sandbox({ state: 'archived', policy }), T0 + 48 * H).action, 'none');
  });

  test('a lease (lastActiveAt in the future) blocks every idle step until it runs out', () => {
    const lease = T0 + 2 * H;
    const s = sandbox({ lastActiveAt: lease, policy: { pauseAfterMs: M } });
    assert.deepEqual(decide(s, T0 + 1 * H), { action: 'none', why: 'leased', nextAt: lease });
    assert.equal(decide(s, lease + 14 * M).action, 'pause');
    assert.equal(decide(s, lease + 15 * M).action, 'hibernate');
    const h = sandbox({ state: 'hibernated', stateSince: T0, lastActiveAt: T0 + 10 * D });
    assert.equal(decide(h, T0 + 9 * D).action, 'none');
    assert.equal(decide(h, T0 + 16 * D).action, 'none', 'the archive countdown starts when the lease ends');
    assert.equal(decide(h, T0 + 17 * D).action, 'archive');
  });

  test('open connections and running execs are activity now', () => {
    const s = sandbox();
    const late = T0 + H;
    assert.deepEqual(decide(s, late, { activity: { openConnections: 1, runningExecs: 0 } }), {
      action: 'none',
      why: 'active: 1 connection(s)',
    });
    assert.deepEqual(decide(s, late, { activity: { openConnections: 0, runningExecs: 2 } }), {
      action: 'none',
      why: 'active: 2 exec(s)',
    });
    assert.equal(decide(s, late, { activity: { openConnections: 0, runningExecs: 0 } }).action, 'hibernate');
  });

  test('transient and failed states are left alone', () => {
    for (const state of ['creating', 'hibernating', 'resuming', 'deleting', 'failed'] as SandboxState[]) {
      assert.equal(decide(sandbox({ state }), T0 + 100 * D).action, 'none', state);
    }
  });

  test('overrides: the sandbox over its tenant over the node', () => {
    const defaults = {
      node: { hibernateAfterMs: 30 * M, archiveAfterMs: 3 * D },
      tenants: { acme: { hibernateAfterMs: 5 * M, pauseAfterMs: 1 * M }, other: { hibernateAfterMs: H } },
    };
    assert.deepEqual(effectivePolicy(sandbox(), defaults), {
      hibernateAfterMs: 5 * M,
      pauseAfterMs: 1 * M,
      archiveAfterMs: 3 * D,
    });
    assert.deepEqual(effectivePolicy(sandbox({ tenant: 'zeta' }), defaults), {
      hibernateAfterMs: 30 * M,
      archiveAfterMs: 3 * D,
    });
    const own = sandbox({ policy: { hibernateAfterMs: 2 * H, pauseAfterMs: undefined } });
    assert.deepEqual(effectivePolicy(own, defaults), {
      hibernateAfterMs: 2 * H,
      pauseAfterMs: 1 * M,
      archiveAfterMs: 3 * D,
    });
    assert.equal(decide(own, T0 + 1 * H, { defaults }).action, 'pause');
    assert.equal(decide(own, T0 + 2 * H, { defaults }).action, 'hibernate');
    assert.equal(decide(sandbox({ tenant: 'other' }), T0 + 45 * M, { defaults }).action, 'none');
    assert.equal(effectivePolicy(sandbox()).hibernateAfterMs, DEFAULT_POLICY.hibernateAfterMs);
  });
});

/** An in-memory controller: states and timestamps as the store keeps them, transitions counted. */
class FakeTarget implements PolicyTarget {
  readonly boxes = new Map<string, Sandbox>();
  readonly transitions: { id: string; from: SandboxState; to: SandboxState; reason: string; at: number }[] =
    [];
  cpuUsec = new Map<string, number>();
  failNext: string | undefined;
  constructor(readonly clock: { now(): number }) {}
  add(s: Sandbox): void {
    this.boxes.set(s.id, s);
  }
  async list(): Promise<Sandbox[]> {
    return [...this.boxes.values()].map((s) => structuredClone(s));
  }
  async get(id: string): Promise<Sandbox> {
    return this.peek(id);
  }
  /** The sandbox now, for the test's checks. */
  peek(id: string): Sandbox {
    const s = this.boxes.get(id);
    if (!s) throw new Error(`no sandbox ${id}`);
    return structuredClone(s);
  }
  private move(id: string, to: SandboxState, reason: string): Promise<Sandbox> {
    if (this.failNext === id) {
      this.failNext = undefined;
      return Promise.reject(new Error('injected'));
    }
    const s = this.boxes.get(id)!;
    const at = this.clock.now();
    this.transitions.push({ id, from: s.state, to, reason, at });
    s.state = to;
    s.stateSince = at;
    return Promise.resolve(structuredClone(s));
  }
  pause(id: string, _t?: string, reason = 'pause') {
    return this.move(id, 'paused', reason);
  }
  hibernate(id: string, _t?: string, reason = 'hibernate') {
    return this.move(id, 'hibernated', reason);
  }
  archive(id: string, _t?: string, reason = 'archive') {
    return this.move(id, 'archived', reason);
  }
  async remove(id: string) {
    await this.move(id, 'deleting', 'rm');
    this.boxes.delete(id);
  }
  usage(id: string) {
    const u = this.cpuUsec.get(id);
    return Promise.resolve(u === undefined ? undefined : { cpuUsageUsec: u });
  }
  async touch(id: string): Promise<void> {
    this.boxes.get(id)!.lastActiveAt = this.clock.now();
  }
}

function manualClock(at: number) {
  const c = { t: at, now: () => c.t };
  return c;
}

describe('policy loop', () => {
  test('walks a sandbox down every tier with reasons, one step each, never repeating', async () => {
    const clock = manualClock(T0);
    const target = new FakeTarget(clock);
    target.add(
      sandbox({
        policy: { pauseAfterMs: 1 * M, hibernateAfterMs: 10 * M, archiveAfterMs: D, deleteAfterMs: 2 * D },
      }),
    );
    const loop = new PolicyLoop({ target, clock, intervalMs: 0 });
    const at = async (t: number) => {
      clock.t = t;
      return (await loop.tick()).map((s) => `${s.action} (${s.reason})`);
    };
    assert.deepEqual(await at(T0 + 30 * S), []);
    assert.deepEqual(await at(T0 + 1 * M), ['pause (policy: idle 1m)']);
    assert.deepEqual(await at(T0 + 2 * M), []);
    assert.deepEqual(await at(T0 + 10 * M), ['hibernate (policy: idle 10m)']);
    assert.deepEqual(await at(T0 + 10 * M + D - 1), []);
    assert.deepEqual(await at(T0 + 10 * M + D), ['archive (policy: hibernated 1d)']);
    assert.deepEqual(await at(T0 + 10 * M + 3 * D - 1), []);
    assert.deepEqual(await at(T0 + 10 * M + 3 * D), ['delete (policy: archived 2d)']);
    assert.deepEqual(await at(T0 + 100 * D), []);
    assert.deepEqual(
      target.transitions.map((t) => `${t.from}->${t.to}`),
      ['running->paused', 'paused->hibernated', 'hibernated->archived', 'archived->deleting'],
    );
    await loop.close();
  });

  test('a restart in the middle of a countdown neither forgets nor repeats a step', async () => {
    const clock = manualClock(T0);
    const target = new FakeTarget(clock);
    target.add(sandbox({ policy: { hibernateAfterMs: 10 * M, archiveAfterMs: H } }));
    const first = new PolicyLoop({ target, clock, intervalMs: 0 });
    clock.t = T0 + 6 * M;
    assert.deepEqual(await first.tick(), []);
    await first.close();
    // The daemon is down for a while; a new loop knows only what the store holds.
    const second = new PolicyLoop({ target, clock, intervalMs: 0 });
    clock.t = T0 + 9 * M;
    assert.deepEqual(await second.tick(), [], 'the countdown did not restart from zero, nor end early');
    clock.t = T0 + 10 * M;
    assert.deepEqual(
      (await second.tick()).map((s) => s.action),
      ['hibernate'],
    );
    await second.close();
    // Restarted again just after the hibernate: the step is not repeated, the archive countdown
    // runs from the hibernate.
    const third = new PolicyLoop({ target, clock, intervalMs: 0 });
    clock.t = T0 + 10 * M + 59 * M;
    assert.deepEqual(await third.tick(), []);
    clock.t = T0 + 10 * M + H;
    assert.deepEqual(
      (await third.tick()).map((s) => s.action),
      ['archive'],
    );
    assert.deepEqual(
      target.transitions.map((t) => t.to),
      ['hibernated', 'archived'],
    );
    await third.close();
  });

  test('a keepalive lease keeps the sandbox running through the whole lease', async () => {
    const clock = manualClock(T0);
    const target = new FakeTarget(clock);
    target.add(sandbox({ lastActiveAt: T0 + 2 * H }));
    const loop = new PolicyLoop({ target, clock, intervalMs: 0 });
    for (let t = T0; t < T0 + 2 * H + 15 * M; t += 5 * M) {
      clock.t = t;
      assert.deepEqual(await loop.tick(), [], `at +${(t - T0) / M}m`);
    }
    clock.t = T0 + 2 * H + 15 * M;
    assert.deepEqual(
      (await loop.tick()).map((s) => s.action),
      ['hibernate'],
    );
  });

  test('CPU above the threshold between ticks counts as activity; below it does not', async () => {
    const clock = manualClock(T0);
    const target = new FakeTarget(clock);
    const s = sandbox({ policy: { hibernateAfterMs: 10 * M } });
    target.add(s);
    const loop = new PolicyLoop({ target, clock, intervalMs: 0, cpuActiveShare: 0.05 });
    target.cpuUsec.set(s.id, 0);
    clock.t = T0 + 5 * M;
    await loop.tick(); // baseline
    // Busy: 30 s of CPU in 5 minutes is 10% of a CPU.
    target.cpuUsec.set(s.id, 30e6);
    clock.t = T0 + 10 * M;
    assert.deepEqual(await loop.tick(), []);
    assert.equal(target.peek(s.id).lastActiveAt, T0 + 10 * M, 'the idle clock restarted');
    // Quiet: 3 s in 10 minutes is 0.5%.
    target.cpuUsec.set(s.id, 33e6);
    clock.t = T0 + 20 * M;
    assert.deepEqual(
      (await loop.tick()).map((x) => x.action),
      ['hibernate'],
    );
  });

  test('open connections and running execs hold the policy off', async () => {
    const clock = manualClock(T0 + H);
    const target = new FakeTarget(clock);
    const s = sandbox();
    target.add(s);
    let act = { openConnections: 1, runningExecs: 0 };
    const loop = new PolicyLoop({ target, clock, intervalMs: 0, activity: () => act });
    assert.deepEqual(await loop.tick(), []);
    act = { openConnections: 0, runningExecs: 1 };
    assert.deepEqual(await loop.tick(), []);
    act = { openConnections: 0, runningExecs: 0 };
    assert.equal((await loop.tick()).length, 1);
  });

  test('a failed step is retried after a growing wait, not every tick', async () => {
    const clock = manualClock(T0 + H);
    const target = new FakeTarget(clock);
    const s = sandbox();
    target.add(s);
    const loop = new PolicyLoop({ target, clock, intervalMs: 0, retryAfterMs: M });
    target.failNext = s.id;
    const [failed] = await loop.tick();
    assert.equal(failed?.error, 'injected');
    clock.t += 30 * S;
    assert.deepEqual(await loop.tick(), [], 'backing off');
    clock.t += 30 * S;
    assert.deepEqual(
      (await loop.tick()).map((x) => [x.action, x.error]),
      [['hibernate', undefined]],
    );
  });

  test('on its timer, a long step in flight does not hold other sandboxes back', async () => {
    const clock = manualClock(T0);
    const target = new FakeTarget(clock);
    target.add(sandbox({ id: 'sb-aaaaaaaaaaaaaaa1' }));
    target.add(sandbox({ id: 'sb-aaaaaaaaaaaaaaa2', lastActiveAt: T0 + 10 * M }));
    let open!: () => void;
    const gate = new Promise<void>((r) => (open = r));
    const hibernate = target.hibernate.bind(target);
    let firstStarted = false;
    target.hibernate = async (id: string, t?: string, reason?: string) => {
      if (id === 'sb-aaaaaaaaaaaaaaa1') {
        firstStarted = true;
        await gate;
      }
      return hibernate(id, t, reason);
    };
    const loop = new PolicyLoop({ target, clock, intervalMs: 5 });
    loop.start();
    clock.t = T0 + 15 * M;
    const until = async (what: string, ok: () => boolean) => {
      for (let i = 0; i < 200 && !ok(); i++) await new Promise((r) => setTimeout(r, 5));
      assert.ok(ok(), what);
    };
    await until('the first hibernate started', () => firstStarted);
    clock.t = T0 + 25 * M;
    await until('the second sandbox was hibernated meanwhile', () =>
      target.transitions.some((t) => t.id === 'sb-aaaaaaaaaaaaaaa2'),
    );
    assert.equal(target.peek('sb-aaaaaaaaaaaaaaa1').state, 'running', 'the first is still in flight');
    open();
    await until('the first finished', () => target.peek('sb-aaaaaaaaaaaaaaa1').state === 'hibernated');
    await loop.close();
    assert.equal(target.transitions.length, 2);
  });

  test('per-tenant defaults from the daemon configuration apply to sandboxes without their own', async () => {
    const clock = manualClock(T0);
    const target = new FakeTarget(clock);
    target.add(sandbox({ id: 'sb-aaaaaaaaaaaaaaa1', tenant: 'fast' }));
    target.add(sandbox({ id: 'sb-aaaaaaaaaaaaaaa2', tenant: 'slow' }));
    const loop = new PolicyLoop({
      target,
      clock,
      intervalMs: 0,
      defaults: { tenants: { fast: { hibernateAfterMs: 2 * M } } },
    });
    clock.t = T0 + 2 * M;
    assert.deepEqual(
      (await loop.tick()).map((x) => x.sandboxId),
      ['sb-aaaaaaaaaaaaaaa1'],
    );
    clock.t = T0 + 15 * M;
    assert.deepEqual(
      (await loop.tick()).map((x) => x.sandboxId),
      ['sb-aaaaaaaaaaaaaaa2'],
    );
  });
});
