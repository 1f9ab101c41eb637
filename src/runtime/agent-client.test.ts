/**
 * dormant-agent and its client, with the agent run on the host (`serve --no-install` on a
 * loopback port, in a temp folder): what a user of the toolbox notices. Commands are
 * binary-safe both ways, output streams while a command runs, a command outlives its
 * connection and attach replays it, timeouts kill promptly, a PTY behaves like a terminal,
 * files round-trip byte for byte, and the agent refuses bad tokens and oversized frames.
 * The agent inside a real sandbox is agent.test.ts.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { mkdtemp, rm, truncate, writeFile } from 'node:fs/promises';
import { connect, createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { once } from 'node:events';
import { finished } from 'node:stream/promises';
import { AgentClient, AgentError, type ProcessHandle, type WatchEvent } from './agent-client.js';
import { locateAgentBinary } from './runc-agent.js';
import { eventually, freePort } from '../api/testing/host.js';

const binary = await locateAgentBinary();
const TOKEN = randomBytes(32).toString('hex');

/** Everything a handle prints, until it exits. */
async function collect(
  h: ProcessHandle,
): Promise<{ stdout: Buffer; stderr: Buffer; exit: Awaited<ProcessHandle['exited']> }> {
  const out: Buffer[] = [];
  const err: Buffer[] = [];
  h.onOutput((s, d) => (s === 'stdout' ? out : err).push(d));
  const exit = await h.exited;
  return { stdout: Buffer.concat(out), stderr: Buffer.concat(err), exit };
}

/** Resolves when the handle's output so far matches re. */
function outputMatching(h: ProcessHandle, re: RegExp, timeoutMs = 5000): Promise<string> {
  let text = '';
  return new Promise((resolve, reject) => {
    const timer = setTimeout(
      () => reject(new Error(`no output matching ${re} within ${timeoutMs} ms: ${JSON.stringify(text)}`)),
      timeoutMs,
    );
    h.onOutput((_s, d) => {
      text += d.toString('latin1');
      if (re.test(text)) {
        clearTimeout(timer);
        resolve(text);
      }
    });
  });
}

async function agentError(p: Promise<unknown>): Promise<AgentError> {
  const e = await p.then(
    () => assert.fail('expected an AgentError'),
    (err: unknown) => err,
  );
  assert.ok(e instanceof AgentError, `an AgentError, got ${String(e)}`);
  return e;
}

