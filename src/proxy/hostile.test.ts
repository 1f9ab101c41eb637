/**
 * The wake proxy against hostile sandboxes and clients, over real sockets on loopback: a
 * sandbox cannot plant dormant's cookie in a browser; a head sent a byte at a time is closed
 * at the head deadline; heads are held to exactly 64 KiB however they arrive; one client, and
 * all of them together, can hold only so many connections; and raw TCP listeners exist only
 * for public ports unless the operator opts in.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { createServer, type Server } from 'node:http';
import { connect, type Socket } from 'node:net';
import { WakeProxy, type ProxiedSandbox, type WakeTarget } from './proxy.js';
import { MAX_HEAD_BYTES } from './http1.js';

const TOKEN = 'dmt_hostile-a';

/** Everything the socket says until it closes (or `ms` pass). */
function readAll(s: Socket, ms = 40_000): Promise<{ text: string; closedAfterMs: number }> {
  const t0 = Date.now();
  return new Promise((resolve) => {
    let text = '';
    const timer = setTimeout(() => resolve({ text, closedAfterMs: Infinity }), ms);
    s.on('data', (d: Buffer) => (text += d.toString('latin1')));
    s.on('error', () => undefined);
    s.on('close', () => {
      clearTimeout(timer);
      resolve({ text, closedAfterMs: Date.now() - t0 });
    });
  });
}

async function open(port: number): Promise<Socket> {
  const s = connect({ host: '127.0.0.1', port });
  s.on('error', () => undefined);
  await new Promise<void>((r) => s.once('connect', r));
  return s;
}

