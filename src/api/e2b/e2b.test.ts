/**
 * E2B's own SDK (the real `e2b` package from npm) running an unmodified E2B program against a
 * real daemon's E2B front (loopback, runc, CRIU, the sandbox's agent): only the environment
 * says where to go. Create from a template, a streamed command, a background one, files,
 * betaPause (dormant hibernates: memory freed), connect (the same process, its memory
 * intact), setTimeout (the idle policy), list, kill; and the refusals: a wrong key, another
 * tenant's sandbox, a path outside the sandbox.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { rm, symlink, writeFile } from 'node:fs/promises';
import { execFile } from 'node:child_process';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { Daemon } from '../../daemon/daemon.js';
import type { DormantClient } from '../../sdk/client.js';
import { startTestDaemon, tearDown, testFolder } from '../testing/daemon.js';
import { loadE2bSdk, type E2bSdk } from './testing/sdk.js';

async function until(what: string, f: () => boolean | Promise<boolean>, ms = 15_000): Promise<void> {
  const deadline = Date.now() + ms;
  while (!(await f())) {
    if (Date.now() > deadline) assert.fail(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

const BIN = join(dirname(fileURLToPath(import.meta.url)), '..', '..', '..', 'bin', 'dormant');

/** `dormant ARGS --json` against `daemon` with its admin token: the parsed output. */
function dormantJson(daemon: Daemon, args: string[]): Promise<Record<string, string>> {
  return new Promise((resolve, reject) => {
    execFile(
      process.execPath,
      [BIN, ...args, '--json'],
      { env: { ...process.env, DORMANT_URL: daemon.url, DORMANT_TOKEN: daemon.adminToken }, timeout: 60_000 },
      (err, stdout, stderr) =>
        err
          ? reject(new Error(`dormant ${args.join(' ')}: ${stderr}`))
          : resolve(JSON.parse(stdout) as Record<string, string>),
    );
  });
}

/** A tenant's E2B key, as `dormant token create --tenant T --e2b` mints it. */
async function e2bKey(daemon: Daemon, tenant: string): Promise<string> {
  const { key, tenant: t } = await dormantJson(daemon, ['token', 'create', '--tenant', tenant, '--e2b']);
  assert.equal(t, tenant);
  assert.match(key!, /^e2b_[0-9a-f]+$/);
  return key!;
}

/** A busybox rootfs with the host's bash at /bin/bash (E2B runs every command with it). */
async function e2bRootfs(name: string): Promise<{ dir: string; rootfs: string }> {
  const t = await testFolder(name);
  await rm(join(t.rootfs, 'bin', 'bash'), { force: true });
  await symlink('/usr/bin/bash', join(t.rootfs, 'bin', 'bash'));
  return t;
}

