/**
 * The CLI's fetch over node:http behaves as the SDK expects of Node's: bodies both ways stream,
 * errors and aborts reject as fetch's do. A loopback server stands in for the daemon.
 */
import assert from 'node:assert/strict';
import { once } from 'node:events';
import { createServer, type IncomingMessage, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { test } from 'node:test';
import { httpFetch } from './http-fetch.js';

async function serve(handler: (req: IncomingMessage, res: ServerResponse) => void): Promise<{
  url: string;
  close: () => Promise<void>;
}> {
  const server = createServer(handler);
  server.listen(0, '127.0.0.1');
  await once(server, 'listening');
  const { port } = server.address() as AddressInfo;
  return {
    url: `http://127.0.0.1:${port}`,
    close: async () => {
      server.closeAllConnections();
      server.close();
      await once(server, 'close');
    },
  };
}

async function bodyText(req: IncomingMessage): Promise<string> {
  let s = '';
  for await (const c of req) s += (c as Buffer).toString('utf8');
  return s;
}

test('a JSON request and answer: method, headers, body and status arrive as sent', async () => {
  const srv = await serve((req, res) => {
    void bodyText(req).then((body) => {
      res.writeHead(201, { 'content-type': 'application/json', 'x-twice': ['a', 'b'] });
      res.end(JSON.stringify({ method: req.method, auth: req.headers.authorization, body }));
    });
  });
  try {
    const res = await httpFetch(`${srv.url}/v1/x`, {
      method: 'POST',
      headers: { authorization: 'Bearer t', 'content-type': 'application/json' },
      body: JSON.stringify({ name: 'é' }),
    });
    assert.equal(res.status, 201);
    assert.equal(res.ok, true);
    assert.equal(res.headers.get('x-twice'), 'a, b');
    assert.deepEqual(await res.json(), { method: 'POST', auth: 'Bearer t', body: '{"name":"é"}' });
  } finally {
    await srv.close();
  }
});

test(
  'bodies stream both ways: the answer is read before the server ends it',
  { timeout: 20_000 },
  async () => {
    let release!: () => void;
    const released = new Promise<void>((r) => (release = r));
    const srv = await serve((req, res) => {
      void bodyText(req).then(async (body) => {
        res.writeHead(200, { 'content-type': 'text/plain' });
        res.write(`got ${body}\n`);
        await released; // the second part only after the client has read the first
        res.end('done\n');
      });
    });
    try {
      async function* parts(): AsyncGenerator<Uint8Array> {
        yield Buffer.from('one,');
        yield Buffer.from('two');
      }
      const res = await httpFetch(`${srv.url}/`, {
        method: 'PUT',
        body: parts(),
        duplex: 'half',
      });
      const reader = res.body!.getReader();
      const first = await reader.read();
      assert.equal(Buffer.from(first.value).toString(), 'got one,two\n');
      release();
      let rest = '';
      for (let r = await reader.read(); !r.done; r = await reader.read())
        rest += Buffer.from(r.value).toString();
      assert.equal(rest, 'done\n');
    } finally {
      await srv.close();
    }
  },
);

test('no daemon: rejects as fetch does, a TypeError whose cause is the system error', async () => {
  const srv = await serve(() => undefined);
  const url = srv.url;
  await srv.close();
  const err = await httpFetch(`${url}/v1/health`).catch((e: unknown) => e);
  assert.ok(err instanceof TypeError);
  assert.equal((err.cause as NodeJS.ErrnoException).code, 'ECONNREFUSED');
});

test('an abort before the answer rejects with the signal reason; a 204 has no body', async () => {
  const srv = await serve((req, res) => {
    if (req.url === '/empty') res.writeHead(204).end();
    // any other path never answers
  });
  try {
    const ac = new AbortController();
    const pending = httpFetch(`${srv.url}/slow`, { signal: ac.signal });
    const reason = new Error('gave up');
    setTimeout(() => ac.abort(reason), 50);
    await assert.rejects(pending, (e) => e === reason);
    const res = await httpFetch(`${srv.url}/empty`);
    assert.equal(res.status, 204);
    assert.equal(res.body, null);
  } finally {
    await srv.close();
  }
});

test('a Blob goes with its length and type, as fetch sends it', async () => {
  const srv = await serve((req, res) => {
    void bodyText(req).then((body) => {
      res.writeHead(200, { 'content-type': 'application/json' });
      res.end(
        JSON.stringify({ length: req.headers['content-length'], type: req.headers['content-type'], body }),
      );
    });
  });
  try {
    const res = await httpFetch(`${srv.url}/`, {
      method: 'POST',
      body: new Blob(['archive bytes'], { type: 'application/zstd' }),
    });
    assert.deepEqual(await res.json(), { length: '13', type: 'application/zstd', body: 'archive bytes' });
  } finally {
    await srv.close();
  }
});
