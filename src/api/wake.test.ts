/**
 * Sleeping by itself and waking on request, end to end: the real daemon (policy loop, wake
 * proxy, runc, CRIU, vault) with a python HTTP server that counts requests in memory. A
 * sandbox with a short idle policy hibernates on its own; the next request through the proxy
 * wakes it with its memory intact; 100 concurrent requests cause one resume; a keepalive lease
 * holds the policy off; a raw TCP client wakes it too; a wake past the bound answers 503.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { connect } from 'node:net';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { Daemon } from '../daemon/daemon.js';
import { DormantClient, type SandboxInfo } from '../sdk/client.js';
import { eventually, untilState as sandboxInState, viaProxy as proxyGet } from './testing/host.js';
import { counterServer } from './testing/servers.js';
import { startTestDaemon, tearDown, testFolder } from './testing/daemon.js';
import { run } from '../sys/exec.js';

const BIN = fileURLToPath(new URL('../../bin/dormant', import.meta.url));

/** The counter, with room for 100 concurrent connections in its listen backlog. */
const SERVER = counterServer({ backlog: 256 });

interface Res {
  status: number;
  body: string;
  retryAfter: string | undefined;
}

describe('idle policy and wake proxy through the daemon', () => {
  let dir: string;
  let rootfs: string;
  let daemon: Daemon;
  let client: DormantClient;
  let sb: SandboxInfo;
  let token: string;
  let last = 0;
  let memToken = '';

  const start = async (wakeTimeoutMs?: number): Promise<void> => {
    ({ daemon, client } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      policy: { intervalMs: 200 },
      proxy: {
        domain: 'dormant.test',
        // Raw TCP for private ports too, the operator's opt-in: the default is public ports only.
        tcp: 'all',
        ...(wakeTimeoutMs !== undefined ? { wakeTimeoutMs } : {}),
      },
    }));
    token = daemon.adminToken;
  };

  /** GET through the proxy, by Host. */
  const viaProxy = async (
    path = '/',
    headers: Record<string, string> = { authorization: `Bearer ${token}` },
  ): Promise<Res> => {
    const r = await proxyGet(daemon.wake.proxy!.port, `8080-${sb.id}.dormant.test`, { path, headers });
    return { status: r.status, body: r.body, retryAfter: r.headers['retry-after'] };
  };

  const resumes = async (): Promise<number> =>
    (await daemon.store.transitions({ sandboxId: sb.id, limit: 100_000 })).filter((t) => t.to === 'resuming')
      .length;

  const state = async (): Promise<string> => (await client.getSandbox(sb.id)).state;

  const untilState = (want: string, timeoutMs = 20_000) => sandboxInState(client, sb.id, want, timeoutMs);

  /** The counter answers with the next count and the same in-memory token. */
  const expectNext = (r: Res, n = 1): void => {
    assert.equal(r.status, 200, r.body);
    const [count, tok] = r.body.split(' ');
    assert.equal(Number(count), last + n, r.body);
    assert.equal(tok, memToken, 'the same process memory answers');
    last += n;
  };

  before(async () => {
    ({ dir, rootfs } = await testFolder('wake', { 'srv/server.py': SERVER }));
    await start();
  });

  after(() => tearDown(dir, daemon));

  test('a sandbox with a short idle policy hibernates by itself; a request wakes it with its memory', async () => {
    sb = await client.createSandbox({
      name: 'sleepy',
      rootfs,
      command: ['/usr/bin/python3', '-u', '/srv/server.py'],
      ports: [8080],
      memory: '256M',
      idle: '3s',
    });
    const first = await eventually('server', async () => {
      const r = await viaProxy();
      if (r.status !== 200) throw new Error(`${r.status} ${r.body}`);
      return r;
    });
    memToken = first.body.split(' ')[1]!;
    last = Number(first.body.split(' ')[0]);
    expectNext(await viaProxy());
    await untilState('hibernated');
    const hib = (await daemon.store.transitions({ sandboxId: sb.id, limit: 1000 })).filter(
      (t) => t.to === 'hibernated',
    );
    assert.deepEqual(
      hib.map((t) => t.reason),
      ['policy: idle 3s'],
    );
    const before = await resumes();
    const t0 = Date.now();
    expectNext(await viaProxy());
    process.stderr.write(`wake from hibernated through the proxy: ${Date.now() - t0} ms\n`);
    assert.equal((await resumes()) - before, 1);
    const r = (await daemon.store.transitions({ sandboxId: sb.id, limit: 1000 })).filter(
      (t) => t.to === 'resuming',
    );
    assert.equal(r.at(-1)?.reason, 'proxy: GET request on port 8080');
  });

  test('the URL needs the tenant token; dormant url says where it is', async () => {
    assert.equal((await viaProxy('/', {})).status, 401);
    assert.equal((await viaProxy('/', { 'x-dormant-token': 'dmt_wrong' })).status, 401);
    const u = await client.sandboxUrl(sb.id, 8080);
    assert.equal(u.url, `http://8080-${sb.id}.dormant.test:${daemon.wake.proxy!.port}/`);
    assert.equal(u.auth, 'token');
    assert.match(u.tcp ?? '', /^127\.0\.0\.1:\d+$/);
    await assert.rejects(client.sandboxUrl(sb.id, 9999), { code: 'INVALID_ARGUMENT' });
    const env = { DORMANT_URL: daemon.url, DORMANT_TOKEN: token };
    const cli = await run(process.execPath, [BIN, 'url', 'sleepy', '8080', '--json'], { env });
    assert.deepEqual(JSON.parse(cli.stdout), u);
    const plain = await run(process.execPath, [BIN, 'url', 'sleepy', '8080'], { env });
    assert.equal(plain.stdout, `${u.url}\n`);
  });

  test('100 concurrent requests to a hibernated sandbox all succeed and cause one resume', async () => {
    await untilState('hibernated');
    const before = await resumes();
    const all = await Promise.all(Array.from({ length: 100 }, () => viaProxy()));
    assert.deepEqual(
      all.map((r) => r.status),
      Array<number>(100).fill(200),
    );
    const counts = all.map((r) => Number(r.body.split(' ')[0])).sort((a, b) => a - b);
    assert.deepEqual(
      counts,
      Array.from({ length: 100 }, (_, i) => last + 1 + i),
    );
    assert.ok(all.every((r) => r.body.endsWith(memToken)));
    last += 100;
    assert.equal((await resumes()) - before, 1, 'exactly one resume');
  });

  test('a long keepalive prevents hibernation', async () => {
    await client.keepalive(sb.id, '1h');
    // Well past the 3 s idle policy, over many policy ticks.
    await new Promise((r) => setTimeout(r, 5000));
    assert.equal(await state(), 'running');
    expectNext(await viaProxy());
    const after = await client.getSandbox(sb.id);
    assert.ok(Date.parse(after.lastActiveAt) > Date.now() + 50 * 60_000, 'traffic did not shorten the lease');
    await client.keepalive(sb.id, '0s');
  });

  test('a running exec keeps the sandbox awake past its idle time', async () => {
    const exec = client.exec(sb.id, ['sleep', '5']);
    await new Promise((r) => setTimeout(r, 4500));
    assert.equal(await state(), 'running', 'not hibernated under a running exec');
    assert.equal((await exec).exitCode, 0);
  });

  test('a raw TCP client wakes the sandbox too', async () => {
    await client.hibernate(sb.id);
    const { tcp } = await client.sandboxUrl(sb.id, 8080);
    const [host, port] = tcp!.split(':');
    const before = await resumes();
    const answer = await new Promise<string>((resolve, reject) => {
      const s = connect({ host: host!, port: Number(port) });
      let got = '';
      s.setEncoding('utf8');
      s.on('data', (d: string) => (got += d));
      s.on('end', () => resolve(got));
      s.on('error', reject);
      s.write('GET / HTTP/1.0\r\n\r\n');
    });
    assert.match(answer, /^HTTP\/1\.0 200/);
    expectNext({ status: 200, body: answer.split('\r\n\r\n')[1] ?? '', retryAfter: undefined });
    assert.equal((await resumes()) - before, 1);
  });

  test('after a restart, a wake longer than the bound answers 503 with Retry-After, then serves', async () => {
    await client.hibernate(sb.id);
    await daemon.close();
    await start(1);
    assert.equal(await state(), 'hibernated', 'the restarted daemon knows it is asleep');
    const r = await viaProxy();
    assert.equal(r.status, 503);
    assert.equal(r.retryAfter, '5');
    assert.equal((JSON.parse(r.body) as { error: { code: string } }).error.code, 'WAKE_TIMEOUT');
    // The wake goes on without the caller.
    await untilState('running');
    expectNext(await viaProxy());
  });
});
