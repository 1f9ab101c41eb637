/**
 * GPU sandboxes through the real daemon (runc, CRIU, SQLite, vault) on a machine without a
 * GPU. A sandbox's GPU state is detected for real: a python process inside maps a file named
 * libcuda.so.1. What no machine here has, an NVIDIA driver with the checkpoint API, is
 * described by a stand-in GpuNode whose CUDA steps only record which pid they were asked for;
 * every policy, refusal and the order of CUDA steps around CRIU are checked against it.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { copyFile, mkdir } from 'node:fs/promises';
import { join } from 'node:path';
import { type Daemon } from '../daemon/daemon.js';
import { DormantClient, type SandboxInfo } from '../sdk/client.js';
import { apiError, startTestDaemon, tearDown, testFolder } from './testing/daemon.js';
import { systemGpuNode, type GpuNode, type GpuSupport } from '../control/gpu.js';
import type { GpuCheckpointFacts } from '../domain/gpu.js';
import { eventually, sandboxProcesses } from './testing/host.js';

const HOLDER = `
import mmap, sys, time
f = open("/opt/cuda/libcuda.so.1", "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
f.close()
print("holding", flush=True)
n = 0
while True:
    n += 1
    time.sleep(0.2)
`;
const PLAIN = 'import time\nprint("plain", flush=True)\nwhile True: time.sleep(0.2)\n';
const M = 60_000;
const H200: GpuCheckpointFacts = {
  driverApiVersion: 12080,
  driverVersion: '570.86.15',
  devices: [{ name: 'NVIDIA H200', memoryBytes: 150_000_000_000 }],
};

describe('GPU sandboxes', () => {
  let dir: string;
  let rootfs: string;
  let daemon: Daemon;
  let client: DormantClient;
  const clock = { t: Date.now(), now: () => clock.t };
  // The node as it is (no driver) until a test describes another.
  const real = systemGpuNode();
  let support: GpuSupport | undefined;
  let facts: GpuCheckpointFacts = H200;
  const steps: string[] = [];
  let failStep: string | undefined;
  const gpu: GpuNode = {
    support: () => (support ? Promise.resolve(support) : real.support()),
    checkpointFacts: () => Promise.resolve(facts),
    holders: (pids) => real.holders(pids),
    processes: (pid1) => real.processes(pid1),
    step: (step, pid) => {
      steps.push(`${step} ${pid}`);
      if (failStep === step) return Promise.reject(new Error(`injected CUDA ${step} failure`));
      return Promise.resolve();
    },
  };
  const supported: GpuSupport = { driverVersion: '570.86.15', checkpointApi: true, helper: '/stand-in' };
  let failNext: string | undefined;

  before(async () => {
    ({ dir, rootfs } = await testFolder('gpu', { 'srv/holder.py': HOLDER, 'srv/plain.py': PLAIN }));
    await mkdir(join(rootfs, 'opt/cuda'), { recursive: true });
    await copyFile('/bin/true', join(rootfs, 'opt/cuda/libcuda.so.1'));
    ({ daemon, client } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      clock,
      proxy: false,
      policy: { intervalMs: 0 },
      gpu,
      failAt: (step) => {
        if (step === failNext) {
          failNext = undefined;
          throw new Error(`injected failure at ${step}`);
        }
      },
    }));
  });

  after(() => tearDown(dir, daemon));

  const create = async (
    name: string,
    script: string,
    extra: { gpus?: string; gpuPolicy?: 'keep-running' | 'filesystem-only' | 'checkpoint' } = {},
  ) => {
    const s = await client.createSandbox({
      name,
      rootfs,
      command: ['/usr/bin/python3', '-u', script],
      memory: '128M',
      ...extra,
    });
    await eventually(`${name} started`, async () => {
      assert.match(await client.logs(s.id), /holding|plain/);
    });
    return s;
  };

  test('create with --gpus on a node without an NVIDIA driver is refused, naming why', async () => {
    support = undefined;
    const e = await apiError(create('nogpu', '/srv/plain.py', { gpus: 'all' }));
    assert.equal(e.code, 'GPU_UNAVAILABLE');
    assert.match(e.message, /cannot create a sandbox with GPUs \(all\): this node has no NVIDIA driver/);
    const bad = await apiError(create('badgpu', '/srv/plain.py', { gpus: 'first' }));
    assert.equal(bad.code, 'INVALID_ARGUMENT');
    assert.match(bad.message, /invalid GPU list "first"/);
    assert.deepEqual(await client.listSandboxes(), []);
  });

  test('detection: a process mapping libcuda is found, a plain sandbox holds nothing; keep-running refuses hibernate', async () => {
    const held = await create('held', '/srv/holder.py');
    const plain = await create('plain', '/srv/plain.py');
    assert.equal(held.gpuPolicy, 'keep-running', 'the default policy');
    assert.equal(held.gpus, null);
    const found = await daemon.controller.gpuHolders(held.id);
    assert.equal(found.length, 1);
    assert.match(found[0]!.evidence.join(), /maps \/opt\/cuda\/libcuda\.so\.1/);
    assert.deepEqual(await daemon.controller.gpuHolders(plain.id), []);

    const e = await apiError(client.hibernate(held.id));
    assert.equal(e.code, 'GPU_KEEP_RUNNING');
    assert.equal(e.status, 409);
    assert.match(
      e.message,
      /holds GPU state \(pid \d+: maps \/opt\/cuda\/libcuda\.so\.1\) and its GPU policy is keep-running: it is not hibernated/,
    );
    assert.match(e.hint ?? '', /dormant archive/);
    const after = await client.getSandbox(held.id);
    assert.equal(after.state, 'running', 'the refusal changed nothing');
    assert.ok(sandboxProcesses(held.id).length > 0);
    assert.equal((await client.hibernate(plain.id)).state, 'hibernated', 'a plain sandbox hibernates');
    await client.remove(plain.id);
  });

  test('idle policy: keep-running is skipped with the reason recorded once; filesystem-only is archived instead', async () => {
    support = undefined;
    const fsOnly = await create('fsonly', '/srv/holder.py', { gpuPolicy: 'filesystem-only' });
    const explicit = await apiError(client.hibernate(fsOnly.id));
    assert.equal(explicit.code, 'GPU_FILESYSTEM_ONLY');
    assert.match(explicit.hint ?? '', new RegExp(`dormant archive ${fsOnly.id}`));
    const loop = daemon.wake.policy!;
    clock.t += 16 * M;
    const first = await loop.tick();
    const byId = new Map(first.map((s) => [s.sandboxId, s]));
    const held = (await client.listSandboxes()).find((s) => s.name === 'held')!;
    assert.match(byId.get(held.id)?.skipped ?? '', /GPU policy is keep-running/);
    assert.equal(byId.get(fsOnly.id)?.action, 'archive');
    assert.match(
      byId.get(fsOnly.id)?.reason ?? '',
      /policy: idle 15m; GPU policy filesystem-only: archived instead of hibernated/,
    );
    assert.equal((await client.getSandbox(held.id)).state, 'running');
    assert.equal((await client.getSandbox(fsOnly.id)).state, 'archived');
    assert.deepEqual(sandboxProcesses(fsOnly.id), []);
    // Later passes look again but do not repeat the note.
    clock.t += 2 * M;
    await loop.tick();
    const notes = (await daemon.store.transitions({ sandboxId: held.id })).filter(
      (t) => t.from === 'running' && t.to === 'running',
    );
    assert.equal(notes.length, 1);
    assert.match(notes[0]!.reason, /^policy: idle 15m; not hibernated: sandbox \S+ holds GPU state/);
    await client.remove(fsOnly.id);
    await client.remove(held.id);
  });

  test('checkpoint policy on a node without the CUDA checkpoint API is refused clearly', async () => {
    support = undefined;
    const s = await create('ckpt-nodrv', '/srv/holder.py', { gpuPolicy: 'checkpoint' });
    const e = await apiError(client.hibernate(s.id));
    assert.equal(e.code, 'GPU_CHECKPOINT_UNSUPPORTED');
    assert.match(
      e.message,
      /GPU policy is checkpoint, but this node has no NVIDIA driver: it is not hibernated/,
    );
    support = { driverVersion: '550.54.15', checkpointApi: false, helper: '/x' };
    const old = await apiError(client.hibernate(s.id));
    assert.match(
      old.message,
      /NVIDIA driver 550\.54\.15 has no CUDA checkpoint API \(cuCheckpointProcess\*, driver 570 or newer\)/,
    );
    support = { ...supported };
    delete support.helper;
    assert.match((await apiError(client.hibernate(s.id))).message, /dormant-cuda-ckpt helper is not built/);
    assert.equal((await client.getSandbox(s.id)).state, 'running');
    assert.deepEqual(steps, [], 'no CUDA step was tried');
    await client.remove(s.id);
  });

  test('checkpoint policy: CUDA lock+checkpoint before CRIU, restore+unlock after; a failed dump puts CUDA state back; another GPU is refused', async () => {
    support = supported;
    facts = H200;
    const s: SandboxInfo = await create('ckpt', '/srv/holder.py', { gpus: '0', gpuPolicy: 'checkpoint' });
    assert.equal(s.gpus, '0');
    const [holder] = await daemon.controller.gpuHolders(s.id);
    assert.ok(holder);

    // A dump that fails after the CUDA checkpoint: the CUDA state goes back, the sandbox runs on.
    steps.length = 0;
    failNext = 'hibernate:frozen';
    const failed = await apiError(client.hibernate(s.id));
    assert.equal(failed.code, 'HIBERNATE_FAILED');
    assert.deepEqual(steps, [
      `lock ${holder.pid}`,
      `checkpoint ${holder.pid}`,
      `restore ${holder.pid}`,
      `unlock ${holder.pid}`,
    ]);
    assert.equal((await client.getSandbox(s.id)).state, 'running');

    // A lock that fails: nothing was checkpointed, only the unlock is needed... and nothing frozen.
    steps.length = 0;
    failStep = 'checkpoint';
    await apiError(client.hibernate(s.id));
    failStep = undefined;
    assert.deepEqual(steps, [`lock ${holder.pid}`, `checkpoint ${holder.pid}`, `unlock ${holder.pid}`]);
    assert.equal((await client.getSandbox(s.id)).state, 'running');

    steps.length = 0;
    const h = await client.hibernate(s.id);
    assert.equal(h.state, 'hibernated');
    assert.deepEqual(steps, [`lock ${holder.pid}`, `checkpoint ${holder.pid}`]);
    const ck = (await daemon.store.listCheckpoints({ sandboxId: s.id }))[0]!;
    assert.deepEqual((ck.meta as { gpu: unknown }).gpu, { ...H200, nsPids: [holder.nsPid] });

    steps.length = 0;
    const r = await client.resume(s.id);
    assert.equal(r.state, 'running');
    const [back] = await daemon.controller.gpuHolders(s.id);
    assert.ok(back, 'the restored process still maps libcuda');
    assert.equal(back.nsPid, holder.nsPid);
    assert.deepEqual(
      steps,
      [`restore ${back.pid}`, `unlock ${back.pid}`],
      'CUDA restore after CRIU, on the new host pid',
    );

    // Hibernated on an H200; this node now has another GPU: the restore is refused, the checkpoint kept.
    await client.hibernate(s.id);
    facts = { ...H200, devices: [{ name: 'NVIDIA A100-SXM4-80GB', memoryBytes: 85_000_000_000 }] };
    const e = await apiError(client.resume(s.id));
    assert.equal(e.code, 'RESTORE_INCOMPATIBLE');
    assert.match(e.message, /GPU 0 was a NVIDIA H200, here it is a NVIDIA A100-SXM4-80GB/);
    facts = { ...H200, driverVersion: '575.51.03' };
    assert.match(
      (await apiError(client.resume(s.id))).message,
      /made with NVIDIA driver 570\.86\.15, this node has 575\.51\.03/,
    );
    support = undefined;
    assert.match(
      (await apiError(client.resume(s.id))).message,
      /holds CUDA state and this node has no NVIDIA driver/,
    );
    assert.equal((await client.getSandbox(s.id)).state, 'hibernated');
    support = supported;
    facts = H200;
    assert.equal((await client.resume(s.id)).state, 'running');
    await client.remove(s.id);
  });
});
