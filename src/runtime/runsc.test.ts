/**
 * RunscRuntime against the real runsc (gVisor) of this machine, on a busybox root filesystem
 * built here. Skipped (with the reason) where runsc or root is missing.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { readFile, readdir } from 'node:fs/promises';
import { request } from 'node:http';
import { createServer, type AddressInfo } from 'node:net';
import { join } from 'node:path';
import { ErrorCode, isDormantError } from '../domain/errors.js';
import { run, which } from '../sys/exec.js';
import { RunscRuntime } from './runsc.js';
import { inboundChain } from './runsc-inbound.js';
import {
  cannotRun,
  mountsUnder,
  removeRuntimeFolders,
  runtimeFolders,
  type RuntimeFolders,
  waitFor,
} from './testing/host.js';

const skip =
  (await cannotRun()) ||
  ((await which('runsc')) === undefined ? 'runsc not installed (scripts/setup.sh)' : false);

// The counter is replaced by a rename, never seen empty: `echo $i > /counter` truncates before
// it writes, and a read in between (the slow system calls of gVisor's ptrace platform widen
// it) finds nothing.
const TICKER =
  'i=0; while true; do i=$((i+1)); echo $i > /counter.new; mv /counter.new /counter; echo tick $i; sleep 0.1; done';

/** runsc's host processes (sentry, gofer) whose command line names `needle`. */
async function runscProcesses(needle: string): Promise<string[]> {
  const out: string[] = [];
  for (const pid of (await readdir('/proc')).filter((p) => /^\d+$/.test(p))) {
    const cmd = await readFile(`/proc/${pid}/cmdline`, 'utf8').catch(() => '');
    if (cmd.includes('runsc') && cmd.includes(needle))
      out.push(`${pid}: ${cmd.replaceAll('\0', ' ').slice(0, 160)}`);
  }
  return out;
}

/** Host processes whose command line names `needle`. */
async function processesOf(needle: string): Promise<string[]> {
  const out: string[] = [];
  for (const pid of (await readdir('/proc')).filter((p) => /^\d+$/.test(p))) {
    const cmd = await readFile(`/proc/${pid}/cmdline`, 'utf8').catch(() => '');
    if (cmd.includes(needle)) out.push(pid);
  }
  return out;
}

/** GET / of httpd at `address`, on a connection of its own ('timeout' after 3 s unanswered). */
function get(address: string, port = 8080): Promise<string> {
  return new Promise((resolve, reject) => {
    const req = request({ host: address, port, path: '/', agent: false, timeout: 3000 }, (res) => {
      let body = '';
      res.setEncoding('utf8');
      res.on('data', (c: string) => (body += c));
      res.on('end', () => resolve(body));
    });
    req.on('timeout', () => req.destroy(new Error('timeout')));
    req.on('error', reject);
    req.end();
  });
}

