/**
 * What starting a command costs the daemon's event loop: `run()` (sys/exec.ts) through the
 * command launcher (sys/launcher.ts, the default) against the same `run()` spawning in this
 * process (the launcher off), while this process holds memory it has touched, as a daemon that
 * has hibernated and resumed does. Node waits, on its event loop, for fork() and exec() of each
 * child it spawns, and fork() copies the page tables of everything the process has touched.
 */
import { monitorEventLoopDelay } from 'node:perf_hooks';
import { run } from '../sys/exec.js';
import { useLauncher } from '../sys/launcher.js';
import { median, type BenchRow, type BenchSuite } from './harness.js';

const MiB = 1024 * 1024;

interface Round {
  /** The event loop's time inside each run() call before it returned its promise, ms. */
  blocked: number[];
  /** Commands started and ended per second, four at a time. */
  perSecond: number;
  /** The event loop's delay while four run at once, p99 and max, ms. */
  loopP99: number;
  loopMax: number;
}

async function round(count: number): Promise<Round> {
  const blocked: number[] = [];
  for (let i = 0; i < count; i++) {
    const t0 = performance.now();
    const p = run('true', []);
    blocked.push(performance.now() - t0);
    await p;
  }
  const loop = monitorEventLoopDelay({ resolution: 1 });
  loop.enable();
  const t0 = performance.now();
  let next = 0;
  await Promise.all(
    Array.from({ length: 4 }, async () => {
      while (next++ < count) await run('true', []);
    }),
  );
  const s = (performance.now() - t0) / 1000;
  loop.disable();
  return { blocked, perSecond: count / s, loopP99: loop.percentile(99) / 1e6, loopMax: loop.max / 1e6 };
}

export const execSuite: BenchSuite = {
  name: 'exec',
  async run({ quick }) {
    const heldMiB = 512;
    const count = quick ? 50 : 200;
    // Memory this process has touched, as a working daemon's is (pools, caches, the heap).
    const held: Buffer[] = [];
    for (let i = 0; i < heldMiB; i++) held.push(Buffer.alloc(MiB, 1));
    const results: { launcher: Round[]; direct: Round[] } = { launcher: [], direct: [] };
    try {
      for (let r = 0; r < 3; r++) {
        for (const side of ['launcher', 'direct'] as const) {
          useLauncher(side === 'launcher');
          await run('true', []); // the launcher started before the timing
          results[side].push(await round(count));
        }
      }
    } finally {
      useLauncher(true);
    }
    const med = (side: 'launcher' | 'direct', f: (r: Round) => number): number =>
      median(results[side].map(f));
    const blockedMedian = (r: Round): number => median(r.blocked);
    const blockedP99 = (r: Round): number =>
      [...r.blocked].sort((a, b) => a - b)[Math.floor(r.blocked.length * 0.99)]!;
    /** A row of the rounds' medians of `f`, launcher against direct, to `digits` places. */
    const row = (
      name: string,
      f: (r: Round) => number,
      digits: number,
      unit = 'ms',
      better: BenchRow['better'] = 'lower',
    ): BenchRow => ({
      name,
      dormant: Number(med('launcher', f).toFixed(digits)),
      peer: Number(med('direct', f).toFixed(digits)),
      peerName: 'spawned by the daemon',
      unit,
      better,
    });
    const rows: BenchRow[] = [
      row(`event loop held by one run() call, median (${heldMiB} MiB held)`, blockedMedian, 2),
      row(`event loop held by one run() call, p99 (${heldMiB} MiB held)`, blockedP99, 2),
      row('event loop delay p99 while 4 commands run at a time', (r) => r.loopP99, 1),
      row('commands run (`true`), 4 at a time', (r) => r.perSecond, 0, 'per second', 'higher'),
    ];
    return {
      title: 'Starting commands: the command launcher against spawning in the daemon',
      description:
        `This process holds ${heldMiB} MiB it has touched, then runs \`true\` ${count} times one after another through run() ` +
        `(timing the event loop's time inside each call), then ${count} times four at a time (the event loop's delay ` +
        `sampled every 1 ms); 3 alternated rounds each with the launcher on (dormant) and off (the peer: run() spawning ` +
        `in this process, as before the launcher), medians of the rounds.`,
      rows,
      notes: [
        `max event loop delay, median of rounds: launcher ${med('launcher', (r) => r.loopMax).toFixed(1)} ms, direct ${med('direct', (r) => r.loopMax).toFixed(1)} ms`,
        `held ${held.length} MiB`,
      ],
    };
  },
};