describe(
  'dormant-agent on the host',
  { skip: binary ? false : 'dormant-agent is not built: run scripts/build-native.sh' },
  () => {
    let dir = '';
    let agent: ChildProcess | undefined;
    let client: AgentClient;

    before(async () => {
      dir = await mkdtemp(join(tmpdir(), 'dormant-agent-'));
      const port = await freePort();
      agent = spawn(binary!, ['serve', '--no-install', '--listen', `127.0.0.1:${port}`], {
        cwd: dir,
        stdio: ['pipe', 'ignore', 'inherit'],
      });
      agent.stdin!.end(`${TOKEN}\n`);
      client = new AgentClient({ host: '127.0.0.1', port, token: TOKEN });
      await eventually('the agent answers ping', () => client.ping(), 5000);
    });

    after(async () => {
      if (agent && agent.exitCode === null) {
        const exited = once(agent, 'exit');
        agent.kill('SIGTERM'); // the agent ends its commands' process groups with itself
        await exited;
      }
      if (dir) await rm(dir, { recursive: true, force: true });
    });

    test('ping names the agent', async () => {
      const p = await client.ping();
      assert.equal(p.version, 1);
      assert.equal(p.pid, agent!.pid);
    });

    test('every byte value, NUL included, goes through stdin and stdout unchanged', async () => {
      const bytes = Buffer.alloc(4 * 256);
      for (let i = 0; i < bytes.length; i++) bytes[i] = i % 256;
      const h = await client.run({ args: ['cat'], stdin: true });
      h.write(bytes);
      h.closeStdin();
      const r = await collect(h);
      assert.equal(r.exit.exitCode, 0);
      assert.ok(r.stdout.equals(bytes), 'cat gave back the same bytes');
    });

    test("stdout and stderr are told apart, and the exit code is the command's", async () => {
      const r = await collect(
        await client.run({ args: ['sh', '-c', 'echo out; echo err >&2; exit 3'], env: { X: 'y' } }),
      );
      assert.equal(r.stdout.toString(), 'out\n');
      assert.equal(r.stderr.toString(), 'err\n');
      assert.deepEqual(
        { ...r.exit, durationMs: 0 },
        { exitCode: 3, signal: null, durationMs: 0, timedOut: false },
      );
    });

    test('env and cwd reach the command; a missing command is ENOENT', async () => {
      const r = await collect(
        await client.run({
          args: ['sh', '-c', 'echo "$GREETING $(pwd)"'],
          env: { GREETING: 'hi' },
          cwd: '/tmp',
        }),
      );
      assert.equal(r.stdout.toString(), 'hi /tmp\n');
      assert.equal((await agentError(client.run({ args: ['no-such-command-here'] }))).code, 'ENOENT');
    });

    test('the first line of a 3 s command arrives long before it ends', async () => {
      const started = Date.now();
      const h = await client.run({ args: ['sh', '-c', 'echo first; sleep 3; echo last'] });
      await outputMatching(h, /first\n/);
      const firstAt = Date.now() - started;
      const exit = await h.exited;
      assert.ok(firstAt < 1500, `first line after ${firstAt} ms`);
      assert.ok(exit.durationMs >= 2900, `ran ${exit.durationMs} ms`);
    });

    test('a command keeps running after its connection closes, and attach replays its output', async () => {
      const h = await client.run({
        args: ['sh', '-c', 'for i in 1 2 3 4 5; do echo tick $i; sleep 0.2; done'],
        tag: 'ticker',
      });
      await outputMatching(h, /tick 1/);
      h.detach();
      await assert.rejects(h.exited, (e: AgentError) => e.code === 'EDETACHED');
      const listed = (await client.list()).find((p) => p.id === h.id);
      assert.equal(listed?.running, true);
      assert.equal(listed?.tag, 'ticker');
      assert.deepEqual(listed?.args.slice(0, 2), ['sh', '-c']);
      const again = await client.attach(h.id);
      assert.equal(again.from, 0);
      const r = await collect(again);
      assert.equal(r.stdout.toString(), 'tick 1\ntick 2\ntick 3\ntick 4\ntick 5\n');
      assert.equal(r.exit.exitCode, 0);
      // attach from an offset replays the rest; after the end it reports the exit at once
      const tail = await collect(await client.attach(h.id, 'tick 1\ntick 2\n'.length));
      assert.equal(tail.stdout.toString(), 'tick 3\ntick 4\ntick 5\n');
      const done = (await client.list()).find((p) => p.id === h.id);
      assert.equal(done?.running, false);
      assert.equal(done?.exitCode, 0);
      assert.equal(done?.outputBytes, 35);
    });

    test('attach says how much output is no longer kept (about the last 4 MiB are kept)', async () => {
      const h = await client.run({ args: ['head', '-c', '6000000', '/dev/zero'] });
      await collect(h);
      const late = await client.attach(h.id);
      const r = await collect(late);
      assert.ok(
        late.from >= 6_000_000 - 4 * 1024 * 1024 && late.from < 6_000_000 - 4 * 1024 * 1024 + 65536,
        `from ${late.from}`,
      );
      assert.equal(late.lostBytes, late.from);
      assert.equal(r.stdout.length, 6_000_000 - late.from);
    });

    test('a timeout kills the whole process group within ~100 ms', async () => {
      const h = await client.run({ args: ['sh', '-c', 'sleep 30 & sleep 30'], timeoutMs: 300 });
      const r = await collect(h);
      assert.equal(r.exit.timedOut, true);
      assert.equal(r.exit.signal, 'SIGKILL');
      assert.equal(r.exit.exitCode, null);
      assert.ok(r.exit.durationMs >= 290 && r.exit.durationMs < 450, `ended after ${r.exit.durationMs} ms`);
    });

    test('signal reaches a running command, and says false once it has ended', async () => {
      const h = await client.run({ args: ['sleep', '30'] });
      assert.equal(await client.signal(h.id, 15), true);
      assert.equal((await h.exited).signal, 'SIGTERM');
      assert.equal(await client.signal(h.id, 15), false);
      assert.equal((await agentError(client.signal('999999999', 15))).code, 'ESRCH');
    });

    test('aborting a run kills its command', async () => {
      const ac = new AbortController();
      const h = await client.run({ args: ['sleep', '30'] }, { signal: ac.signal });
      ac.abort();
      const exit = await h.exited;
      assert.equal(exit.signal, 'SIGKILL');
      assert.ok(exit.durationMs < 1000, `ended after ${exit.durationMs} ms`);
    });

    test('stdin of a background command can be written over its own connection', async () => {
      const h = await client.run({ args: ['cat'], stdin: true });
      const out = collect(h);
      await client.stdin(h.id, Buffer.from('one\0'));
      await client.stdin(
        h.id,
        (async function* () {
          yield Buffer.from('two');
          yield Buffer.from('three');
        })(),
        true,
      );
      const r = await out;
      assert.equal(r.stdout.toString('latin1'), 'one\0twothree');
    });

    test('a PTY is a terminal of its own: tty names /dev/pts/N, stty sees a resize', async () => {
      const h = await client.run({ args: ['sh', '-i'], pty: { cols: 80, rows: 24 }, env: { PS1: '$ ' } });
      let text = '';
      const seen = (re: RegExp): Promise<void> =>
        eventually(
          `terminal output matching ${re}`,
          async () => {
            if (!re.test(text)) throw new Error(text);
          },
          5000,
        );
      h.onOutput((s, d) => {
        assert.equal(s, 'stdout', "a PTY's output is all stdout");
        text += d.toString();
      });
      h.write(Buffer.from('tty\n'));
      await seen(/\/dev\/pts\/\d+/);
      h.write(Buffer.from('stty size\n'));
      await seen(/24 80/);
      await client.resize(h.id, 100, 40);
      h.write(Buffer.from('stty size\n'));
      await seen(/40 100/);
      h.resize(120, 50);
      h.write(Buffer.from('stty size; exit 7\n'));
      assert.equal((await h.exited).exitCode, 7);
      assert.match(text, /50 120/);
    });

    test('a 1 MiB random file is written and read back byte for byte', async () => {
      const data = randomBytes(1 << 20);
      const w = await client.write(join(dir, 'deep/er/blob.bin'), data);
      assert.deepEqual(w, { path: join(dir, 'deep/er/blob.bin'), size: data.length });
      const r = await client.read(join(dir, 'deep/er/blob.bin'));
      assert.equal(r.size, data.length);
      const chunks: Buffer[] = [];
      for await (const c of r.stream) chunks.push(c as Buffer);
      assert.ok(Buffer.concat(chunks).equals(data), 'the same bytes');
      // append adds; a stream is accepted as data; mode is kept
      await client.write(join(dir, 'log.txt'), Buffer.from('a'), { mode: 0o600 });
      await client.write(
        join(dir, 'log.txt'),
        (async function* () {
          yield Buffer.from('b');
        })(),
        { append: true },
      );
      const info = await client.stat(join(dir, 'log.txt'));
      assert.deepEqual([info.size, info.mode, info.type, info.name], [2, 0o600, 'file', 'log.txt']);
    });

    test('a large file comes raw, byte for byte; /proc files by their contents, not their size', async () => {
      const data = randomBytes(3 << 20);
      await client.write(join(dir, 'big.bin'), data);
      const r = await client.read(join(dir, 'big.bin'));
      const chunks: Buffer[] = [];
      for await (const c of r.stream) chunks.push(c as Buffer);
      assert.equal(r.size, data.length);
      assert.ok(Buffer.concat(chunks).equals(data), 'the same bytes');
      // /proc/self/status has size 0 and a few KiB of text
      const p = await client.read('/proc/self/status');
      let text = '';
      for await (const c of p.stream) text += (c as Buffer).toString();
      assert.match(text, /^Name:/);
    });

    test('a file that shrinks while it is read ends the read with an error, not a short file', async () => {
      const path = join(dir, 'shrinks.bin');
      await client.write(path, Buffer.alloc(64 << 20, 7));
      const r = await client.read(path);
      const it = r.stream[Symbol.asyncIterator]();
      await it.next(); // the agent is sending; most of the file is still to come
      await truncate(path, 1 << 20);
      const err = await (async () => {
        try {
          for (let c = await it.next(); !c.done; c = await it.next());
        } catch (e) {
          return e as Error;
        }
        return undefined;
      })();
      assert.ok(err, 'the read failed');
      assert.match(err.message, /ended after|ECONNRESET|reset/);
    });

    test('stat, ls, mkdir, rename and remove do what they say; errors keep their errno', async () => {
      const base = join(dir, 'tree');
      assert.equal(await client.mkdir(join(base, 'a/b')), true);
      assert.equal(await client.mkdir(join(base, 'a/b')), false);
      await client.write(join(base, 'a/one.txt'), Buffer.from('1'));
      await writeFile(join(base, 'z.txt'), '22');
      const depth1 = await client.ls(base);
      assert.deepEqual(
        depth1.map((e) => [e.path, e.type]),
        [
          [join(base, 'a'), 'dir'],
          [join(base, 'z.txt'), 'file'],
        ],
      );
      const depth2 = await client.ls(base, 2);
      assert.deepEqual(
        depth2.map((e) => e.name),
        ['a', 'b', 'one.txt', 'z.txt'],
      );
      await client.rename(join(base, 'z.txt'), join(base, 'a/z.txt'));
      assert.equal((await client.stat(join(base, 'a/z.txt'))).size, 2);
      assert.equal((await agentError(client.stat(join(base, 'z.txt')))).code, 'ENOENT');
      assert.equal((await agentError(client.read(join(base, 'a')))).code, 'EISDIR');
      assert.equal((await agentError(client.ls(join(base, 'a/z.txt')))).code, 'ENOTDIR');
      await client.remove(base);
      assert.equal((await agentError(client.stat(base))).code, 'ENOENT');
      assert.equal((await agentError(client.remove(base))).code, 'ENOENT');
    });

    test('watch sees a file created, written and removed', async () => {
      const base = join(dir, 'watched');
      await client.mkdir(join(base, 'sub'));
      const events: WatchEvent[] = [];
      const w = await client.watch(base, true, (e) => events.push(e));
      await client.write(join(base, 'sub/new.txt'), Buffer.from('x'));
      await collect(
        await client.run({ args: ['sh', '-c', `echo more >> ${base}/sub/new.txt; rm ${base}/sub/new.txt`] }),
      );
      const has = (type: string): boolean =>
        events.some((e) => e.type === type && e.path === join(base, 'sub/new.txt'));
      await eventually(
        'create, write and remove events',
        async () => assert.ok(has('create') && has('write') && has('remove'), JSON.stringify(events)),
        5000,
      );
      assert.ok(
        !events.some((e) => e.path.includes('.dormant-')),
        'the temp file of a write is not reported',
      );
      w.close();
      await w.closed;
    });

    test('a bad token is refused', async () => {
      const bad = new AgentClient({ ...client.addr, token: 'not-the-token' });
      assert.equal((await agentError(bad.ping())).code, 'EAUTH');
    });

    test('a frame larger than 1 MiB is refused by the agent', async () => {
      const sock = connect(client.addr.port, '127.0.0.1');
      await once(sock, 'connect');
      const head = Buffer.from([0x51, 0, 0x20, 0, 0]); // Q, 2 MiB
      sock.write(head);
      const chunks: Buffer[] = [];
      sock.on('data', (d: Buffer) => chunks.push(d));
      await once(sock, 'close');
      const answer = Buffer.concat(chunks);
      assert.equal(String.fromCharCode(answer[0]!), '!');
      assert.match(answer.subarray(5).toString(), /"code":"E2BIG"/);
    });

    test("a raw read's bytes come through the socket's big reads exact: short reads copied, long ones handed on", async () => {
      // Small pieces first (each read short: copied out of a buffer that is then used again),
      // then one burst (reads of up to 1 MiB handed on as they are): a buffer used again
      // before its bytes were copied would show as changed bytes here.
      const small = randomBytes(200 * 1000);
      const burst = randomBytes(6 << 20);
      const data = Buffer.concat([small, burst]);
      const server = createServer((s) => {
        s.once('data', () => {
          const json = Buffer.from(JSON.stringify({ size: data.length, raw: true }));
          const head = Buffer.alloc(5);
          head.write('R', 0, 'latin1');
          head.writeUInt32BE(json.length, 1);
          s.write(Buffer.concat([head, json]));
          void (async () => {
            for (let at = 0; at < small.length; at += 1000) {
              s.write(small.subarray(at, at + 1000));
              await new Promise((r) => setTimeout(r, at % 20_000 === 0 ? 2 : 0));
            }
            s.end(burst);
          })();
        });
      });
      server.listen(0, '127.0.0.1');
      await once(server, 'listening');
      try {
        const { port } = server.address() as { port: number };
        const fake = new AgentClient({ host: '127.0.0.1', port, token: 'x' });
        const r = await fake.read('/f');
        assert.equal(r.size, data.length);
        const chunks: Buffer[] = [];
        // consumed only at the end: every chunk stays held while later reads arrive
        await new Promise((res) => setTimeout(res, 300));
        // 'data' events, one per chunk pushed (an async iterator would join buffered chunks)
        r.stream.on('data', (c: Buffer) => chunks.push(c));
        await finished(r.stream);
        assert.ok(Buffer.concat(chunks).equals(data), 'the same bytes');
        const largest = Math.max(...chunks.map((c) => c.length));
        assert.ok(largest > 64 << 10, `reads larger than 64 KiB (the largest chunk: ${largest} bytes)`);
      } finally {
        server.close();
      }
    });

    test('the client refuses an oversized or malformed answer from whatever listens there', async () => {
      const server = createServer((s) => {
        s.once('data', () => s.end(Buffer.from([0x52, 0x7f, 0, 0, 0]))); // R of 2 GiB
      });
      server.listen(0, '127.0.0.1');
      await once(server, 'listening');
      try {
        const { port } = server.address() as { port: number };
        const impostor = new AgentClient({ host: '127.0.0.1', port, token: 'x' });
        assert.equal((await agentError(impostor.ping())).code, 'EPROTO');
      } finally {
        server.close();
      }
    });
  },
);
