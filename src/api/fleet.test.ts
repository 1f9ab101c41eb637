/**
 * A fleet of two nodes on this machine, sharing one PostgreSQL (the database of record) and
 * one S3 bucket (Ceph RGW: the vault), with real sandboxes: a sandbox made on node 1
 * hibernates into S3 and resumes on node 2 with its memory; node 1's API and wake proxy reach
 * it there; two nodes racing to wake it restore it once; drain hibernates a node's sandboxes
 * and sends creates elsewhere; a node that stops renewing its lease has its sandboxes taken
 * back to their checkpoints by the other; a node cut off from the database freezes its sandboxes
 * before its lease runs out, and ends its stale copies once it learns it was marked lost.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { connect, createServer, type Socket } from 'node:net';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import { rm } from 'node:fs/promises';
import type { Daemon, DaemonOptions } from '../daemon/daemon.js';
import { DormantClient, type SandboxInfo } from '../sdk/client.js';
import { pgMissing, startPostgres, type TestPostgres } from '../state/testing/postgres.js';
import { rgwMissing, startRgw, type TestRgw } from '../vault/testing/rgw.js';
import { COUNTER_SERVER_PY } from './testing/servers.js';
import { eventually, httpGet, viaProxy } from './testing/host.js';
import { apiError, rgwVault, startTestDaemon, stopTestDaemon, testFolder } from './testing/daemon.js';
import { openTerminal } from './testing/toolbox.js';

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
  /** The fleet's warnings, by node, with when they came. */
  const warned: Record<string, { at: number; m: string }[]> = {};
  let relay: Relay | undefined;

  const startNode = async (name: string, stateUrl = url): Promise<Daemon> => {
    const opts: DaemonOptions = {
      dataDir: join(dir, name),
      masterKey: { key },
      state: { url: stateUrl },
      node: { name, leaseMs: LEASE_MS },
      vault: rgwVault(rgw, 'fleet'),
      proxy: { domain: 'dormant.test', listen: '127.0.0.1:0' },
      policy: false,
      // The fleet's own warnings (a node marked lost, a drain that failed) in the test's output.
      warn: (m: string) => {
        (warned[name] ??= []).push({ at: Date.now(), m });
        if (/lost|drain|releas|renew/.test(m)) process.stderr.write(`[${name}] ${m}\n`);
      },
    };
    const { daemon } = await startTestDaemon(opts);
    nodes[name] = daemon;
    clients[name] = new DormantClient({ url: daemon.url, token: daemon.adminToken });
    return daemon;
  };

  /** GET / of the sandbox's port 8080 through `node`'s wake proxy. */
  const viaProxyOf = (node: string, id: string) =>
    viaProxy(nodes[node]!.wake.proxy!.port, `8080-${id}.dormant.test`, {
      headers: { authorization: `Bearer ${nodes[node]!.adminToken}` },
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
      await relay?.close();
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

  test('hibernated on node 2, node 1’s wake proxy wakes it on node 2 and relays through node 2’s proxy', async () => {
    assert.equal((await clients.node1!.hibernate(sb.id)).state, 'hibernated');
    const [out1, in2] = [nodes.node1!.wake.proxy!.hops.out, nodes.node2!.wake.proxy!.hops.in];
    const r = await viaProxyOf('node1', sb.id);
    assert.equal(r.status, 200, r.body);
    assert.equal(r.body, `3 ${memToken}`);
    const s = await clients.node2!.getSandbox(sb.id);
    assert.equal(s.state, 'running');
    assert.equal(s.node, 'node2', 'placement kept it on its node');
    // Node 1's proxy relayed it through node 2's (which has the address), awake or not.
    assert.equal((await viaProxyOf('node1', sb.id)).body, `4 ${memToken}`);
    assert.deepEqual(
      [nodes.node1!.wake.proxy!.hops.out - out1, nodes.node2!.wake.proxy!.hops.in - in2],
      [2, 2],
    );
  });

  test('a terminal on node 2’s sandbox through node 1’s API: the WebSocket is joined to node 2', async () => {
    const auth = { authorization: `Bearer ${nodes.node1!.adminToken}` };
    const res = await fetch(`${nodes.node1!.url}/v1/sandboxes/${sb.id}/commands`, {
      method: 'POST',
      headers: { ...auth, 'content-type': 'application/json' },
      body: JSON.stringify({
        cmd: '/bin/sh',
        pty: { cols: 80, rows: 24 },
        stdin: true,
        background: true,
        timeoutMs: 0,
      }),
    });
    assert.equal(res.status, 201, await res.clone().text());
    assert.equal(res.headers.get('x-dormant-node'), 'node2');
    const { id } = (await res.json()) as { id: string };
    const t = await openTerminal(
      nodes.node1!.url,
      `/v1/sandboxes/${sb.id}/commands/${id}/ws`,
      nodes.node1!.adminToken,
    );
    t.type('echo $((6*7)) $(hostname); stty size\n');
    t.resize(100, 30);
    t.type('stty size\n');
    await eventually('the shell answers', () => {
      assert.match(t.screen(), /\b42\b/);
      assert.match(t.screen(), /30 100/);
      return Promise.resolve();
    });
    t.type('exit 3\n');
    await t.closed;
    assert.deepEqual([t.events.at(-1)?.type, t.events.at(-1)?.exitCode], ['end', 3]);
  });

  test('two nodes racing to wake it: it is restored once, the other is told of the conflict', async () => {
    let count = 4;
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

  test('drain: the node’s sandboxes hibernate, creates and forks go elsewhere, they wake on another node; undrain', async () => {
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
    // So does a fork of its sleeping sandbox, restored from the same checkpoint.
    const forked = await clients[where]!.fork(sb.id, { name: 'drained-fork' });
    assert.equal(forked.node, other);
    assert.equal(forked.state, 'running');
    assert.match(
      await eventually('fork answers', () => httpGet(forked.address!, 8080)),
      new RegExp(` ${memToken}$`),
    );
    await clients[other]!.remove(forked.id);
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

  test('a node cut off from the database freezes its sandboxes before its lease runs out; taken back, its copy never runs again', async () => {
    // Node 3 reaches PostgreSQL through a relay the test can cut: its lease cannot be renewed,
    // while its sandboxes, its API and the vault are untouched.
    relay = await cuttableRelay(Number(new URL(url).port));
    const through = new URL(url);
    through.port = String(relay.port);
    await startNode('node3', through.toString());
    const made = await clients.node3!.createSandbox({
      rootfs,
      command: ['/usr/bin/python3', '-u', '/srv/server.py'],
      ports: [8080],
    });
    assert.equal(made.node, 'node3');
    const tok = (await eventually('server', () => httpGet(made.address!, 8080))).split(' ')[1]!;
    // Its checkpoint holds count 1; then it wakes on node 3 and counts on.
    assert.equal((await clients.node3!.hibernate(made.id)).state, 'hibernated');
    const res = await fetch(`${nodes.node3!.url}/v1/sandboxes/${made.id}/resume?node=node3`, {
      method: 'POST',
      headers: { authorization: `Bearer ${nodes.node3!.adminToken}` },
    });
    const woke = (await res.json()) as SandboxInfo;
    assert.equal(woke.node, 'node3', JSON.stringify(woke));
    assert.equal(await eventually('resumed', () => httpGet(woke.address!, 8080)), `2 ${tok}`);

    relay.cut();
    const back = await eventually(
      'taken back by another node',
      async () => {
        const s = await clients.node1!.getSandbox(made.id);
        if (s.state !== 'hibernated') throw new Error(`still ${s.state} on ${s.node}`);
        return s;
      },
      30_000,
    );
    assert.notEqual(back.node, 'node3');
    const reclaimedAt = (await nodes.node1!.store.transitions({ sandboxId: made.id, limit: 10_000 })).at(
      -1,
    )!.at;
    const froze = warned.node3?.find((w) => /froze 1 sandbox/.test(w.m));
    assert.ok(froze, `node 3 fenced itself: ${JSON.stringify(warned.node3)}`);
    assert.ok(froze.at < reclaimedAt, 'frozen before the fleet took it back');
    assert.equal((await nodes.node3!.runtime.state(made.id)).status, 'paused', 'the stale copy is frozen');

    // Woken elsewhere from its checkpoint: what ran on node 3 after it is gone.
    const r = await clients.node1!.resume(made.id);
    assert.notEqual(r.node, 'node3');
    assert.equal(await eventually('woken', () => httpGet(r.address!, 8080)), `2 ${tok}`);

    // Node 3 reaches the database again: told it was lost, it ends its copy without thawing
    // it, and joins again.
    relay.mend();
    await eventually(
      'node 3 lets go',
      async () => {
        if ((await nodes.node3!.runtime.list()).includes(made.id)) throw new Error('still held');
      },
      30_000,
    );
    assert.ok(!warned.node3!.some((w) => /renewed its lease in time/.test(w.m)), 'never thawed');
    await eventually('node 3 joins again', async () => {
      const n3 = (await (
        await fetch(`${nodes.node1!.url}/v1/nodes/node3`, {
          headers: { authorization: `Bearer ${nodes.node1!.adminToken}` },
        })
      ).json()) as { state: string };
      if (n3.state !== 'active') throw new Error(`node 3 is ${n3.state}`);
    });
    assert.equal(await httpGet(r.address!, 8080), `3 ${tok}`, 'the woken copy is the sandbox');
    await clients.node1!.remove(made.id);
  });
});

interface Relay {
  port: number;
  /** Ends every connection through it, and refuses new ones until mend. */
  cut(): void;
  mend(): void;
  close(): Promise<void>;
}

/** A TCP relay on loopback to port `to` that the test can cut and mend. */
async function cuttableRelay(to: number): Promise<Relay> {
  const open = new Set<Socket>();
  let cut = false;
  const server = createServer((c) => {
    if (cut) return void c.destroy();
    const up = connect(to, '127.0.0.1');
    const end = (): void => {
      for (const s of [c, up]) {
        s.destroy();
        open.delete(s);
      }
    };
    open.add(c).add(up);
    c.on('error', end).on('close', end);
    up.on('error', end).on('close', end);
    c.pipe(up).pipe(c);
  });
  await new Promise<void>((res) => server.listen(0, '127.0.0.1', res));
  const { port } = server.address() as { port: number };
  const cutAll = (): void => {
    cut = true;
    for (const s of open) s.destroy();
    open.clear();
  };
  return {
    port,
    cut: cutAll,
    mend: () => (cut = false),
    close: async () => {
      cutAll();
      await new Promise<void>((res) => server.close(() => res()));
    },
  };
}
