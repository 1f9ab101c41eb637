/**
 * The benchmark harness behind `npm run bench`. Each suite measures dormant against a peer
 * in the same run (raw criu, podman, restic, borg) and reports ratios, because absolute
 * figures on these VMs move by +-30% between runs. Results are written to docs/BENCHMARKS.md
 * together with the command and the machine that produced them.
 */
import { cpus, totalmem, release, arch } from 'node:os';

export interface BenchRow {
  /** What was measured, e.g. "ingest 1 GiB checkpoint". */
  name: string;
  /** dormant's figure and the peer's, in the same unit. */
  dormant: number;
  peer?: number;
  peerName?: string;
  unit: string;
  /** How to read the ratio: 'higher' when bigger is better (throughput), 'lower' otherwise. */
  better: 'higher' | 'lower';
}

export interface BenchSection {
  title: string;
  /** What was run, in words a reader can repeat. */
  description: string;
  rows: BenchRow[];
  notes?: string[];
}

export interface BenchSuite {
  name: string;
  run(opts: { quick: boolean }): Promise<BenchSection>;
}

/** Ratio of dormant to its peer, oriented so that > 1 always means dormant is better. */
export function advantage(row: BenchRow): number | undefined {
  if (row.peer === undefined || row.peer === 0 || row.dormant === 0) return undefined;
  return row.better === 'higher' ? row.dormant / row.peer : row.peer / row.dormant;
}

function fmt(n: number): string {
  if (Number.isInteger(n)) return String(n);
  return Math.abs(n) >= 100 ? n.toFixed(0) : Math.abs(n) >= 10 ? n.toFixed(1) : n.toFixed(3);
}

export function machineLine(): string {
  const cpu = cpus()[0]?.model ?? 'unknown CPU';
  return `${cpus().length} x ${cpu}, ${(totalmem() / 1024 ** 3).toFixed(0)} GiB, Linux ${release()} ${arch()}, Node ${process.version}`;
}

export function renderSection(s: BenchSection): string {
  const lines = [`## ${s.title}`, '', s.description, ''];
  lines.push('| measurement | dormant | peer | unit | dormant vs peer |', '|---|---|---|---|---|');
  for (const r of s.rows) {
    const adv = advantage(r);
    const peer = r.peer === undefined ? '-' : `${fmt(r.peer)} (${r.peerName ?? 'peer'})`;
    const cmp =
      adv === undefined
        ? '-'
        : adv.toFixed(2) === '1.00'
          ? '1.00x (even)'
          : `${adv.toFixed(2)}x ${adv > 1 ? 'better' : 'worse'}`;
    lines.push(`| ${r.name} | ${fmt(r.dormant)} | ${peer} | ${r.unit} | ${cmp} |`);
  }
  if (s.notes && s.notes.length > 0) lines.push('', ...s.notes.map((n) => `- ${n}`));
  lines.push('');
  return lines.join('\n');
}

export function renderReport(sections: BenchSection[], command: string, at: Date): string {
  return [
    '# Benchmarks',
    '',
    'Written by `npm run bench`; every figure is measured against a peer in the same run.',
    '',
    `- command: \`${command}\``,
    `- machine: ${machineLine()}`,
    `- date: ${at.toISOString()}`,
    '',
    ...sections.map(renderSection),
  ].join('\n');
}
