/**
 * The SDK against a real running daemon (loopback, runc, CRIU, vault): a full lifecycle
 * through `Sandbox` — create, exec, pause, hibernate, connect (which resumes, memory intact),
 * fork, url, logs, kill — with typed errors mapped back from the API's codes and an
 * AbortSignal honoured.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { join } from 'node:path';
import type { Daemon } from '../daemon/daemon.js';
import { startTestDaemon, tearDown, testFolder } from '../api/testing/daemon.js';
import {
  AuthenticationError,
  ConflictError,
  ConnectionError,
  DormantApiError,
  InvalidArgumentError,
  NotFoundError,
  Sandbox,
  type ConnectionOptions,
  type TransitionInfo,
} from './index.js';

/** A shell loop that keeps a counter in its own memory and writes it out each tick. */
const COUNTER = 'i=0; while true; do i=$((i+1)); echo $i > /tmp/n; sleep 0.1; done';

async function rejection(p: Promise<unknown>): Promise<unknown> {
  try {
    await p;
  } catch (e) {
    return e;
  }
  assert.fail('expected a rejection');
}

describe('SDK: Sandbox against a running daemon', () => {
  let dir: string;
  let rootfs: string;
  let daemon: Daemon;
  let conn: ConnectionOptions;
  let sb: Sandbox;

  const counter = async (s: Sandbox): Promise<number> => Number((await s.exec('cat /tmp/n')).stdout.trim());

  before(async () => {
    ({ dir, rootfs } = await testFolder('sdk'));
    ({ daemon } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      readonlyBinds: [],
      policy: false,
    }));
    conn = { url: daemon.url, token: daemon.adminToken };
  });

  after(() => tearDown(dir, daemon));

  test('create, exec, list', async () => {
    sb = await Sandbox.create({
      ...conn,
      name: 'sdk-test',
      rootfs,
      command: ['sh', '-c', `echo booted; ${COUNTER}`],
      ports: [8080],
      memoryBytes: 64 * 1024 * 1024,
      idleTimeoutMs: 60 * 60_000,
    });
    assert.equal(sb.state, 'running');
    assert.match(sb.id, /^sb-/);
    assert.equal(sb.info.memoryLimitBytes, 64 * 1024 * 1024);
    assert.equal(sb.info.policy.hibernateAfterMs, 60 * 60_000, 'milliseconds reach the policy as given');
    const r = await sb.exec('echo $((6*7)); echo oops >&2; exit 3');
    assert.deepEqual([r.stdout, r.stderr, r.exitCode], ['42\n', 'oops\n', 3]);
    assert.equal((await sb.exec(['echo', 'argv'])).stdout, 'argv\n');
    assert.deepEqual(
      (await Sandbox.list(conn)).map((s) => s.id),
      [sb.id],
    );
  });

  test('pause and hibernate free the memory; connect resumes with the memory intact', async () => {
    const seen: TransitionInfo[] = [];
    const ac = new AbortController();
    const watching = (async () => {
      for await (const t of sb.transitions({ signal: ac.signal })) seen.push(t);
    })();
    try {
      await new Promise((r) => setTimeout(r, 300));
      assert.equal((await sb.pause()).state, 'paused');
      const before = await (async () => {
        await sb.resume();
        await new Promise((r) => setTimeout(r, 300));
        return counter(sb);
      })();
      assert.ok(before > 0);
      const h = await sb.hibernate();
      assert.equal(h.state, 'hibernated');
      assert.equal(h.memoryBytes, 0);
      assert.equal(sb.state, 'hibernated');

      const again = await Sandbox.connect(sb.id, conn);
      assert.equal(again.state, 'running', 'connect resumed it');
      await new Promise((r) => setTimeout(r, 300));
      // The counter lived only in the shell's memory: had it restarted it would be small again.
      assert.ok((await counter(again)) >= before, 'the loop carried on from where it was');

      const asleep = await sb.pause();
      assert.equal(asleep.state, 'paused');
      const left = await Sandbox.connect('sdk-test', { ...conn, resume: false });
      assert.equal(left.state, 'paused', 'connect({ resume: false }) leaves it asleep');
      await left.resume();
      await sb.getInfo();
      assert.equal(sb.state, 'running');
      // Events are delivered within a poll interval (250 ms) of the transition.
      const deadline = Date.now() + 5000;
      while (seen.length < 8 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50));
    } finally {
      ac.abort();
      await watching;
    }
    assert.deepEqual(
      seen.map((t) => t.to),
      ['paused', 'running', 'hibernating', 'hibernated', 'resuming', 'running', 'paused', 'running'],
    );
  });

  test('fork, url, logs, keepalive', async () => {
    const child = await sb.fork({ name: 'sdk-fork' });
    try {
      assert.notEqual(child.id, sb.id);
      assert.equal(child.state, 'running');
      assert.ok((await counter(child)) > 0, 'the fork carries the counter on');
    } finally {
      await child.kill();
    }
    assert.match(await sb.url(8080), new RegExp(`^http://8080-${sb.id}\\.`));
    assert.match(await sb.logs(), /booted/);
    const until = Date.parse((await sb.keepalive(20 * 60_000)).lastActiveAt);
    assert.ok(until > Date.now() + 19 * 60_000);
  });

  test('typed errors carry the API codes', async () => {
    const nf = await rejection(Sandbox.connect('sb-0000000000000000', conn));
    assert.ok(nf instanceof NotFoundError);
    assert.ok(nf instanceof DormantApiError);
    assert.equal(nf.code, 'SANDBOX_NOT_FOUND');
    assert.equal(nf.status, 404);

    // exec wakes a sleeping sandbox now: pausing a hibernated one is the conflict here.
    await sb.hibernate();
    const conflict = await rejection(sb.pause());
    assert.ok(conflict instanceof ConflictError);
    assert.equal(conflict.code, 'ILLEGAL_TRANSITION');
    assert.ok(conflict.hint);
    await sb.resume();

    const bad = await rejection(sb.exec([]));
    assert.ok(bad instanceof InvalidArgumentError);
    assert.equal(bad.code, 'INVALID_ARGUMENT');

    const unauth = await rejection(Sandbox.list({ url: daemon.url, token: 'dmt_wrong' }));
    assert.ok(unauth instanceof AuthenticationError);
    assert.equal(unauth.code, 'UNAUTHORIZED');

    const down = await rejection(Sandbox.list({ url: 'http://127.0.0.1:9', token: 'x' }));
    assert.ok(down instanceof ConnectionError);
    assert.equal(down.code, 'DAEMON_UNREACHABLE');
  });

  test('an AbortSignal cancels a call with its reason', async () => {
    const ac = new AbortController();
    ac.abort(new Error('changed my mind'));
    const e = await rejection(sb.hibernate({ signal: ac.signal }));
    assert.ok(e instanceof Error);
    assert.equal(e.message, 'changed my mind');
    assert.equal((await sb.getInfo()).state, 'running', 'nothing was sent');
    const slow = await rejection(sb.exec('sleep 5', { signal: AbortSignal.timeout(200) }));
    assert.ok(slow instanceof Error && slow.name === 'TimeoutError', String(slow));
  });

  test('kill deletes it', async () => {
    await sb.kill();
    const e = await rejection(sb.getInfo());
    assert.ok(e instanceof NotFoundError);
    assert.deepEqual(await Sandbox.list(conn), []);
  });
});
