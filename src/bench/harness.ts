/**
 * The benchmark harness behind `npm run bench`. Each suite measures dormant against a peer
 * in the same run (raw criu, podman, restic, borg) and reports ratios, because absolute
 * figures on these VMs move by +-30% between runs. Results are written to docs/BENCHMARKS.md
 * together with the command and the machine that produced them.
 */
import { cpus, totalmem, release, arch } from 'node:os';
import type { OperationTimings } from '../domain/timings.js';

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

const HEADER = [
  '# Benchmarks',
  '',
  "Written by `npm run bench` (or `npm run bench -- --only SUITE`, which replaces that suite's",
  'section and keeps the others). Every figure is measured against a peer in the same run, on',
  'the machine named in its section; absolute numbers on these VMs move by about 30% between',
  'runs, ratios much less.',
  '',
].join('\n');

/** A suite's section with the command, machine and date that produced it. */
export function renderSuite(suite: string, s: BenchSection, command: string, at: Date): string {
  const body = renderSection(s);
  const [title, ...rest] = body.split('\n');
  return [
    title,
    `<!-- suite: ${suite} -->`,
    '',
    `Command: \`${command}\` · ${machineLine()} · ${at.toISOString()}`,
    ...rest,
  ].join('\n');
}

/**
 * Merges freshly rendered suite sections into an existing report: a suite's old section is
 * replaced, sections of suites not run this time are kept, new ones are appended.
 */
export function mergeReport(existing: string, fresh: Map<string, string>, order: readonly string[]): string {
  const old = new Map<string, string>();
  // Hand-written sections (no suite marker) stay where they were: after the suite before them.
  const notes = new Map<string, string[]>();
  const parts = existing.split(/^(?=## )/m).slice(1);
  let last: string | undefined;
  for (const part of parts) {
    const m = /<!-- suite: ([\w-]+) -->/.exec(part);
    if (m) {
      last = m[1]!;
      old.set(last, part.trimEnd() + '\n');
    } else if (last !== undefined) notes.set(last, [...(notes.get(last) ?? []), part.trimEnd() + '\n']);
  }
  const sections: string[] = [];
  for (const name of order) {
    const text = fresh.get(name) ?? old.get(name);
    if (text !== undefined) sections.push(text.trimEnd() + '\n');
    sections.push(...(notes.get(name) ?? []));
  }
  return `${HEADER}\n${sections.join('\n')}`;
}

/** The middle value (the upper one of an even count): the figure each suite reports. */
export function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)]!;
}

/** Milliseconds `fn` took. */
export async function timed(fn: () => Promise<unknown>): Promise<number> {
  const t = performance.now();
  await fn();
  return performance.now() - t;
}

/** Per step name, the median of its wall times over the operations in `ts`. */
export function stepMedians(ts: OperationTimings[]): string {
  const byStep = new Map<string, number[]>();
  for (const t of ts) for (const s of t.steps) byStep.set(s.step, [...(byStep.get(s.step) ?? []), s.ms]);
  return [...byStep].map(([step, ms]) => `${step} ${Math.round(median(ms))}`).join(', ');
}
