/**
 * Resume with CRIU's lazy pages, the daemon's default: the sandbox answers as soon as its
 * processes are back while its memory (here 64 MiB that it hashes on every request) is copied
 * in behind it; a hibernate right after waits for the copy to finish; nothing is left in
 * staging. A lazy-pages daemon that dies while the pages stream in sends the sandbox back to
 * its checkpoint, whole. A node without userfaultfd resumes eagerly (one warning), and
 * `lazyRestore: false` always does.
 */
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync, readdirSync, statSync } from 'node:fs';
import { readdir, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { connect } from 'node:net';
import { stagingDirFor, type Daemon, type DaemonOptions } from '../daemon/daemon.js';
import { DormantClient, type SandboxInfo } from '../sdk/client.js';
import { eventually, httpGet, sandboxProcesses, untilState } from './testing/host.js';
import { MEMORY_CHECKER_PY, checkMemory, checkerPasses, pythonServer } from './testing/servers.js';
import { startTestDaemon, tearDown, testFolder, type TestDaemon } from './testing/daemon.js';
import { flipByte } from '../vault/testing/fixtures.js';

const SERVER = pythonServer({
  setup: `
import hashlib, os, sys
blob = bytearray(os.urandom(int(sys.argv[1] if len(sys.argv) > 1 else 64) * 1024 * 1024))`,
  answer: '"%d %s" % (count, hashlib.sha256(blob).hexdigest())',
});

/**
 * The answer of the server of `sb` ("COUNT DIGEST"), once it answers: one request to the
 * sandbox's counter. Only connecting is retried: a request that reached the server counted, so
 * a retry after a slow answer (pages faulted in on a loaded machine) would count twice.
 */
const serve = async (sb: SandboxInfo): Promise<string> => {
  await eventually(
    `server of ${sb.id}`,
    () =>
      new Promise<void>((resolve, reject) => {
        const s = connect({ host: sb.address!, port: 8080 }, () => {
          s.destroy();
          resolve();
        });
        s.on('error', reject);
      }),
    60_000,
  );
  return httpGet(sb.address!, 8080, '/', 180_000);
};

/** Host pids of `criu lazy-pages` processes serving sandbox `id`'s restore. */
function lazyPagesOf(id: string): number[] {
  const pids: number[] = [];
  for (const p of readdirSync('/proc')) {
    if (!/^\d+$/.test(p)) continue;
    let argv: string[];
    try {
      argv = readFileSync(`/proc/${p}/cmdline`, 'utf8').split('\0');
    } catch {
      continue; // gone while we looked
    }
    if (argv.includes('lazy-pages') && argv.some((a) => a.includes(`${id}-restore`))) pids.push(Number(p));
  }
  return pids;
}

let dir: string;
let daemon: Daemon;
let client: DormantClient;
/** Every daemon these tests started and did not close, the main one first. */
const others: Daemon[] = [];
/** Set by a test: the sandbox whose lazy-pages daemon is killed once its restore returned. */
let killLazyPagesOf: string | undefined;
const killed: number[] = [];
/** Set by a test: the sandbox whose staged pages images are looked at once its restore returned. */
let inspectStagingOf: { id: string; dataDir: string; size: number; allocated: number } | undefined;

/** Sizes and allocated bytes of the pages images in sandbox `id`'s restore staging. */
function stagedPages(dataDir: string, id: string): { size: number; allocated: number } {
  const images = join(stagingDirFor(dataDir), `${id}-restore`, 'images');
  let size = 0;
  let allocated = 0;
  for (const f of readdirSync(images)) {
    if (!/^pages-\d+\.img$/.test(f)) continue;
    const st = statSync(join(images, f));
    size += st.size;
    allocated += st.blocks * 512;
  }
  return { size, allocated };
}

function inspectAtRestored(step: string): void {
  if (step !== 'resume:restored' || inspectStagingOf === undefined) return;
  Object.assign(inspectStagingOf, stagedPages(inspectStagingOf.dataDir, inspectStagingOf.id));
}

/**
 * What these tests' daemons share. Their sandboxes have no user namespace: in one, a lazy
 * restore needs vm.unprivileged_userfaultfd = 1 (runtime/userns.ts), and these tests are about
 * lazy restore whatever the host's setting.
 */
const LAZY = { proxy: false, policy: false, userNamespace: false } as const;

/** A daemon of these tests on `dataDir` (its sandboxes removed at the end), with its client. */
async function open(opts: Omit<DaemonOptions, 'listen'>): Promise<TestDaemon> {
  const started = await startTestDaemon({ ...LAZY, ...opts });
  others.push(started.daemon);
  return started;
}

before(async () => {
  ({ dir } = await testFolder('lazy', { 'srv/server.py': SERVER, 'srv/checker.py': MEMORY_CHECKER_PY }));
  ({ daemon, client } = await open({
    dataDir: join(dir, 'data'),
    // Every checkpoint's pages from the vault, the small sandboxes of these tests' too.
    pagesFromVaultAboveBytes: 0,
    // The processes run again and their pages are on the way (restore has returned).
    failAt: (step) => {
      inspectAtRestored(step);
      if (step !== 'resume:restored' || killLazyPagesOf === undefined) return;
      for (const pid of lazyPagesOf(killLazyPagesOf)) {
        process.kill(pid, 'SIGKILL');
        killed.push(pid);
      }
    },
  }));
});

after(() => tearDown(dir, ...others));

test('lazy resume: memory intact, a hibernate right after waits for the pages, staging wiped', async () => {
  const sb = await client.createSandbox({
    rootfs: join(dir, 'rootfs'),
    command: ['/usr/bin/python3', '/srv/server.py'],
    ports: [8080],
  });
  const first = await serve(sb);
  const [, digest] = first.split(' ');
  await client.hibernate(sb.id);
  assert.equal((await client.resume(sb.id)).state, 'running');
  // Lazy without being asked: the default.
  await client.pause(sb.id);
  const steps = daemon.controller.lastTimings(sb.id, 'resume')?.steps.map((x) => x.step) ?? [];
  assert.ok(steps.includes('lazy-pages start') && steps.includes('pages loaded'), steps.join(', '));
  await client.resume(sb.id);
  // Straight away: the hibernate queues behind the page copy instead of dumping a half-loaded process.
  assert.equal((await client.hibernate(sb.id)).state, 'hibernated');
  await client.resume(sb.id);
  assert.equal(await serve(sb), `2 ${digest}`, 'counter and 64 MiB of memory intact');
  // Once the pages are in, the staging folder is gone.
  await client.pause(sb.id);
  await client.resume(sb.id);
  assert.deepEqual(await readdir(stagingDirFor(join(dir, 'data'))), []);
});

test('memory shared with a forked worker (MAP_SHARED) comes back whole from a lazy resume', async () => {
  // CRIU restores shared anonymous memory from its own pages image, never lazily: that image
  // must reach staging whole although the processes' pages images do not.
  const sb = await client.createSandbox({
    rootfs: join(dir, 'rootfs'),
    command: ['/usr/bin/python3', '/srv/checker.py'],
    env: { SHARED: '1', BLOCKS: '32' },
    ports: [8080],
  });
  const before = await checkMemory(sb);
  assert.equal(sandboxProcesses(sb.id).length, 2, 'the server and its worker');
  await client.hibernate(sb.id);
  assert.equal((await client.resume(sb.id)).state, 'running');
  const after = await checkerPasses(sb, before.passes + 1);
  assert.equal(after.bad, 0, 'every MiB of the shared mapping is as it was');
  assert.equal(after.token, before.token, 'same process');
  // A pause waits for the pages; the resume's steps are recorded by then.
  await client.pause(sb.id);
  const steps = daemon.controller.lastTimings(sb.id, 'resume')?.steps.map((x) => x.step) ?? [];
  assert.ok(steps.includes('page server'), `pages served from the vault: ${steps.join(', ')}`);
  await client.remove(sb.id);
});

test('lazy pages come straight from the vault: staging never holds the memory; servePagesFromVault false, or a checkpoint below pagesFromVaultAboveBytes (default 256 MiB), stages it', async () => {
  const staged: Record<string, { size: number; allocated: number; steps: string[] }> = {};
  const other = await open({
    dataDir: join(dir, 'staged'),
    servePagesFromVault: false,
    failAt: inspectAtRestored,
  });
  // The defaults: this 64 MiB sandbox's checkpoint is under the threshold.
  const small = await open({ dataDir: join(dir, 'small'), failAt: inspectAtRestored });
  for (const [name, { daemon: d, client: c }, dataDir] of [
    ['vault', { daemon, client }, join(dir, 'data')],
    ['staged', other, join(dir, 'staged')],
    ['small', small, join(dir, 'small')],
  ] as const) {
    const sb = await c.createSandbox({
      rootfs: join(dir, 'rootfs'),
      command: ['/usr/bin/python3', '/srv/server.py'],
      ports: [8080],
    });
    const [, digest] = (await serve(sb)).split(' ');
    await c.hibernate(sb.id);
    inspectStagingOf = { id: sb.id, dataDir, size: 0, allocated: 0 };
    assert.equal((await c.resume(sb.id)).state, 'running');
    const seen = inspectStagingOf;
    inspectStagingOf = undefined;
    assert.equal(await serve(sb), `2 ${digest}`, 'counter and 64 MiB of memory intact');
    await c.pause(sb.id);
    const steps = d.controller.lastTimings(sb.id, 'resume')?.steps.map((x) => x.step) ?? [];
    staged[name] = { size: seen.size, allocated: seen.allocated, steps };
    await c.remove(sb.id);
  }
  const v = staged.vault!;
  const st = staged.staged!;
  assert.ok(v.size >= 64 * 1024 ** 2, `the pages images keep their size (${String(v.size)})`);
  // Only the pages that are not lazy (vdso, private file mappings) reach staging.
  assert.ok(v.allocated < 8 * 1024 ** 2, `served from the vault: ${String(v.allocated)} bytes staged`);
  assert.ok(v.steps.includes('page server') && v.steps.includes('pages loaded'), v.steps.join(', '));
  assert.ok(st.allocated >= 64 * 1024 ** 2, `staged: ${String(st.allocated)} bytes of pages on disk`);
  assert.ok(!st.steps.includes('page server') && st.steps.includes('pages loaded'), st.steps.join(', '));
  const sm = staged.small!;
  assert.ok(sm.allocated >= 64 * 1024 ** 2, `small, staged: ${String(sm.allocated)} bytes of pages on disk`);
  assert.ok(!sm.steps.includes('page server') && sm.steps.includes('pages loaded'), sm.steps.join(', '));
});

test('a page that fails authentication while it streams in is never served: back to the checkpoint, whole once repaired', async () => {
  const sb = await client.createSandbox({
    rootfs: join(dir, 'rootfs'),
    command: ['/usr/bin/python3', '/srv/server.py'],
    ports: [8080],
  });
  const [, digest] = (await serve(sb)).split(' ');
  const packs = join(dir, 'data', 'vault', 'data', sb.tenant, 'packs');
  const before = new Set(await readdir(packs).catch(() => []));
  const ck = (await client.hibernate(sb.id)).checkpointId!;
  // The middle of the largest pack this hibernate wrote: its 64 MiB of random memory, lazy pages.
  let pack = '';
  let size = 0;
  for (const f of await readdir(packs)) {
    if (before.has(f)) continue;
    const n = (await stat(join(packs, f))).size;
    if (n > size) [pack, size] = [join(packs, f), n];
  }
  assert.ok(size > 1024 * 1024, `the hibernate wrote a pack (${pack}: ${String(size)} bytes)`);
  const at = Math.floor(size / 2);
  const flip = (): Promise<void> => flipByte(pack, at);
  await flip();
  assert.equal(
    (await client.resume(sb.id)).state,
    'running',
    'the damage is in a lazy page: found while they stream in',
  );
  const back = await untilState(client, sb.id, 'hibernated');
  assert.equal(back.checkpointId, ck);
  assert.match(
    back.lastError ?? '',
    new RegExp(`lazy restore failed.*checkpoint ${ck}.*(authentic|damaged)`, 's'),
  );
  assert.deepEqual(sandboxProcesses(sb.id), [], 'its processes, waiting on pages, were ended');
  assert.deepEqual(lazyPagesOf(sb.id), []);
  assert.deepEqual(await readdir(stagingDirFor(join(dir, 'data'))), [], 'the images were wiped');
  // Repaired (a replica, say): the checkpoint was never lost.
  await flip();
  assert.equal((await client.resume(sb.id)).state, 'running');
  assert.equal(await serve(sb), `2 ${digest}`);
  await client.remove(sb.id);
});

test('a daemon shut down while pages stream in from the vault waits for them: the sandbox runs on, whole', async () => {
  const data = join(dir, 'shutdown');
  // Not in `others` until it is opened again: this test closes it.
  const d = await startTestDaemon({
    ...LAZY,
    dataDir: data,
    pagesFromVaultAboveBytes: 0,
  });
  const c = d.client;
  // 256 MiB: the copy is still going when resume answers.
  const sb = await c.createSandbox({
    rootfs: join(dir, 'rootfs'),
    command: ['/usr/bin/python3', '/srv/server.py', '256'],
    ports: [8080],
    memory: '768M',
  });
  const [, digest] = (await serve(sb)).split(' ');
  await c.hibernate(sb.id);
  assert.equal((await c.resume(sb.id)).state, 'running');
  assert.ok(
    lazyPagesOf(sb.id).length > 0,
    'the pages are still streaming in when the daemon is told to close',
  );
  await d.daemon.close();
  // Its page server lived until the last page was in: nothing serves the sandbox any more.
  assert.deepEqual(lazyPagesOf(sb.id), [], 'the lazy-pages daemon finished before the daemon closed');
  assert.equal(await serve(sb), `2 ${digest}`, 'memory intact');
  const { daemon: again } = await open({ dataDir: data, pagesFromVaultAboveBytes: 0 });
  assert.equal((await again.controller.get(sb.id)).state, 'running');
  await again.controller.remove(sb.id);
});

test('the lazy-pages daemon dies while pages stream in: the sandbox goes back to its checkpoint, whole', async () => {
  // 256 MiB: the copy takes long enough that the daemon is still at it when restore returns.
  const sb = await client.createSandbox({
    rootfs: join(dir, 'rootfs'),
    command: ['/usr/bin/python3', '/srv/server.py', '256'],
    ports: [8080],
    memory: '768M',
  });
  const [first, digest] = (await serve(sb)).split(' ');
  let n = Number(first);
  let back: SandboxInfo | undefined;
  // Should the copy have finished before the kill (a fast moment), the resume simply worked:
  // hibernate and try again.
  for (let attempt = 0; attempt < 3 && back === undefined; attempt++) {
    const ck = (await client.hibernate(sb.id)).checkpointId;
    killLazyPagesOf = sb.id;
    killed.length = 0;
    const running = await client.resume(sb.id).finally(() => (killLazyPagesOf = undefined));
    assert.equal(running.state, 'running', 'the sandbox runs before its pages are in');
    if (killed.length === 0) {
      assert.equal(await serve(sb), `${++n} ${digest}`);
      continue;
    }
    // Noticed while the daemon lives: back to hibernated on the same checkpoint, saying why.
    back = await untilState(client, sb.id, 'hibernated');
    assert.equal(back.checkpointId, ck, 'the checkpoint it was restored from is still the current one');
  }
  assert.ok(back, 'the lazy-pages daemon was caught copying in one of three resumes');
  assert.match(back.lastError ?? '', /lazy restore failed/);
  const last = (await daemon.store.transitions({ sandboxId: sb.id })).at(-1)!;
  assert.deepEqual([last.from, last.to], ['running', 'hibernated']);
  assert.match(last.reason, /lazy restore failed, back to its checkpoint/);
  assert.deepEqual(sandboxProcesses(sb.id), [], 'its processes, waiting on pages, were ended');
  assert.deepEqual(lazyPagesOf(sb.id), []);
  assert.deepEqual(await readdir(stagingDirFor(join(dir, 'data'))), [], 'the images were wiped');
  // Nothing lost: the next resume carries on from the checkpoint.
  assert.equal((await client.resume(sb.id)).state, 'running');
  assert.equal(await serve(sb), `${n + 1} ${digest}`);
  await client.remove(sb.id);
});

test('no userfaultfd on the node: resumes are eager, with one warning; lazyRestore false is eager, silently', async () => {
  const make = async (name: string, opts: Partial<DaemonOptions>) => {
    const warnings: string[] = [];
    const { daemon: d, client: c } = await open({
      dataDir: join(dir, name),
      warn: (m) => warnings.push(m),
      ...opts,
    });
    return { d, c, warnings };
  };
  const cases = [
    await make('no-uffd', { lazyRestoreProbe: () => Promise.resolve('kernel has no userfaultfd') }),
    await make('eager', { lazyRestore: false }),
  ];
  for (const [i, { d, c, warnings }] of cases.entries()) {
    const sb = await c.createSandbox({
      rootfs: join(dir, 'rootfs'),
      command: ['/usr/bin/python3', '/srv/server.py'],
      ports: [8080],
    });
    const [n, digest] = (await serve(sb)).split(' ');
    for (let round = 1; round <= 2; round++) {
      await c.hibernate(sb.id);
      assert.equal((await c.resume(sb.id)).state, 'running');
      const steps = d.controller.lastTimings(sb.id, 'resume')?.steps.map((x) => x.step) ?? [];
      assert.ok(steps.includes('restore'), steps.join(', '));
      assert.ok(!steps.includes('lazy-pages start') && !steps.includes('pages loaded'), steps.join(', '));
      assert.equal(await serve(sb), `${Number(n) + round} ${digest}`);
    }
    const said = warnings.filter((w) => /lazy restore/.test(w));
    if (i === 0) {
      assert.equal(said.length, 1, `one warning, not one per resume: ${said.join(' | ')}`);
      assert.match(said[0]!, /kernel has no userfaultfd.*eager/);
    } else assert.deepEqual(said, []);
    await c.remove(sb.id);
  }
});
