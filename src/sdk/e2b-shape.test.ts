/**
 * An E2B-shaped TypeScript program against a real daemon (loopback, runc, CRIU, the sandbox's
 * agent): what a program written for E2B's SDK does in its first minutes, with only the import
 * and the environment changed (DORMANT_URL, DORMANT_TOKEN, DORMANT_ROOTFS in place of
 * E2B_API_KEY). packages/python/tests/e2b_shape.py is the same program in Python
 * (python.test.ts runs it).
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import type { Daemon } from '../daemon/daemon.js';
import { startTestDaemon, tearDown, testFolder } from '../api/testing/daemon.js';
import { CommandExitError, Sandbox } from './index.js';

/** Polls `f` until it is true (a stream's next chunk, a state). */
async function until(what: string, f: () => boolean | Promise<boolean>, ms = 15_000): Promise<void> {
  const deadline = Date.now() + ms;
  while (!(await f())) {
    if (Date.now() > deadline) assert.fail(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

describe('SDK: an E2B-shaped program', () => {
  let dir: string;
  let daemon: Daemon;
  const saved = { ...process.env };

  before(async () => {
    let rootfs: string;
    ({ dir, rootfs } = await testFolder('e2b-shape'));
    ({ daemon } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      readonlyBinds: [],
      policy: false,
      meterIntervalMs: 250,
    }));
    // What a ported program's environment holds, in place of E2B_API_KEY.
    process.env.DORMANT_URL = daemon.url;
    process.env.DORMANT_TOKEN = daemon.adminToken;
    process.env.DORMANT_ROOTFS = rootfs;
  });

  after(async () => {
    process.env = saved;
    await tearDown(dir, daemon);
  });

  test('runs unchanged but for the import and the environment', async () => {
    const run = randomBytes(4).toString('hex');
    // ---- the program (as written for E2B) ---------------------------------------------------
    const sandbox = await Sandbox.create({ metadata: { suite: 'e2b-shape', run }, timeoutMs: 60 * 60_000 });
    assert.equal(sandbox.sandboxId, sandbox.id);

    // Streaming: the first line arrives while the command still runs.
    const started = Date.now();
    const chunks: { at: number; data: string }[] = [];
    const result = await sandbox.commands.run(
      'for i in 1 2 3; do echo line$i; sleep 0.5; done; echo err >&2',
      {
        onStdout: (data) => void chunks.push({ at: Date.now(), data }),
      },
    );
    assert.equal(result.stdout, 'line1\nline2\nline3\n');
    assert.equal(result.stderr, 'err\n');
    assert.equal(result.exitCode, 0);
    assert.ok(chunks.length >= 2, `output came in pieces: ${JSON.stringify(chunks)}`);
    assert.ok(chunks[0]!.at - started < Date.now() - started - 700, 'the first line came before the end');

    // A non-zero exit throws, carrying the output, as in E2B.
    const failed = await sandbox.commands.run('echo partial; exit 3').catch((e: unknown) => e);
    assert.ok(failed instanceof CommandExitError, String(failed));
    assert.deepEqual([failed.exitCode, failed.stdout], [3, 'partial\n']);

    // cwd, envs, stdin with NUL bytes.
    const env = await sandbox.commands.run('pwd; echo $GREETING', { cwd: '/tmp', envs: { GREETING: 'hi' } });
    assert.equal(env.stdout, '/tmp\nhi\n');
    const counted = await sandbox.commands.run('wc -c', { stdin: new Uint8Array([0, 1, 0, 2, 0]) });
    assert.equal(counted.stdout.trim(), '5');

    // A background command: a handle, disconnect, connect again, kill.
    const ticker = await sandbox.commands.run(
      'i=0; while true; do echo tick$i; i=$((i+1)); sleep 0.1; done',
      {
        background: true,
      },
    );
    await until('ticks', () => ticker.stdout.includes('tick2'));
    await ticker.disconnect();
    const seen: string[] = [];
    const again = await sandbox.commands.connect(ticker.pid, { onStdout: (d) => void seen.push(d) });
    await until('ticks after connect', () => again.stdout.includes('tick5'));
    assert.ok(again.stdout.startsWith('tick0\n'), 'connect replays the output from the start');
    const listed = await sandbox.commands.list();
    assert.ok(listed.some((c) => c.pid === ticker.pid && c.running));
    assert.equal(await sandbox.commands.kill(ticker.pid), true);
    const killed = await again.wait().catch((e: unknown) => e);
    assert.ok(killed instanceof CommandExitError && killed.signal === 'SIGKILL', String(killed));
    assert.equal(await sandbox.commands.kill(ticker.pid), false, 'a second kill: already ended');

    // A background command fed through stdin.
    const cat = await sandbox.commands.run('cat', { background: true, stdin: true });
    await cat.sendStdin('hello\n');
    await sandbox.commands.sendStdin(cat.pid, 'world\n', { eof: true });
    assert.equal((await cat.wait()).stdout, 'hello\nworld\n');

    // Files: 1 MiB of random bytes there and back, byte for byte, under a watched folder.
    assert.equal(await sandbox.files.makeDir('/data'), true);
    const events: string[] = [];
    const watch = await sandbox.files.watchDir('/data', (e) => void events.push(`${e.type}:${e.name}`), {
      recursive: true,
    });
    const blob = new Uint8Array(randomBytes(1024 * 1024));
    const written = await sandbox.files.write('/data/blob.bin', blob);
    assert.deepEqual([written.path, written.size], ['/data/blob.bin', blob.length]);
    const back = await sandbox.files.read('/data/blob.bin', { format: 'bytes' });
    assert.ok(Buffer.from(back).equals(Buffer.from(blob)), 'read back byte for byte');
    await sandbox.files.write([
      { path: '/data/a.txt', data: 'alpha' },
      { path: '/data/sub/b.txt', data: 'beta' },
    ]);
    assert.equal(await sandbox.files.read('/data/a.txt'), 'alpha');
    const names = (await sandbox.files.list('/data')).map((e) => `${e.type}:${e.name}`).sort();
    assert.deepEqual(names, ['dir:sub', 'file:a.txt', 'file:blob.bin']);
    assert.deepEqual(
      (await sandbox.files.list('/data', { depth: 2 })).map((e) => e.path).filter((p) => p.endsWith('.txt')),
      ['/data/a.txt', '/data/sub/b.txt'],
    );
    assert.equal(await sandbox.files.exists('/data/a.txt'), true);
    assert.equal(await sandbox.files.exists('/data/nope'), false);
    assert.equal((await sandbox.files.getInfo('/data/blob.bin')).size, blob.length);
    assert.equal(await sandbox.files.makeDir('/data/new/deep'), true);
    assert.equal((await sandbox.files.rename('/data/a.txt', '/data/new/a.txt')).path, '/data/new/a.txt');
    await sandbox.files.remove('/data/new');
    assert.equal(await sandbox.files.exists('/data/new'), false);
    const text = await sandbox.files.read('/data/sub/b.txt', { format: 'blob' });
    assert.equal(await text.text(), 'beta');
    // (Not sub/b.txt: a file made in a new folder at once may come before the folder is watched.)
    await until('watch events', () => events.includes('create:blob.bin') && events.includes('create:sub'));
    await watch.stop();

    // The meter: CPU, memory and disk over time, with E2B's field names.
    await until('meter samples', async () => (await sandbox.getMetrics()).length >= 2);
    const last = (await sandbox.getMetrics()).at(-1)!;
    assert.ok(last.memUsed > 0 && last.timestamp instanceof Date, JSON.stringify(last));

    // A terminal: an interactive shell answers typed input.
    let screen = '';
    const term = await sandbox.pty.create({
      cols: 80,
      rows: 24,
      onData: (d) => void (screen += new TextDecoder().decode(d)),
    });
    await sandbox.pty.sendInput(term.pid, new TextEncoder().encode('echo $((6*7)); tty\n'));
    await until('the shell to answer', () => /\b42\b/.test(screen) && /\/dev\/pts\//.test(screen));
    await sandbox.pty.resize(term.pid, { cols: 120, rows: 40 });
    await sandbox.pty.sendInput(term.pid, new TextEncoder().encode('stty size\n'));
    await until('the new size', () => screen.includes('40 120'));
    assert.equal(await sandbox.pty.kill(term.pid), true);

    // Listing by label (E2B's metadata query).
    const mine = await Sandbox.list({ query: { metadata: { run }, state: 'running' } });
    assert.deepEqual(
      mine.map((s) => [s.sandboxId, s.metadata.suite]),
      [[sandbox.sandboxId, 'e2b-shape']],
    );
    assert.deepEqual(await Sandbox.list({ query: { metadata: { run: 'other' } } }), []);

    // dormant's own: hibernate, and the next command wakes it.
    await sandbox.files.write('/tmp/kept.txt', 'still here');
    assert.equal((await sandbox.hibernate()).state, 'hibernated');
    const woke = await sandbox.commands.run('cat /tmp/kept.txt');
    assert.equal(woke.stdout, 'still here');
    assert.equal((await sandbox.getInfo()).state, 'running');

    await sandbox.setTimeout(5 * 60_000);
    assert.equal(sandbox.info.policy.hibernateAfterMs, 5 * 60_000, 'setTimeout is the idle timeout');
    await sandbox.kill();
    assert.equal(await Sandbox.kill(sandbox.sandboxId), false, 'already gone');
  });
});
