/**
 * Metering on a real run: sandboxes on runc, one hibernated; the report's memory figures agree
 * with what the cgroups showed, and its storage figure with the vault's own statistics.
 */
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { join } from 'node:path';
import { type Daemon } from '../daemon/daemon.js';
import { DormantClient } from '../sdk/client.js';
import { startTestDaemon, tearDown, testFolder } from './testing/daemon.js';
import { cgroupUsage } from '../sys/cgroup.js';

const HOLDER = `
import os, time
blob = bytearray(os.urandom(48 * 1024 * 1024))
print("holding", flush=True)
while True:
    time.sleep(1)
`;

interface CostAnswer {
  totals: {
    spent: number;
    alwaysWarm: number;
    saved: number;
    savedRatio: number;
    memoryHoursFreed: number;
    storageGiBMonths: number;
  };
  sandboxes: {
    sandboxId: string;
    spent: number;
    averageResidentBytes: number;
    secondsByState: Record<string, number>;
    storageGiBMonths: number;
  }[];
  neverSlept: { sandboxId: string }[];
  capacity: { warm: number; hibernated: number; averageResidentBytes: number };
}

let dir: string;
let daemon: Daemon;
let client: DormantClient;

before(async () => {
  ({ dir } = await testFolder('cost', { 'srv/holder.py': HOLDER }));
  ({ daemon, client } = await startTestDaemon({
    dataDir: join(dir, 'data'),
    meterIntervalMs: 60_000,
  }));
});

after(() => tearDown(dir, daemon));

test('cost report on a real run agrees with the cgroups and with vault stats', async () => {
  const cmd = ['/usr/bin/python3', '-u', '/srv/holder.py'];
  const sleeper = await client.createSandbox({ name: 'sleeper', rootfs: join(dir, 'rootfs'), command: cmd });
  const awake = await client.createSandbox({ name: 'awake', rootfs: join(dir, 'rootfs'), command: cmd });
  const deadline = Date.now() + 30_000;
  while (!/holding/.test(await client.logs(sleeper.id)) || !/holding/.test(await client.logs(awake.id))) {
    assert.ok(Date.now() < deadline, 'holders start');
    await new Promise((r) => setTimeout(r, 200));
  }
  // Samples taken by the meter, compared with the cgroup read at the same moment.
  await daemon.meter.sample();
  const cg = await cgroupUsage(`/dormant/${sleeper.id}`);
  const sampled = (await daemon.store.samples()).filter((s) => s.sandboxId === sleeper.id).at(-1)!;
  assert.ok(cg && cg.memoryBytes > 48 * 1024 * 1024);
  assert.ok(
    Math.abs(sampled.memoryBytes - cg.memoryBytes) / cg.memoryBytes < 0.05,
    `sample ${sampled.memoryBytes} vs cgroup ${cg.memoryBytes}`,
  );
  await new Promise((r) => setTimeout(r, 1500));
  await daemon.meter.sample();

  await client.hibernate(sleeper.id);
  await new Promise((r) => setTimeout(r, 1500));
  await daemon.meter.sample();

  const r = await client.request<CostAnswer>('GET', '/v1/cost');
  const s = r.sandboxes.find((x) => x.sandboxId === sleeper.id)!;
  const a = r.sandboxes.find((x) => x.sandboxId === awake.id)!;
  assert.ok(s.secondsByState.hibernated! > 1, 'the sleeper spent time hibernated');
  assert.ok(
    Math.abs(s.averageResidentBytes - cg.memoryBytes) / cg.memoryBytes < 0.1,
    `average resident ${s.averageResidentBytes} near the cgroup's ${cg.memoryBytes}`,
  );
  assert.deepEqual(
    r.neverSlept.map((n) => n.sandboxId),
    [awake.id],
  );
  assert.ok(r.totals.saved > 0 && r.totals.savedRatio > 0, 'sleeping saved something');
  assert.ok(a.spent > 0);

  // Storage: what the report charges for is what the vault says it stores for the tenant.
  const stats = await daemon.vault.stats();
  const vaultStored = stats.total.storedBytes;
  const recorded = (await daemon.store.listCheckpoints({ sandboxId: sleeper.id })).reduce(
    (n, c) => n + c.storedBytes,
    0,
  );
  assert.ok(vaultStored > 0);
  assert.ok(
    Math.abs(recorded - vaultStored) / vaultStored < 0.1,
    `checkpoint records ${recorded} vs vault stats ${vaultStored}`,
  );
  assert.ok(s.storageGiBMonths > 0);

  // A series for a chart: cumulative, ending at the totals.
  const withSeries = await client.request<
    CostAnswer & { series: { at: string; spent: number; alwaysWarm: number }[] }
  >('GET', '/v1/cost?points=5');
  assert.equal(withSeries.series.length, 5);
  for (let i = 1; i < 5; i++) assert.ok(withSeries.series[i]!.spent >= withSeries.series[i - 1]!.spent);
  const last = withSeries.series[4]!;
  assert.ok(
    Math.abs(last.alwaysWarm - withSeries.totals.alwaysWarm) <= 0.05 * withSeries.totals.alwaysWarm + 1e-12,
  );

  const bad = await client.request('GET', '/v1/cost?since=yesterday').catch((e: unknown) => e);
  assert.ok(bad instanceof Error && /invalid since/.test(bad.message));
});