describe('RunscRuntime (real runsc)', { skip }, () => {
  let folders: RuntimeFolders;
  let rt: RunscRuntime;
  const suffix = randomBytes(3).toString('hex');

  before(async () => {
    folders = await runtimeFolders('rsc');
    rt = new RunscRuntime({ stateDir: join(folders.tmp, 'state') });
  });

  after(() => removeRuntimeFolders(folders, [rt]));

  test("gVisor's kernel, exec, logs, writes in the layer, pause, checkpoint and restore with memory intact, destroy leaves nothing", async () => {
    const id = `gv-${suffix}`;
    const counter = async (): Promise<number> =>
      Number(await readFile(join(rt.upperDir(id), 'counter'), 'utf8'));
    await rt.create({
      id,
      rootfs: folders.rootfs,
      args: ['sh', '-c', TICKER],
      hostname: 'gv-box',
      limits: { memoryBytes: 256 << 20, pids: 512 },
    });
    await rt.start(id);
    assert.equal((await rt.state(id)).status, 'running');

    // The kernel the sandbox sees is gVisor's, not the host's.
    const version = await rt.exec(id, ['cat', '/proc/version']);
    assert.equal(version.exitCode, 0);
    const host = await readFile('/proc/version', 'utf8');
    assert.notEqual(version.stdout, host);
    const dmesg = await rt.exec(id, ['dmesg']);
    assert.match(dmesg.stdout, /gVisor/, "dmesg is the sentry's");

    // exec: output, exit code, environment and working directory; hostname; its own eth0.
    const r = await rt.exec(id, ['sh', '-c', 'echo out; echo err >&2; exit 7']);
    assert.deepEqual([r.stdout, r.stderr, r.exitCode], ['out\n', 'err\n', 7]);
    const env = await rt.exec(id, ['sh', '-c', 'echo $GREETING; pwd'], {
      env: { GREETING: 'hi' },
      cwd: '/tmp',
    });
    assert.equal(env.stdout, 'hi\n/tmp\n');
    assert.equal((await rt.exec(id, ['hostname'])).stdout.trim(), 'gv-box');
    const address = (await rt.state(id)).network.address;
    assert.match(
      (await rt.exec(id, ['ip', 'addr', 'show', 'eth0'])).stdout,
      new RegExp(`inet ${address.replaceAll('.', '\\.')}/`),
    );

    // Output reaches the host-side log; writes land in the writable layer.
    await waitFor('ticks in the log', async () =>
      (await readFile(rt.logPath(id), 'utf8')).includes('tick 3') ? true : undefined,
    );
    assert.ok((await counter()) >= 3);

    // pause: the counter stops; exec is refused; thaw: it moves again.
    await rt.freeze(id);
    assert.equal((await rt.state(id)).status, 'paused');
    const frozenAt = await counter();
    await new Promise((r) => setTimeout(r, 400));
    assert.equal(await counter(), frozenAt, 'no progress while paused');
    await assert.rejects(rt.exec(id, ['true']), (e) => isDormantError(e, ErrorCode.RUNTIME_INVALID_STATE));
    await rt.thaw(id);
    await waitFor('the counter to move', async () => ((await counter()) > frozenAt ? true : undefined));

    // A checkpoint that leaves it running (what hibernate and fork take): it reads as paused,
    // its files still; a thaw brings it back from the state file with its memory.
    await rt.freeze(id);
    const images = join(folders.shm, 'images');
    await rt.checkpoint(id, { imagesDir: images, workDir: join(folders.shm, 'work'), leaveRunning: true });
    assert.ok((await readdir(images)).length > 0, 'a state file');
    assert.equal((await rt.state(id)).status, 'paused');
    const parkedAt = await counter();
    await new Promise((r) => setTimeout(r, 300));
    assert.equal(await counter(), parkedAt, 'no progress while parked');
    await rt.thaw(id);
    assert.equal((await rt.state(id)).status, 'running');
    await waitFor('the counter to carry on', async () => ((await counter()) > parkedAt ? true : undefined));
    // Through exec too (the restored sandbox's own view), asked once.
    const carried = Number((await rt.exec(id, ['cat', '/counter'])).stdout.trim());
    assert.ok(
      carried > parkedAt && carried < parkedAt + 100,
      `the counter carried on from ${parkedAt}: ${carried}`,
    );

    // A checkpoint that ends it, then a restore: the shell's variable (memory) carries on, not a restart.
    const before = await counter();
    const images2 = join(folders.shm, 'images2');
    await rt.checkpoint(id, { imagesDir: images2, workDir: join(folders.shm, 'work2') });
    assert.equal((await rt.state(id)).status, 'absent');
    assert.deepEqual(await runscProcesses(id), [], 'no runsc process of the sandbox while it sleeps');
    const restored = await rt.restore(id, { imagesDir: images2, workDir: join(folders.shm, 'work3') });
    assert.ok(restored.pid > 0);
    await waitFor('the counter past the checkpoint', async () =>
      (await counter()) > before ? true : undefined,
    );
    const log = await readFile(rt.logPath(id), 'utf8');
    assert.equal(log.match(/^tick 1$/gm)?.length, 1, 'the ticker never started over');

    // destroy leaves nothing: no runsc state, mounts, processes, network namespace.
    const net = (await rt.state(id)).network;
    const logDir = join(folders.tmp, 'state', 'sandboxes', id, 'log');
    await rt.destroy(id);
    assert.deepEqual(await rt.list(), []);
    assert.ok(!existsSync(join(folders.tmp, 'state', 'sandboxes', id)));
    const left = await readdir(join(folders.tmp, 'state', 'runsc')).catch(() => []);
    assert.deepEqual(
      left.filter((n) => n.includes(id)),
      [],
      'no runsc state',
    );
    assert.deepEqual(await mountsUnder(folders.tmp), []);
    assert.deepEqual(await runscProcesses(id), []);
    assert.deepEqual(await processesOf(logDir), [], 'no log collector');
    const netns = await run('ip', ['netns', 'list'], { timeoutMs: 5000 });
    assert.ok(!netns.stdout.includes(net.netns), 'netns removed');
  });

  test('listening is read inside; only declared ports are reachable, from the host only; a checkpoint with a connection closing is refused, the sandbox left running', async () => {
    const id = `gv-net-${suffix}`;
    const other = `gv-oth-${suffix}`;
    const hostServer = createServer((c) => c.end('host\n'));
    await new Promise<void>((r) => hostServer.listen(0, '0.0.0.0', r));
    const hostPort = (hostServer.address() as AddressInfo).port;
    await rt.create({
      id,
      rootfs: folders.rootfs,
      // 8080 declared; 9090 listens too, undeclared.
      args: [
        'sh',
        '-c',
        'mkdir -p /www && echo hello > /www/index.html && httpd -p 9090 -h /www && exec httpd -f -p 8080 -h /www',
      ],
      ports: [8080],
      limits: { memoryBytes: 256 << 20, pids: 512 },
    });
    await rt.create({
      id: other,
      rootfs: folders.rootfs,
      args: ['sleep', '3600'],
      limits: { memoryBytes: 128 << 20, pids: 512 },
    });
    try {
      await rt.start(id);
      await rt.start(other);
      const net = (await rt.state(id)).network;
      const { address } = net;
      // The host's tables of the sentry's namespace show no listener; gVisor's own do.
      await waitFor('httpd to listen', async () => ((await rt.listening(id, 8080)) ? true : undefined));
      assert.equal(await rt.listening(id, 9090), true);
      assert.equal(await rt.listening(id, 8081), false);

      // The namespace's firewall does not see gVisor's packets: the host side's does. From the
      // host, the declared port only; from a sandbox, neither the host nor another sandbox.
      assert.equal(
        await get(address, 9090).catch((e: unknown) => (e as Error).message),
        'timeout',
        'undeclared port',
      );
      const nc = async (box: string, host: string, port: number): Promise<number> =>
        (await rt.exec(box, ['nc', '-w', '2', host, String(port)], { input: '' })).exitCode;
      assert.equal(await nc(id, '127.0.0.1', 9090), 0, 'nc works (its own loopback)');
      assert.notEqual(await nc(id, net.hostAddress, hostPort), 0, 'the host, at its gateway');
      assert.notEqual(await nc(other, address, 8080), 0, "another sandbox's declared port");

      // One request served and closed by httpd: its side waits in TIME_WAIT, which gVisor
      // cannot save. The checkpoint is refused before anything changes, naming the connection.
      assert.equal(await get(address), 'hello\n');
      await rt.freeze(id);
      await assert.rejects(
        rt.checkpoint(id, {
          imagesDir: join(folders.shm, 'net-images'),
          workDir: join(folders.shm, 'net-work'),
          leaveRunning: true,
        }),
        (e) =>
          isDormantError(e, ErrorCode.RUNTIME_CHECKPOINT_FAILED) &&
          e.message.includes(`${address}:8080`) &&
          /TIME_WAIT/.test(e.message) &&
          /left paused/.test(e.message),
      );
      assert.equal((await rt.state(id)).status, 'paused');
      await rt.thaw(id);
      assert.equal(await get(address), 'hello\n', 'it still serves');
      await rt.destroy(id);
      const rules = await run('iptables', ['-w', '-S'], { timeoutMs: 10_000 });
      assert.ok(!rules.stdout.includes(inboundChain(net)), 'its host-side chain goes with it');
    } finally {
      hostServer.close();
      await rt.destroy(id);
      await rt.destroy(other);
    }
  });

  test('no toolbox agent under gVisor: a clear error', async () => {
    await assert.rejects(rt.ensureAgent('any'), /gVisor/);
  });
});
