/**
 * Egress (docs/NETWORK.md), against a real daemon, real sandboxes and a test-made "outside"
 * host: a network namespace in 198.18.0.0/15 with an HTTP server and a DNS server
 * (testing/outside.ts). No sandbox here connects to anything but that namespace, the node
 * and other sandboxes of this test.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { connect } from 'node:net';
import { join } from 'node:path';
import type { Daemon } from '../daemon/daemon.js';
import { DormantClient, type SandboxInfo } from '../sdk/client.js';
import { run } from '../sys/exec.js';
import { apiError, startTestDaemon, tearDown, testFolder } from './testing/daemon.js';
import { eventually, httpGet } from './testing/host.js';
import { startOutside, type Outside } from './testing/outside.js';

/** What a TCP server sends before it closes. */
/** What a TCP listener sends, once it listens (a sandbox's server may still be starting). */
async function tcpRead(host: string, port: number): Promise<string> {
  for (let i = 0; ; i++) {
    try {
      return await tcpReadOnce(host, port);
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code !== 'ECONNREFUSED' || i >= 50) throw e;
      await new Promise((r) => setTimeout(r, 100));
    }
  }
}

function tcpReadOnce(host: string, port: number): Promise<string> {
  return new Promise((resolve, reject) => {
    let got = '';
    const c = connect({ host, port, timeout: 5000 }, () => undefined);
    c.on('data', (d) => (got += d.toString()));
    c.on('end', () => resolve(got));
    c.on('timeout', () => c.destroy(new Error('timeout')));
    c.on('error', reject);
  });
}

const LOOP = ['/bin/sh', '-c', 'while true; do sleep 1; done'];