describe('wake proxy: hostile sandboxes and clients', () => {
  let app: Server;
  let appPort = 0;
  const proxies: WakeProxy[] = [];
  const sockets: Socket[] = [];
  const boxes = new Map<string, ProxiedSandbox>();
  const target: WakeTarget = {
    find: (ref) => [...boxes.values()].filter((s) => s.id === ref || s.name === ref),
    list: () => [...boxes.values()],
    wake: (id) => Promise.resolve(boxes.get(id)!.address!),
    touch: () => undefined,
    authenticate: (t) => (t === TOKEN ? { tenant: 'a', admin: false } : undefined),
  };
  const start = async (o: Partial<Parameters<typeof WakeProxy.start>[0]> = {}) => {
    const p = await WakeProxy.start({
      target,
      listen: '127.0.0.1:0',
      domain: 'hostile.test',
      tcp: 'off',
      ...o,
    });
    proxies.push(p);
    return p;
  };
  const HOST = () => `${appPort}-sb-one.hostile.test`;

  before(async () => {
    // A sandbox's app that tries to plant dormant's cookie for its siblings, every way it can.
    app = createServer({ maxHeaderSize: 256 * 1024 }, (req, res) => {
      res.setHeader('set-cookie', [
        'dormant_token=dmt_planted; Domain=hostile.test; Path=/',
        '__Host-dormant_token=dmt_planted2; Path=/; Secure',
        'DORMANT_TOKEN=dmt_planted3; domain=.hostile.test',
        ' __Secure-Dormant_Token=dmt_planted4',
        'app=1; Path=/',
      ]);
      res.end(`app ${req.url ?? ''}`);
    });
    await new Promise<void>((r) => app.listen(0, '127.0.0.1', r));
    appPort = (app.address() as { port: number }).port;
    boxes.set('sb-one', {
      id: 'sb-one',
      name: 'one',
      tenant: 'a',
      state: 'running',
      address: '127.0.0.1',
      ports: [{ port: appPort, public: false }],
    });
  });

  after(async () => {
    for (const s of sockets) s.destroy();
    for (const p of proxies) await p.close();
    app.closeAllConnections();
    await new Promise((r) => app.close(r));
  });

  test("a sandbox's Set-Cookie of dormant's cookie never reaches the browser; its own cookies do", async () => {
    const p = await start();
    for (const path of ['/plain', `/q?dormant_token=${TOKEN}`]) {
      const s = await open(p.port);
      sockets.push(s);
      const auth = path.startsWith('/q') ? '' : `Authorization: Bearer ${TOKEN}\r\n`;
      const got = readAll(s, 5000);
      s.write(`GET ${path} HTTP/1.1\r\nHost: ${HOST()}\r\n${auth}Connection: close\r\n\r\n`);
      const { text } = await got;
      assert.match(text, /^HTTP\/1\.1 200/);
      assert.ok(!text.includes('dmt_planted'), `a planted cookie reached the client:\n${text}`);
      assert.match(text, /set-cookie: app=1; Path=\//i, "the app's own cookie passes");
      if (path.startsWith('/q'))
        assert.match(text, /set-cookie: __Host-dormant_token=dmt_hostile-a; Path=\/; Secure; HttpOnly/);
      else assert.ok(!/dormant_token/i.test(text), 'no dormant cookie at all when none was asked for');
    }
  });

  test('a head sent a byte at a time is answered 408 and closed at the head deadline', async () => {
    const p = await start({ headTimeoutMs: 1500 });
    const s = await open(p.port);
    sockets.push(s);
    const got = readAll(s);
    const head = `GET / HTTP/1.1\r\nHost: ${HOST()}\r\nAuthorization: Bearer ${TOKEN}\r\n\r\n`;
    let i = 0;
    const drip = setInterval(() => {
      if (i < head.length && !s.destroyed) s.write(head[i++]!);
    }, 200);
    const { text, closedAfterMs } = await got;
    clearInterval(drip);
    assert.match(text, /^HTTP\/1\.1 408/);
    assert.ok(closedAfterMs < 5000, `closed after ${closedAfterMs} ms`);
    // The default deadline is well inside 30 s: a connection that never sends a byte goes too.
    const d = await start();
    const idle = await open(d.port);
    sockets.push(idle);
    const r = await readAll(idle, 30_000);
    assert.ok(r.closedAfterMs < 30_000, `an idle connection was closed after ${r.closedAfterMs} ms`);
    assert.match(r.text, /^HTTP\/1\.1 408/);
  });

  test('a request head is at most 64 KiB, counted exactly, however it arrives', async () => {
    const p = await start();
    const headOf = (bytes: number) => {
      const start = `GET / HTTP/1.1\r\nHost: ${HOST()}\r\nAuthorization: Bearer ${TOKEN}\r\nConnection: close\r\nX-Pad: `;
      const pad = bytes - start.length - 4;
      return `${start}${'a'.repeat(pad)}\r\n\r\n`;
    };
    const send = async (head: string, pieceBytes: number) => {
      assert.ok(head.length > 0);
      const s = await open(p.port);
      sockets.push(s);
      const got = readAll(s, 10_000);
      for (let at = 0; at < head.length; at += pieceBytes) s.write(head.slice(at, at + pieceBytes));
      return (await got).text;
    };
    assert.match(
      await send(headOf(MAX_HEAD_BYTES), MAX_HEAD_BYTES),
      /^HTTP\/1\.1 200/,
      'exactly 64 KiB passes',
    );
    assert.match(
      await send(headOf(MAX_HEAD_BYTES + 1), MAX_HEAD_BYTES + 1),
      /^HTTP\/1\.1 431/,
      'one byte more',
    );
    assert.match(await send(headOf(70 * 1024), 70 * 1024), /^HTTP\/1\.1 431/, '70 KiB in one piece');
    assert.match(await send(headOf(70 * 1024), 1024), /^HTTP\/1\.1 431/, '70 KiB in 1 KiB pieces');
  });

  test('connections are capped per client and in all: the next one is answered 503', async () => {
    const perClient = await start({ maxConnectionsPerClient: 4 });
    const held: Socket[] = [];
    for (let i = 0; i < 4; i++) {
      const s = await open(perClient.port);
      s.write('GET / HTTP/1.1\r\n'); // a half-sent head, held open
      held.push(s);
    }
    sockets.push(...held);
    const fifth = await open(perClient.port);
    sockets.push(fifth);
    const refused = await readAll(fifth, 5000);
    assert.match(refused.text, /^HTTP\/1\.1 503/);
    assert.match(refused.text, /PROXY_BUSY/);
    assert.ok(Number.isFinite(refused.closedAfterMs), 'and closed');
    // One held connection goes: a new one is let in.
    held[0]!.destroy();
    await new Promise((r) => setTimeout(r, 100));
    const again = await open(perClient.port);
    sockets.push(again);
    const ok = readAll(again, 5000);
    again.write(
      `GET /x HTTP/1.1\r\nHost: ${HOST()}\r\nAuthorization: Bearer ${TOKEN}\r\nConnection: close\r\n\r\n`,
    );
    assert.match((await ok).text, /^HTTP\/1\.1 200/);

    const total = await start({ maxConnections: 2 });
    const a = await open(total.port);
    const b = await open(total.port);
    sockets.push(a, b);
    const c = await open(total.port);
    sockets.push(c);
    assert.match((await readAll(c, 5000)).text, /^HTTP\/1\.1 503/);
  });

  test('raw TCP listeners are opened for public ports only, unless the operator asks for all', async () => {
    boxes.set('sb-two', {
      id: 'sb-two',
      name: 'two',
      tenant: 'a',
      state: 'running',
      address: '127.0.0.1',
      ports: [
        { port: appPort, public: false },
        { port: appPort + 0, public: false },
      ],
    });
    boxes.set('sb-pub', {
      id: 'sb-pub',
      name: 'pub',
      tenant: 'a',
      state: 'running',
      address: '127.0.0.1',
      ports: [{ port: appPort, public: true }],
    });
    try {
      // On loopback, with no tcp option: the default.
      const p = await WakeProxy.start({ target, listen: '127.0.0.1:0', domain: 'hostile.test' });
      proxies.push(p);
      assert.equal(
        p.urlFor(boxes.get('sb-two')!, appPort)?.tcp,
        null,
        'a private port has no raw TCP listener',
      );
      const pub = p.urlFor(boxes.get('sb-pub')!, appPort)?.tcp;
      assert.ok(pub !== null && pub !== undefined, 'a public port has one');
      const s = await open(Number(pub.split(':')[1]));
      sockets.push(s);
      const got = readAll(s, 5000);
      s.write('GET /raw HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n');
      assert.match((await got).text, /app \/raw/);
      const all = await WakeProxy.start({
        target,
        listen: '127.0.0.1:0',
        domain: 'hostile.test',
        tcp: 'all',
      });
      proxies.push(all);
      assert.ok(
        typeof all.urlFor(boxes.get('sb-two')!, appPort)?.tcp === 'string',
        "tcp: 'all' opens private ports too",
      );
    } finally {
      boxes.delete('sb-two');
      boxes.delete('sb-pub');
    }
  });
});
