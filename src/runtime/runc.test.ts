/**
 * RuncRuntime against the real runc and CRIU of this machine, on a busybox root filesystem
 * built here. Skipped (with the reason) where they or root are missing.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { cp, mkdir, readFile } from 'node:fs/promises';
import { once } from 'node:events';
import { createServer } from 'node:http';
import { connect, type AddressInfo } from 'node:net';
import { join } from 'node:path';
import { isDormantError, ErrorCode } from '../domain/errors.js';
import { run } from '../sys/exec.js';
import { findCollector, stopCollector } from './log-collector.js';
import { findSlot, tearDownNetwork } from './network.js';
import { RuncRuntime } from './runc.js';
import {
  cannotRun,
  CRIU,
  removeRuntimeFolders,
  runtimeFolders,
  type RuntimeFolders,
  waitFor,
} from './testing/host.js';

const skip = await cannotRun('criu', 'python3');

const SERVER_PY = `
import http.server, os, sys, threading, socketserver
count = 0
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global count
        count += 1
        body = str(count).encode()
        self.send_response(200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        print('request', count, flush=True)
    def log_message(self, *a):
        pass
# A second listener on a port that is not declared: the host must not reach it.
undeclared = http.server.HTTPServer(('0.0.0.0', 8081), H)
threading.Thread(target=undeclared.serve_forever, daemon=True).start()
print('server up, pid', os.getpid(), flush=True)
http.server.HTTPServer(('0.0.0.0', 8080), H).serve_forever()
`;

const TICKER = 'i=0; while true; do i=$((i+1)); echo $i > /counter; echo tick $i; sleep 0.1; done';

async function get(url: string, timeoutMs = 2000): Promise<string> {
  const res = await fetch(url, { signal: AbortSignal.timeout(timeoutMs) });
  return res.text();
}

describe('RuncRuntime (real runc + CRIU)', { skip }, () => {
  let tmp: string;
  let shm: string;
  let rootfs: string;
  let rt: RuncRuntime;
  const suffix = randomBytes(3).toString('hex');

  let folders: RuntimeFolders;

  before(async () => {
    folders = await runtimeFolders('rt', { 'srv/server.py': SERVER_PY });
    ({ tmp, shm, rootfs } = folders);
    rt = new RuncRuntime({ stateDir: join(tmp, 'state'), criuPath: CRIU });
  });

  after(() => removeRuntimeFolders(folders, [rt]));

  test('create, exec, logs, isolation, limits, freeze/thaw, destroy', async () => {
    const id = `basic-${suffix}`;
    const created = await rt.create({
      id,
      rootfs,
      args: ['sh', '-c', TICKER],
      hostname: 'agent-box',
      limits: { memoryBytes: 64 * 1024 * 1024, cpus: 0.5, pids: 64 },
    });
    assert.equal(created.status, 'created');
    await rt.start(id);
    assert.equal((await rt.state(id)).status, 'running');

    // Output lands in the host-side log.
    await waitFor('ticks in the log', async () =>
      (await readFile(rt.logPath(id), 'utf8')).includes('tick 3') ? true : undefined,
    );

    // exec: stdout, stderr, exit code.
    const r = await rt.exec(id, ['sh', '-c', 'echo out; echo err >&2; exit 7']);
    assert.deepEqual([r.stdout, r.stderr, r.exitCode], ['out\n', 'err\n', 7]);
    const withEnv = await rt.exec(id, ['sh', '-c', 'echo $GREETING; pwd'], {
      env: { GREETING: 'hi' },
      cwd: '/tmp',
    });
    assert.equal(withEnv.stdout, 'hi\n/tmp\n');
    await assert.rejects(rt.exec(id, ['sleep', '30'], { timeoutMs: 300 }), (e) =>
      isDormantError(e, ErrorCode.COMMAND_TIMEOUT),
    );

    // Isolation facts, seen from inside.
    assert.equal((await rt.exec(id, ['hostname'])).stdout.trim(), 'agent-box');
    assert.match((await rt.exec(id, ['cat', '/proc/1/cmdline'])).stdout, /^sh\0-c\0/);
    const pids = (await rt.exec(id, ['ls', '/proc'])).stdout.split(/\s+/).filter((p) => /^\d+$/.test(p));
    assert.ok(!pids.includes(String(process.pid)), 'the sandbox sees no host process');
    assert.ok(pids.length < 10, `a handful of processes inside, saw ${pids.length}`);
    const status = (await rt.exec(id, ['cat', '/proc/self/status'])).stdout;
    assert.match(status, /NoNewPrivs:\s+1/);
    const capEff = BigInt(`0x${/CapEff:\s+([0-9a-f]+)/.exec(status)![1]!}`);
    assert.equal(capEff & (1n << 21n), 0n, 'no CAP_SYS_ADMIN');
    assert.equal(capEff & (1n << 13n), 0n, 'no CAP_NET_RAW');
    const seesState = await rt.exec(id, ['ls', join(tmp, 'state')]);
    assert.notEqual(seesState.exitCode, 0, 'the data directory is out of reach');
    assert.equal((await rt.exec(id, ['cat', '/proc/kcore'])).stdout, '', 'masked path');

    // The sandbox cannot open connections to the host, even to a server on all addresses.
    const hostServer = createServer((_, res) => res.end('host')).listen(0, '0.0.0.0');
    try {
      await once(hostServer, 'listening');
      const { port } = hostServer.address() as AddressInfo;
      const hostAddress = (await rt.state(id)).network.hostAddress;
      const probe = await rt.exec(id, ['wget', '-q', '-T', '2', '-O', '-', `http://${hostAddress}:${port}/`]);
      assert.notEqual(probe.exitCode, 0, 'host unreachable from inside');
    } finally {
      hostServer.close();
    }

    const v6 = await rt.exec(id, ['cat', '/proc/sys/net/ipv6/conf/eth0/disable_ipv6']);
    assert.equal(v6.stdout.trim(), '1', 'no IPv6 on the link (the firewall is IPv4)');

    // Writes land in the writable layer only.
    await rt.exec(id, ['sh', '-c', 'echo hello > /note.txt']);
    assert.equal(await readFile(join(rt.upperDir(id), 'note.txt'), 'utf8'), 'hello\n');
    assert.ok(!existsSync(join(rootfs, 'note.txt')), 'the rootfs folder is untouched');

    // cgroup limits, seen from the host (v1 hierarchies here; v2 has one unified tree).
    const cg = rt.cgroupPath(id);
    if (existsSync('/sys/fs/cgroup/memory')) {
      assert.equal(
        (await readFile(`/sys/fs/cgroup/memory${cg}/memory.limit_in_bytes`, 'utf8')).trim(),
        String(64 * 1024 * 1024),
      );
      assert.equal((await readFile(`/sys/fs/cgroup/pids${cg}/pids.max`, 'utf8')).trim(), '64');
      assert.equal((await readFile(`/sys/fs/cgroup/cpu${cg}/cpu.cfs_quota_us`, 'utf8')).trim(), '50000');
    } else {
      assert.equal(
        (await readFile(`/sys/fs/cgroup${cg}/memory.max`, 'utf8')).trim(),
        String(64 * 1024 * 1024),
      );
      assert.equal((await readFile(`/sys/fs/cgroup${cg}/pids.max`, 'utf8')).trim(), '64');
    }

    // freeze: the counter stops; thaw: it moves again.
    const counter = async (): Promise<number> =>
      Number(await readFile(join(rt.upperDir(id), 'counter'), 'utf8'));
    await rt.freeze(id);
    assert.equal((await rt.state(id)).status, 'paused');
    const frozenAt = await counter();
    await new Promise((r) => setTimeout(r, 500));
    assert.equal(await counter(), frozenAt, 'no progress while frozen');
    await assert.rejects(rt.exec(id, ['true']), (e) => isDormantError(e, ErrorCode.RUNTIME_INVALID_STATE));
    const t0 = performance.now();
    await rt.thaw(id);
    const thawMs = performance.now() - t0;
    // runc resume is a process start plus a cgroup write; generous for a loaded CI machine.
    assert.ok(thawMs < 2000, `thaw took ${thawMs} ms`);
    await waitFor('the counter to move', async () => ((await counter()) > frozenAt ? true : undefined));

    // destroy leaves nothing behind.
    const net = (await rt.state(id)).network;
    const logDir = join(tmp, 'state', 'sandboxes', id, 'log');
    const collector = await findCollector(logDir);
    assert.ok(collector);
    await rt.destroy(id);
    assert.ok(!existsSync(join(tmp, 'state', 'sandboxes', id)));
    const netns = await run('ip', ['netns', 'list'], { timeoutMs: 5000 });
    assert.ok(!netns.stdout.includes(net.netns), 'netns removed');
    const link = await run('ip', ['link', 'show', net.hostInterface], {
      timeoutMs: 5000,
      okExitCodes: [0, 1],
    });
    assert.notEqual(link.exitCode, 0, 'host veth removed');
    assert.ok(
      !existsSync(`/sys/fs/cgroup/memory${cg}`) && !existsSync(`/sys/fs/cgroup${cg}`),
      'cgroup removed',
    );
    assert.ok(!existsSync(`/proc/${collector.pid}`), 'log collector ended');
    assert.equal(await findSlot('/var/lib/dormant-net', id), undefined, 'address released');
    await assert.rejects(rt.state(id), (e) => isDormantError(e, ErrorCode.RUNTIME_SANDBOX_NOT_FOUND));
  });

  test('a declared device node (how a GPU is given) is created inside and usable', async () => {
    const id = `dev-${suffix}`;
    // A stand-in for /dev/nvidia0: the null device, 1:3, under a GPU-like name.
    await rt.create({
      id,
      rootfs,
      args: ['sleep', '300'],
      devices: [{ path: '/dev/gpu-standin0', major: 1, minor: 3 }],
    });
    await rt.start(id);
    try {
      const r = await rt.exec(id, [
        'sh',
        '-c',
        'echo data > /dev/gpu-standin0 && echo written; ls -l /dev/gpu-standin0',
      ]);
      assert.equal(r.exitCode, 0, r.stderr);
      assert.match(r.stdout, /^written\n/);
      assert.match(r.stdout, /^c.* 1,\s+3 .*\/dev\/gpu-standin0$/m, 'a character device 1:3');
    } finally {
      await rt.destroy(id);
    }
  });

  test('an HTTP server keeps its memory across checkpoint and restore; logs carry on', async () => {
    const id = `http-${suffix}`;
    await rt.create({
      id,
      rootfs,
      args: ['/usr/bin/python3', '-u', '/srv/server.py'],
      ports: [8080],
      readonlyBinds: [{ source: '/usr', destination: '/usr' }],
      limits: { memoryBytes: 256 * 1024 * 1024 },
    });
    await rt.start(id);
    const { network } = await rt.state(id);
    const url = `http://${network.address}:8080/`;
    await waitFor('the server', () => get(url, 500), 20_000);
    assert.equal(await get(url), '2');
    assert.equal(await get(url), '3');

    // Only declared ports are reachable from the host.
    await assert.rejects(get(`http://${network.address}:8081/`, 500), 'port 8081 was not declared');

    // A failed checkpoint leaves the sandbox running: CRIU runs out of space in a staging
    // folder that is too small for the dump (a full tmpfs, as a real node can have).
    const tiny = join(tmp, 'tiny');
    await mkdir(tiny);
    await run('mount', ['-t', 'tmpfs', '-o', 'size=1m', 'tmpfs', tiny], { timeoutMs: 5000 });
    try {
      await assert.rejects(
        rt.checkpoint(id, { imagesDir: join(tiny, 'images'), workDir: join(tmp, 'bad-work') }),
        (e) => isDormantError(e, ErrorCode.RUNTIME_CHECKPOINT_FAILED) && /running/.test(e.message),
        'the dump must fail',
      );
    } finally {
      await run('umount', [tiny], { timeoutMs: 5000 });
    }
    assert.equal((await rt.state(id)).status, 'running');
    assert.equal(await get(url), '4', 'still serving, memory intact');

    // An established connection does not block the checkpoint: it is dumped closed.
    const held = connect(8080, network.address);
    await new Promise<void>((resolve, reject) => held.once('connect', resolve).once('error', reject));
    held.on('error', () => undefined);

    const imagesDir = join(shm, 'images');
    const ckpt = await rt.checkpoint(id, { imagesDir, workDir: join(tmp, 'work') });
    assert.ok(ckpt.durationMs > 0);
    assert.equal((await rt.state(id)).status, 'absent', 'the container is gone');
    assert.equal(await rt.rootfsMounted(id), false, 'the writable layer is at rest');
    await assert.rejects(get(url, 500), 'nothing answers while hibernated');
    held.destroy();

    // The collector may be gone by restore time (a reboot): a new pipe takes the old one's place.
    // So may its network namespace (it lives on /run): restore makes both again, with the
    // same address, as after a reboot of the node.
    await stopCollector(join(tmp, 'state', 'sandboxes', id, 'log'));
    await tearDownNetwork(network, { markerPath: join(tmp, 'state', 'sandboxes', id, 'network.done') });
    const restored = await rt.restore(id, { imagesDir, workDir: join(tmp, 'work-restore') });
    assert.ok(restored.pid > 0);
    assert.equal((await rt.state(id)).status, 'running');
    assert.equal(await get(url), '5', 'the counter carries on');
    assert.match((await rt.exec(id, ['cat', '/proc/1/cmdline'])).stdout, /python3/, 'same pid 1 inside');

    // Checkpoint with leaveRunning, then the same server keeps answering.
    await rt.checkpoint(id, {
      imagesDir: join(shm, 'images2'),
      workDir: join(tmp, 'work2'),
      leaveRunning: true,
    });
    assert.equal(await get(url), '6');

    const log = await waitFor('output after restore', async () => {
      const text = await readFile(rt.logPath(id), 'utf8');
      return text.includes('request 6') ? text : undefined;
    });
    assert.match(log, /server up/);
    assert.match(log, /request 3\n/);
    assert.match(log, /request 5\n/);

    await rt.destroy(id);
  });
  test('a connection still waiting to be accepted does not fail a checkpoint: it is left out of the dump, the sandbox runs on', async () => {
    // A server that listens and never accepts: the host's connection completes in the kernel
    // and waits in the accept queue, as a client that arrives while a sandbox is dumped does.
    const id = `inflight-${suffix}`;
    await rt.create({
      id,
      rootfs,
      args: [
        '/usr/bin/python3',
        '-u',
        '-c',
        'import socket, time\ns = socket.socket()\ns.bind(("0.0.0.0", 8080))\ns.listen(8)\nwhile True: time.sleep(60)',
      ],
      ports: [8080],
      readonlyBinds: [{ source: '/usr', destination: '/usr' }],
    });
    await rt.start(id);
    const { network } = await rt.state(id);
    const waiting = await waitFor(
      'the listener',
      () =>
        new Promise<ReturnType<typeof connect> | undefined>((resolve) => {
          const c = connect(8080, network.address);
          c.once('connect', () => resolve(c));
          c.once('error', () => resolve(undefined));
        }),
      20_000,
    );
    waiting.on('error', () => undefined);
    try {
      const ck = await rt.checkpoint(id, {
        imagesDir: join(shm, 'inflight'),
        workDir: join(tmp, 'work-inflight'),
        leaveRunning: true,
      });
      assert.ok(ck.durationMs > 0);
      assert.equal((await rt.state(id)).status, 'running');
    } finally {
      waiting.destroy();
      await rt.destroy(id);
    }
  });

  test("the daemon's hibernate path (freeze, dump leaving it in place, stop) and a fork", async () => {
    const spec = {
      id: `hib-${suffix}`,
      rootfs,
      args: ['/usr/bin/python3', '-u', '/srv/server.py'],
      ports: [8080],
      readonlyBinds: [{ source: '/usr', destination: '/usr' }],
    };
    await rt.create(spec);
    await rt.start(spec.id);
    const url = `http://${(await rt.state(spec.id)).network.address}:8080/`;
    await waitFor('the server', () => get(url, 500), 20_000);
    // A background process started by exec, with its output redirected, returns at once.
    const bg = await rt.exec(spec.id, ['sh', '-c', 'echo kept > /data.txt; sleep 600 >/dev/null 2>&1 &'], {
      timeoutMs: 5000,
    });
    assert.equal(bg.exitCode, 0);

    await rt.freeze(spec.id);
    const imagesDir = join(shm, 'hib');
    await rt.checkpoint(spec.id, { imagesDir, workDir: join(tmp, 'hib-work'), leaveRunning: true });
    assert.equal((await rt.state(spec.id)).status, 'paused', 'left in place, still frozen');
    await rt.stop(spec.id);
    assert.equal((await rt.state(spec.id)).status, 'absent');
    const cg = rt.cgroupPath(spec.id);
    assert.ok(
      !existsSync(`/sys/fs/cgroup/memory${cg}`) && !existsSync(`/sys/fs/cgroup${cg}`),
      'while hibernated no cgroup (and so no memory) is held',
    );
    assert.equal(await rt.rootfsMounted(spec.id), false);

    // What a hibernated sandbox refuses, by code.
    await assert.rejects(rt.exec(spec.id, ['true']), (e) =>
      isDormantError(e, ErrorCode.RUNTIME_INVALID_STATE),
    );
    await assert.rejects(rt.prepare({ ...spec, ports: [9999] }), (e) =>
      isDormantError(e, ErrorCode.RUNTIME_SANDBOX_EXISTS),
    );
    // A failed restore (here: images that are not there) says so and leaves nothing half-made.
    await assert.rejects(
      rt.restore(spec.id, { imagesDir: join(shm, 'missing'), workDir: join(tmp, 'hib-missing') }),
      (e) => isDormantError(e, ErrorCode.RUNTIME_RESTORE_FAILED),
    );
    assert.equal((await rt.state(spec.id)).status, 'absent');

    await rt.prepare(spec);
    await rt.restore(spec.id, { imagesDir, workDir: join(tmp, 'hib-restore') });
    await assert.rejects(rt.restore(spec.id, { imagesDir, workDir: join(tmp, 'hib-again') }), (e) =>
      isDormantError(e, ErrorCode.RUNTIME_INVALID_STATE),
    );
    assert.equal((await rt.state(spec.id)).status, 'running', 'restored running, not frozen');
    assert.equal(await get(url), '2');
    await waitFor('output through the same collector after restore', async () =>
      (await readFile(rt.logPath(spec.id), 'utf8')).includes('request 2\n') ? true : undefined,
    );
    assert.match(
      (await rt.exec(spec.id, ['pidof', 'sleep'])).stdout,
      /^\d+\n$/,
      'the background child is back',
    );

    // A fork: the same images restored into a second sandbox with its own address,
    // hostname and writable layer (the daemon copies the filesystem diff in first).
    const fork = { ...spec, id: `fork-${suffix}` };
    await rt.prepare(fork);
    await rt.stop(fork.id);
    await cp(rt.upperDir(spec.id), rt.upperDir(fork.id), { recursive: true });
    // Restored lazily: the pages come in behind the running process (userfaultfd).
    const lazy = await rt.restore(fork.id, {
      imagesDir,
      workDir: join(tmp, 'fork-restore'),
      lazyPages: true,
    });
    const forkNet = (await rt.state(fork.id)).network;
    assert.notEqual(forkNet.address, (await rt.state(spec.id)).network.address);
    const forkUrl = `http://${forkNet.address}:8080/`;
    assert.equal(await get(forkUrl), '2', 'the fork starts from the checkpoint');
    await lazy.pagesLoaded;
    assert.equal(await get(url), '3', 'the original carries on independently');
    assert.equal((await rt.exec(fork.id, ['hostname'])).stdout.trim(), fork.id);
    assert.equal((await rt.exec(fork.id, ['cat', '/data.txt'])).stdout, 'kept\n');

    await rt.destroy(fork.id);
    await rt.destroy(spec.id);
  });
});
