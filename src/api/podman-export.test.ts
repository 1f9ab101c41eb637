/**
 * A dormant sandbox carried over to podman: a busybox counter hibernates, `dormant checkpoint
 * export` writes podman's layout, and bookworm's podman 4.3 restores it with
 * `podman container restore --import`. The counter goes on from where it was in the shell's
 * memory (a restarted shell would wait for a file the first one read and removed), and the
 * container's network is the one podman made for it: loopback only.
 *
 * Needs podman (scripts/setup.sh installs it) running containers with runc; skipped without.
 * The sandbox has no user namespace: podman restores only dumps taken in the host's. The base
 * image is imported into podman first (podman's restore finds the image by config.dump's name
 * and id). The container and the image have names of their own and are removed afterwards;
 * removing the container removes the network namespace podman made.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { mkdtemp, readFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { Daemon } from '../daemon/daemon.js';
import type { DormantClient } from '../sdk/client.js';
import { run } from '../sys/exec.js';
import { startTestDaemon, tearDown } from './testing/daemon.js';
import { eventually } from './testing/host.js';
import { busyboxImage, installed, podman } from './testing/podman.js';

const BIN = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'bin', 'dormant');

const hasPodman = await installed('podman');

/**
 * pid 1 waits for /tok, keeps its contents in memory only (the file is removed), then counts
 * into /count. A shell started again finds no /tok and never writes /count.
 */
const COUNTER =
  'while [ ! -f /tok ]; do sleep 0.1; done; tok=$(cat /tok); rm /tok; ' +
  'i=0; while :; do i=$((i+1)); echo "$tok $i" > /count; sleep 0.2; done';

describe('dormant exports for podman', { skip: hasPodman ? false : 'podman is not installed' }, () => {
  const tag = randomBytes(4).toString('hex');
  const image = `localhost/dormant-export-test-${tag}:latest`;
  const container = `dormant-export-test-${tag}`;
  let dir: string;
  let layout: string;
  let daemon: Daemon;
  let client: DormantClient;

  before(async () => {
    dir = await mkdtemp('/tmp/dormant-podman-export-');
    layout = await busyboxImage(dir, image);
    ({ daemon, client } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      proxy: false,
      policy: false,
      allowedSourceRoots: [dir],
      // podman cannot restore a dump taken in a user namespace of the sandbox's own.
      userNamespace: false,
    }));
  });

  after(async () => {
    await podman(['rm', '-f', container]).catch(() => undefined);
    await podman(['rmi', '-f', image]).catch(() => undefined);
    await tearDown(dir, daemon);
  });

  test('a hibernated sandbox exported in podman layout restores under podman: the counter goes on in its memory, on loopback only', async () => {
    const sb = await client.createSandbox({ name: 'counter', image: layout, command: ['sh', '-c', COUNTER] });
    const token = randomBytes(6).toString('hex');
    await client.exec(sb.id, ['sh', '-c', `echo ${token} > /tok`]);
    const inSandbox = async () => (await client.exec(sb.id, ['cat', '/count'])).stdout.trim().split(' ');
    await eventually('the counter runs', async () => assert.ok(Number((await inSandbox())[1]) >= 3));
    const before = Number((await inSandbox())[1]);
    const h = await client.hibernate(sb.id);
    assert.ok(h.checkpointId);

    const archive = join(dir, 'counter.tar.zst');
    await run(
      process.execPath,
      [BIN, 'checkpoint', 'export', h.checkpointId, '--out', archive, '--allow-plaintext', '--json'],
      {
        timeoutMs: 120_000,
        env: { ...process.env, DORMANT_URL: daemon.url, DORMANT_TOKEN: daemon.adminToken, NO_COLOR: '1' },
      },
    );

    await podman([
      'container',
      'restore',
      '--import',
      archive,
      '--name',
      container,
      '--runtime',
      'runc',
    ]).catch(async (e: unknown) => {
      // CRIU's reason is in the restore log podman names, which goes with the container.
      const log = /log file: (\S+)/.exec(e instanceof Error ? e.message : String(e))?.[1];
      const why = log ? (await readFile(log, 'utf8').catch(() => '')).match(/^.*Error.*$/gm) : null;
      throw new Error(`podman's restore failed: ${(why ?? []).join('\n') || String(e)}`, { cause: e });
    });
    const inPodman = async () =>
      (await podman(['exec', container, 'cat', '/count'])).stdout.trim().split(' ');
    const [tok, at] = await inPodman();
    assert.equal(tok, token, "the shell's memory came back: the token it read before /tok was removed");
    assert.ok(Number(at) >= before, `the counter carried on (${at} after ${before} before the hibernate)`);
    await eventually('the counter goes on under podman', async () =>
      assert.ok(Number((await inPodman())[1]) > Number(at)),
    );
    const pid1 = (await podman(['exec', container, 'cat', '/proc/1/cmdline'])).stdout.split('\0');
    assert.deepEqual(pid1.slice(0, 2), ['sh', '-c'], "pid 1 is the sandbox's shell");
    // The network namespace podman made for it: loopback, nothing else.
    assert.deepEqual((await podman(['exec', container, 'ls', '/sys/class/net'])).stdout.trim().split(/\s+/), [
      'lo',
    ]);
    const netns = (
      await podman(['inspect', '--format', '{{.NetworkSettings.SandboxKey}}', container])
    ).stdout.trim();
    assert.ok(netns.startsWith('/run/netns/'), `podman made the network namespace (${netns})`);
    await podman(['rm', '-f', container]);
    assert.equal(existsSync(netns), false, 'removing the container removed its network namespace');
  });
});
