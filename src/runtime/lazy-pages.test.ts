/**
 * RuncRuntime.endLazyPages: a `criu lazy-pages` orphaned by a daemon that died is found by the
 * work dir it serves and ended; one serving another work dir is left alone. Stand-ins carry
 * the same arguments (a real one needs a restore in flight; the crash tests cover that).
 */
import { after, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync } from 'node:fs';
import { mkdtemp, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { RuncRuntime } from './runc.js';

const started: ChildProcess[] = [];
let tmp: string | undefined;

after(async () => {
  for (const c of started) if (c.exitCode === null && c.signalCode === null) c.kill('SIGKILL');
  if (tmp !== undefined) await rm(tmp, { recursive: true, force: true });
});

function standIn(workDir: string): Promise<ChildProcess> {
  const c = spawn(
    process.execPath,
    [
      '-e',
      'setInterval(() => {}, 1000); console.log("up")',
      'lazy-pages',
      '--images-dir',
      '/x',
      '--work-dir',
      workDir,
    ],
    { stdio: ['ignore', 'pipe', 'ignore'] },
  );
  started.push(c);
  return new Promise((resolve, reject) => {
    c.stdout.once('data', () => resolve(c));
    c.once('error', reject);
  });
}

test('endLazyPages ends the lazy-pages daemon of that work dir only', async () => {
  tmp = await mkdtemp('/tmp/dormant-lazy-pages-');
  const rt = new RuncRuntime({ stateDir: join(tmp, 'state'), criuPath: 'criu' });
  const mine = await standIn(join(tmp, 'a', 'work'));
  const other = await standIn(join(tmp, 'b', 'work'));
  const exited = new Promise<NodeJS.Signals | null>((r) => mine.once('exit', (_c, s) => r(s)));
  // The work dir is matched resolved, as the runtime passed it to criu.
  const ended = await rt.endLazyPages(join(tmp, 'a', '.', 'work'));
  assert.deepEqual(ended, [mine.pid]);
  assert.equal(await exited, 'SIGKILL');
  assert.ok(existsSync(`/proc/${String(other.pid)}`), 'the other work dir keeps its daemon');
  assert.deepEqual(await rt.endLazyPages(join(tmp, 'c', 'work')), [], 'none: nothing to end');
});
