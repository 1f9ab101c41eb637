/**
 * A gVisor sandbox through the real daemon (API, controller, RuntimeDispatch, runsc, vault,
 * wake proxy): created with `runtime: 'runsc'`, it runs on gVisor's kernel, hibernates into
 * the vault with nothing of its memory in clear on disk, forks, wakes on a request through
 * the proxy with its in-memory counter and token, and leaves nothing of runsc behind when removed.
 * A template built on it is taken once its port listens (inside gVisor); a save gVisor fails
 * (which ends the sandbox) leaves it on its previous checkpoint, never recorded running.
 * Skipped where runsc is not installed.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { readFile, readdir } from 'node:fs/promises';
import { join } from 'node:path';
import type { Daemon } from '../daemon/daemon.js';
import { bundleDirFor, stagingDirFor } from '../daemon/daemon.js';
import type { DormantClient, SandboxInfo } from '../sdk/client.js';
import { run, which } from '../sys/exec.js';
import { eventually, untilState, viaProxy } from './testing/host.js';
import { COUNTER_SERVER_PY, serveCounter } from './testing/servers.js';
import { apiError, startTestDaemon, tearDown, testFolder } from './testing/daemon.js';

const skip =
  process.getuid?.() !== 0
    ? 'needs root'
    : (await which('runsc')) === undefined
      ? 'runsc not installed (scripts/setup.sh)'
      : false;

/** GET / on port 8080 of sandbox `id` through the wake proxy: the body of a 200. */
async function viaDaemonProxy(daemon: Daemon, id: string): Promise<string> {
  const r = await viaProxy(daemon.wake.proxy!.port, `8080-${id}.dormant.test`, {
    headers: { authorization: `Bearer ${daemon.adminToken}` },
  });
  if (r.status !== 200) throw new Error(`${r.status}: ${r.body}`);
  return r.body;
}

/** Files under `dirs` holding `text` in clear. */
async function filesHolding(text: string, dirs: string[]): Promise<string[]> {
  const r = await run('grep', ['-rlF', '--', text, ...dirs], { okExitCodes: [0, 1, 2], timeoutMs: 60_000 });
  return r.stdout.split('\n').filter(Boolean);
}

