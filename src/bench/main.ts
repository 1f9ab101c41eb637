/**
 * `npm run bench [-- --quick] [-- --only NAME]`: runs every suite and writes docs/BENCHMARKS.md.
 * Suites register in SUITES below.
 */
import { writeFile } from 'node:fs/promises';
import { fileURLToPath } from 'node:url';
import { dirname, join } from 'node:path';
import { renderReport, type BenchSection, type BenchSuite } from './harness.js';
import { criuSuite } from './criu.js';
import { vaultSuite } from './vault.js';

const SUITES: BenchSuite[] = [criuSuite, vaultSuite];

async function main(): Promise<void> {
  const args = process.argv.slice(2);
  const quick = args.includes('--quick');
  const onlyIdx = args.indexOf('--only');
  const only = onlyIdx >= 0 ? args[onlyIdx + 1] : undefined;
  const sections: BenchSection[] = [];
  for (const suite of SUITES) {
    if (only !== undefined && suite.name !== only) continue;
    process.stderr.write(`bench: ${suite.name}...\n`);
    sections.push(await suite.run({ quick }));
  }
  const command = `npm run bench${args.length ? ` -- ${args.join(' ')}` : ''}`;
  const report = renderReport(sections, command, new Date());
  const out = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'docs', 'BENCHMARKS.md');
  await writeFile(out, report);
  process.stdout.write(report);
}

await main();
