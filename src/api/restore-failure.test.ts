/**
 * A restore that real CRIU refuses, through the real daemon (runc, CRIU, the vault): the resume
 * fails fast with an error naming the kept CRIU log, and leaves nothing of the attempt: no
 * mount under the sandbox's folder or the staging folder, no cgroup of the sandbox in any
 * hierarchy, no runc state, no CRIU process. The sandbox stays hibernated on its checkpoint
 * and resumes from it (memory intact) once the cause is gone; rm leaves nothing either.
 *
 * Cases: a file the checkpoint holds open is missing from the rootfs (CRIU refuses to open it;
 * no fault hook: a real rootfs change), the mm image's argument range swapped in staging
 * (CRIU's restorer is refused by the kernel late in the restore, with pages served from the
 * vault), and a truncated pages image in staging (CRIU 4.2 retries the read at the end of the
 * file forever: the restore must still end well within the restore timeout).
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync, readdirSync, statSync, truncateSync, writeFileSync } from 'node:fs';
import { readFile, rename, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { stagingDirFor, type Daemon } from '../daemon/daemon.js';
import { DormantApiError, DormantClient, type SandboxInfo } from '../sdk/client.js';
import { run } from '../sys/exec.js';
import { leftovers, readOr } from './testing/host.js';
import { counterServer, serveCounter } from './testing/servers.js';
import { startTestDaemon, tearDown, testFolder } from './testing/daemon.js';

/** The counter server, holding a file of the rootfs open (CRIU records and reopens it). */
const HOLDING_SERVER_PY = counterServer({ setup: 'held = open("/srv/held.txt")' });

/** Well under runc's 120 s restore timeout, which a wedged restore used to run into. */
const FAIL_FAST_MS = 30_000;

function varint(buf: Uint8Array, pos: number): number {
  while ((buf[pos++]! & 0x80) !== 0);
  return pos;
}

/**
 * Swaps arg_start and arg_end (fields 8 and 9) of every mm-*.img in `images`: the kernel then
 * refuses the restorer's PR_SET_MM_MAP, late in CRIU's restore (memory and uffd set up).
 */
function swapMmArgs(images: string): void {
  for (const n of readdirSync(images).filter((f) => /^mm-\d+\.img$/.test(f))) {
    const buf = readFileSync(join(images, n));
    const body = buf.subarray(12, 12 + buf.readUInt32LE(8));
    const at = new Map<number, [number, number]>();
    for (let pos = 0; pos < body.length;) {
      const keyEnd = varint(body, pos);
      const key = body[pos]!;
      const wire = key & 7;
      const field = key >> 3;
      let end: number;
      if (wire === 0) end = varint(body, keyEnd);
      else if (wire === 2) {
        let len = 0;
        let shift = 0;
        let p = keyEnd;
        for (;;) {
          const b = body[p++]!;
          len += (b & 0x7f) * 2 ** shift;
          shift += 7;
          if ((b & 0x80) === 0) break;
        }
        end = p + len;
      } else if (wire === 1) end = keyEnd + 8;
      else if (wire === 5) end = keyEnd + 4;
      else throw new Error(`${n}: wire type ${wire}`);
      at.set(field, [keyEnd, end]);
      pos = end;
    }
    const a = at.get(8);
    const b = at.get(9);
    assert.ok(a && b && a[1] - a[0] === b[1] - b[0], `${n}: arg_start and arg_end of one length`);
    const first = Buffer.from(body.subarray(a[0], a[1]));
    body.copy(body, a[0], b[0], b[1]);
    first.copy(body, b[0]);
    writeFileSync(join(images, n), buf);
  }
}

/** Cuts every pages-*.img in `images` to half its pages. */
function truncatePages(images: string): void {
  const names = readdirSync(images).filter((f) => /^pages-\d+\.img$/.test(f));
  assert.ok(names.length > 0, 'the staged images hold pages');
  for (const n of names) {
    const size = statSync(join(images, n)).size;
    truncateSync(join(images, n), Math.floor(size / 8192) * 4096);
  }
}

