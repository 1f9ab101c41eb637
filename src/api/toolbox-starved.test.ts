/**
 * A command's output is all there when it ends, even when the sandbox's CPU share starves the
 * agent: the agent reads the exit through a pidfd and answers once the pipes are empty, not
 * after a fixed 50 ms that a throttled pump thread can miss (a loaded CI machine lost `cat`'s
 * whole output that way).
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { join } from 'node:path';
import type { Daemon } from '../daemon/daemon.js';
import type { DormantClient, SandboxInfo } from '../sdk/client.js';
import { startTestDaemon, tearDown, testFolder } from './testing/daemon.js';

describe('the toolbox under a starved CPU share', () => {
  let dir: string;
  let daemon: Daemon;
  let client: DormantClient;
  let sb: SandboxInfo;

  before(async () => {
    let rootfs: string;
    ({ dir, rootfs } = await testFolder('starved'));
    ({ daemon, client } = await startTestDaemon({ dataDir: join(dir, 'data'), policy: false }));
    sb = await client.createSandbox({
      name: 'starved',
      rootfs,
      command: ['/bin/sh', '-c', 'while true; do sleep 1; done'],
      memory: '64M',
      // 1 ms of CPU per 100 ms period: the agent's threads wait tens of ms for their turn.
      cpus: 0.01,
    });
  });

  after(() => tearDown(dir, daemon));

  test('every exec returns all its output', async () => {
    const want = Array.from({ length: 20000 }, (_, i) => `${i + 1}`).join('\n') + '\n';
    for (let i = 0; i < 8; i++) {
      const r = await client.exec(sb.id, ['seq', '1', '20000'], { timeoutMs: 60_000 });
      assert.equal(r.exitCode, 0, r.stderr);
      assert.equal(r.stdout.length, want.length, `round ${i}: ${r.stdout.length} of ${want.length} bytes`);
      assert.equal(r.stdout, want);
    }
  });
});
