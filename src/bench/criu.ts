/**
 * dormant's criu driver against raw criu on the same process: dump and restore of a python
 * process holding a known amount of memory. The ratio shows what dormant's own layer (exec
 * with timeouts, log handling, pidfile) costs on top of criu itself.
 */
import { spawn } from 'node:child_process';
import { mkdir, mkdtemp, rm } from 'node:fs/promises';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { dumpProcess, getCriu, restoreProcess } from '../criu/criu.js';
import type { BenchRow, BenchSuite } from './harness.js';

const HOLDER = `
import os, sys, time
mib = int(sys.argv[1])
chunk = os.urandom(1 << 20)
# Half random, half zeros per MiB: like a real heap, partly compressible.
data = [bytearray(chunk[: 1 << 19]) + bytearray(1 << 19) for _ in range(mib)]
for i, b in enumerate(data):
    b[0] = i & 255
open(sys.argv[2], "w").write("ready")
while True:
    time.sleep(1)
`;

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)]!;
}

/** Runs a command directly, without dormant's exec layer: the raw peer. */
function raw(cmd: string, args: string[], env: NodeJS.ProcessEnv): Promise<number | null> {
  return new Promise((resolve, reject) => {
    const c = spawn(cmd, args, { env, stdio: 'ignore' });
    c.on('error', reject);
    c.on('exit', (code) => resolve(code));
  });
}

/** Starts the memory holder; `exited` resolves once it is gone and reaped (its PID free again). */
async function startHolder(mib: number, dir: string): Promise<{ pid: number; exited: Promise<void> }> {
  const ready = join(dir, `ready-${Date.now()}`);
  const child = spawn('/usr/bin/python3', ['-c', HOLDER, String(mib), ready], {
    detached: true,
    stdio: 'ignore',
  });
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()));
  child.unref();
  const deadline = Date.now() + 60_000;
  for (;;) {
    try {
      readFileSync(ready);
      return { pid: child.pid!, exited };
    } catch {
      if (Date.now() > deadline) throw new Error('memory holder did not start');
      await new Promise((r) => setTimeout(r, 50));
    }
  }
}

function kill(pid: number): void {
  try {
    process.kill(pid, 'SIGKILL');
  } catch {
    // Already gone.
  }
}

export const criuSuite: BenchSuite = {
  name: 'criu',
  async run({ quick }) {
    const criu = await getCriu();
    const mib = quick ? 64 : 256;
    const rounds = quick ? 2 : 4;
    const work = await mkdtemp('/dev/shm/dormant-bench-criu-');
    const t = {
      rawDump: [] as number[],
      ourDump: [] as number[],
      rawRestore: [] as number[],
      ourRestore: [] as number[],
    };
    try {
      const rawRound = async (i: number, record: boolean): Promise<void> => {
        // Raw criu, called the way a person would, with the same environment.
        {
          const { pid, exited } = await startHolder(mib, work);
          const dir = join(work, `raw-${i}`);
          await mkdir(dir);
          const env = { ...process.env, ...criu.env };
          let t0 = performance.now();
          const d = await raw(criu.path, ['dump', '-t', String(pid), '-D', dir, '-o', 'dump.log'], env);
          if (record) t.rawDump.push(performance.now() - t0);
          if (d !== 0) throw new Error(`raw criu dump failed (${String(d)})`);
          await exited;
          t0 = performance.now();
          const r = await raw(
            criu.path,
            ['restore', '-D', dir, '-o', 'restore.log', '-d', '--pidfile', join(dir, 'pid')],
            env,
          );
          if (record) t.rawRestore.push(performance.now() - t0);
          if (r !== 0) throw new Error(`raw criu restore failed (${String(r)})`);
          kill(pid);
          await rm(dir, { recursive: true, force: true });
        }
      };
      const ourRound = async (i: number, record: boolean): Promise<void> => {
        // The same through dormant's driver.
        {
          const { pid, exited } = await startHolder(mib, work);
          const dir = join(work, `ours-${i}`);
          let t0 = performance.now();
          await dumpProcess({ pid, imagesDir: dir });
          if (record) t.ourDump.push(performance.now() - t0);
          await exited;
          t0 = performance.now();
          const restored = await restoreProcess({ imagesDir: dir });
          if (record) t.ourRestore.push(performance.now() - t0);
          kill(restored.pid);
          await rm(dir, { recursive: true, force: true });
        }
      };
      // One unrecorded warm-up each, then alternate who goes first: fresh tmpfs pages cost a
      // page fault each on these VMs, and whoever runs first pays for them.
      await rawRound(-1, false);
      await ourRound(-1, false);
      for (let i = 0; i < rounds; i++) {
        if (i % 2 === 0) {
          await rawRound(i, true);
          await ourRound(i, true);
        } else {
          await ourRound(i, true);
          await rawRound(i, true);
        }
      }
    } finally {
      await rm(work, { recursive: true, force: true });
    }
    const rows: BenchRow[] = [
      {
        name: `dump ${mib} MiB process`,
        dormant: median(t.ourDump),
        peer: median(t.rawDump),
        peerName: 'raw criu',
        unit: 'ms',
        better: 'lower',
      },
      {
        name: `restore ${mib} MiB process`,
        dormant: median(t.ourRestore),
        peer: median(t.rawRestore),
        peerName: 'raw criu',
        unit: 'ms',
        better: 'lower',
      },
    ];
    return {
      title: 'criu driver overhead',
      description: `A python process holding ${mib} MiB (half random, half zero) is dumped into /dev/shm and restored detached, one warm-up and ${rounds} rounds each in alternating order, median shown: raw \`criu dump\`/\`criu restore -d\` against dormant's \`dumpProcess\`/\`restoreProcess\` (CRIU ${criu.version}${criu.env.CRIU_FAULT ? ', CRIU_FAULT=130 on both' : ''}).`,
      rows,
      notes: ['dormant adds -v4 logging and a timeout-guarded exec; the ratio is what that costs.'],
    };
  },
};
