import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { DormantError, ErrorCode } from '../domain/errors.js';
import { run, which } from './exec.js';
import { launcherPid, useLauncher } from './launcher.js';

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** A process that still runs (a zombie waiting for its reaper does not count). */
function alive(pid: number): boolean {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    return !/^\d+ \(.*\) [ZX]/.test(stat);
  } catch {
    return false;
  }
}

async function rejection(p: Promise<unknown>): Promise<DormantError> {
  try {
    await p;
  } catch (e) {
    assert.ok(e instanceof DormantError, `expected a DormantError, got ${String(e)}`);
    return e;
  }
  assert.fail('expected the command to fail');
}

describe('run()', () => {
  test('returns stdout, stderr and the exit code', async () => {
    const r = await run('sh', ['-c', 'echo out; echo err >&2']);
    assert.equal(r.stdout, 'out\n');
    assert.equal(r.stderr, 'err\n');
    assert.equal(r.exitCode, 0);
  });

  test('passes the environment it is given, and input on stdin', async () => {
    const r = await run('sh', ['-c', 'printf "%s:" "$DORMANT_TEST_VAR"; cat'], {
      env: { DORMANT_TEST_VAR: 'hello' },
      input: 'from-stdin',
    });
    assert.equal(r.stdout, 'hello:from-stdin');
  });

  test('a failing command is reported with its exit code and output', async () => {
    const e = await rejection(run('sh', ['-c', 'echo "what went wrong" >&2; exit 3']));
    assert.equal(e.code, ErrorCode.COMMAND_FAILED);
    assert.match(e.message, /exited with 3/);
    assert.match(e.message, /what went wrong/);
    assert.equal(e.details?.exitCode, 3);
  });

  test('accepts the exit codes it is told are fine', async () => {
    const r = await run('sh', ['-c', 'exit 1'], { okExitCodes: [0, 1] });
    assert.equal(r.exitCode, 1);
  });

  test('a stuck command is killed at its timeout, with its helpers, and its output is in the error', async () => {
    // The shell starts a helper (sleep) and reports both PIDs, then hangs.
    const started = Date.now();
    const e = await rejection(
      run('sh', ['-c', 'sleep 1000 & echo "shell=$$ helper=$!"; echo "partial progress" >&2; wait'], {
        timeoutMs: 500,
      }),
    );
    assert.equal(e.code, ErrorCode.COMMAND_TIMEOUT);
    assert.match(e.message, /killed after 500 ms timeout/);
    assert.match(e.message, /partial progress/);
    assert.ok(Date.now() - started < 5000, 'the timeout fired promptly');
    const m = /shell=(\d+) helper=(\d+)/.exec(e.message);
    assert.ok(m, 'the output carries the PIDs');
    await new Promise((r) => setTimeout(r, 100));
    assert.equal(alive(Number(m[1])), false, 'the command is gone');
    assert.equal(alive(Number(m[2])), false, 'its helper in the same process group is gone');
  });

  test('a command that ignores SIGTERM is killed with SIGKILL after the grace period', async () => {
    const e = await rejection(
      run('sh', ['-c', "trap '' TERM; echo ready; while :; do sleep 0.05; done"], {
        timeoutMs: 300,
        killGraceMs: 300,
      }),
    );
    assert.equal(e.code, ErrorCode.COMMAND_TIMEOUT);
    assert.equal(e.details?.signal, 'SIGKILL');
    assert.match(e.message, /ready/);
  });

  test('an abort signal stops the command', async () => {
    const ac = new AbortController();
    setTimeout(() => ac.abort(new Error('user cancelled')), 200);
    const e = await rejection(run('sleep', ['1000'], { signal: ac.signal, timeoutMs: 60_000 }));
    assert.equal(e.code, ErrorCode.COMMAND_ABORTED);
  });

  test('an already aborted signal never starts the command', async () => {
    const e = await rejection(run('sleep', ['1000'], { signal: AbortSignal.abort() }));
    assert.equal(e.code, ErrorCode.COMMAND_ABORTED);
  });

  test('a missing program is COMMAND_NOT_FOUND with a hint', async () => {
    const e = await rejection(run('/nonexistent/dormant-no-such-tool', []));
    assert.equal(e.code, ErrorCode.COMMAND_NOT_FOUND);
    assert.ok(e.hint);
  });

  test('keeps only the tail of very long output', async () => {
    const r = await run('sh', ['-c', 'seq 1 200000'], { maxOutputBytes: 1000 });
    assert.equal(r.truncated, true);
    assert.ok(r.stdout.length <= 1000);
    assert.ok(r.stdout.endsWith('200000\n'));
  });

  test('does not wait for a daemonised grandchild holding the pipes', async () => {
    const r = await run('sh', ['-c', 'sleep 30 & echo $!'], { timeoutMs: 10_000 });
    const pid = Number(r.stdout.trim());
    try {
      assert.equal(r.exitCode, 0);
      assert.ok(r.durationMs < 5000);
    } finally {
      process.kill(pid, 'SIGKILL');
    }
  });
});

