/**
 * A sandbox in a user namespace, against the real runc and CRIU: root inside is an unprivileged
 * host user (uid_map is not the identity), it cannot make a nested user namespace (seccomp),
 * what it writes is owned on the host by the mapped ids, and a checkpoint and restore (eager and
 * lazy) brings its memory back in the same user namespace.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { chmod, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { RuncRuntime } from './runc.js';
import {
  cannotRun,
  CRIU,
  removeRuntimeFolders,
  runtimeFolders,
  type RuntimeFolders,
} from './testing/host.js';
import { locateIdmapHelper } from './userns.js';

const skip =
  (await cannotRun('criu', 'python3')) ||
  ((await locateIdmapHelper()) === undefined && 'dormant-idmap-mount not built (npm run build)');

const MAP = { hostId: 100_000, size: 65_536 };

describe('a sandbox in a user namespace (real runc + CRIU)', { skip }, () => {
  let folders: RuntimeFolders;
  const runtimes: RuncRuntime[] = [];
  const suffix = randomBytes(3).toString('hex');

  before(async () => {
    folders = await runtimeFolders('userns');
    // The test's folder is 0700 (mkdtemp); the sandbox's mapped root must walk through it.
    await chmod(folders.tmp, 0o711);
  });

  after(() => removeRuntimeFolders(folders, runtimes));

  /** Waits until the sandbox's loop has written its state file once. */
  async function waitForState(rt: RuncRuntime, id: string): Promise<void> {
    for (let i = 0; i < 200; i++) {
      if ((await rt.exec(id, ['cat', '/tmp/state'])).exitCode === 0) return;
      await new Promise((r) => setTimeout(r, 50));
    }
    assert.fail(`sandbox ${id} never wrote /tmp/state`);
  }

  const spec = (id: string) => ({
    id,
    rootfs: folders.rootfs,
    // Memory only the running process holds: a counter, and a random value drawn at start.
    args: [
      'sh',
      '-c',
      'v=$(cat /proc/sys/kernel/random/uuid); n=0; while true; do n=$((n+1)); echo "$v $n" > /tmp/s.new; mv /tmp/s.new /tmp/state; sleep 0.05; done',
    ],
    readonlyBinds: [{ source: '/usr', destination: '/usr' }],
    limits: { memoryBytes: 128 * 1024 * 1024, pids: 64 },
  });

  test('root inside is a host nobody; files it writes are the mapped ids; hibernate/resume keeps it', async () => {
    const rt = new RuncRuntime({ stateDir: join(folders.tmp, 'state'), criuPath: CRIU, userNamespace: MAP });
    runtimes.push(rt);
    const id = `userns-${suffix}`;
    await rt.create(spec(id));
    await rt.start(id);
    const uidMap = (await rt.exec(id, ['cat', '/proc/self/uid_map'])).stdout.trim().split(/\s+/).map(Number);
    assert.deepEqual(uidMap, [0, MAP.hostId, MAP.size], 'root inside is host uid 100000');
    const pid = (await rt.state(id)).pid!;
    const hostStatus = (await import('node:fs/promises')).readFile(`/proc/${String(pid)}/status`, 'utf8');
    assert.match(await hostStatus, /^Uid:\s+100000\s+100000\s+100000\s+100000$/m, 'pid 1 on the host');

    const nested = await rt.exec(id, ['unshare', '-U', 'true']);
    assert.notEqual(nested.exitCode, 0, `unshare -U inside fails (${nested.stderr.trim()})`);

    const w = await rt.exec(id, [
      'sh',
      '-c',
      'echo hi > /root/made && mkdir /srv/d && chown 1000:1000 /srv/d && ls -ln /etc/passwd',
    ]);
    assert.equal(w.exitCode, 0, w.stderr);
    assert.match(w.stdout, /^\S+\s+\d+\s+0\s+0\s/, 'the shared rootfs is root-owned inside');
    const made = await stat(join(rt.upperDir(id), 'root', 'made'));
    assert.deepEqual([made.uid, made.gid], [MAP.hostId, MAP.hostId], 'written as host uid 100000');
    const d = await stat(join(rt.upperDir(id), 'srv', 'd'));
    assert.deepEqual([d.uid, d.gid], [MAP.hostId + 1000, MAP.hostId + 1000], 'uid 1000 inside is 101000');

    const before = (await rt.exec(id, ['cat', '/tmp/state'])).stdout.trim().split(' ');
    const imagesDir = join(folders.shm, 'images');
    await rt.checkpoint(id, { imagesDir, workDir: join(folders.tmp, 'work') });
    assert.equal((await rt.state(id)).status, 'absent');
    await rt.restore(id, { imagesDir, workDir: join(folders.tmp, 'work-restore') });
    const after = (await rt.exec(id, ['cat', '/tmp/state'])).stdout.trim().split(' ');
    assert.equal(after[0], before[0], 'the random value drawn at start is still in memory');
    assert.ok(Number(after[1]) >= Number(before[1]), `the counter went on (${before[1]} -> ${after[1]})`);
    const uidMapAfter = (await rt.exec(id, ['cat', '/proc/1/uid_map'])).stdout
      .trim()
      .split(/\s+/)
      .map(Number);
    assert.deepEqual(uidMapAfter, [0, MAP.hostId, MAP.size], 'restored into the user namespace');
    await rt.destroy(id);
  });

  test('a checkpoint taken without a user namespace is refused by name by a sandbox that has one', async () => {
    const plain = new RuncRuntime({ stateDir: join(folders.tmp, 'plain'), criuPath: CRIU });
    const mapped = new RuncRuntime({
      stateDir: join(folders.tmp, 'mapped'),
      criuPath: CRIU,
      userNamespace: MAP,
    });
    runtimes.push(plain, mapped);
    const from = `plain-${suffix}`;
    await plain.create(spec(from));
    await plain.start(from);
    // Checkpointed once its loop runs, not while its first processes are still starting (on a
    // loaded machine CRIU's freeze then waited out its 10 s on a task in exec).
    await waitForState(plain, from);
    const imagesDir = join(folders.shm, 'plain-images');
    await plain.checkpoint(from, { imagesDir, workDir: join(folders.tmp, 'plain-work') });
    const to = `mapped-${suffix}`;
    await mapped.prepare(spec(to));
    await assert.rejects(
      mapped.restore(to, { imagesDir, workDir: join(folders.tmp, 'mapped-work') }),
      (e: Error & { hint?: string }) =>
        /taken without a user namespace/.test(e.message) && /archive/.test(e.hint ?? ''),
    );
    assert.equal((await mapped.state(to)).status, 'absent', 'nothing was restored');
  });
});
