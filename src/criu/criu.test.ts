/**
 * The real CRIU, driven through dormant's own code: a process serving HTTP on a TCP port is
 * checkpointed and restored, and its answers prove its memory survived, not just its PID.
 */
import { after, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { mkdtemp, rm, readdir } from 'node:fs/promises';
import { readFileSync } from 'node:fs';
import { DormantError, ErrorCode } from '../domain/errors.js';
import { criuEnvironment, dumpProcess, getCriu, restoreProcess } from './criu.js';
import { eventually, freePort, httpGet } from '../api/testing/host.js';
import { pythonServer } from '../api/testing/servers.js';

const PYTHON = '/usr/bin/python3';

/** A tiny HTTP server whose state lives only in its memory: a counter and a random token. */
const SERVER = pythonServer({
  setup: 'import os, sys\ntoken = os.urandom(8).hex()',
  answer: '"%d %s %d\\n" % (count, token, os.getpid())',
  host: '"127.0.0.1"',
  port: 'int(sys.argv[1])',
});

function alive(pid: number): boolean {
  try {
    return !/^\d+ \(.*\) [ZX]/.test(readFileSync(`/proc/${pid}/stat`, 'utf8'));
  } catch {
    return false;
  }
}

/** The server's answer, without its newline. */
const get = async (port: number): Promise<string> => (await httpGet('127.0.0.1', port)).trim();

describe('criu through dormant', () => {
  const pids: number[] = [];
  const dirs: string[] = [];
  after(async () => {
    for (const pid of pids) if (alive(pid)) process.kill(pid, 'SIGKILL');
    for (const d of dirs) await rm(d, { recursive: true, force: true });
  });

  test('this node needs the breakpoint fallback exactly when criu check says so', async () => {
    const criu = await getCriu();
    assert.deepEqual(criu.env, criuEnvironment(criu.check));
    if (!criu.check.hardwareBreakpointsWork) assert.equal(criu.env.CRIU_FAULT, '130');
    assert.deepEqual(criuEnvironment({ hardwareBreakpointsWork: false }), { CRIU_FAULT: '130' });
    assert.deepEqual(criuEnvironment({ hardwareBreakpointsWork: true }), {});
  });

  test('an HTTP server is checkpointed, killed, restored, and carries on counting', async () => {
    const port = await freePort();
    // Its own session (detached) and /dev/null for stdio: CRIU cannot dump a host file as stdio.
    const child = spawn(PYTHON, ['-c', SERVER, String(port)], { detached: true, stdio: 'ignore' });
    const pid = child.pid!;
    pids.push(pid);
    child.unref();

    const first = await eventually('server', () => get(port), 10_000);
    const [, token, pidInside] = first.split(' ');
    assert.equal(first.split(' ')[0], '1');
    assert.equal(await get(port), `2 ${token} ${pidInside}`);
    assert.equal(await get(port), `3 ${token} ${pidInside}`);

    // Images go to a memory-backed folder, as the design requires for real checkpoints.
    const images = await mkdtemp('/dev/shm/dormant-criu-test-');
    dirs.push(images);
    const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()));
    await dumpProcess({ pid, imagesDir: images, timeoutMs: 60_000 });
    await exited;
    assert.equal(alive(pid), false, 'after a dump without --leave-running the process is gone');
    await assert.rejects(get(port), 'nothing listens while it is checkpointed');
    const files = await readdir(images);
    assert.ok(
      files.some((f) => f.startsWith('pages-')),
      `memory pages were written (${files.join(', ')})`,
    );

    const restored = await restoreProcess({ imagesDir: images, timeoutMs: 60_000 });
    assert.equal(restored.pid, pid, 'CRIU restores the same PID');
    assert.ok(alive(pid));
    // The counter and the random token were only ever in the process's memory.
    assert.equal(await eventually('restored server', () => get(port), 10_000), `4 ${token} ${pidInside}`);
    assert.equal(await get(port), `5 ${token} ${pidInside}`);
  });

  test('a failed dump is CRIU_DUMP_FAILED and carries criu log', async () => {
    const images = await mkdtemp('/dev/shm/dormant-criu-test-');
    dirs.push(images);
    // No such process: criu must fail cleanly, and say so in its log.
    const err = await dumpProcess({ pid: 999_999_999, imagesDir: images, timeoutMs: 30_000 }).then(
      () => assert.fail('dump of a non-existent pid succeeded'),
      (e: unknown) => e,
    );
    assert.ok(err instanceof DormantError);
    assert.equal(err.code, ErrorCode.CRIU_DUMP_FAILED);
    assert.match(err.message, /criu log/);
    assert.ok(typeof err.details?.log === 'string' && err.details.log.length > 0);
  });

  test('a failed restore leaves the images in place and says why', async () => {
    const images = await mkdtemp('/dev/shm/dormant-criu-test-');
    dirs.push(images);
    const err = await restoreProcess({ imagesDir: images, timeoutMs: 30_000 }).then(
      () => assert.fail('restore from an empty folder succeeded'),
      (e: unknown) => e,
    );
    assert.ok(err instanceof DormantError);
    assert.equal(err.code, ErrorCode.CRIU_RESTORE_FAILED);
    assert.match(err.message, /criu log/);
  });
});
