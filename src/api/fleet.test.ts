/**
 * A fleet of two nodes on this machine, sharing one PostgreSQL (the database of record) and
 * one S3 bucket (Ceph RGW: the vault), with real sandboxes: a sandbox made on node 1
 * hibernates into S3 and resumes on node 2 with its memory; node 1's API and wake proxy reach
 * it there; two nodes racing to wake it restore it once; drain hibernates a node's sandboxes
 * and sends creates elsewhere; a node that stops renewing its lease has its sandboxes taken
 * back to their checkpoints by the other.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { request } from 'node:http';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import { rm } from 'node:fs/promises';
import type { Daemon, DaemonOptions } from '../daemon/daemon.js';
import { DormantClient, type SandboxInfo } from '../sdk/client.js';
import { pgMissing, startPostgres, type TestPostgres } from '../state/testing/postgres.js';
import { rgwMissing, startRgw, type TestRgw } from '../vault/testing/rgw.js';
import { COUNTER_SERVER_PY } from './testing/servers.js';
import { eventually, httpGet } from './testing/host.js';
import { apiError, rgwVault, startTestDaemon, stopTestDaemon, testFolder } from './testing/daemon.js';

const missing = (await pgMissing()) ?? (await rgwMissing());
const LEASE_MS = 3_000;

describe('a fleet: two nodes, one PostgreSQL, one S3 vault', { skip: missing }, () => {
  let pgServer: TestPostgres;
  let rgw: TestRgw;
  let dir: string;
  let rootfs: string;
  let url: string;
  const key = randomBytes(32);
  const nodes: Record<string, Daemon | undefined> = {};
  const clients: Record<string, DormantClient> = {};

  const startNode = async (name: string): Promise<Daemon> => {
    const opts: DaemonOptions = {
      dataDir: join(dir, name),
      masterKey: { key },
      state: { url },
      node: { name, leaseMs: LEASE_MS },
      vault: rgwVault(rgw, 'fleet'),
      proxy: { domain: 'dormant.test', listen: '127.0.0.1:0' },
      policy: false,
      // The fleet's own warnings (a node marked lost, a drain that failed) in the test's output.
      warn: (m: string) => {
        if (/lost|drain|releas|renew/.test(m)) process.stderr.write(`[${name}] ${m}\n`);
      },
    };
    const { daemon } = await startTestDaemon(opts);
    nodes[name] = daemon;
    clients[name] = new DormantClient({ url: daemon.url, token: daemon.adminToken });
    return daemon;
  };

  /** GET / of the sandbox's port 8080 through `node`'s wake proxy. */
  const viaProxy = (node: string, id: string): Promise<{ status: number; body: string }> =>
    new Promise((resolve, reject) => {
      const req = request(
        {
          host: '127.0.0.1',
          port: nodes[node]!.wake.proxy!.port,
          path: '/',
          headers: { host: `8080-${id}.dormant.test`, authorization: `Bearer ${nodes[node]!.adminToken}` },
          agent: false,
          timeout: 60_000,
        },
        (res) => {
          let body = '';
          res.setEncoding('utf8');
          res.on('data', (c: string) => (body += c));
          res.on('end', () => resolve({ status: res.statusCode ?? 0, body }));
        },
      );
      req.on('error', reject);
      req.end();
    });

  /** The transitions of `id` into `to`, as the events tell. */
  const entered = async (id: string, to: string): Promise<number> =>
    (await nodes.node1!.store.transitions({ sandboxId: id, limit: 10_000 })).filter((t) => t.to === to)
      .length;

  before(async () => {
    pgServer = await startPostgres();
    url = await pgServer.createDatabase('fleet');
    rgw = await startRgw({ bucket: 'dormant-fleet' });
    ({ dir, rootfs } = await testFolder('fleet', { 'srv/server.py': COUNTER_SERVER_PY }));
    await startNode('node1');
    await startNode('node2');
  });

  after(async () => {
    try {
      for (const d of Object.values(nodes)) await stopTestDaemon(d).catch(() => undefined);
      await rm(dir, { recursive: true, force: true });
    } finally {
      await rgw.stop();
      await pgServer.stop();
    }
  });

  let sb: SandboxInfo;
  let memToken = '';

  test('node ls: both nodes registered, active, with their capacity', async () => {
    const r = (await (
      await fetch(`${nodes.node1!.url}/v1/nodes`, {
        headers: { authorization: `Bearer ${nodes.node1!.adminToken}` },
      })
    ).json()) as {
      node: string;
      nodes: { name: string; state: string; capacity: { memoryBytes: number } }[];
    };
    assert.equal(r.node, 'node1');
    assert.deepEqual(
      r.nodes.map((n) => [n.name, n.state]),
      [
        ['node1', 'active'],
        ['node2', 'active'],
      ],
    );
    assert.ok(r.nodes.every((n) => n.capacity.memoryBytes > 0));
  });

  test('made on node 1, hibernated into S3, resumed on node 2 (asked through node 1) with its memory', async () => {
    sb = await clients.node1!.createSandbox({
      name: 'counter',
      rootfs,
      command: ['/usr/bin/python3', '-u', '/srv/server.py'],
      ports: [8080],
    });
    assert.equal(sb.node, 'node1');
    const [n1, t] = (await eventually('server', () => httpGet(sb.address!, 8080))).split(' ');
    assert.equal(n1, '1');
    memToken = t!;
    assert.equal((await clients.node2!.hibernate(sb.id)).state, 'hibernated', 'node 2 forwards to node 1');
    const res = await fetch(`${nodes.node1!.url}/v1/sandboxes/${sb.id}/resume?node=node2`, {
      method: 'POST',
      headers: { authorization: `Bearer ${nodes.node1!.adminToken}` },
    });
    assert.equal(res.status, 200, await res.clone().text());
    assert.equal(res.headers.get('x-dormant-node'), 'node2', 'node 1 forwarded the resume to node 2');
    const r = (await res.json()) as SandboxInfo;
    assert.equal(r.state, 'running');
    assert.equal(r.node, 'node2');
    assert.equal(await eventually('resumed server', () => httpGet(r.address!, 8080)), `2 ${memToken}`);
    assert.ok((await nodes.node2!.runtime.list()).includes(sb.id), 'its container is node 2’s');
    // What node 1 held of it (its writable layer's mount, its address) is released.
    await eventually('node 1 lets go', async () => {
      if ((await nodes.node1!.runtime.list()).includes(sb.id)) throw new Error('still held');
    });
    // Node 1's API answers for it (forwarded): the same sandbox, on node 2.
    assert.equal((await clients.node1!.getSandbox(sb.id)).node, 'node2');
  });

  test('hibernated on node 2, node 1’s wake proxy wakes it on node 2', async () => {
    assert.equal((await clients.node1!.hibernate(sb.id)).state, 'hibernated');
    const r = await viaProxy('node1', sb.id);
    assert.equal(r.status, 200, r.body);
    assert.equal(r.body, `3 ${memToken}`);
    const s = await clients.node2!.getSandbox(sb.id);
    assert.equal(s.state, 'running');
    assert.equal(s.node, 'node2', 'placement kept it on its node');
  });

  test('two nodes racing to wake it: it is restored once, the other is told of the conflict', async () => {
    let count = 3;
    for (let round = 0; round < 5; round++) {
      await clients.node2!.hibernate(sb.id);
      const before = await entered(sb.id, 'resuming');
      const answers = await Promise.all(
        ['node1', 'node2'].map(async (n) => {
          const res = await fetch(`${nodes[n]!.url}/v1/sandboxes/${sb.id}/resume?node=${n}`, {
            method: 'POST',
            headers: { authorization: `Bearer ${nodes[n]!.adminToken}` },
          });
          return {
            status: res.status,
            body: (await res.json()) as { state?: string; error?: { code: string } },
          };
        }),
      );
      for (const a of answers)
        assert.ok(
          a.status === 200 || (a.status === 409 && a.body.error?.code === 'SANDBOX_BUSY'),
          JSON.stringify(a),
        );
      assert.ok(answers.some((a) => a.status === 200));
      assert.equal(await entered(sb.id, 'resuming'), before + 1, `round ${round}: one restore`);
      const s = await clients.node1!.getSandbox(sb.id);
      assert.equal(s.state, 'running');
      const other = s.node === 'node1' ? 'node2' : 'node1';
      assert.equal(await runningOn(other, sb.id), false, `round ${round}: nothing of it runs on ${other}`);
      count++;
      assert.equal(await eventually('server', () => httpGet(s.address!, 8080)), `${count} ${memToken}`);
    }
  });

  const runningOn = async (node: string, id: string): Promise<boolean> => {
    const st = await nodes[node]!.runtime.state(id).catch(() => undefined);
    return st?.status === 'running' || st?.status === 'paused';
  };

  test('drain: the node’s sandboxes hibernate, creates go elsewhere, they wake on another node; undrain', async () => {
    const where = (await clients.node1!.getSandbox(sb.id)).node!;
    const other = where === 'node1' ? 'node2' : 'node1';
    const res = await fetch(`${nodes[other]!.url}/v1/nodes/${where}/drain`, {
      method: 'POST',
      headers: { authorization: `Bearer ${nodes[other]!.adminToken}` },
    });
    assert.equal(res.status, 200);
    assert.equal(((await res.json()) as { state: string }).state, 'draining');
    await eventually('drained', async () => {
      const s = await clients[other]!.getSandbox(sb.id);
      if (s.state !== 'hibernated') throw new Error(`still ${s.state}`);
      return s;
    });
    // A create sent to the draining node lands on the other.
    const made = await clients[where]!.createSandbox({ rootfs, command: ['/bin/sleep', '600'] });
    assert.equal(made.node, other);
    // Waking it through the draining node: placement picks the other.
    const r = await clients[where]!.resume(sb.id);
    assert.equal(r.node, other);
    assert.match(
      await eventually('woken elsewhere', () => httpGet(r.address!, 8080)),
      new RegExp(` ${memToken}$`),
    );
    await clients[other]!.remove(made.id);
    const un = await fetch(`${nodes[other]!.url}/v1/nodes/${where}/undrain`, {
      method: 'POST',
      headers: { authorization: `Bearer ${nodes[other]!.adminToken}` },
    });
    assert.equal(((await un.json()) as { state: string }).state, 'active');
  });

  test('a node that stops renewing: after its lease, its sandboxes go back to their last checkpoint and wake on the other', async () => {
    const where = (await clients.node1!.getSandbox(sb.id)).node!;
    const other = where === 'node1' ? 'node2' : 'node1';
    // The node goes away without a word (its daemon closed, the sandbox's processes ended as a
    // power loss ends them): nothing renews its lease.
    const gone = nodes[where]!;
    nodes[where] = undefined;
    await gone.close();
    await gone.runtime.stop(sb.id);
    // Within the lease, node `other` cannot answer for it.
    const err = await apiError(
      clients[other]!.getSandbox(sb.id).then(() => clients[other]!.exec(sb.id, ['true'])),
    );
    assert.equal(err.code, 'NODE_UNAVAILABLE');
    const back = await eventually(
      'taken back',
      async () => {
        const s = await clients[other]!.getSandbox(sb.id);
        if (s.state !== 'hibernated') throw new Error(`still ${s.state}`);
        return s;
      },
      30_000,
    );
    assert.equal(back.node, other);
    assert.match(back.lastError ?? '', new RegExp(`node ${where} was lost .*what ran after it is gone`));
    const events = await nodes[other]!.store.transitions({ sandboxId: sb.id, limit: 10_000 });
    assert.match(events.at(-1)!.reason, /was lost/);
    const r = await clients[other]!.resume(sb.id);
    assert.equal(r.node, other);
    assert.match(await eventually('woken', () => httpGet(r.address!, 8080)), new RegExp(` ${memToken}$`));
    const ls = (await (
      await fetch(`${nodes[other]!.url}/v1/nodes`, {
        headers: { authorization: `Bearer ${nodes[other]!.adminToken}` },
      })
    ).json()) as { nodes: { name: string; state: string }[] };
    assert.equal(ls.nodes.find((n) => n.name === where)?.state, 'lost');
    // It comes back: it joins again, active, and owns nothing it lost.
    await startNode(where);
    const again = (await (
      await fetch(`${nodes[other]!.url}/v1/nodes/${where}`, {
        headers: { authorization: `Bearer ${nodes[other]!.adminToken}` },
      })
    ).json()) as { state: string };
    assert.equal(again.state, 'active');
    assert.equal((await clients[where]!.getSandbox(sb.id)).node, other);
  });
});
