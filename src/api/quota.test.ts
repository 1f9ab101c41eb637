/**
 * The disk quota through the real daemon (HTTP API, SQLite, vault, runc, CRIU): a sandbox
 * created with `disk: 64M` cannot write past it, keeps what it wrote within it across
 * hibernate and resume, fork, archive, a daemon restart and a lost mount (a reboot), and rm
 * leaves no loop device or mount behind.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { type Daemon } from '../daemon/daemon.js';
import { DormantApiError, DormantClient, type SandboxInfo } from '../sdk/client.js';
import { startTestDaemon, tearDown, testFolder } from './testing/daemon.js';
import { layerHostBytes, layerImage, layerMountPoint } from '../runtime/quota.js';
import { run } from '../sys/exec.js';
import { cannotRun, loopsLeft, loopsUnder, mountsUnder } from '../runtime/testing/host.js';

const MIB = 1024 * 1024;
const QUOTA = 64 * MIB;
const skip = await cannotRun('mkfs.ext4');

describe('disk quota through the daemon', { skip }, () => {
  let dir: string;
  let rootfs: string;
  let daemon: Daemon;
  let client: DormantClient;
  let sb: SandboxInfo;
  let kept: string;
  const secret = `QUOTA-SECRET-${randomBytes(12).toString('hex')}`;

  const start = async (): Promise<void> => {
    ({ daemon, client } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      readonlyBinds: [],
      proxy: false,
      policy: false,
    }));
  };
  const sandboxDir = (id: string) => join(dir, 'data', 'runtime', 'sandboxes', id);

  /** 100 MiB into a 64 MiB quota: refused inside, and the host holds at most the quota. */
  const overfill = async (id: string, when: string): Promise<void> => {
    const r = await client.exec(id, ['dd', 'if=/dev/zero', 'of=/big', 'bs=1M', 'count=100'], {
      timeoutMs: 60_000,
    });
    assert.notEqual(r.exitCode, 0, `${when}: 100 MiB fit in a 64 MiB quota`);
    assert.match(r.stderr, /No space left|quota/i, when);
    const host = await layerHostBytes(sandboxDir(id));
    assert.ok(host > 0 && host <= QUOTA, `${when}: the layer takes ${host} bytes of the host disk`);
    assert.equal((await client.exec(id, ['rm', '/big'])).exitCode, 0);
  };
  const md5 = async (id: string): Promise<string> => (await client.exec(id, ['md5sum', '/kept'])).stdout;

  before(async () => {
    ({ dir, rootfs } = await testFolder('quota'));
    await start();
  });

  after(() => tearDown(dir, daemon));

  test('a quota out of range is a 400 before anything is made', async () => {
    const e = await client.createSandbox({ rootfs, command: ['true'], disk: '1M' }).then(
      () => undefined,
      (err: unknown) => err,
    );
    assert.ok(e instanceof DormantApiError, String(e));
    assert.equal(e.status, 400);
    assert.equal(e.code, 'INVALID_ARGUMENT');
    assert.match(e.message, /disk quota/);
    assert.deepEqual(await client.listSandboxes(), []);
  });

  test('create --disk 64M: writes past it fail inside with ENOSPC, the host holds at most 64 MiB', async () => {
    sb = await client.createSandbox({
      rootfs,
      command: ['sh', '-c', 'while true; do sleep 1; done'],
      disk: '64M',
    });
    assert.equal(sb.state, 'running');
    assert.equal(sb.diskLimitBytes, QUOTA);
    await overfill(sb.id, 'created');
    const w = await client.exec(sb.id, [
      'sh',
      '-c',
      `head -c 8388608 /dev/urandom > /kept && echo ${secret} > /secret.txt && sync`,
    ]);
    assert.equal(w.exitCode, 0, w.stderr);
    kept = await md5(sb.id);
  });

  test('hibernate: the layer is emptied off the host disk; resume: the files are back and the quota holds', async () => {
    await client.hibernate(sb.id);
    const image = layerImage(sandboxDir(sb.id));
    const asleep = await layerHostBytes(sandboxDir(sb.id));
    assert.ok(asleep < 8 * MIB, `a sleeping sandbox's image takes ${asleep} bytes of the host disk`);
    assert.ok(!(await readFile(image)).includes(secret), 'its files are in the vault, not in the image');
    await client.resume(sb.id);
    assert.equal(await md5(sb.id), kept);
    assert.equal((await client.exec(sb.id, ['cat', '/secret.txt'])).stdout, `${secret}\n`);
    await overfill(sb.id, 'resumed');
  });

  test('a fork gets the same quota and the files; archive and resume keep them', async () => {
    const fork = await client.fork(sb.id);
    assert.equal(fork.diskLimitBytes, QUOTA);
    assert.equal(await md5(fork.id), kept);
    await overfill(fork.id, 'fork');
    await client.remove(fork.id);
    assert.deepEqual(await loopsLeft(sandboxDir(fork.id), 20_000), []);

    assert.equal((await client.archive(sb.id)).state, 'archived');
    assert.equal((await client.resume(sb.id)).state, 'running');
    assert.equal(await md5(sb.id), kept);
    await overfill(sb.id, 'after archive');
  });

  test('a restarted daemon, and one whose node lost the mount (a reboot), keep the layer and its quota', async () => {
    await daemon.close();
    await start();
    assert.equal((await client.getSandbox(sb.id)).state, 'running');
    assert.equal(await md5(sb.id), kept);

    await client.hibernate(sb.id);
    await daemon.close();
    assert.deepEqual(
      (await mountsUnder(sandboxDir(sb.id))).map((l) => l.split(' ')[4]),
      [layerMountPoint(sandboxDir(sb.id))],
      'a hibernated sandbox: its image mounted once, nothing else',
    );
    // What a reboot does to it: the image is no longer mounted.
    await run('umount', [layerMountPoint(sandboxDir(sb.id))], { timeoutMs: 10_000 });
    assert.deepEqual(await loopsLeft(sandboxDir(sb.id), 20_000), []);
    await start();
    assert.equal((await client.resume(sb.id)).state, 'running');
    assert.equal(await md5(sb.id), kept);
    await overfill(sb.id, 'after the remount');
  });

  test('rm: no loop device, no mount, no image left', async () => {
    const sdir = sandboxDir(sb.id);
    assert.equal((await loopsUnder(sdir)).length, 1);
    await client.remove(sb.id);
    assert.deepEqual(await loopsLeft(sdir, 20_000), []);
    assert.deepEqual(await mountsUnder(sdir), []);
    assert.ok(!existsSync(sdir));
  });
});