describe('a gVisor (runsc) sandbox through the daemon', { skip }, () => {
  let dir: string;
  let rootfs: string;
  let daemon: Daemon;
  let client: DormantClient;
  let sb: SandboxInfo;

  before(async () => {
    ({ dir, rootfs } = await testFolder('runsc-api', { 'srv/server.py': COUNTER_SERVER_PY }));
    ({ daemon, client } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      proxy: { domain: 'dormant.test' },
      // A template's builder sandbox takes the node's default runtime.
      defaultRuntime: { node: 'runsc', tenants: {} },
    }));
  });

  after(() => tearDown(dir, daemon));

  test("runs on gVisor's kernel; hibernates with nothing in clear; forks; wakes through the proxy with its memory; rm leaves nothing", async () => {
    sb = await client.createSandbox({
      name: 'gvisor',
      rootfs,
      command: ['/usr/bin/python3', '-u', '/srv/server.py'],
      ports: [8080],
      memory: '256M',
      runtime: 'runsc',
    });
    assert.equal(sb.runtime, 'runsc');
    assert.equal((await client.getSandbox(sb.id)).runtime, 'runsc');
    // No request before the hibernate: gVisor (this build) cannot save a TCP endpoint that is
    // connected or in TIME_WAIT (docs/RUNTIME.md). The log says the server is up.
    await eventually('the server', async () => {
      if (!(await client.logs(sb.id)).includes('serving')) throw new Error('not yet');
    });

    const dmesg = await client.exec(sb.id, ['dmesg']);
    assert.match(dmesg.stdout, /gVisor/);
    const version = await client.exec(sb.id, ['cat', '/proc/version']);
    assert.notEqual(version.stdout, await readFile('/proc/version', 'utf8'), "not the host's kernel");

    assert.equal((await client.hibernate(sb.id)).state, 'hibernated');
    const data = join(dir, 'data');
    assert.deepEqual(
      await readdir(join(data, 'runtime-runsc', 'runsc')).catch(() => []),
      [],
      'no runsc container',
    );

    // Fork from the hibernated checkpoint: the fork runs on gVisor too, from the same memory.
    const fork = await client.fork(sb.id, { name: 'gvisor-fork' });
    await untilState(client, fork.id, 'running', 60_000);
    const forked = await client.getSandbox(fork.id);
    assert.equal(forked.runtime, 'runsc');

    // A request through the proxy wakes it; its server answers from the memory it had (its
    // random token, made once at start, never written anywhere), count 1. (The proxy waits
    // for the port to listen, which on gVisor is read inside the sandbox.)
    assert.equal((await client.getSandbox(sb.id)).state, 'hibernated');
    const t0 = Date.now();
    const woke = await viaDaemonProxy(daemon, sb.id);
    process.stderr.write(`runsc: wake through the proxy from hibernated: ${Date.now() - t0} ms\n`);
    const [count, token] = woke.split(' ');
    assert.equal(count, '1');
    assert.match(token!, /^[0-9a-f]{16}$/);
    assert.equal((await client.getSandbox(sb.id)).state, 'running');
    assert.equal(await viaDaemonProxy(daemon, sb.id), `2 ${token}`, 'the counter carries on');
    const [, forkToken] = await serveCounter(forked);
    assert.equal(forkToken, token, "the fork holds its origin's memory");

    // The token, in the server's memory only, is nowhere in clear on disk or in staging: the
    // checkpoint in the vault is sealed, the staged state file wiped.
    assert.deepEqual(
      await filesHolding(token!, [data, stagingDirFor(data), `${bundleDirFor(data)}-runsc`]),
      [],
      'no plaintext memory',
    );

    // The toolbox is not there on gVisor: a clear error.
    const res = await fetch(`${daemon.url}/v1/sandboxes/${sb.id}/files/stat?path=/`, {
      headers: { authorization: `Bearer ${daemon.adminToken}` },
    });
    const err = (await res.json()) as { error: { code: string; message: string } };
    assert.equal(err.error.code, 'TOOLBOX_UNAVAILABLE');
    assert.match(err.error.message, /gVisor/);

    // rm: nothing of runsc stays.
    await client.remove(fork.id);
    await client.remove(sb.id);
    assert.deepEqual(await readdir(join(data, 'runtime-runsc', 'runsc')).catch(() => []), []);
    assert.deepEqual(await readdir(join(data, 'runtime-runsc', 'sandboxes')).catch(() => []), []);
    const ps = await run('ps', ['-eo', 'args'], { timeoutMs: 10_000 });
    assert.ok(
      !ps.stdout.split('\n').some((l) => l.includes('runsc') && l.includes(sb.id)),
      'no runsc process',
    );
  });

  test('a template built on gVisor is taken once its port listens inside, and its sandboxes answer', async () => {
    // The listener lives in gVisor's own network stack, not in the host kernel's tables.
    const tpl = await client.createTemplate({
      name: 'gvisor-tpl',
      rootfs,
      command: ['/usr/bin/python3', '-u', '/srv/server.py'],
      ports: [8080],
      memory: '256M',
      ready: { port: 8080, timeout: '30s' },
    });
    const t = await client.createSandbox({ template: tpl.id, name: 'from-gvisor-tpl' });
    assert.equal(t.runtime, 'runsc');
    await untilState(client, t.id, 'running', 60_000);
    const [count] = await serveCounter(await client.getSandbox(t.id));
    assert.equal(count, 1, "the template's server, never asked before");
    await client.remove(t.id);
    await client.removeTemplate(tpl.id);
  });

  test('a checkpoint gVisor fails ends the sandbox: hibernate says so and records it on its previous checkpoint, not running', async () => {
    const s = await client.createSandbox({
      name: 'gvisor-ended',
      rootfs,
      command: ['/usr/bin/python3', '-u', '/srv/server.py'],
      ports: [8080],
      memory: '256M',
      runtime: 'runsc',
    });
    await eventually('the server', async () => {
      if (!(await client.logs(s.id)).includes('serving')) throw new Error('not yet');
    });
    const ck1 = (await client.hibernate(s.id)).checkpointId;
    assert.ok(ck1);
    await client.resume(s.id);
    // A TCP connection the adapter's check cannot see (as one opened between the check and
    // the save): to the sandbox's own address, which gVisor's stack delivers without the host,
    // so the host's connection tracking never sees it. gVisor fails the save, and ends the
    // sandbox. (Over 127.0.0.1 it saves fine: loopback endpoints are not refused.)
    const hold = `import socket, time
l = socket.socket(); l.bind(("0.0.0.0", 9000)); l.listen()
c = socket.create_connection(("${s.address!}", 9000)); a, _ = l.accept()
open("/tmp/connected", "w").close(); time.sleep(3600)`;
    await client.exec(s.id, ['sh', '-c', `python3 -c '${hold}' >/dev/null 2>&1 &`]);
    await eventually('the loopback connection', async () => {
      if ((await client.exec(s.id, ['cat', '/tmp/connected'])).exitCode !== 0) throw new Error('not yet');
    });

    const e = await apiError(client.hibernate(s.id));
    assert.equal(e.code, 'HIBERNATE_FAILED');
    assert.match(e.message, /the sandbox ended/);
    assert.match(e.message, new RegExp(`previous checkpoint ${ck1}`));
    const after = await client.getSandbox(s.id);
    assert.equal(after.state, 'hibernated', 'not running: gVisor ended it');
    assert.equal(after.checkpointId, ck1);

    // Resumed from that checkpoint: the server answers, with nothing of the connection.
    await client.resume(s.id);
    const [count] = await serveCounter(await client.getSandbox(s.id));
    assert.equal(count, 1);
    assert.notEqual((await client.exec(s.id, ['cat', '/tmp/connected'])).exitCode, 0, 'back before it');
    await client.remove(s.id);
  });
});