describe('E2B front: the real E2B SDK', () => {
  let dir: string;
  let daemon: Daemon;
  let client: DormantClient;
  let e2b: E2bSdk;
  let key: string;
  let otherKey: string;
  const saved = { ...process.env };

  before(async () => {
    e2b = await loadE2bSdk();
    let rootfs: string;
    ({ dir, rootfs } = await e2bRootfs('e2b'));
    ({ daemon, client } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      policy: false,
      meterIntervalMs: 200,
      e2b: { listen: '127.0.0.1:0', templates: { base: { rootfs } } },
    }));
    key = await e2bKey(daemon, 'acme');
    otherKey = await e2bKey(daemon, 'other');
    // What `dormant e2b` prints is all a program needs.
    const info = await dormantJson(daemon, ['e2b']);
    assert.equal(info.apiUrl, daemon.e2b!.url);
    process.env.E2B_API_URL = info.apiUrl;
    process.env.E2B_SANDBOX_URL = info.sandboxUrl;
    process.env.E2B_DOMAIN = info.domain;
    process.env.E2B_API_KEY = key;
  });

  after(async () => {
    process.env = saved;
    await tearDown(dir, daemon);
  });

  test('an unmodified E2B program runs, hibernates and resumes', async () => {
    const { Sandbox } = e2b;
    // ---- the program (as written for E2B) ----
    const sandbox = await Sandbox.create('base', { metadata: { suite: 'e2b-front' }, timeoutMs: 600_000 });
    const id = sandbox.sandboxId;

    // Streamed output: the first line arrives before the command ends.
    const started = Date.now();
    const chunks: { at: number; data: string }[] = [];
    const r = await sandbox.commands.run('echo one; sleep 0.6; echo two', {
      onStdout: (data) => void chunks.push({ at: Date.now(), data }),
    });
    assert.equal(r.exitCode, 0);
    assert.equal(r.stdout, 'one\ntwo\n');
    assert.ok(chunks.length >= 2 && chunks[0]!.at - started < Date.now() - started - 400, 'streamed');

    // A background command holding a secret only in its memory.
    let seen = '';
    const bg = await sandbox.commands.run(
      's=$RANDOM$RANDOM$RANDOM; echo "secret $s"; while read line; do echo "again $s"; done',
      { background: true, stdin: true, onStdout: (d) => void (seen += d) },
    );
    await until('the secret', () => /secret \d+/.test(seen));
    const secret = /secret (\d+)/.exec(seen)![1]!;
    await bg.disconnect();

    // Files.
    await sandbox.files.write('/tmp/hello.txt', 'hello from e2b');
    assert.equal(await sandbox.files.read('/tmp/hello.txt'), 'hello from e2b');
    assert.ok((await sandbox.files.list('/tmp')).some((e) => e.name === 'hello.txt' && e.type === 'file'));
    assert.equal(sandbox.getHost(8080), `8080-${id}.${process.env.E2B_DOMAIN}`);

    // betaPause: dormant hibernates it (its memory goes to the vault and is freed).
    assert.equal(await sandbox.betaPause(), true);
    const slept = await client.getSandbox(id);
    assert.equal(slept.state, 'hibernated');
    assert.equal(await daemon.controller.usage(id), undefined, 'no memory held: no cgroup left');

    // connect: resumed, the background process is the same one, its memory intact.
    const again = await Sandbox.connect(id);
    assert.equal((await client.getSandbox(id)).state, 'running');
    assert.ok(
      (await again.commands.list()).some((p) => p.pid === bg.pid),
      'the same pid runs',
    );
    let after = '';
    await again.commands.connect(bg.pid, { onStdout: (d) => void (after += d) });
    await again.commands.sendStdin(bg.pid, 'ping\n');
    await until('the answer', () => after.includes('again'));
    assert.equal(after.trim(), `again ${secret}`);
    assert.equal(await again.files.read('/tmp/hello.txt'), 'hello from e2b');

    // getMetrics: the meter's samples (it samples every 200 ms here).
    await until('a metric sample', async () => (await again.getMetrics()).length > 0);
    const [m] = await again.getMetrics();
    assert.ok(m!.memUsed > 0 && m!.memTotal >= m!.memUsed && m!.cpuCount >= 1, JSON.stringify(m));

    // setTimeout is the idle policy.
    await again.setTimeout(120_000);
    assert.equal((await client.getSandbox(id)).policy.hibernateAfterMs, 120_000);

    // list: metadata are labels (the template's own label is not shown).
    const listed = await Sandbox.list().nextItems();
    const mine = listed.find((s) => s.sandboxId === id);
    assert.deepEqual(mine?.metadata, { suite: 'e2b-front' });
    assert.equal(mine?.state, 'running');

    // ---- refusals ----
    // A wrong key: E2B's AuthenticationError, nothing made.
    const before = (await daemon.controller.list()).length;
    await assert.rejects(Sandbox.create('base', { apiKey: 'e2b_0123456789abcdef' }), e2b.AuthenticationError);
    assert.equal((await daemon.controller.list()).length, before);
    // Another tenant's sandbox id: not found, as if it were not there; it is not killed.
    await assert.rejects(Sandbox.connect(id, { apiKey: otherKey }), e2b.NotFoundError);
    assert.equal(await Sandbox.kill(id, { apiKey: otherKey }), false);
    assert.equal((await client.getSandbox(id)).state, 'running');
    // envd with another sandbox's access token: unauthenticated, nothing served.
    const other = await Sandbox.create('base', { apiKey: otherKey });
    const res = await fetch(`${process.env.E2B_SANDBOX_URL}/filesystem.Filesystem/ListDir`, {
      method: 'POST',
      headers: {
        'content-type': 'application/json',
        'e2b-sandbox-id': id,
        'x-access-token': (other as unknown as { envdAccessToken: string }).envdAccessToken,
      },
      body: JSON.stringify({ path: '/tmp', depth: 1 }),
    });
    assert.equal(res.status, 401);
    const body = (await res.json()) as { code: string; message: string };
    assert.equal(body.code, 'unauthenticated');
    assert.ok(!JSON.stringify(body).includes('hello.txt'));
    // A path outside the sandbox: the host's file is not reached.
    const hostFile = join(dir, 'host-secret.txt');
    await writeFile(hostFile, 'host only');
    await assert.rejects(again.files.read(`/../../../..${hostFile}`), e2b.NotFoundError);
    assert.equal(await again.files.exists(`/../../..${hostFile}`), false);
    await other.kill();

    // createSnapshot: a dormant template of the sandbox; a sandbox made from it has its
    // processes and memory (the background command answers with the same secret) and files.
    const snap = await again.createSnapshot();
    assert.ok((await Sandbox.listSnapshots().nextItems()).some((s) => s.snapshotId === snap.snapshotId));
    const copy = await Sandbox.create(snap.snapshotId);
    assert.notEqual(copy.sandboxId, id);
    let copied = '';
    await copy.commands.connect(bg.pid, { onStdout: (d) => void (copied += d) });
    await copy.commands.sendStdin(bg.pid, 'ping\n');
    await until('the copy answers', () => copied.includes('again'));
    assert.equal(copied.trim(), `again ${secret}`);
    assert.equal(await copy.files.read('/tmp/hello.txt'), 'hello from e2b');
    await copy.kill();
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true);
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false, 'gone');

    // kill: gone from dormant too.
    await again.kill();
    await assert.rejects(client.getSandbox(id), /no sandbox/);
  });

  test('terminals, signals, folders, watches and forks', async () => {
    const { Sandbox } = e2b;
    const sandbox = await Sandbox.create('base');
    try {
      // A PTY: an interactive bash, its size set, its output on the terminal.
      let screen = '';
      const term = await sandbox.pty.create({
        cols: 80,
        rows: 24,
        onData: (d) => void (screen += Buffer.from(d).toString('utf8')),
      });
      await sandbox.pty.resize(term.pid, { cols: 100, rows: 30 });
      await sandbox.pty.sendInput(
        term.pid,
        new TextEncoder().encode('tty >/dev/null && stty size; echo m$((6*7))\n'),
      );
      await until('the terminal answers', () => screen.includes('m42') && screen.includes('30 100'));
      assert.equal(await sandbox.pty.kill(term.pid), true);

      // A signal ends a background command; a second kill finds it gone.
      const sleeper = await sandbox.commands.run('sleep 600', { background: true });
      assert.equal(await sandbox.commands.kill(sleeper.pid), true);
      const ended = await sleeper.wait().catch((e: unknown) => e);
      assert.ok(ended instanceof e2b.CommandExitError, String(ended));
      assert.equal(await sandbox.commands.kill(sleeper.pid), false);

      // Folders: make, watch, move, stat, remove.
      assert.equal(await sandbox.files.makeDir('/work/deep'), true);
      assert.equal(await sandbox.files.makeDir('/work/deep'), false);
      const events: string[] = [];
      const watch = await sandbox.files.watchDir('/work', (e) => void events.push(`${e.type}:${e.name}`));
      await sandbox.files.write('/work/a.txt', 'alpha');
      const moved = await sandbox.files.rename('/work/a.txt', '/work/deep/b.txt');
      assert.equal(moved.path, '/work/deep/b.txt');
      assert.equal((await sandbox.files.getInfo('/work/deep/b.txt')).size, 5);
      await until('watch events', () => events.some((e) => e.endsWith(':a.txt')));
      await watch.stop();
      // The polling watchers (what E2B's Python SDK's synchronous watch_dir uses).
      const envd = async (
        method: string,
        body: object,
      ): Promise<{ status: number; json: Record<string, unknown> }> => {
        const res = await fetch(`${process.env.E2B_SANDBOX_URL}/filesystem.Filesystem/${method}`, {
          method: 'POST',
          headers: {
            'content-type': 'application/json',
            'e2b-sandbox-id': sandbox.sandboxId,
            'x-access-token': (sandbox as unknown as { envdAccessToken: string }).envdAccessToken,
          },
          body: JSON.stringify(body),
        });
        return { status: res.status, json: (await res.json()) as Record<string, unknown> };
      };
      const created = await envd('CreateWatcher', { path: '/work/deep', recursive: false });
      const watcherId = created.json.watcherId as string;
      await sandbox.files.write('/work/deep/c.txt', 'gamma');
      const polled: unknown[] = [];
      await until('polled events', async () => {
        polled.push(...((await envd('GetWatcherEvents', { watcherId })).json.events as unknown[]));
        return JSON.stringify(polled).includes('"name":"c.txt","type":"EVENT_TYPE_CREATE"');
      });
      assert.equal((await envd('RemoveWatcher', { watcherId })).status, 200);
      const gone = await envd('GetWatcherEvents', { watcherId });
      assert.deepEqual([gone.status, gone.json.code], [404, 'not_found']);
      await sandbox.files.remove('/work/deep');
      assert.equal(await sandbox.files.exists('/work/deep/b.txt'), false);

      // A fork: a new sandbox with the same files.
      await sandbox.files.write('/tmp/fork.txt', 'carried');
      const [fork] = await Sandbox.fork(sandbox.sandboxId, { count: 1 });
      assert.ok(
        fork !== undefined && !(fork instanceof Error),
        `fork failed: ${(fork as Error | undefined)?.message}`,
      );
      assert.notEqual(fork.sandboxId, sandbox.sandboxId);
      assert.equal(await fork.files.read('/tmp/fork.txt'), 'carried');
      await fork.kill();
    } finally {
      await sandbox.kill();
    }
  });
});
