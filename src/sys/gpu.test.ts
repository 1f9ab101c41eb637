/**
 * The CUDA checkpoint helper builds from the project's own source and, on a machine without
 * an NVIDIA driver, says so clearly; its declarations agree with NVIDIA's cuda.h where that
 * is installed; and GPU state is recognised in a process's open files and mappings.
 */
import { after, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { copyFile, mkdtemp, rm, stat } from 'node:fs/promises';
import { existsSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { run } from './exec.js';
import { cudaInfo, cudaStep, gpuEvidence, gpuHolders, nsPidOf, nvidiaDeviceNodes } from './gpu.js';
import { isDormantError } from '../domain/errors.js';

const HEADER = '/usr/local/cuda/include/cuda.h';
const hasDriver = existsSync('/proc/driver/nvidia/version');

describe('dormant-cuda-ckpt', () => {
  let dir = '';
  after(async () => {
    if (dir) await rm(dir, { recursive: true, force: true });
  });

  test('builds with scripts/build-native.sh, and without a driver says so and exits 2', async () => {
    dir = await mkdtemp(join(tmpdir(), 'dormant-native-'));
    await run('bash', ['scripts/build-native.sh', dir], { timeoutMs: 120_000 });
    const helper = join(dir, 'dormant-cuda-ckpt');
    assert.ok((await stat(helper)).mode & 0o100, 'the helper is executable');

    const usage = await run(helper, [], { okExitCodes: [64], timeoutMs: 10_000 });
    assert.match(usage.stderr, /usage: dormant-cuda-ckpt info \| state PID \| lock PID/);
    const bad = await run(helper, ['lock', 'x1'], { okExitCodes: [64], timeoutMs: 10_000 });
    assert.match(bad.stderr, /invalid PID: x1/);

    if (hasDriver) return; // the driverless answers below are for machines without a GPU
    const info = await run(helper, ['info'], { okExitCodes: [2], timeoutMs: 10_000 });
    assert.equal(info.stdout, '');
    const err = JSON.parse(info.stderr) as { error: string; code: string };
    assert.equal(err.code, 'NO_DRIVER');
    assert.match(err.error, /^no NVIDIA driver on this machine: libcuda\.so\.1 cannot be loaded/);
    // The same through the TypeScript side: a DormantError a user can read.
    await assert.rejects(cudaInfo(helper), (e: unknown) => {
      assert.ok(isDormantError(e, 'GPU_NO_DRIVER'));
      assert.match(e.message, /no NVIDIA driver on this machine/);
      return true;
    });
    await assert.rejects(cudaStep(helper, 'lock', process.pid), /no NVIDIA driver on this machine/);
  });

  test(
    'its own CUDA declarations agree with cuda.h (static asserts)',
    { skip: !existsSync(HEADER) && `no ${HEADER}` },
    async () => {
      const r = await run(
        'gcc',
        ['-fsyntax-only', '-Wall', '-Werror', '-I/usr/local/cuda/include', 'native/abi-check.c'],
        {
          timeoutMs: 60_000,
          okExitCodes: [0, 1],
        },
      );
      assert.equal(r.exitCode, 0, r.stderr);
    },
  );
});

describe('GPU state detection', () => {
  const started: number[] = [];
  let dir = '';
  after(async () => {
    for (const pid of started) {
      try {
        process.kill(pid, 'SIGKILL');
      } catch {
        // already gone
      }
    }
    if (dir) await rm(dir, { recursive: true, force: true });
  });

  /** A python process that maps `path` (or just sleeps) and says when it is ready. */
  async function holder(path: string | undefined): Promise<number> {
    const code =
      path === undefined
        ? 'import sys,time\nprint("ready",flush=True)\ntime.sleep(600)'
        : `import mmap,sys,time\nf=open(${JSON.stringify(path)},'rb')\nm=mmap.mmap(f.fileno(),0,prot=mmap.PROT_READ)\nf.close()\nprint("ready",flush=True)\ntime.sleep(600)`;
    const child = spawn('python3', ['-c', code], { stdio: ['ignore', 'pipe', 'inherit'] });
    started.push(child.pid!);
    await new Promise<void>((res, rej) => {
      child.stdout.once('data', () => res());
      child.once('exit', (c) => rej(new Error(`python exited ${String(c)}`)));
    });
    return child.pid!;
  }

  test('a process that maps a libcuda.so.1 is a GPU holder; a plain one is not', async () => {
    dir = await mkdtemp(join(tmpdir(), 'dormant-gpu-detect-'));
    const fake = join(dir, 'libcuda.so.1');
    await copyFile('/bin/true', fake);
    const gpu = await holder(fake);
    const plain = await holder(undefined);
    assert.deepEqual(await gpuEvidence(gpu), [`maps ${fake}`]);
    assert.deepEqual(await gpuEvidence(plain), []);
    const found = await gpuHolders([plain, gpu, 999_999_999]);
    assert.deepEqual(found, [{ pid: gpu, nsPid: await nsPidOf(gpu), evidence: [`maps ${fake}`] }]);
  });
});

describe('NVIDIA device nodes for a sandbox declared with GPUs', () => {
  test('"all", an index list, the control nodes; a missing GPU is named', async () => {
    const dev = await mkdtemp(join(tmpdir(), 'dormant-dev-'));
    try {
      const node = (name: string, major: number, minor: number) =>
        run('mknod', [join(dev, name), 'c', String(major), String(minor)], { timeoutMs: 5000 });
      await node('nvidia0', 195, 0);
      await node('nvidia1', 195, 1);
      await node('nvidiactl', 195, 255);
      await node('nvidia-uvm', 507, 0);
      assert.deepEqual(await nvidiaDeviceNodes('all', dev), [
        { path: '/dev/nvidia0', major: 195, minor: 0 },
        { path: '/dev/nvidia1', major: 195, minor: 1 },
        { path: '/dev/nvidiactl', major: 195, minor: 255 },
        { path: '/dev/nvidia-uvm', major: 507, minor: 0 },
      ]);
      assert.deepEqual(
        (await nvidiaDeviceNodes('1', dev)).map((d) => d.path),
        ['/dev/nvidia1', '/dev/nvidiactl', '/dev/nvidia-uvm'],
      );
      await assert.rejects(nvidiaDeviceNodes('0,3', dev), /no device node .*nvidia3/);
      const empty = await mkdtemp(join(tmpdir(), 'dormant-dev-'));
      await assert.rejects(nvidiaDeviceNodes('all', empty), /no NVIDIA GPU device node/);
      await rm(empty, { recursive: true });
    } finally {
      await rm(dev, { recursive: true, force: true });
    }
  });
});
