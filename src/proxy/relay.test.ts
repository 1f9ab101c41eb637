/**
 * The wake proxy's HTTP relay on one client connection, against real node http servers on
 * loopback (two "sandboxes" of different tenants) and a fake WakeTarget: pipelined requests,
 * chunked and sized bodies split across writes, a Host switch mid-connection (re-routed to the
 * other sandbox with its own token check, or refused after the earlier answers), the query
 * token turned into a cookie, HEAD and chunked responses, upgrades the server declines.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { createServer, type IncomingHttpHeaders, type Server } from 'node:http';
import { connect, type Socket } from 'node:net';
import { WakeProxy, type ProxiedSandbox, type WakeTarget } from './proxy.js';
import { reusedReads } from './relay.js';

const TOKEN_A = 'dmt_relay-a';
const TOKEN_B = 'dmt_relay-b';

interface Seen {
  server: string;
  method: string;
  url: string;
  headers: IncomingHttpHeaders;
  body: string;
}

let cutOnce = false;

/** Bytes that differ from one place to the next, so that a chunk copied twice or lost shows. */
function pattern(bytes: number): Buffer {
  const b = Buffer.alloc(bytes);
  let x = 12345;
  for (let i = 0; i < bytes; i += 4) {
    x = (Math.imul(x, 1103515245) + 12345) >>> 0;
    b.writeUInt32LE(x, i);
  }
  return b;
}
const PATTERN = pattern(4 * 1024 * 1024);

function upstream(name: string, seen: Seen[]): Server {
  const s = createServer((req, res) => {
    if (req.url === '/cut' && !cutOnce) {
      // The connection dies under the request (the sandbox was checkpointed just then).
      cutOnce = true;
      req.socket.destroy();
      return;
    }
    let body = '';
    req.setEncoding('utf8');
    req.on('data', (c: string) => (body += c));
    req.on('end', () => {
      seen.push({ server: name, method: req.method ?? '', url: req.url ?? '', headers: req.headers, body });
      if (req.url === '/big') {
        const out = `${name} got ${body.length} `.padEnd(4 * 1024 * 1024, 'x');
        res.writeHead(200, { 'content-length': out.length });
        res.end(out);
        return;
      }
      if (req.url === '/pattern') {
        // In pieces of different sizes, small ones too (each read by the proxy on its own).
        res.writeHead(200, { 'content-length': PATTERN.length });
        let at = 0;
        const more = (): void => {
          const n = Math.min(PATTERN.length - at, at % 3 === 0 ? 700 + (at % 9000) : 70_001);
          const piece = PATTERN.subarray(at, at + n);
          at += n;
          if (at === PATTERN.length) res.end(piece);
          else if (!res.write(piece)) res.once('drain', more);
          else setImmediate(more);
        };
        more();
        return;
      }
      if (req.url === '/wait') {
        setTimeout(() => res.end('waited'), 300);
        return;
      }
      if (req.url === '/chunked') {
        res.write(`${name} part1 `);
        setTimeout(() => res.end('part2'), 5);
        return;
      }
      if (req.headers.upgrade !== undefined) {
        res.writeHead(426, { 'content-length': '8' });
        res.end('declined');
        return;
      }
      const out = `${name} ${req.method ?? ''} ${req.url ?? ''} ${body}`;
      res.writeHead(200, { 'content-length': Buffer.byteLength(out) });
      res.end(req.method === 'HEAD' ? undefined : out);
    });
  });
  // Upgrade requests reach the request handler, which declines them.
  s.on('upgrade', (req, socket) => {
    seen.push({ server: name, method: req.method ?? '', url: req.url ?? '', headers: req.headers, body: '' });
    socket.end('HTTP/1.1 426 Upgrade Required\r\ncontent-length: 8\r\n\r\ndeclined');
  });
  return s;
}

/**
 * Reads from a raw socket until `done(text so far)` holds, or fails after 30 s (a bound for a
 * hang, not a speed check: megabytes to a slow reader took over 5 s on a loaded machine).
 */
