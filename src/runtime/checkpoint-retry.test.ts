/**
 * A dump CRIU gives up on because it could not seize the tasks within its own timeout (a task
 * in uninterruptible sleep on a busy node: `Timeout reached`, `Unseizable non-zombie ... state
 * D`) leaves the sandbox running: the runtime tries once more, and only once. Real runc and
 * CRIU; runc is reached through a wrapper that makes the first `runc checkpoint` (or every one)
 * fail the way CRIU does, writing the same lines into the dump log.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { chmod, readFile, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { ErrorCode, isDormantError } from '../domain/errors.js';
import { run } from '../sys/exec.js';
import { RuncRuntime } from './runc.js';
import {
  cannotRun,
  CRIU,
  removeRuntimeFolders,
  runtimeFolders,
  type RuntimeFolders,
  waitFor,
} from './testing/host.js';

const skip = await cannotRun('criu');

const runcPath = (await run('sh', ['-c', 'command -v runc'], { timeoutMs: 5000 })).stdout.trim();

/**
 * A runc that fails `checkpoint` as CRIU does when it cannot seize a task, the first `fails`
 * times (counted in `counter`), and is the real runc otherwise.
 */
function wrapper(counter: string, fails: number): string {
  return `#!/bin/sh
case " $* " in
  *" checkpoint "*)
    n=$(cat '${counter}' 2>/dev/null || echo 0); n=$((n+1)); echo $n > '${counter}'
    if [ $n -le ${String(fails)} ]; then
      work=''; prev=''
      for a in "$@"; do [ "$prev" = --work-path ] && work="$a"; prev="$a"; done
      mkdir -p "$work"
      printf '(10.067910) Error (criu/cr-dump.c:1655): Timeout reached. Try to interrupt: 0\\n(10.068100) Error (compel/src/lib/infect.c:262): Unseizable non-zombie 6395 found, state D, err -1/4\\n(10.073057) Error (criu/cr-dump.c:1975): Dumping FAILED.\\n' > "$work/dump.log"
      echo 'criu failed: type NOTIFY errno 0' >&2
      exit 1
    fi;;
esac
exec '${runcPath}' "$@"
`;
}

describe('a dump CRIU could not seize the tasks for is tried once more (real runc + CRIU)', { skip }, () => {
  let folders: RuntimeFolders;
  const runtimes: RuncRuntime[] = [];
  const suffix = randomBytes(3).toString('hex');

  before(async () => {
    folders = await runtimeFolders('ckretry');
  });
  after(() => removeRuntimeFolders(folders, runtimes));

  async function sandbox(
    name: string,
    fails: number,
  ): Promise<{ rt: RuncRuntime; id: string; counter: string }> {
    const counter = join(folders.tmp, `${name}.count`);
    const path = join(folders.tmp, `${name}-runc`);
    await writeFile(path, wrapper(counter, fails));
    await chmod(path, 0o755);
    const rt = new RuncRuntime({ stateDir: join(folders.tmp, name), criuPath: CRIU, runcPath: path });
    runtimes.push(rt);
    const id = `${name}-${suffix}`;
    await rt.create({
      id,
      rootfs: folders.rootfs,
      args: [
        'sh',
        '-c',
        'v=$RANDOM$RANDOM; i=0; while true; do i=$((i+1)); echo "$v $i" > /tmp/s; sleep 0.1; done',
      ],
      limits: { memoryBytes: 64 * 1024 * 1024, pids: 32 },
    });
    await rt.start(id);
    await waitFor('the loop runs', async () =>
      (await rt.exec(id, ['cat', '/tmp/s'])).exitCode === 0 ? true : undefined,
    );
    return { rt, id, counter };
  }

  test('a first failure to seize is retried: the checkpoint is taken and restores with its memory', async () => {
    const { rt, id, counter } = await sandbox('once', 1);
    const before = (await rt.exec(id, ['cat', '/tmp/s'])).stdout.trim().split(' ');
    const imagesDir = join(folders.shm, 'once');
    await rt.checkpoint(id, { imagesDir, workDir: join(folders.tmp, 'once-work') });
    assert.equal((await readFile(counter, 'utf8')).trim(), '2', 'runc checkpoint ran twice');
    assert.equal((await rt.state(id)).status, 'absent');
    await rt.restore(id, { imagesDir, workDir: join(folders.tmp, 'once-restore') });
    const after = (await rt.exec(id, ['cat', '/tmp/s'])).stdout.trim().split(' ');
    assert.equal(after[0], before[0], 'the value drawn at start is still in memory');
    assert.ok(Number(after[1]) >= Number(before[1]), 'the counter went on');
  });

  test('a second failure is the error, the sandbox runs on, and no third try is made', async () => {
    const { rt, id, counter } = await sandbox('always', 5);
    await assert.rejects(
      rt.checkpoint(id, {
        imagesDir: join(folders.shm, 'always'),
        workDir: join(folders.tmp, 'always-work'),
      }),
      (e: unknown) =>
        isDormantError(e, ErrorCode.RUNTIME_CHECKPOINT_FAILED) && /Unseizable non-zombie/.test(e.message),
    );
    assert.equal((await readFile(counter, 'utf8')).trim(), '2', 'runc checkpoint ran twice, not more');
    assert.equal((await rt.state(id)).status, 'running');
  });
});
