/**
 * Two wake proxies as two nodes of a fleet, over fake targets and a real HTTP server as the
 * sandbox: a request that reaches node A's proxy for a sandbox awake on node B goes through
 * B's proxy (A has no address for it), let in there with A's node token; the sandbox sees
 * neither token nor the hop's mark; a client's own hop mark is not believed; a request B's
 * proxy got from A is never sent on again, nor to an address recorded for another node.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { createServer, type IncomingHttpHeaders, type Server } from 'node:http';
import { viaProxy } from '../api/testing/host.js';
import { WakeProxy, type ProxiedSandbox, type WakeTarget } from './proxy.js';

const TENANT = 'dmt_hop-tenant';
const NODE = 'dmt_hop-node-admin';

describe('wake proxy: a request for a sandbox on another node goes through that node’s proxy', () => {
  let server: Server;
  let port = 0;
  const seen: IncomingHttpHeaders[] = [];
  let a: WakeProxy;
  let b: WakeProxy;
  // On node A, the address recorded for the sandbox (node B's) is another sandbox of A's own:
  // addresses are each node's. What answers there must never see these requests.
  let victim: Server;
  const victimSeen: string[] = [];
  const onA: ProxiedSandbox = {
    id: 'sb-hop',
    name: 'hop',
    tenant: 't',
    state: 'running',
    address: '127.0.0.2',
    elsewhere: 'b',
    ports: [],
  };
  const onB: ProxiedSandbox = { ...onA, address: '127.0.0.1', elsewhere: undefined };
  delete onB.elsewhere;
  const wakes: string[] = [];

  /** Other tenants' sandboxes on node B (a name is unique per tenant only). */
  const othersOnB: ProxiedSandbox[] = [];

  const target = (box: ProxiedSandbox, node: string, other: () => WakeProxy): WakeTarget => ({
    find: (ref) => [box, ...(node === 'b' ? othersOnB : [])].filter((x) => ref === x.id || ref === x.name),
    list: () => [box],
    wake: (id) => {
      wakes.push(`${node} ${id}`);
      return Promise.reject(new Error(`node ${node} has no sandbox ${id} to wake`));
    },
    touch: () => undefined,
    authenticate: (t) =>
      t === TENANT
        ? { tenant: 't', admin: false }
        : t === NODE
          ? { tenant: 'admin', admin: true }
          : undefined,
    nodeProxy: () => Promise.resolve({ host: '127.0.0.1', port: other().port, token: NODE }),
  });

  before(async () => {
    server = createServer((req, res) => {
      seen.push(req.headers);
      res.end(`sandbox answered ${req.url ?? ''}`);
    });
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
    port = (server.address() as { port: number }).port;
    victim = createServer((req, res) => {
      victimSeen.push(req.url ?? '');
      res.end('the wrong sandbox answered');
    });
    await new Promise<void>((r) => victim.listen(port, '127.0.0.2', r));
    onA.ports = [{ port, public: false }];
    onB.ports = [{ port, public: false }];
    a = await WakeProxy.start({
      target: target(onA, 'a', () => b),
      listen: '127.0.0.1:0',
      domain: 'hop.test',
      tcp: 'off',
    });
    b = await WakeProxy.start({
      target: target(onB, 'b', () => a),
      listen: '127.0.0.1:0',
      domain: 'hop.test',
      tcp: 'off',
    });
  });

  after(async () => {
    await a.close();
    await b.close();
    for (const x of [server, victim]) {
      x.closeAllConnections();
      await new Promise((r) => x.close(r));
    }
    assert.deepEqual(victimSeen, [], 'nothing reached the address A had recorded');
  });

  const get = (via: WakeProxy, path: string, headers: Record<string, string>) =>
    viaProxy(via.port, `${port}-sb-hop.hop.test`, { path, headers });

  test('through node B’s proxy, let in with the node’s token; the sandbox sees no token and no mark', async () => {
    const r = await get(a, '/x?keep=1', { authorization: `Bearer ${TENANT}`, 'x-app': 'kept' });
    assert.equal(r.status, 200, r.body);
    assert.equal(r.body, 'sandbox answered /x?keep=1');
    assert.deepEqual(wakes, [], 'nothing woken: it is awake on b');
    assert.deepEqual(
      [a.hops, b.hops],
      [
        { out: 1, in: 0 },
        { out: 0, in: 1 },
      ],
    );
    const h = seen.at(-1)!;
    assert.equal(h.authorization, undefined);
    assert.equal(h['x-dormant-token'], undefined);
    assert.equal(h['x-dormant-hop'], undefined);
    assert.equal(h['x-app'], 'kept');
    assert.equal(h.host, `${port}-sb-hop.hop.test`);
    // The client, then node A, as B's proxy saw them.
    assert.equal(h['x-forwarded-for'], '127.0.0.1, 127.0.0.1');
  });

  test('the token in the query string is checked on A and never reaches B or the sandbox', async () => {
    const r = await get(a, `/q?dormant_token=${TENANT}&z=2`, {});
    assert.equal(r.status, 200, r.body);
    assert.equal(r.body, 'sandbox answered /q?z=2');
  });

  test('a client cannot borrow the node’s way in: a bad token stops at A, a forged mark changes nothing', async () => {
    const before = { ...b.hops };
    const r = await get(a, '/', { authorization: 'Bearer dmt_wrong' });
    assert.equal(r.status, 401);
    assert.deepEqual(b.hops, before, 'B never saw it');
    // The hop mark from a client (with its own token) is not believed: the request goes
    // through B as any other, never to the address A has recorded.
    const forged = await get(a, '/forged', { authorization: `Bearer ${TENANT}`, 'x-dormant-hop': '1' });
    assert.equal(forged.status, 200, forged.body);
    assert.equal(forged.body, 'sandbox answered /forged');
    assert.equal(b.hops.in, before.in + 1);
    assert.equal(seen.at(-1)!['x-dormant-hop'], undefined);
  });

  test('a host that names the sandbox by its name reaches that tenant’s sandbox on B, though another tenant’s there has the same name', async () => {
    othersOnB.push({ ...onB, id: 'sb-same-name', tenant: 'u', address: '127.0.0.3' });
    try {
      const r = await viaProxy(a.port, `${port}-hop.hop.test`, {
        path: '/by-name',
        headers: { authorization: `Bearer ${TENANT}` },
      });
      assert.equal(r.status, 200, r.body);
      assert.equal(r.body, 'sandbox answered /by-name');
      const h = seen.at(-1)!;
      assert.equal(h.host, `${port}-hop.hop.test`, 'the Host goes as it came');
      assert.equal(h['x-dormant-hop-to'], undefined);
      // The id a hop names counts only with the node's token: a client's is ignored, and
      // its name still resolves among its own sandboxes.
      const forged = await viaProxy(b.port, `${port}-hop.hop.test`, {
        path: '/forged-to',
        headers: {
          authorization: `Bearer ${TENANT}`,
          'x-dormant-hop': '1',
          'x-dormant-hop-to': 'sb-same-name',
        },
      });
      assert.equal(forged.status, 200, forged.body);
      assert.equal(forged.body, 'sandbox answered /forged-to');
    } finally {
      othersOnB.length = 0;
    }
  });

  test('a request B got from A is never sent on, nor to an address B has for another node', async () => {
    // The sandbox moved on while the request was on its way: B sees it awake on A (whose
    // proxy would send it back). B answers a retryable error; nothing loops.
    onB.elsewhere = 'a';
    try {
      const outA = a.hops.out;
      const n = seen.length;
      const r = await get(a, '/loop', { authorization: `Bearer ${TENANT}` });
      assert.equal(r.status, 503, r.body);
      assert.match(r.body, /NODE_UNAVAILABLE/);
      assert.equal(a.hops.out, outA + 1, 'one hop');
      assert.equal(b.hops.out, 0);
      assert.equal(seen.length, n, 'no sandbox saw it');
    } finally {
      delete onB.elsewhere;
    }
  });
});