function readUntil(s: Socket, done: (t: string) => boolean): Promise<string> {
  return new Promise((resolve, reject) => {
    let got = '';
    const timer = setTimeout(() => {
      cleanup();
      reject(new Error(`timed out; got ${JSON.stringify(got.slice(0, 300))} (${got.length} characters)`));
    }, 30_000);
    const onData = (d: Buffer) => {
      got += d.toString('latin1');
      if (done(got)) {
        cleanup();
        resolve(got);
      }
    };
    const onEnd = () => {
      cleanup();
      if (done(got)) resolve(got);
      else reject(new Error(`connection ended; got ${JSON.stringify(got)}`));
    };
    const cleanup = () => {
      clearTimeout(timer);
      s.off('data', onData);
      s.off('end', onEnd);
    };
    s.on('data', onData);
    s.on('end', onEnd);
  });
}

const count = (t: string, re: RegExp) => (t.match(re) ?? []).length;

describe('wake proxy HTTP relay', () => {
  const seen: Seen[] = [];
  const servers: Server[] = [];
  const ports: number[] = [];
  const clients: Socket[] = [];
  let proxy: WakeProxy;
  const boxes = new Map<string, ProxiedSandbox>();

  const target: WakeTarget = {
    find: (ref) => [...boxes.values()].filter((s) => s.id === ref || s.name === ref),
    list: () => [...boxes.values()],
    wake: (id) => {
      const s = boxes.get(id)!;
      s.state = 'running';
      s.address = '127.0.0.1';
      return Promise.resolve(s.address);
    },
    touch: () => undefined,
    authenticate: (t) =>
      t === TOKEN_A
        ? { tenant: 'a', admin: false }
        : t === TOKEN_B
          ? { tenant: 'b', admin: false }
          : undefined,
  };

  before(async () => {
    for (const name of ['one', 'two']) {
      const s = upstream(name, seen);
      await new Promise<void>((r) => s.listen(0, '127.0.0.1', r));
      servers.push(s);
      ports.push((s.address() as { port: number }).port);
    }
    boxes.set('sb-one', {
      id: 'sb-one',
      name: 'one',
      tenant: 'a',
      state: 'running',
      address: '127.0.0.1',
      ports: [{ port: ports[0]!, public: false }],
    });
    boxes.set('sb-two', {
      id: 'sb-two',
      name: 'two',
      tenant: 'b',
      state: 'paused',
      address: undefined,
      ports: [{ port: ports[1]!, public: false }],
    });
    proxy = await WakeProxy.start({ target, listen: '127.0.0.1:0', domain: 'relay.test', tcp: 'off' });
  });

  after(async () => {
    for (const c of clients) c.destroy();
    await proxy.close();
    for (const s of servers) {
      s.closeAllConnections();
      await new Promise((r) => s.close(r));
    }
  });

  const ONE = () => `${ports[0]!}-sb-one.relay.test`;
  const TWO = () => `${ports[1]!}-sb-two.relay.test`;

  async function client(): Promise<Socket> {
    const s = connect({ host: '127.0.0.1', port: proxy.port });
    clients.push(s);
    await new Promise<void>((r) => s.once('connect', r));
    return s;
  }

  test('pipelined requests on one connection are answered in order, tokens scrubbed', async () => {
    seen.length = 0;
    const s = await client();
    const req = (path: string) =>
      `GET ${path} HTTP/1.1\r\nHost: ${ONE()}\r\nAuthorization: Bearer ${TOKEN_A}\r\nX-Forwarded-For: 10.0.0.9\r\n\r\n`;
    s.write(req('/1') + req('/2') + req('/3'));
    const got = await readUntil(s, (t) => t.includes('one GET /3'));
    assert.equal(count(got, /HTTP\/1\.1 200/g), 3);
    assert.ok(got.indexOf('GET /1') < got.indexOf('GET /2') && got.indexOf('GET /2') < got.indexOf('GET /3'));
    assert.deepEqual(
      seen.map((x) => x.url),
      ['/1', '/2', '/3'],
    );
    for (const x of seen) {
      assert.equal(x.headers.authorization, undefined);
      assert.equal(x.headers['x-forwarded-for'], '10.0.0.9, 127.0.0.1');
      assert.equal(x.headers['x-forwarded-host'], ONE());
    }
    s.destroy();
  });

  test('chunked and sized request bodies split across writes, then the next request', async () => {
    seen.length = 0;
    const s = await client();
    const h = `Host: ${ONE()}\r\nX-Dormant-Token: ${TOKEN_A}\r\n`;
    const parts = [
      `POST /c HTTP/1.1\r\n${h}Transfer-Encoding: chunked\r\n\r\n5\r\nhel`,
      'lo\r\n6;x=y\r\n world\r\n0\r\nx-t: 1\r',
      `\n\r\nPUT /s HTTP/1.1\r\n${h}Content-Length: 11\r\n\r\nsized`,
      ` body!GET /after HTTP/1.1\r\n${h}\r\n`,
    ];
    for (const p of parts) {
      s.write(p);
      await new Promise((r) => setTimeout(r, 10));
    }
    const got = await readUntil(s, (t) => t.includes('one GET /after'));
    assert.match(got, /one POST \/c hello world/);
    assert.match(got, /one PUT \/s sized body!/);
    assert.deepEqual(
      seen.map((x) => [x.method, x.url, x.body, x.headers['x-dormant-token']]),
      [
        ['POST', '/c', 'hello world', undefined],
        ['PUT', '/s', 'sized body!', undefined],
        ['GET', '/after', '', undefined],
      ],
    );
    s.destroy();
  });

  test('a Host switch mid-connection is re-routed with its own token, or refused in order', async () => {
    seen.length = 0;
    const s = await client();
    // Tenant a's request, then tenant b's own sandbox (asleep: woken) with b's token, on one connection.
    s.write(
      `GET /a1 HTTP/1.1\r\nHost: ${ONE()}\r\nAuthorization: Bearer ${TOKEN_A}\r\n\r\n` +
        `GET /b1 HTTP/1.1\r\nHost: ${TWO()}\r\nAuthorization: Bearer ${TOKEN_B}\r\n\r\n` +
        `GET /a2 HTTP/1.1\r\nHost: ${ONE()}\r\nAuthorization: Bearer ${TOKEN_A}\r\n\r\n`,
    );
    const got = await readUntil(s, (t) => t.includes('one GET /a2'));
    assert.ok(got.indexOf('one GET /a1') < got.indexOf('two GET /b1'));
    assert.ok(got.indexOf('two GET /b1') < got.indexOf('one GET /a2'));
    assert.deepEqual(
      seen.map((x) => `${x.server} ${x.url}`),
      ['one /a1', 'two /b1', 'one /a2'],
    );
    // Tenant a's token may not switch to tenant b's sandbox: the earlier answer comes first,
    // then a 404, and nothing reaches the other sandbox.
    seen.length = 0;
    s.write(
      `GET /a3 HTTP/1.1\r\nHost: ${ONE()}\r\nAuthorization: Bearer ${TOKEN_A}\r\n\r\n` +
        `GET /b2 HTTP/1.1\r\nHost: ${TWO()}\r\nAuthorization: Bearer ${TOKEN_A}\r\n\r\n`,
    );
    const refused = await readUntil(s, (t) => t.includes('SANDBOX_NOT_FOUND'));
    assert.ok(refused.indexOf('one GET /a3') < refused.indexOf('HTTP/1.1 404'));
    assert.deepEqual(
      seen.map((x) => `${x.server} ${x.url}`),
      ['one /a3'],
    );
    s.destroy();
    // The same host with no token on a connection that had one: 401, nothing forwarded.
    seen.length = 0;
    const t = await client();
    t.write(
      `GET /ok HTTP/1.1\r\nHost: ${ONE()}\r\nAuthorization: Bearer ${TOKEN_A}\r\n\r\n` +
        `GET /sneak HTTP/1.1\r\nHost: ${ONE()}\r\n\r\n`,
    );
    const unauth = await readUntil(t, (x) => x.includes('HTTP/1.1 401'));
    assert.match(unauth, /one GET \/ok/);
    assert.deepEqual(
      seen.map((x) => x.url),
      ['/ok'],
    );
    t.destroy();
  });

  test('a token in the query string is removed and set as a cookie on the answer', async () => {
    seen.length = 0;
    const s = await client();
    s.write(`GET /q?x=1&dormant_token=${TOKEN_A} HTTP/1.1\r\nHost: ${ONE()}\r\n\r\n`);
    const got = await readUntil(s, (t) => t.includes('one GET /q?x=1'));
    assert.match(
      got,
      /set-cookie: __Host-dormant_token=dmt_relay-a; Path=\/; Secure; HttpOnly; SameSite=Lax\r\n/,
    );
    assert.equal(seen[0]?.url, '/q?x=1');
    s.destroy();
  });

  test('HEAD and chunked responses end where they should, and the connection goes on', async () => {
    const s = await client();
    const h = `Host: ${ONE()}\r\nAuthorization: Bearer ${TOKEN_A}\r\n\r\n`;
    s.write(`HEAD /h HTTP/1.1\r\n${h}GET /chunked HTTP/1.1\r\n${h}GET /last HTTP/1.1\r\n${h}`);
    const got = await readUntil(s, (t) => t.includes('one GET /last'));
    assert.equal(count(got, /HTTP\/1\.1 200/g), 3);
    assert.match(
      got,
      /transfer-encoding: chunked\r\n\r\n[0-9a-f]+\r\none part1 \r\n5\r\npart2\r\n0\r\n\r\n/i,
    );
    s.destroy();
  });

  test('an upgrade the sandbox declines leaves an HTTP connection', async () => {
    seen.length = 0;
    const s = await client();
    const h = `Host: ${ONE()}\r\nAuthorization: Bearer ${TOKEN_A}\r\n`;
    s.write(`GET /ws HTTP/1.1\r\n${h}Connection: Upgrade\r\nUpgrade: websocket\r\n\r\n`);
    const got = await readUntil(s, (t) => t.includes('declined'));
    assert.match(got, /^HTTP\/1\.1 426/);
    assert.equal(seen[0]?.headers.upgrade, 'websocket');
    assert.equal(seen[0]?.headers.authorization, undefined);
    s.destroy();
  });

  test('a malformed or smuggling request gets a 400 and the connection closes', async () => {
    seen.length = 0;
    const s = await client();
    s.write(
      `POST / HTTP/1.1\r\nHost: ${ONE()}\r\nAuthorization: Bearer ${TOKEN_A}\r\n` +
        'Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n',
    );
    const got = await readUntil(s, (t) => t.includes('}'));
    assert.match(got, /^HTTP\/1\.1 400/);
    assert.match(got, /both Content-Length and Transfer-Encoding/);
    await new Promise<void>((r) => (s.readableEnded ? r() : s.once('end', r)));
    assert.equal(seen.length, 0);
  });

  test('megabytes each way, with the client slow to read, then the next request', async () => {
    const s = await client();
    const h = `Host: ${ONE()}\r\nAuthorization: Bearer ${TOKEN_A}\r\n`;
    s.write(`POST /big HTTP/1.1\r\n${h}Transfer-Encoding: chunked\r\n\r\n`);
    const piece = 'y'.repeat(256 * 1024);
    for (let i = 0; i < 12; i++) s.write(`${piece.length.toString(16)}\r\n${piece}\r\n`);
    s.write(`0\r\n\r\nGET /after-big HTTP/1.1\r\n${h}\r\n`);
    s.pause();
    await new Promise((r) => setTimeout(r, 200));
    s.resume();
    const got = await readUntil(s, (t) => t.includes('one GET /after-big'));
    assert.match(got, new RegExp(`one got ${12 * 256 * 1024} x+HTTP/1\\.1 200`));
    assert.ok(got.length > 4 * 1024 * 1024);
    s.destroy();
  });

  test('a response read slowly arrives byte for byte, then the next request', async () => {
    const s = await client();
    const h = `Host: ${ONE()}\r\nAuthorization: Bearer ${TOKEN_A}\r\n`;
    s.write(`GET /pattern HTTP/1.1\r\n${h}\r\nGET /after-pattern HTTP/1.1\r\n${h}\r\n`);
    // The client stops reading now and then, so the proxy's writes to it queue up.
    s.pause();
    await new Promise((r) => setTimeout(r, 300));
    s.resume();
    const slow = setInterval(() => {
      s.pause();
      setTimeout(() => s.resume(), 20);
    }, 40);
    try {
      const got = await readUntil(s, (t) => t.includes('one GET /after-pattern'));
      const start = got.indexOf('\r\n\r\n') + 4;
      const body = Buffer.from(got.slice(start, start + PATTERN.length), 'latin1');
      assert.ok(body.equals(PATTERN), 'the body differs from what the sandbox sent');
      assert.match(got.slice(start + PATTERN.length), /^HTTP\/1\.1 200 /);
    } finally {
      clearInterval(slow);
      s.destroy();
    }
  });

  test('reads go to a fresh buffer while bytes written from the last one wait to be sent', () => {
    const to = { writableLength: 0 };
    const got: Buffer[] = [];
    const o = reusedReads(to, (d) => got.push(d));
    const next = o.buffer as () => Uint8Array;
    const first = next();
    assert.equal(next(), first, 'nothing queued: the same buffer');
    to.writableLength = 100;
    const second = next();
    assert.notEqual(second, first, 'a queued write still points into the first buffer');
    o.callback(3, second);
    assert.equal(got[0]!.length, 3);
    assert.equal(got[0]!.buffer, second.buffer);
  });

  test('a bodyless request cut off on a reused connection is sent once more; a POST is not', async () => {
    const s = await client();
    const h = `Host: ${ONE()}\r\nAuthorization: Bearer ${TOKEN_A}\r\n`;
    s.write(`GET /first HTTP/1.1\r\n${h}\r\n`);
    await readUntil(s, (t) => t.includes('one GET /first'));
    cutOnce = false;
    s.write(`GET /cut HTTP/1.1\r\n${h}\r\n`);
    const again = await readUntil(s, (t) => t.includes('one GET /cut'));
    assert.match(again, /^HTTP\/1\.1 200/);
    cutOnce = false;
    s.write(`POST /cut HTTP/1.1\r\n${h}content-length: 2\r\n\r\nhi`);
    const failed = await readUntil(s, (t) => t.includes('}'));
    assert.match(failed, /^HTTP\/1\.1 502/);
    s.destroy();
  });

  test('an idle keep-alive connection is closed, one waiting on an answer is not', async () => {
    const quick = await WakeProxy.start({
      target,
      listen: '127.0.0.1:0',
      domain: 'relay.test',
      tcp: 'off',
      idleConnectionMs: 50,
    });
    try {
      const s = connect({ host: '127.0.0.1', port: quick.port });
      clients.push(s);
      await new Promise<void>((r) => s.once('connect', r));
      s.write(`GET /wait HTTP/1.1\r\nHost: ${ONE()}\r\nAuthorization: Bearer ${TOKEN_A}\r\n\r\n`);
      const got = await readUntil(s, (t) => t.includes('waited'));
      assert.match(got, /^HTTP\/1\.1 200/);
      const t0 = Date.now();
      await new Promise<void>((r) => (s.readableEnded ? r() : s.once('end', r)));
      assert.ok(Date.now() - t0 < 1000);
    } finally {
      await quick.close();
    }
  });
});
