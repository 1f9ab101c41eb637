/**
 * The wake proxy against in-process upstreams on loopback and a fake WakeTarget: routing by
 * Host, tokens (and that they never reach the sandbox), waking held connections (single
 * flight, bounded with a 503), WebSocket upgrades, raw TCP, and activity counting.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { createServer, request, type IncomingHttpHeaders, type Server } from 'node:http';
import { connect, createServer as createTcpServer, type Server as TcpServer } from 'node:net';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { WakeProxy, type ProxiedSandbox, type WakeTarget } from './proxy.js';
import { extractCredentials, parseHost } from './routing.js';

const TOKEN_A = 'dmt_tenant-a-token';
const TOKEN_B = 'dmt_tenant-b-token';

class FakeTarget implements WakeTarget {
  readonly boxes = new Map<string, ProxiedSandbox>();
  wakes = 0;
  wakeDelayMs = 50;
  touches = 0;
  find(ref: string) {
    return [...this.boxes.values()].filter((s) => s.id === ref || s.name === ref);
  }
  list() {
    return [...this.boxes.values()];
  }
  async wake(id: string): Promise<string> {
    this.wakes++;
    await new Promise((r) => setTimeout(r, this.wakeDelayMs));
    const s = this.boxes.get(id)!;
    s.state = 'running';
    s.address = '127.0.0.1';
    return s.address;
  }
  touch(): undefined {
    this.touches++;
    return undefined;
  }
  // Asynchronous, as the daemon's (a database read): requests route after a turn.
  async authenticate(token: string) {
    if (token === TOKEN_A) return { tenant: 'a', admin: false };
    if (token === TOKEN_B) return { tenant: 'b', admin: false };
    return undefined;
  }
}

interface Res {
  status: number;
  headers: IncomingHttpHeaders;
  body: string;
}

function get(
  proxyPort: number,
  host: string,
  path = '/',
  headers: Record<string, string> = {},
): Promise<Res> {
  return new Promise((resolve, reject) => {
    const req = request(
      { host: '127.0.0.1', port: proxyPort, path, headers: { host, ...headers }, agent: false },
      (res) => {
        let body = '';
        res.setEncoding('utf8');
        res.on('data', (c: string) => (body += c));
        res.on('end', () => resolve({ status: res.statusCode ?? 0, headers: res.headers, body }));
      },
    );
    req.on('error', reject);
    req.end();
  });
}

describe('wake proxy', () => {
  let upstream: Server;
  let echo: TcpServer;
  let httpPort: number;
  let tcpPort: number;
  let proxy: WakeProxy;
  let target: FakeTarget;
  let dir: string;
  let seen: { url: string; headers: IncomingHttpHeaders }[] = [];
  let slow: (() => void) | undefined;

  const box = (id: string, o: Partial<ProxiedSandbox> = {}): ProxiedSandbox => ({
    id,
    name: id.replace(/^sb-/, 'n'),
    tenant: 'a',
    state: 'running',
    address: '127.0.0.1',
    ports: [
      { port: httpPort, public: false },
      { port: tcpPort, public: false },
    ],
    ...o,
  });

  before(async () => {
    dir = await mkdtemp(join(tmpdir(), 'dormant-proxy-'));
    upstream = createServer((req, res) => {
      seen.push({ url: req.url ?? '', headers: req.headers });
      if (req.url === '/slow') {
        slow = () => res.end('slow done');
        return;
      }
      res.setHeader('set-cookie', 'app=1');
      res.end(`hello ${req.url ?? ''}`);
    });
    upstream.on('upgrade', (req, socket) => {
      seen.push({ url: req.url ?? '', headers: req.headers });
      socket.write('HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n');
      socket.on('data', (d: Buffer) => socket.write(`ws:${d.toString()}`));
      socket.on('end', () => socket.end());
    });
    await new Promise<void>((r) => upstream.listen(0, '127.0.0.1', r));
    echo = createTcpServer((c) => c.on('data', (d: Buffer) => c.write(`tcp:${d.toString()}`)));
    await new Promise<void>((r) => echo.listen(0, '127.0.0.1', r));
    httpPort = (upstream.address() as { port: number }).port;
    tcpPort = (echo.address() as { port: number }).port;
    target = new FakeTarget();
    target.boxes.set('sb-run', box('sb-run'));
    target.boxes.set('sb-pub', box('sb-pub', { ports: [{ port: httpPort, public: true }] }));
    target.boxes.set('sb-other', box('sb-other', { tenant: 'b' }));
    proxy = await WakeProxy.start({
      target,
      listen: '127.0.0.1:0',
      domain: 'sb.test',
      tcpPortsFile: join(dir, 'tcp-ports.json'),
      touchEveryMs: 0,
      // Raw TCP for private ports too: the operator's opt-in (the default is public ports only).
      tcp: 'all',
    });
  });

  after(async () => {
    await proxy.close();
    upstream.closeAllConnections();
    await new Promise((r) => upstream.close(r));
    await new Promise((r) => echo.close(r));
    await rm(dir, { recursive: true, force: true });
  });

  const host = (ref: string, port = httpPort) => `${port}-${ref}.sb.test`;

  test('parses hosts and finds tokens', () => {
    assert.deepEqual(parseHost('8080-sb-abc.dormant.localhost:7421', 'dormant.localhost'), {
      port: 8080,
      ref: 'sb-abc',
    });
    assert.equal(parseHost('8080-sb-abc.elsewhere:7421', 'dormant.localhost'), undefined);
    assert.equal(parseHost('99999-x.dormant.localhost', 'dormant.localhost'), undefined);
    assert.equal(parseHost('dormant.localhost', 'dormant.localhost'), undefined);
    const c = extractCredentials('/a?x=1&dormant_token=dmt_q', {
      cookie: 'a=1; __Host-dormant_token=dmt_c; b=2',
    });
    assert.deepEqual([c.token, c.from, c.path, c.headers.cookie], ['dmt_c', 'cookie', '/a?x=1', 'a=1; b=2']);
    // The old, domain-wide name is no credential (a page could have planted it) and goes nowhere.
    const legacy = extractCredentials('/a', { cookie: 'a=1; dormant_token=dmt_planted' });
    assert.deepEqual([legacy.token, legacy.headers.cookie], [undefined, 'a=1']);
    const app = extractCredentials('/', { authorization: 'Bearer app-own-token' });
    assert.equal(app.token, undefined, "an app's own bearer token is not dormant's");
    assert.deepEqual(app.rewrite, []);
  });

  test('routes by Host with the tenant token, and the token never reaches the sandbox', async () => {
    seen = [];
    const r = await get(proxy.port, host('sb-run'), '/x', { authorization: `Bearer ${TOKEN_A}` });
    assert.deepEqual([r.status, r.body], [200, 'hello /x']);
    const byName = await get(proxy.port, host('nrun'), '/y', { 'x-dormant-token': TOKEN_A, cookie: 'k=v' });
    assert.deepEqual([byName.status, byName.body], [200, 'hello /y']);
    const q = await get(proxy.port, host('sb-run'), `/z?a=1&dormant_token=${TOKEN_A}`);
    assert.deepEqual([q.status, q.body], [200, 'hello /z?a=1']);
    assert.ok(
      q.headers['set-cookie']?.some(
        (c) =>
          c.startsWith(`__Host-dormant_token=${TOKEN_A};`) &&
          c.includes('HttpOnly') &&
          c.includes('Secure') &&
          !/domain=/i.test(c),
      ),
    );
    assert.ok(q.headers['set-cookie']?.includes('app=1'));
    for (const s of seen) {
      assert.ok(!JSON.stringify(s).includes('dmt_'), `no token upstream: ${JSON.stringify(s)}`);
      assert.equal(s.headers['x-forwarded-for'], '127.0.0.1');
    }
    assert.equal(seen[1]?.headers.cookie, 'k=v');
  });

  test('answers 401 without a token, 404 for another tenant, and serves public ports to anyone', async () => {
    const none = await get(proxy.port, host('sb-run'));
    assert.equal(none.status, 401);
    assert.equal((JSON.parse(none.body) as { error: { code: string } }).error.code, 'UNAUTHORIZED');
    assert.equal((await get(proxy.port, host('sb-run'), '/', { 'x-dormant-token': 'dmt_nope' })).status, 401);
    const other = await get(proxy.port, host('sb-other'), '/', { authorization: `Bearer ${TOKEN_A}` });
    assert.equal(other.status, 404);
    assert.equal(
      (await get(proxy.port, host('sb-other'), '/', { authorization: `Bearer ${TOKEN_B}` })).status,
      200,
    );
    assert.equal((await get(proxy.port, host('sb-pub'))).status, 200);
    assert.equal((await get(proxy.port, host('sb-run', 1))).status, 401, 'undeclared port, no token');
    assert.equal((await get(proxy.port, host('sb-run', 1), '/', { 'x-dormant-token': TOKEN_A })).status, 404);
    const stray = await get(proxy.port, 'localhost');
    assert.equal(stray.status, 404);
    assert.equal((JSON.parse(stray.body) as { error: { code: string } }).error.code, 'PROXY_NO_ROUTE');
  });

  test('100 concurrent requests to a sleeping sandbox cause one wake and all succeed', async () => {
    target.boxes.set('sb-sleep', box('sb-sleep', { state: 'hibernated', address: undefined }));
    target.wakes = 0;
    target.wakeDelayMs = 300;
    const all = await Promise.all(
      Array.from({ length: 100 }, (_, i) =>
        get(proxy.port, host('sb-sleep'), `/${i}`, { authorization: `Bearer ${TOKEN_A}` }),
      ),
    );
    assert.deepEqual(
      all.map((r) => r.status),
      Array<number>(100).fill(200),
    );
    assert.equal(target.wakes, 1);
  });

  test('a wake past the bound answers 503 with Retry-After, and the wake goes on', async () => {
    const p = await WakeProxy.start({
      target,
      listen: '127.0.0.1:0',
      domain: 'sb.test',
      wakeTimeoutMs: 100,
      tcp: 'off',
    });
    try {
      target.boxes.set('sb-late', box('sb-late', { state: 'hibernated', address: undefined }));
      target.wakes = 0;
      target.wakeDelayMs = 400;
      const r = await get(p.port, host('sb-late'), '/', { authorization: `Bearer ${TOKEN_A}` });
      assert.equal(r.status, 503);
      assert.equal(r.headers['retry-after'], '5');
      assert.equal((JSON.parse(r.body) as { error: { code: string } }).error.code, 'WAKE_TIMEOUT');
      await new Promise((res) => setTimeout(res, 500));
      assert.equal(
        (await get(p.port, host('sb-late'), '/', { authorization: `Bearer ${TOKEN_A}` })).status,
        200,
      );
      assert.equal(target.wakes, 1);
    } finally {
      await p.close();
    }
  });

  test('a request that meets a sandbox going to sleep wakes it again and is served', async () => {
    // A port that nothing listens on yet: the "sandbox" has just been hibernated under us.
    const probe = createServer();
    await new Promise<void>((r) => probe.listen(0, '127.0.0.1', r));
    const port = (probe.address() as { port: number }).port;
    await new Promise((r) => probe.close(r));
    const racy = box('sb-race', { ports: [{ port, public: true }] });
    target.boxes.set('sb-race', racy);
    let finds = 0;
    const realFind = target.find.bind(target);
    target.find = (ref: string) => {
      if (ref === 'sb-race' && ++finds === 2) racy.state = 'hibernated';
      return realFind(ref);
    };
    const revived = createServer((_q, r) => r.end('awake again'));
    const realWake = target.wake.bind(target);
    target.wake = async (id: string) => {
      if (id === 'sb-race') await new Promise<void>((r) => revived.listen(port, '127.0.0.1', r));
      return realWake(id);
    };
    target.wakes = 0;
    try {
      const r = await get(proxy.port, host('sb-race', port));
      assert.deepEqual([r.status, r.body], [200, 'awake again']);
      assert.equal(target.wakes, 1);
    } finally {
      target.find = realFind;
      target.wake = realWake;
      revived.closeAllConnections();
      await new Promise((r) => revived.close(r));
    }
  });

  test('an open request counts as a connection until it ends', async () => {
    target.touches = 0;
    const pending = get(proxy.port, host('sb-run'), '/slow', { authorization: `Bearer ${TOKEN_A}` });
    while (!slow) await new Promise((r) => setTimeout(r, 10));
    assert.equal(proxy.openConnections('sb-run'), 1);
    slow();
    slow = undefined;
    assert.equal((await pending).body, 'slow done');
    await new Promise((r) => setTimeout(r, 20));
    assert.equal(proxy.openConnections('sb-run'), 0);
    assert.ok(target.touches >= 1);
  });

  test('WebSocket upgrades are tunnelled, waking the sandbox', async () => {
    target.boxes.set('sb-ws', box('sb-ws', { state: 'paused', address: undefined }));
    target.wakeDelayMs = 50;
    const s = connect({ host: '127.0.0.1', port: proxy.port });
    let got = '';
    s.setEncoding('utf8');
    s.on('data', (d: string) => (got += d));
    await new Promise<void>((r) => s.once('connect', r));
    s.write(
      `GET /chat HTTP/1.1\r\nhost: ${host('sb-ws')}\r\nupgrade: websocket\r\nconnection: Upgrade\r\n` +
        `sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\nx-dormant-token: ${TOKEN_A}\r\n\r\n`,
    );
    while (!got.includes('\r\n\r\n')) await new Promise((r) => setTimeout(r, 10));
    assert.match(got, /^HTTP\/1\.1 101/);
    assert.equal(proxy.openConnections('sb-ws'), 1);
    s.write('ping');
    while (!got.includes('ws:ping')) await new Promise((r) => setTimeout(r, 10));
    const up = seen.at(-1)!;
    assert.equal(up.url, '/chat');
    assert.equal(up.headers['x-dormant-token'], undefined);
    assert.equal(up.headers.upgrade, 'websocket');
    s.destroy();
    await new Promise((r) => setTimeout(r, 50));
    assert.equal(proxy.openConnections('sb-ws'), 0);
  });

  test('plain TCP gets a host port per declared port, wakes the sandbox, and the port is remembered', async () => {
    target.boxes.set('sb-tcp', box('sb-tcp', { state: 'hibernated', address: undefined }));
    await proxy.sync();
    const u = proxy.urlFor(target.boxes.get('sb-tcp')!, tcpPort);
    assert.ok(u?.tcp);
    assert.equal(u.url, `http://${tcpPort}-sb-tcp.sb.test:${proxy.port}/`);
    const [h, p] = u.tcp.split(':');
    target.wakes = 0;
    const s = connect({ host: h!, port: Number(p) });
    s.write('hi');
    let got = '';
    s.setEncoding('utf8');
    s.on('data', (d: string) => (got += d));
    while (!got.includes('tcp:hi')) await new Promise((r) => setTimeout(r, 10));
    assert.equal(target.wakes, 1);
    s.destroy();
    const saved = JSON.parse(await readFile(join(dir, 'tcp-ports.json'), 'utf8')) as Record<string, number>;
    assert.equal(saved[`sb-tcp:${tcpPort}`], Number(p));
    // A removed sandbox's listener goes away.
    target.boxes.delete('sb-tcp');
    await proxy.sync();
    await assert.rejects(
      new Promise((resolve, reject) => {
        const c = connect({ host: h!, port: Number(p) });
        c.once('connect', () => {
          c.destroy();
          resolve(undefined);
        });
        c.once('error', reject);
      }),
      { code: 'ECONNREFUSED' },
    );
  });
});
