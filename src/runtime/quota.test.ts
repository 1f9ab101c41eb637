/**
 * What a sandbox sees of the host, and its disk quota, against the real runc and CRIU of this
 * machine: its own cgroup namespace (/proc/self/cgroup shows `/`), a mount table without the
 * host's folders, and a writable layer that ends at its quota, across checkpoint and restore,
 * with nothing (mount, loop device) left behind by destroy.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { readlink } from 'node:fs/promises';
import { basename, join } from 'node:path';
import { cgroupUsage } from '../sys/cgroup.js';
import { layerHostBytes, layerImage } from './quota.js';
import { RuncRuntime } from './runc.js';
import {
  cannotRun,
  CRIU,
  loopsLeft,
  loopsUnder,
  mountsUnder,
  removeRuntimeFolders,
  runtimeFolders,
  type RuntimeFolders,
} from './testing/host.js';

const MIB = 1024 * 1024;
const skip = await cannotRun('criu', 'mkfs.ext4');

describe('what a sandbox sees of the host, and its disk quota (real runc + CRIU)', { skip }, () => {
  let tmp: string;
  let shm: string;
  let rootfs: string;
  let rt: RuncRuntime;
  const suffix = randomBytes(3).toString('hex');

  let folders: RuntimeFolders;

  before(async () => {
    // Distinctive names, to look for inside the sandbox.
    folders = await runtimeFolders('hostview', {}, `rootfs-${suffix}`);
    ({ tmp, shm, rootfs } = folders);
    rt = new RuncRuntime({ stateDir: join(tmp, 'state'), criuPath: CRIU });
  });

  after(() => removeRuntimeFolders(folders, [rt]));

  test('inside: /proc/self/cgroup ends in /, mountinfo names no host folder; the host still reads the cgroup; so after checkpoint and restore', async () => {
    const id = `view-${suffix}`;
    const spec = {
      id,
      rootfs,
      args: ['sh', '-c', 'while true; do sleep 1; done'],
      limits: { memoryBytes: 64 * MIB, diskBytes: 64 * MIB },
      readonlyBinds: [{ source: '/usr', destination: '/usr' }],
    };
    await rt.create(spec);
    await rt.start(id);
    const hostNames = [basename(tmp), `rootfs-${suffix}`, 'sandboxes', rt.cgroupPath(id)];

    const look = async (when: string): Promise<void> => {
      const cgroup = (await rt.exec(id, ['cat', '/proc/self/cgroup', '/proc/1/cgroup'])).stdout;
      const lines = cgroup.split('\n').filter((l) => l !== '');
      assert.ok(lines.length > 0);
      for (const l of lines)
        assert.match(l, /^\d+:[^:]*:\/$/, `${when}: a cgroup line names a host path: ${l}`);
      const mounts = (await rt.exec(id, ['cat', '/proc/self/mountinfo', '/proc/1/mountinfo'])).stdout;
      for (const name of hostNames)
        assert.ok(!mounts.includes(name), `${when}: the mount table names ${name}:\n${mounts}`);
      const root = mounts.split('\n').find((l) => l.split(' ')[4] === '/');
      assert.match(root ?? '', /lowerdir=lower,upperdir=upper,workdir=work/, `${when}: ${root}`);
      // A loop device's backing file would name the disk image's host path.
      const backing = await rt.exec(id, ['sh', '-c', 'cat /sys/block/*/loop/backing_file 2>/dev/null; true']);
      assert.ok(!backing.stdout.includes(basename(tmp)), `${when}: backing_file shows ${backing.stdout}`);
      // Its own cgroup namespace: pid 1's is not the host's.
      const pid = (await rt.state(id)).pid!;
      assert.notEqual(await readlink(`/proc/${pid}/ns/cgroup`), await readlink('/proc/self/ns/cgroup'));
      // The host reads the sandbox's usage from its cgroup as before.
      const usage = await cgroupUsage(rt.cgroupPath(id));
      assert.ok(usage !== undefined && usage.memoryBytes > 0, `${when}: usage ${JSON.stringify(usage)}`);
    };
    await look('created');

    await rt.freeze(id);
    const imagesDir = join(shm, 'view');
    await rt.checkpoint(id, { imagesDir, workDir: join(tmp, 'view-dump') });
    assert.equal((await rt.state(id)).status, 'absent');
    await rt.prepare(spec, { mountRootfs: false });
    await rt.restore(id, { imagesDir, workDir: join(tmp, 'view-restore') });
    assert.equal((await rt.state(id)).status, 'running');
    await look('restored');
    await rt.destroy(id);
  });

  test('a write past the quota fails inside with ENOSPC and stays off the host disk; files within it survive checkpoint and restore; destroy leaves no loop device or mount', async () => {
    const id = `quota-${suffix}`;
    const quota = 64 * MIB;
    const spec = {
      id,
      rootfs,
      args: ['sh', '-c', 'while true; do sleep 1; done'],
      limits: { diskBytes: quota },
    };
    await rt.create(spec);
    await rt.start(id);
    const dir = join(tmp, 'state', 'sandboxes', id);

    const fill = async (when: string): Promise<void> => {
      const r = await rt.exec(id, ['dd', 'if=/dev/zero', 'of=/big', 'bs=1M', 'count=100'], {
        timeoutMs: 60_000,
      });
      assert.notEqual(r.exitCode, 0, `${when}: 100 MiB fit in a 64 MiB quota: ${r.stderr}`);
      assert.match(r.stderr, /No space left|quota/i, when);
      const host = await layerHostBytes(dir);
      assert.ok(host > 0 && host <= quota, `${when}: the layer takes ${host} bytes of the host disk`);
      await rt.exec(id, ['rm', '/big']);
    };
    await fill('created');
    const kept = await rt.exec(id, [
      'sh',
      '-c',
      'head -c 8388608 /dev/urandom > /kept && sync && md5sum /kept',
    ]);
    assert.equal(kept.exitCode, 0, kept.stderr);

    await rt.freeze(id);
    const imagesDir = join(shm, 'quota');
    await rt.checkpoint(id, { imagesDir, workDir: join(tmp, 'quota-dump') });
    await rt.prepare(spec, { mountRootfs: false });
    await rt.restore(id, { imagesDir, workDir: join(tmp, 'quota-restore') });
    assert.equal((await rt.exec(id, ['md5sum', '/kept'])).stdout, kept.stdout, 'the file came back whole');
    await fill('restored');

    assert.ok(existsSync(layerImage(dir)));
    assert.equal((await loopsUnder(dir)).length, 1, 'one loop device while it exists');
    await rt.destroy(id);
    assert.deepEqual(await loopsLeft(dir, 5000), [], 'no loop device left');
    assert.deepEqual(await mountsUnder(dir), [], 'no mount left');
    assert.ok(!existsSync(dir));
  });

  test('a quota out of range is refused before anything is made', async () => {
    await assert.rejects(
      rt.create({ id: `small-${suffix}`, rootfs, args: ['true'], limits: { diskBytes: MIB } }),
      /disk quota must be/,
    );
    assert.ok(!existsSync(join(tmp, 'state', 'sandboxes', `small-${suffix}`)));
  });
});