describe('the command launcher', () => {
  test('starts the commands: their parent is the launcher, not this process', async () => {
    const r = await run('sh', ['-c', 'echo $PPID']);
    const launcher = launcherPid();
    assert.ok(launcher !== undefined, 'a launcher runs');
    assert.notEqual(launcher, process.pid);
    assert.equal(Number(r.stdout.trim()), launcher);
  });

  test('a launcher that dies fails the commands it ran, kills them, and the next command starts a new one', async () => {
    let sleeper = 0;
    const running = run('sh', ['-c', 'echo $$; exec sleep 30'], {
      timeoutMs: 20_000,
      onStdout: (b) => (sleeper = Number(b.toString().trim())),
    });
    const old = launcherPid()!;
    for (let i = 0; i < 100 && sleeper === 0; i++) await sleep(20);
    assert.ok(sleeper > 0 && alive(sleeper), 'the command runs');
    process.kill(old, 'SIGKILL');
    const e = await rejection(running);
    assert.equal(e.code, ErrorCode.COMMAND_FAILED);
    assert.match(e.message, /launcher died/);
    for (let i = 0; i < 100 && alive(sleeper); i++) await sleep(20);
    assert.equal(alive(sleeper), false, 'its command was killed');
    const r = await run('sh', ['-c', 'echo $PPID']);
    assert.equal(Number(r.stdout.trim()), launcherPid());
    assert.notEqual(launcherPid(), old);
  });

  test('a Ctrl-C or hangup meant for the daemon does not end the launcher or its commands', async () => {
    const running = run('sh', ['-c', 'sleep 0.5; echo done'], { timeoutMs: 10_000 });
    await sleep(50);
    const pid = launcherPid()!;
    process.kill(pid, 'SIGINT');
    process.kill(pid, 'SIGHUP');
    assert.equal((await running).stdout, 'done\n');
    assert.equal(launcherPid(), pid);
    assert.ok(alive(pid));
  });

  test('a command that writes without end waits for the daemon to read: the launcher does not hold its output', async () => {
    const running = run('yes', [], { timeoutMs: 4000, maxOutputBytes: 4096 }).catch((e: unknown) => e);
    await sleep(200);
    const pid = launcherPid()!;
    // The daemon's event loop busy for 1.5 s: nothing reads the launcher's messages meanwhile.
    const until = Date.now() + 1500;
    while (Date.now() < until) {
      // busy
    }
    const rssKiB = Number(/VmRSS:\s+(\d+)/.exec(readFileSync(`/proc/${pid}/status`, 'utf8'))![1]);
    assert.ok(rssKiB < 120 * 1024, `the launcher holds ${Math.round(rssKiB / 1024)} MiB`);
    const e = await running;
    assert.ok(e instanceof DormantError && e.code === ErrorCode.COMMAND_TIMEOUT, String(e));
  });

  test('a process that ran commands exits when its work is done, even with a grandchild holding their pipes', async () => {
    const script = `
      const { run } = await import(${JSON.stringify(new URL('./exec.js', import.meta.url).href)});
      const r = await run('sh', ['-c', 'sleep 30 & echo $!']);
      console.log(r.stdout.trim());
    `;
    const t0 = performance.now();
    const r = await run(process.execPath, ['--input-type=module', '-e', script], { timeoutMs: 15_000 });
    const grandchild = Number(r.stdout.trim());
    try {
      assert.ok(performance.now() - t0 < 10_000, 'it did not wait for the grandchild');
    } finally {
      process.kill(grandchild, 'SIGKILL');
    }
  });

  test('turned off, commands are spawned by this process', async () => {
    useLauncher(false);
    try {
      const r = await run('sh', ['-c', 'echo $PPID']);
      assert.equal(Number(r.stdout.trim()), process.pid);
      assert.equal(launcherPid(), undefined);
    } finally {
      useLauncher(true);
    }
  });
});

describe('which()', () => {
  test('finds programs on PATH and not elsewhere', async () => {
    assert.ok((await which('sh'))?.endsWith('/sh'));
    assert.equal(await which('sh', '/nonexistent'), undefined);
  });
});