describe('egress', () => {
  let dir: string;
  let rootfs: string;
  let daemon: Daemon | undefined;
  let client: DormantClient;
  let outside: Outside;
  let apiPort: number;

  const start = async (): Promise<void> => {
    ({ daemon, client } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      policy: false,
      // The API on every address, so that only the firewall keeps sandboxes from it.
      listen: '0.0.0.0:0',
      allowedSourceRoots: [dir],
      egressResolvers: [outside.address],
      // The test's DNS answers live 1 s: names are looked up again after 1 s, not 30.
      egressRefreshMinMs: 1000,
      defaultEgress: { node: { mode: 'internet' }, tenants: { closed: { mode: 'none' } } },
    }));
    apiPort = Number(new URL(daemon.url).port);
  };

  /** Exit code and output of a fetch from inside (busybox wget, 3 s timeout). */
  const fetchFrom = async (sb: SandboxInfo, url: string): Promise<{ ok: boolean; out: string }> => {
    const r = await client.exec(sb.id, ['wget', '-q', '-T', '3', '-O', '-', url], { timeoutMs: 15_000 });
    return { ok: r.exitCode === 0, out: r.stdout + r.stderr };
  };

  const make = (name: string, egress?: string): Promise<SandboxInfo> =>
    client.createSandbox({
      name,
      rootfs,
      command: LOOP,
      memory: '64M',
      ...(egress !== undefined ? { egress } : {}),
    });

  before(async () => {
    ({ dir, rootfs } = await testFolder('egress'));
    outside = await startOutside((p) => ({ 'api.egress.test': `${p}2`, 'other.egress.test': `${p}3` }));
    await start();
  });

  after(async () => {
    await tearDown(dir, daemon);
    await outside.close();
  });

  test('by default a sandbox reaches the outside host, by address and by name, with DNS inside', async () => {
    const sb = await make('open');
    assert.equal(sb.egress, 'internet');
    assert.match(
      (await client.exec(sb.id, ['cat', '/etc/resolv.conf'])).stdout,
      new RegExp(`nameserver ${outside.address}`),
    );
    const byAddress = await fetchFrom(sb, `http://${outside.address}:8080/`);
    assert.ok(byAddress.ok, byAddress.out);
    assert.match(byAddress.out, /^outside /);
    const byName = await fetchFrom(sb, 'http://other.egress.test:8080/');
    assert.ok(byName.ok, byName.out);
    assert.match(byName.out, new RegExp(`outside ${outside.other}`));
    // The sandbox cannot replace its resolv.conf (a read-only bind of the runtime's file).
    const write = await client.exec(sb.id, ['sh', '-c', 'echo nameserver 1.1.1.1 > /etc/resolv.conf']);
    assert.notEqual(write.exitCode, 0);
    // Metering: what it sent beyond the node is counted.
    const bytes = (await daemon!.runtime.egressBytes()).get(sb.id) ?? 0;
    assert.ok(bytes > 100, `egress bytes ${bytes}`);
    const prom = await fetch(`${daemon!.url}/metrics`, {
      headers: { authorization: `Bearer ${daemon!.adminToken}` },
    });
    assert.match(await prom.text(), /^dormant_sandbox_egress_bytes [1-9]\d*$/m);
  });

  test("the node's API and another tenant's sandbox are out of reach, whatever the policy", async () => {
    const other = await client.createToken({ tenant: 'neighbour' });
    const theirs = new DormantClient({
      url: daemon!.url,
      token: other.token,
    });
    const target = await theirs.createSandbox({
      name: 'target',
      rootfs,
      command: ['/bin/sh', '-c', 'while true; do echo hi | nc -l -p 8000; done'],
      ports: [8000],
      memory: '64M',
    });
    // From the host both answer: only the firewall stands between them and a sandbox.
    assert.match(await tcpRead(target.address!, 8000), /hi/);
    const hostEnd = (await daemon!.runtime.state(target.id)).network.hostAddress;
    assert.match(await httpGet(hostEnd, apiPort, '/v1/health'), /"ok":true/);
    for (const egress of ['internet', `${outside.prefix}0/24,10.0.0.0/8,0.0.0.0/1`]) {
      const sb = await make(`prober-${egress === 'internet' ? 'open' : 'list'}`, egress);
      const net = await daemon!.runtime.state(sb.id);
      for (const url of [
        `http://${net.network.hostAddress}:${apiPort}/v1/health`,
        `http://${outside.hostAddress}:${apiPort}/v1/health`,
        `http://${target.address!}:8000/`,
      ]) {
        const r = await fetchFrom(sb, url);
        assert.ok(!r.ok, `${egress}: ${url} answered from inside: ${r.out}`);
      }
      await client.remove(sb.id);
    }
    await theirs.remove(target.id);
  });

  test('--egress none, and a list that leaves the host out, both block it', async () => {
    const none = await make('closed', 'none');
    assert.equal(none.egress, 'none');
    assert.ok(!(await fetchFrom(none, `http://${outside.address}:8080/`)).ok);
    assert.doesNotMatch((await client.exec(none.id, ['cat', '/etc/resolv.conf'])).stdout, /nameserver/);
    const list = await make('narrow', `${outside.prefix}128/25`);
    assert.ok(!(await fetchFrom(list, `http://${outside.address}:8080/`)).ok);
    // A tenant's default: `closed` gets none.
    const token = await client.createToken({ tenant: 'closed' });
    const closed = new DormantClient({
      url: daemon!.url,
      token: token.token,
    });
    const theirs = await closed.createSandbox({ name: 'dflt', rootfs, command: LOOP, memory: '64M' });
    assert.equal(theirs.egress, 'none');
    await closed.remove(theirs.id);
    await client.remove(none.id);
    await client.remove(list.id);
  });

  test('a host name in the list admits its addresses (resolved by the node), and only those', async () => {
    const sb = await make('named', 'api.egress.test');
    assert.equal(sb.egress, 'api.egress.test');
    const ok = await fetchFrom(sb, `http://${outside.address}:8080/`);
    assert.ok(ok.ok, ok.out);
    assert.ok(
      !(await fetchFrom(sb, `http://${outside.other}:8080/`)).ok,
      'an address the name does not have',
    );
    await client.remove(sb.id);
  });

  test('a name whose address changes: the node follows it, and the old address is closed', async () => {
    const names = { 'api.egress.test': `${outside.prefix}2`, 'other.egress.test': `${outside.prefix}3` };
    await outside.setNames({ ...names, 'moving.egress.test': outside.address });
    const sb = await make('moving', 'moving.egress.test');
    assert.ok((await fetchFrom(sb, `http://${outside.address}:8080/`)).ok);
    assert.ok(!(await fetchFrom(sb, `http://${outside.other}:8080/`)).ok);
    await outside.setNames({ ...names, 'moving.egress.test': outside.other });
    await eventually('the new address is admitted', async () => {
      const r = await fetchFrom(sb, `http://${outside.other}:8080/`);
      if (!r.ok) throw new Error(r.out);
    });
    assert.ok(!(await fetchFrom(sb, `http://${outside.address}:8080/`)).ok, 'the old address is closed');
    await outside.setNames(names);
    await client.remove(sb.id);
  });

  test('bad policies: a clear code, and no sandbox left behind', async () => {
    const before = (await client.listSandboxes()).length;
    const unresolvable = await apiError(make('nope', 'nope.egress.test'));
    assert.equal(unresolvable.code, 'EGRESS_HOST_UNRESOLVABLE');
    assert.match(unresolvable.message, /nope\.egress\.test/);
    for (const bad of ['198.18.0.0/33', '300.1.1.1', 'none,internet', 'bad_name']) {
      const e = await apiError(make('bad', bad));
      assert.equal(e.code, 'EGRESS_POLICY_INVALID', bad);
      assert.equal(e.status, 400);
    }
    assert.equal((await client.listSandboxes()).length, before);
  });

  test('the policy survives hibernate/resume, fork and a daemon restart; rm leaves no rule', async () => {
    const sb = await make('travels', 'api.egress.test');
    await client.hibernate(sb.id);
    await client.resume(sb.id);
    assert.ok((await fetchFrom(sb, `http://${outside.address}:8080/`)).ok, 'after resume');
    assert.ok(!(await fetchFrom(sb, `http://${outside.other}:8080/`)).ok, 'the list still holds');
    // Metering: 2 MB sent; the total survives hibernate/resume and the daemon's restart.
    const metered = async (): Promise<number> => {
      await daemon!.meter.sample();
      const m = await client.sandboxMetrics(sb.id);
      return m.samples[m.samples.length - 1]?.egressBytes ?? 0;
    };
    const up = await client.exec(sb.id, [
      'sh',
      '-c',
      `head -c 2000000 /dev/zero > /tmp/up && wget -q -O - --post-file /tmp/up http://${outside.address}:8080/`,
    ]);
    assert.match(up.stdout, /got 2000000/);
    const sent = await metered();
    assert.ok(sent > 2_000_000 && sent < 2_400_000, `metered egress ${sent}`);
    const fork = await client.fork(sb.id, { name: 'travels-fork' });
    assert.equal(fork.egress, 'api.egress.test');
    assert.ok((await fetchFrom(fork, `http://${outside.address}:8080/`)).ok, 'in the fork');
    assert.ok(!(await fetchFrom(fork, `http://${outside.other}:8080/`)).ok, 'the fork keeps the list');
    await daemon!.close();
    daemon = undefined;
    await start();
    assert.ok((await fetchFrom(sb, `http://${outside.address}:8080/`)).ok, 'after a daemon restart');
    const after = await metered();
    assert.ok(after >= sent && after < sent + 100_000, `metered egress after restart ${after} (was ${sent})`);
    const slots = await Promise.all(
      [sb, fork].map(async (s) => (await daemon!.runtime.state(s.id)).network.hostInterface.slice(3)),
    );
    await client.remove(sb.id);
    await client.remove(fork.id);
    const rules = (await run('iptables-save', [], { timeoutMs: 10_000 })).stdout;
    for (const slot of slots) {
      assert.doesNotMatch(rules, new RegExp(`DMO-${slot}\\b`), `chain DMO-${slot} is gone`);
      assert.doesNotMatch(rules, new RegExp(`dmh${slot}\\b`), `no rule names dmh${slot}`);
    }
    const netns = (await run('ip', ['netns', 'list'], { timeoutMs: 10_000 })).stdout;
    for (const s of [sb, fork]) assert.doesNotMatch(netns, new RegExp(`dormant-${s.id}\\b`));
  });
});
