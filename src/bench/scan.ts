/**
 * Secret scan throughput: `dormant checkpoint scan` (every detector, memory + images +
 * metadata) against `checkpointctl memparse --search` (one literal string, memory only) on
 * the same podman-layout archive of a real CRIU dump of a python process holding N MiB of
 * mixed memory and a planted key. Both read the uncompressed .tar; figures are MiB of
 * memory pages per second of wall time, including unpacking.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { openCheckpointPath } from '../checkpoint/source.js';
import { scanCheckpoint } from '../checkpoint/scan.js';
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
    const work = await mkdtemp('/dev/shm/dormant-bench-scan-');
    const secret = `AKIA${'Q'.repeat(8)}7EXAMPLE`;
    try {
      const pid = await startMixedPython(work, mib, Buffer.from(secret).toString('hex'));
      await dump(pid, join(work, 'images'));
      const archive = await podmanArchive(join(work, 'images'), join(work, 'ck.tar'), 'none');
      const ours: number[] = [];
      let memBytes = 0;
      let found = 0;
      for (let i = 0; i < rounds; i++) {
        const t0 = performance.now();
        const ck = await openCheckpointPath(archive);
        try {
          const r = await scanCheckpoint(ck);
          memBytes = r.scanned.memoryBytes;
          found = r.findings.filter((f) => f.kind === 'aws_access_key').length;
        } finally {
          await ck.close();
        }
        ours.push((performance.now() - t0) / 1000);
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
      return {
        title: 'Secret scan: dormant checkpoint scan vs checkpointctl memparse --search',
        description: `python3 holding ${mib} MiB of mixed memory (random, text, zeros) and a planted AWS key, dumped with CRIU 4.2, packed as a podman .tar; median of ${rounds} runs each, wall time including unpacking`,
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
        ],
        notes: [
          `dormant ran all 17 detectors and found the planted key (${found} finding(s)); checkpointctl searched one literal string: ${ctlFound}.`,
          'checkpointctl 1.3 reports 0 B of memory for CRIU 4.2 dumps and finds no planted string in them (it appears to read the old pagemap page count), so its time is for reading the archive, not for searching pages.',
        ],
      };
    } finally {
      await rm(work, { recursive: true, force: true });
    }
  },
};
