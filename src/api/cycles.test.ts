/**
 * Repeated cycles: one sandbox hibernated and resumed many times in a row keeps its memory
 * and its files exactly. A python server holds 16 MiB of random bytes and a counter in
 * memory; the sandbox's filesystem holds a 4 MiB random file and a log that grows by one line
 * per cycle. Every cycle checks the hashes of all of them, the counter, and that only the
 * last two checkpoints are kept; at the end the vault verifies clean and has not grown
 * beyond two checkpoints' worth.
 *
 * Runs 5 cycles by default; DORMANT_TEST_CYCLES=50 runs the full 50 (8.5 minutes on a
 * loaded 2-core machine).
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { join } from 'node:path';
import { stagingDirFor, type Daemon } from '../daemon/daemon.js';
import { DormantClient, type SandboxInfo } from '../sdk/client.js';
import { eventually, httpGet, leftovers, sandboxProcesses } from './testing/host.js';
import { startTestDaemon, tearDown, testFolder } from './testing/daemon.js';
import { pythonServer } from './testing/servers.js';
import { readdir } from 'node:fs/promises';

const CYCLES = Number(process.env.DORMANT_TEST_CYCLES ?? '5');

const SERVER = pythonServer({
  setup: 'import hashlib, os\nblob = bytearray(os.urandom(16 * 1024 * 1024))',
  answer: '"%d %s" % (count, hashlib.sha256(blob).hexdigest())',
});

function stats(xs: number[]): string {
  const s = [...xs].sort((a, b) => a - b);
  const at = (q: number) => s[Math.min(s.length - 1, Math.floor(q * s.length))] ?? 0;
  return `median ${at(0.5)} ms, p90 ${at(0.9)} ms, max ${s.at(-1) ?? 0} ms`;
}

describe(`repeated cycles (DORMANT_TEST_CYCLES=${CYCLES}; set it to 50 for the full run)`, () => {
  let dir: string;
  let daemon: Daemon;
  let client: DormantClient;
  let sb: SandboxInfo | undefined;

  before(async () => {
    ({ dir } = await testFolder('cycles', { 'srv/server.py': SERVER }));
    ({ daemon, client } = await startTestDaemon({ dataDir: join(dir, 'data'), proxy: false, policy: false }));
  });

  after(() => tearDown(dir, daemon));

  test(`${CYCLES} hibernate/resume cycles keep memory and files exactly`, async (t) => {
    sb = await client.createSandbox({
      name: 'cycles',
      rootfs: join(dir, 'rootfs'),
      command: ['/usr/bin/python3', '-u', '/srv/server.py'],
      ports: [8080],
      memory: '256M',
    });
    const id = sb.id;
    const address = sb.address!;
    const get = () => eventually('server', () => httpGet(address, 8080), 30_000);
    const sh = async (script: string): Promise<string> => {
      const r = await client.exec(id, ['sh', '-c', script]);
      assert.equal(r.exitCode, 0, r.stderr);
      return r.stdout;
    };
    const [, memory] = (await get()).split(' ');
    assert.match(memory!, /^[0-9a-f]{64}$/);
    await sh('head -c 4194304 /dev/urandom > /srv/data.bin');
    const file = await sh('sha256sum /srv/data.bin');
    let count = 1;
    let log = '';
    const hib: number[] = [];
    const res: number[] = [];
    for (let i = 1; i <= CYCLES; i++) {
      await sh(`echo cycle-${i} >> /srv/log.txt`);
      log += `cycle-${i}\n`;
      let t0 = Date.now();
      const h = await client.hibernate(id);
      hib.push(Date.now() - t0);
      assert.equal(h.state, 'hibernated', `cycle ${i}`);
      assert.deepEqual(sandboxProcesses(id), [], `cycle ${i}: nothing runs while hibernated`);
      t0 = Date.now();
      assert.equal((await client.resume(id)).state, 'running', `cycle ${i}`);
      res.push(Date.now() - t0);
      count++;
      assert.equal(await get(), `${count} ${memory}`, `cycle ${i}: the counter and the 16 MiB buffer`);
      assert.equal(await sh('sha256sum /srv/data.bin'), file, `cycle ${i}: the 4 MiB file`);
      assert.equal(await sh('cat /srv/log.txt'), log, `cycle ${i}: the growing log`);
      assert.equal(
        (await client.listCheckpoints(id)).length,
        Math.min(i, 2),
        `cycle ${i}: the last two checkpoints are kept`,
      );
    }
    t.diagnostic(`hibernate: ${stats(hib)}; resume: ${stats(res)}; ${CYCLES} cycles`);
    // The last resume's pages may still be streaming in: its staging goes once they are.
    await eventually('staging is empty', async () => {
      assert.deepEqual(await readdir(stagingDirFor(join(dir, 'data'))), [], 'staging is empty');
    });
    const v = await daemon.vault.verify();
    assert.equal(v.ok, true, JSON.stringify(v.problems));
    assert.equal(v.checkpoints, Math.min(CYCLES, 2));
    await daemon.vault.gc();
    const st = await daemon.vault.stats();
    t.diagnostic(`vault after gc: ${JSON.stringify(st).slice(0, 400)}`);
    await client.remove(id);
    sb = undefined;
    assert.deepEqual(leftovers(id), []);
  });
});
