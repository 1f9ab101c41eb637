/**
 * `npm run bench [-- --quick] [-- --only NAME]`: runs every suite and writes docs/BENCHMARKS.md.
 * Suites register in SUITES below.
 */
// First: sizes libuv's thread pool before anything uses it.
import '../sys/threadpool.js';
import { readFile, writeFile } from 'node:fs/promises';
import { fileURLToPath } from 'node:url';
import { dirname, join } from 'node:path';
import { mergeReport, renderSuite, type BenchSuite } from './harness.js';
import { criuSuite } from './criu.js';
import { sandboxSuite } from './sandbox.js';
import { vaultSuite } from './vault.js';
import { proxySuite } from './proxy.js';
import { scanSuite } from './scan.js';
import { loadSuite } from './load.js';
import { confineSuite, usernsSuite } from './confine.js';
import { cliSuite } from './cli.js';
import { toolboxSuite } from './toolbox.js';
import { templateSuite } from './template.js';
import { e2bSuite } from './e2b.js';
import { egressSuite } from './egress.js';
import { runscSuite } from './runsc.js';
import { s3Suite } from './s3.js';
import { stateSuite } from './state.js';
import { crossnodeSuite } from './crossnode.js';
import { fleetSuite } from './fleet.js';
import { execSuite } from './exec.js';

const SUITES: BenchSuite[] = [
  criuSuite,
  sandboxSuite,
  vaultSuite,
  proxySuite,
  scanSuite,
  loadSuite,
  execSuite,
  confineSuite,
  usernsSuite,
  cliSuite,
  toolboxSuite,
  templateSuite,
  e2bSuite,
  egressSuite,
  runscSuite,
  s3Suite,
  stateSuite,
  fleetSuite,
  crossnodeSuite,
];

async function main(): Promise<void> {
  const args = process.argv.slice(2);
  const quick = args.includes('--quick');
  const onlyIdx = args.indexOf('--only');
  const only = onlyIdx >= 0 ? args[onlyIdx + 1] : undefined;
  if (only !== undefined && !SUITES.some((s) => s.name === only)) {
    process.stderr.write(`bench: no suite "${only}" (suites: ${SUITES.map((s) => s.name).join(', ')})\n`);
    process.exit(2);
  }
  const command = `npm run bench${args.length ? ` -- ${args.join(' ')}` : ''}`;
  const fresh = new Map<string, string>();
  for (const suite of SUITES) {
    if (only !== undefined && suite.name !== only) continue;
    process.stderr.write(`bench: ${suite.name}...\n`);
    const section = await suite.run({ quick });
    const text = renderSuite(suite.name, section, command, new Date());
    fresh.set(suite.name, text);
    process.stdout.write(`${text}\n`);
  }
  const out = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'docs', 'BENCHMARKS.md');
  const existing = await readFile(out, 'utf8').catch(() => '');
  await writeFile(
    out,
    mergeReport(
      existing,
      fresh,
      SUITES.map((s) => s.name),
    ),
  );
}

await main();
