/**
 * Commands inside a sandbox through the toolbox (the agent in the sandbox, the HTTP routes,
 * the CLI), against a real daemon and real sandboxes: output streams as it is written, stdin
 * and output are binary-safe, a detached command runs on and is reattached to, a terminal
 * session runs a shell over the WebSocket, exec keeps its bounds (timeout, output limit, a
 * background job does not hold it) and wakes a hibernated sandbox.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { join } from 'node:path';
import type { Daemon } from '../daemon/daemon.js';
import type { DormantClient, SandboxInfo } from '../sdk/client.js';
import { eventually } from './testing/host.js';
import { startTestDaemon, tearDown, testFolder } from './testing/daemon.js';
import { call, drain, dormant, json, lines, openTerminal, type Line } from './testing/toolbox.js';

interface CommandInfo {
  id: string;
  pid: number;
  running: boolean;
  exitCode: number | null;
  signal: string | null;
}

describe('the toolbox: commands', () => {
  let dir: string;
  let daemon: Daemon;
  let client: DormantClient;
  let sb: SandboxInfo;
  const path = (rest: string): string => `/v1/sandboxes/${sb.id}${rest}`;
  const exec = (body: Record<string, unknown>) => call(daemon, 'POST', path('/exec'), body);

  let rootfs: string;

  before(async () => {
    ({ dir, rootfs } = await testFolder('toolbox'));
    ({ daemon, client } = await startTestDaemon({ dataDir: join(dir, 'data'), policy: false }));
    sb = await client.createSandbox({
      name: 'tools',
      rootfs,
      command: ['/bin/sh', '-c', 'while true; do sleep 1; done'],
      memory: '128M',
    });
  });

  after(() => tearDown(dir, daemon));

  test('exec: binary-safe both ways, old fields kept', async () => {
    const bytes = Buffer.from([0xc8, 0xff, 0x00, 0x0a, 0x01, 0xfe]);
    const r = await json<{
      exitCode: number;
      stdout: string;
      stderr: string;
      durationMs: number;
      truncated: { stdout: boolean; stderr: boolean };
    }>(await exec({ command: ['cat'], stdinBase64: bytes.toString('base64'), encoding: 'base64' }));
    assert.deepEqual(Buffer.from(r.stdout, 'base64'), bytes, 'NUL and non-UTF-8 bytes round trip');
    assert.equal(r.exitCode, 0);
    assert.equal(typeof r.durationMs, 'number');
    assert.deepEqual(r.truncated, { stdout: false, stderr: false });
    const printf = await json<{ stdout: string }>(
      await exec({ command: ['printf', '\\310\\377'], encoding: 'base64' }),
    );
    assert.deepEqual(Buffer.from(printf.stdout, 'base64'), Buffer.from([0o310, 0o377]));
    const text = await json<{ stdout: string; stderr: string; exitCode: number }>(
      await exec({ command: ['sh', '-c', 'echo out; echo err >&2; exit 4'] }),
    );
    assert.deepEqual([text.stdout, text.stderr, text.exitCode], ['out\n', 'err\n', 4]);
  });

  test('exec: a 1 s timeout ends the call within ~1.1 s; a background job does not hold it', async () => {
    const t0 = Date.now();
    const res = await exec({ command: ['sleep', '10'], timeoutMs: 1000 });
    const took = Date.now() - t0;
    assert.equal(res.status, 504);
    assert.equal(((await res.json()) as { error: { code: string } }).error.code, 'COMMAND_TIMEOUT');
    assert.ok(took >= 1000 && took < 1250, `the timeout answered after ${took} ms`);

    const t1 = Date.now();
    const bg = await json<{ stdout: string; exitCode: number }>(
      await exec({ command: ['sh', '-c', 'sleep 30 & echo started'] }),
    );
    assert.equal(bg.stdout, 'started\n');
    assert.ok(Date.now() - t1 < 3000, `a background job held exec for ${Date.now() - t1} ms`);
  });

  test('exec: output past maxOutputBytes is cut and said so', async () => {
    const r = await json<{
      stdout: string;
      truncated: { stdout: boolean; stderr: boolean };
      outputLimitBytes: number;
    }>(
      await exec({
        command: ['sh', '-c', 'head -c 100000 /dev/zero'],
        maxOutputBytes: 1000,
        encoding: 'base64',
      }),
    );
    assert.equal(Buffer.from(r.stdout, 'base64').length, 1000);
    assert.deepEqual(r.truncated, { stdout: true, stderr: false });
    assert.equal(r.outputLimitBytes, 1000);
  });

  test('a streamed command: its first line arrives before it ends', async () => {
    const t0 = Date.now();
    const res = await call(daemon, 'POST', path('/commands'), { cmd: 'echo first; sleep 3; echo second' });
    assert.equal(res.status, 200);
    assert.match(res.headers.get('content-type') ?? '', /ndjson/);
    const seen: Line[] = [];
    for await (const l of lines(res)) seen.push(l);
    const first = seen.find((l) => l.type === 'stdout')!;
    const end = seen.at(-1)!;
    assert.equal(seen[0]!.type, 'start');
    assert.equal(Buffer.from(first.data!, 'base64').toString(), 'first\n');
    assert.equal(end.type, 'end');
    assert.equal(end['exitCode'], 0);
    assert.ok(first.at - t0 < 2000, `the first line came after ${first.at - t0} ms`);
    assert.ok(end.at - first.at >= 2500, 'the end came after the sleep');
  });

  test('stdin: NUL bytes go through a streamed command', async () => {
    const res = await call(daemon, 'POST', path('/commands'), { args: ['cat'], stdin: true });
    const it = lines(res);
    const start = (await it.next()).value as Line;
    assert.equal(start.type, 'start');
    const bytes = Buffer.from([0, 1, 2, 0, 0xff, 0, 10]);
    const fed = await call(daemon, 'POST', path(`/commands/${String(start['id'])}/stdin?eof=true`), bytes);
    assert.equal(fed.status, 200, await fed.clone().text());
    const out: Buffer[] = [];
    let end: Line | undefined;
    for (let n = await it.next(); !n.done; n = await it.next()) {
      if (n.value.type === 'stdout') out.push(Buffer.from(n.value.data!, 'base64'));
      if (n.value.type === 'end') end = n.value;
    }
    assert.deepEqual(Buffer.concat(out), bytes);
    assert.equal(end?.['exitCode'], 0);
  });

  test('a detached command runs on after the call and its output is reconnected to', async () => {
    const res = await call(daemon, 'POST', path('/commands'), {
      cmd: 'for i in 1 2 3 4; do echo tick $i; sleep 0.5; done',
      background: true,
      tag: 'ticker',
    });
    const info = await json<CommandInfo>(res, 201);
    assert.equal(info.running, true);
    const listed = await json<{ commands: CommandInfo[] }>(await call(daemon, 'GET', path('/commands')));
    assert.ok(listed.commands.some((c) => c.id === info.id && c.running));
    // From byte 7: past "tick 1\n", as a client that had read that much reconnects.
    const again = await drain(await call(daemon, 'GET', path(`/commands/${info.id}/output?from=7`)));
    assert.equal(again.stdout.toString(), 'tick 2\ntick 3\ntick 4\n');
    assert.equal(again.lines[0]!['from'], 7);
    assert.equal(again.lines.at(-1)!['exitCode'], 0);
    const done = await json<CommandInfo>(await call(daemon, 'GET', path(`/commands/${info.id}`)));
    assert.deepEqual([done.running, done.exitCode], [false, 0]);
    const missing = await call(daemon, 'GET', path('/commands/999999'));
    assert.equal(missing.status, 404);
  });

  test('kill is idempotent; a client leaving a foreground command kills it', async () => {
    const info = await json<CommandInfo>(
      await call(daemon, 'POST', path('/commands'), { cmd: 'sleep 100', background: true }),
      201,
    );
    const kill = (): Promise<Response> =>
      call(daemon, 'POST', path(`/commands/${info.id}/kill`), { signal: 'SIGTERM' });
    assert.deepEqual(await json(await kill()), { killed: true });
    await eventually('the command ends', async () => {
      const c = await json<CommandInfo>(await call(daemon, 'GET', path(`/commands/${info.id}`)));
      assert.equal(c.running, false);
      assert.equal(c.signal, 'SIGTERM');
    });
    assert.deepEqual(await json(await kill()), { killed: false });

    const ac = new AbortController();
    const res = await call(daemon, 'POST', path('/commands'), { cmd: 'sleep 100', tag: 'leaver' }, ac.signal);
    const start = (await lines(res).next()).value as Line;
    ac.abort();
    await eventually('the abandoned command is killed', async () => {
      const c = await json<CommandInfo>(await call(daemon, 'GET', path(`/commands/${String(start['id'])}`)));
      assert.equal(c.running, false);
    });
  });

  test('a terminal session runs an interactive shell over the WebSocket', async () => {
    const info = await json<CommandInfo>(
      await call(daemon, 'POST', path('/commands'), {
        cmd: '/bin/sh',
        pty: { cols: 80, rows: 24 },
        stdin: true,
        background: true,
        timeoutMs: 0,
      }),
      201,
    );
    const t = await openTerminal(daemon.url, path(`/commands/${info.id}/ws`), daemon.adminToken);
    t.resize(100, 30);
    t.type('echo $((6*7)); tty; stty size\n');
    await eventually('the shell answers', () => {
      assert.match(t.screen(), /\b42\b/);
      assert.match(t.screen(), /\/dev\/pts\/\d+/);
      assert.match(t.screen(), /30 100/);
      return Promise.resolve();
    });
    t.type('exit 3\n');
    await t.closed;
    assert.equal(t.events[0]?.type, 'start');
    const end = t.events.at(-1)!;
    assert.deepEqual([end.type, end.exitCode], ['end', 3]);
  });

  test('the CLI: streamed exec with its exit code, -i stdin, -d detached, --env and --cwd', async () => {
    const r = await dormant(daemon, ['exec', sb.id, '--', 'sh', '-c', 'echo out; echo err >&2; exit 5']);
    assert.deepEqual([r.code, r.stdout.toString(), r.stderr], [5, 'out\n', 'err\n']);
    const bytes = Buffer.from([0, 0xc8, 0xff, 0, 10]);
    const piped = await dormant(daemon, ['exec', '-i', sb.id, '--', 'cat'], bytes);
    assert.equal(piped.code, 0, piped.stderr);
    assert.deepEqual(piped.stdout, bytes);
    const env = await dormant(daemon, [
      'exec',
      '--env',
      'A=b c',
      '--cwd',
      '/tmp',
      sb.id,
      '--',
      'sh',
      '-c',
      'echo "$A" $(pwd)',
    ]);
    assert.equal(env.stdout.toString(), 'b c /tmp\n');
    const d = await dormant(daemon, ['exec', '-d', sb.id, '--', 'sh', '-c', 'sleep 1; echo bg > /tmp/bg']);
    assert.equal(d.code, 0, d.stderr);
    assert.match(d.stdout.toString(), /^\d+\n$/);
    await eventually('the detached command ran', async () => {
      assert.equal((await client.exec(sb.id, ['cat', '/tmp/bg'])).stdout, 'bg\n');
    });
  });

  test('exec and a command wake a hibernated sandbox', async () => {
    // A sandbox of its own: the others above left background jobs behind.
    const sleepy = await client.createSandbox({
      name: 'sleepy',
      rootfs,
      command: ['/bin/sh', '-c', 'while true; do sleep 1; done'],
      memory: '128M',
    });
    const at = (rest: string): string => `/v1/sandboxes/${sleepy.id}${rest}`;
    await client.exec(sleepy.id, ['sh', '-c', 'echo kept > /tmp/kept']);
    assert.equal((await client.hibernate(sleepy.id)).state, 'hibernated');
    const r = await json<{ stdout: string }>(
      await call(daemon, 'POST', at('/exec'), { command: ['cat', '/tmp/kept'] }),
    );
    assert.equal(r.stdout, 'kept\n');
    assert.equal((await client.getSandbox(sleepy.id)).state, 'running');
    assert.equal((await client.hibernate(sleepy.id)).state, 'hibernated');
    const s = await drain(await call(daemon, 'POST', at('/commands'), { cmd: 'cat /tmp/kept' }));
    assert.equal(s.stdout.toString(), 'kept\n');
  });

  test('hibernate/resume keeps working with a background job left behind and an agent started after a restore', async () => {
    // A command's orphan (the leader of its process group gone): it once broke the resume.
    const orphan = await client.createSandbox({
      name: 'orphan',
      rootfs,
      command: ['sleep', 'infinity'],
      memory: '64M',
    });
    assert.equal(
      (await client.exec(orphan.id, ['sh', '-c', 'sleep 300 & echo started'])).stdout,
      'started\n',
    );
    await client.hibernate(orphan.id);
    await client.resume(orphan.id);
    assert.match(
      (await client.exec(orphan.id, ['ps', '-eo', 'args'])).stdout,
      /sleep 300/,
      'the orphan came back',
    );
    // An agent first started into a restored sandbox sits outside the time namespace CRIU
    // made for it: it is ended before the next dump (else that resume fails) and starts again.
    const late = await client.createSandbox({
      name: 'late',
      rootfs,
      command: ['sleep', 'infinity'],
      memory: '64M',
    });
    await client.hibernate(late.id);
    await client.resume(late.id);
    await client.exec(late.id, ['sh', '-c', 'echo again > /tmp/again']);
    await client.hibernate(late.id);
    assert.equal((await client.resume(late.id)).state, 'running');
    assert.equal((await client.exec(late.id, ['cat', '/tmp/again'])).stdout, 'again\n');
  });
});