describe('a restore CRIU refuses leaves nothing behind, and the sandbox resumes afterwards', () => {
  let dir: string;
  let rootfs: string;
  let client: DormantClient;
  /** Applied to the staged images at `resume:fetched` (before CRIU sees them), once. */
  let damage: ((images: string) => void) | undefined;

  before(async () => {
    ({ dir, rootfs } = await testFolder('restore-failure', {
      'srv/server.py': HOLDING_SERVER_PY,
      'srv/held.txt': 'held\n',
    }));
    ({ client } = await start(join(dir, 'data')));
  });

  const daemons: Daemon[] = [];
  /** A daemon on `data` whose `resume:fetched` step applies `damage` to the staged images. */
  async function start(
    data: string,
    extra: { pagesFromVaultAboveBytes?: number } = {},
  ): Promise<{ daemon: Daemon; client: DormantClient }> {
    const started = await startTestDaemon({
      dataDir: data,
      proxy: false,
      policy: false,
      ...extra,
      failAt: (step) => {
        if (step !== 'resume:fetched' || damage === undefined) return;
        const staging = stagingDirFor(data);
        const restore = readdirSync(staging).find((n) => n.endsWith('-restore'));
        assert.ok(restore, 'a restore is staged');
        const fn = damage;
        damage = undefined;
        fn(join(staging, restore, 'images'));
      },
    });
    daemons.push(started.daemon);
    return started;
  }

  after(() => tearDown(dir, ...daemons));

  const create = (name: string, c = client) =>
    c.createSandbox({
      name,
      rootfs,
      command: ['/usr/bin/python3', '-u', '/srv/server.py'],
      ports: [8080],
      memory: '128M',
    });

  /** What the failed restore must not have left: mounts, cgroups, runc state, CRIU. */
  async function nothingOfTheRestore(sb: SandboxInfo, data = join(dir, 'data'), c = client): Promise<void> {
    const sandboxDir = join(data, 'runtime', 'sandboxes', sb.id);
    const mounts = readOr('/proc/self/mountinfo', '')
      .split('\n')
      .filter((l) => l.includes(sandboxDir) || l.includes(stagingDirFor(data) + '/'))
      // The writable layer's disk image stays mounted at fs/ for the sandbox's whole life on
      // the node, asleep too (its quota): that one mount is the sandbox's, not the restore's.
      .filter((l) => !(l.split(' ')[4] === join(sandboxDir, 'fs') && l.includes(' - ext4 ')));
    assert.deepEqual(mounts, [], 'no mount under the sandbox’s folder or in staging');
    const cgroups: string[] = [];
    for (const h of readdirSync('/sys/fs/cgroup'))
      for (const p of [`/sys/fs/cgroup/${h}/dormant/${sb.id}`, `/sys/fs/cgroup/dormant/${sb.id}`])
        if (
          await stat(p).then(
            () => true,
            () => false,
          )
        )
          cgroups.push(p);
    assert.deepEqual([...new Set(cgroups)], [], 'no cgroup of the sandbox in any hierarchy');
    const list = await run('runc', ['--root', join(data, 'runtime', 'runc'), 'list', '-q'], {
      timeoutMs: 10_000,
    });
    assert.equal(list.stdout.trim(), '', 'no container in runc’s state');
    const criu: string[] = [];
    for (const p of readdirSync('/proc').filter((x) => /^\d+$/.test(x))) {
      const cmd = readOr(`/proc/${p}/cmdline`, '').replaceAll('\0', ' ');
      if (/criu/.test(cmd) && cmd.includes(stagingDirFor(data))) criu.push(`${p}: ${cmd}`);
    }
    assert.deepEqual(criu, [], 'no criu (restore, lazy-pages) left');
    assert.deepEqual(
      leftovers(sb.id).filter((l) => l.startsWith('process') && !/collector|keeper\.pid/.test(l)),
      [],
      'no process of the sandbox',
    );
    assert.deepEqual(readdirSync(stagingDirFor(data)), [], 'staging wiped');
    assert.equal((await c.getSandbox(sb.id)).state, 'hibernated');
  }

  /** Resumes `sb`, expects the failure within FAIL_FAST_MS, and checks the kept CRIU log. */
  async function failedResume(sb: SandboxInfo, criuSays: RegExp, c = client): Promise<DormantApiError> {
    const t0 = Date.now();
    const e = await c.resume(sb.id).then(
      () => assert.fail('the resume succeeded'),
      (x: unknown) => x,
    );
    const tookMs = Date.now() - t0;
    assert.ok(e instanceof DormantApiError, String(e));
    assert.equal(e.code, 'RESUME_FAILED');
    assert.ok(tookMs < FAIL_FAST_MS, `failed after ${tookMs} ms (limit ${FAIL_FAST_MS})`);
    process.stderr.write(`# ${sb.name ?? sb.id}: resume failed after ${tookMs} ms\n`);
    assert.match(e.message, /still hibernated and its checkpoint is intact/);
    const log = /criu's log of the failed restore: (\S+)$/.exec(e.hint ?? '')?.[1];
    assert.ok(log, `the hint names the kept CRIU log: ${e.hint ?? ''}`);
    assert.equal((await stat(log)).mode & 0o777, 0o600, 'the kept log is private');
    const kept = await readFile(log, 'utf8');
    assert.match(kept, criuSays, 'the kept log says why');
    // The same log through the API (what `dormant logs --restore ID` prints).
    assert.equal(await c.restoreLog(sb.id), kept, 'logs --restore shows the kept log');
    return e;
  }

  test('a file the checkpoint holds open is gone from the rootfs: CRIU refuses, nothing is left, and it resumes once the file is back', async (t) => {
    const sb = await create('missing-file');
    const [n, token] = await serveCounter(sb);
    assert.equal((await client.hibernate(sb.id)).state, 'hibernated');
    const none = await client.restoreLog(sb.id).then(
      () => assert.fail('a restore log before any failed restore'),
      (x: unknown) => x as DormantApiError,
    );
    assert.equal(none.code, 'NO_RESTORE_LOG', 'no restore has failed yet');
    await rename(join(rootfs, 'srv/held.txt'), join(dir, 'held.txt'));
    try {
      const e = await failedResume(sb, /Can't open file srv\/held\.txt/);
      t.diagnostic(e.message.slice(0, 400));
      // The sandbox's tenant reads what CRIU said, without the node's folders.
      const { token } = await client.createToken({ tenant: sb.tenant });
      const asTenant = await new DormantClient({ url: client.url, token }).restoreLog(sb.id);
      assert.match(asTenant, /Can't open file srv\/held\.txt/);
      assert.ok(!asTenant.includes(join(dir, 'data')), "no host path of the node in the tenant's copy");
      await nothingOfTheRestore(sb);
      // The same refusal again, not a different error from what the first one left.
      await failedResume(sb, /Can't open file srv\/held\.txt/);
      await nothingOfTheRestore(sb);
    } finally {
      await rename(join(dir, 'held.txt'), join(rootfs, 'srv/held.txt'));
    }
    const back = await client.resume(sb.id);
    assert.equal(back.state, 'running');
    assert.deepEqual(await serveCounter(back), [n + 1, token], 'same process, same memory');
    await client.remove(sb.id);
    assert.deepEqual(leftovers(sb.id), [], 'rm leaves nothing');
  });

  test('the kernel refuses the restorer late in the restore (pages from the vault): nothing is left; the intact checkpoint resumes', async () => {
    const data = join(dir, 'data-vault');
    const v = await start(data, { pagesFromVaultAboveBytes: 0 });
    const sb = await create('late-refusal', v.client);
    const [n, token] = await serveCounter(sb);
    assert.equal((await v.client.hibernate(sb.id)).state, 'hibernated');
    damage = swapMmArgs;
    await failedResume(sb, /prctl failed|Can't restore/, v.client);
    await nothingOfTheRestore(sb, data, v.client);
    const back = await v.client.resume(sb.id);
    assert.deepEqual(await serveCounter(back), [n + 1, token], 'same process, same memory');
    await v.client.remove(sb.id);
    assert.deepEqual(leftovers(sb.id), [], 'rm leaves nothing');
  });

  test('a truncated pages image (CRIU loops on it): the restore is ended early, nothing is left, and rm after the failure leaves nothing', async () => {
    const sb = await create('stuck-criu');
    await serveCounter(sb);
    assert.equal((await client.hibernate(sb.id)).state, 'hibernated');
    damage = truncatePages;
    // Lazily CRIU loops on `Advanced iov 0 bytes`; eagerly (user namespaces without
    // unprivileged userfaultfd) on the restorer's `returned 0`.
    const e = await failedResume(sb, /Advanced iov 0 bytes|`- returned 0/);
    assert.match(e.message, /stuck in a loop/);
    await nothingOfTheRestore(sb);
    await client.remove(sb.id);
    assert.deepEqual(leftovers(sb.id), [], 'rm leaves nothing');
  });

  test('CRIU dies mid-restore (SIGKILL): nothing is left, and the intact checkpoint resumes', async () => {
    const data = join(dir, 'data');
    const sb = await create('criu-dies');
    const [n, token] = await serveCounter(sb);
    assert.equal((await client.hibernate(sb.id)).state, 'hibernated');
    // CRIU loops on the truncated image (the staged copy only), and is killed while it does:
    // it cleans up nothing (its cgroup yard stays mounted in the work dir).
    damage = truncatePages;
    const runcRoot = join(data, 'runtime', 'runc');
    let killed: number | undefined;
    const hunt = setInterval(() => {
      for (const p of readdirSync('/proc').filter((x) => /^\d+$/.test(x))) {
        const cmd = readOr(`/proc/${p}/cmdline`, '').split('\0');
        if (!cmd.includes('swrk')) continue;
        const ppid = /^PPid:\s+(\d+)/m.exec(readOr(`/proc/${p}/status`, ''))?.[1];
        // Only the criu of this test's daemon (its runc has this data dir's root).
        if (ppid === undefined || !readOr(`/proc/${ppid}/cmdline`, '').includes(runcRoot)) continue;
        try {
          process.kill(Number(p), 'SIGKILL');
          killed = Number(p);
        } catch {
          // Gone meanwhile: the next round finds none.
        }
      }
    }, 100);
    try {
      await failedResume(sb, /./);
    } finally {
      clearInterval(hunt);
    }
    assert.ok(killed !== undefined, 'criu was found and killed');
    await nothingOfTheRestore(sb);
    const back = await client.resume(sb.id);
    assert.deepEqual(await serveCounter(back), [n + 1, token], 'same process, same memory');
    await client.remove(sb.id);
    assert.deepEqual(leftovers(sb.id), [], 'rm leaves nothing');
  });
});
