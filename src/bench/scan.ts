/**
 * Secret scan throughput: `dormant checkpoint scan` (every detector, memory + images +
 * metadata) against `checkpointctl memparse --search` (one literal string, memory only) on
 * the same podman-layout archive of a real CRIU dump of a python process holding N MiB of
 * mixed memory and a planted key. Both read the uncompressed .tar; figures are MiB of
 * memory pages per second of wall time, including opening the archive (dormant reads the
 * pages in place and unpacks the rest). The scan alone, and how long it holds up the event
 * loop, are also measured against the same scan with the detectors on the calling thread.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { availableParallelism, loadavg } from 'node:os';
import { monitorEventLoopDelay } from 'node:perf_hooks';
import { join } from 'node:path';
import { openCheckpointPath } from '../checkpoint/source.js';
import { scanCheckpoint } from '../checkpoint/scan.js';
import { defaultScanWorkers } from '../checkpoint/scan-pool.js';
import { dump, podmanArchive } from '../checkpoint/testing/fixtures.js';
import { startMixedPython } from '../vault/testing/fixtures.js';
import { run, which } from '../sys/exec.js';
import type { BenchSuite } from './harness.js';

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)]!;
}

export const scanSuite: BenchSuite = {
  name: 'scan',
  async run({ quick }) {
    const mib = quick ? 64 : 256;
    const rounds = quick ? 2 : 3;
    const loadStart = loadavg()[0]!;
    const work = await mkdtemp('/dev/shm/dormant-bench-scan-');
    const secret = `AKIA${'Q'.repeat(8)}7EXAMPLE`;
    try {
      const pid = await startMixedPython(work, mib, Buffer.from(secret).toString('hex'));
      await dump(pid, join(work, 'images'));
      const archive = await podmanArchive(join(work, 'images'), join(work, 'ck.tar'), 'none');
      const ours: number[] = [];
      const scanOnly: number[] = [];
      const stalls: number[] = [];
      const busy: number[] = [];
      const inlineScan: number[] = [];
      const inlineStalls: number[] = [];
      const inlineBusy: number[] = [];
      let memBytes = 0;
      let found = 0;
      /**
       * One scan of the archive: seconds to open and to scan, the longest event-loop stall (ms)
       * and how busy the event loop was during the scan (0-1).
       */
      const once = async (
        workers?: number,
      ): Promise<{ open: number; scan: number; stallMs: number; busy: number }> => {
        const t0 = performance.now();
        // As `dormant checkpoint scan` opens it: the pages stay in the (uncompressed) archive.
        const ck = await openCheckpointPath(archive, { pagesInPlace: true });
        const t1 = performance.now();
        const h = monitorEventLoopDelay({ resolution: 1 });
        let elu = performance.eventLoopUtilization();
        try {
          h.enable();
          const r = await scanCheckpoint(ck, workers !== undefined ? { workers } : {});
          h.disable();
          elu = performance.eventLoopUtilization(elu);
          memBytes = r.scanned.memoryBytes;
          found = r.findings.filter((f) => f.kind === 'aws_access_key').length;
        } finally {
          await ck.close();
        }
        const t2 = performance.now();
        return {
          open: (t1 - t0) / 1000,
          scan: (t2 - t1) / 1000,
          stallMs: h.max / 1e6,
          busy: elu.utilization,
        };
      };
      await once(); // the first run in a process also compiles the detectors: not counted
      for (let i = 0; i < rounds; i++) {
        const a = await once();
        ours.push(a.open + a.scan);
        scanOnly.push(a.scan);
        stalls.push(a.stallMs);
        busy.push(a.busy);
        const b = await once(0);
        inlineScan.push(b.scan);
        inlineStalls.push(b.stallMs);
        inlineBusy.push(b.busy);
      }
      const ctl = await which('checkpointctl');
      const theirs: number[] = [];
      let ctlFound = 'n/a';
      if (ctl !== undefined) {
        for (let i = 0; i < rounds; i++) {
          const t0 = performance.now();
          const r = await run(ctl, ['memparse', archive, '--pid', String(pid), '--search', secret], {
            timeoutMs: 300_000,
            okExitCodes: [0, 1],
          });
          theirs.push((performance.now() - t0) / 1000);
          ctlFound = /No matches/.test(r.stdout + r.stderr) ? 'no match' : 'match';
        }
      }
      const mibs = memBytes / 1024 / 1024;
      const nw = defaultScanWorkers();
      const workersName = `${nw} worker thread${nw === 1 ? '' : 's'}`;
      return {
        title: 'Secret scan: dormant checkpoint scan vs checkpointctl memparse --search',
        description: `python3 holding ${mib} MiB of mixed memory (random, text, zeros) and a planted AWS key, dumped with CRIU 4.2, packed as a podman .tar; median of ${rounds} runs each (after one unmeasured), wall time including opening the archive (the pages are read in place, the rest unpacked); the scan alone and the event loop also against the same scan with its detectors on the calling thread (workers: 0)`,
        rows: [
          {
            name: `scan ${mibs.toFixed(0)} MiB of pages (MiB/s)`,
            dormant: mibs / median(ours),
            ...(theirs.length > 0 ? { peer: mibs / median(theirs), peerName: 'checkpointctl memparse' } : {}),
            unit: 'MiB/s',
            better: 'higher',
          },
          {
            name: 'wall time (s)',
            dormant: median(ours),
            ...(theirs.length > 0 ? { peer: median(theirs), peerName: 'checkpointctl memparse' } : {}),
            unit: 's',
            better: 'lower',
          },
          {
            name: `the scan alone, ${workersName} (MiB/s)`,
            dormant: mibs / median(scanOnly),
            peer: mibs / median(inlineScan),
            peerName: 'on the calling thread',
            unit: 'MiB/s',
            better: 'higher',
          },
          {
            name: "the daemon's thread busy during the scan (event-loop utilization, %)",
            dormant: 100 * median(busy),
            peer: 100 * median(inlineBusy),
            peerName: 'on the calling thread',
            unit: '%',
            better: 'lower',
          },
        ],
        notes: [
          `Load average at the start: ${loadStart.toFixed(1)} on ${availableParallelism()} cores.`,
          `Longest event-loop stall during the scan (median): ${median(stalls).toFixed(1)} ms with ${workersName} (starting them), ${median(inlineStalls).toFixed(1)} ms on the calling thread (one 4 MiB chunk).`,
          `dormant ran all 17 detectors and found the planted key (${found} finding(s)); checkpointctl searched one literal string: ${ctlFound}.`,
          'checkpointctl 1.3 reports 0 B of memory for CRIU 4.2 dumps and finds no planted string in them (it appears to read the old pagemap page count), so its time is for reading the archive, not for searching pages.',
        ],
      };
    } finally {
      await rm(work, { recursive: true, force: true });
    }
  },
};
