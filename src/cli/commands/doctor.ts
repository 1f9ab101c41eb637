import type { Command } from '@commander-js/extra-typings';
import Table from 'cli-table3';
import pc from 'picocolors';
import type { DoctorReport, RowStatus } from '../../control/doctor.js';
import { EXIT_ERROR, EXIT_OK, printJson } from '../output.js';
import { defaultDataDir } from '../env.js';

const MARK: Record<RowStatus, string> = {
  supported: pc.green('supported'),
  degraded: pc.yellow('degraded'),
  missing: pc.red('missing'),
};

export function renderDoctor(report: DoctorReport): string {
  const table = new Table({
    head: ['check', 'status', 'found', 'what to do'].map((h) => pc.bold(h)),
    wordWrap: true,
    colWidths: [26, 11, 52, 44],
    style: { head: [], border: [] },
  });
  for (const r of report.rows) {
    const name = !r.required && r.status === 'missing' ? `${r.name} ${pc.dim('(optional)')}` : r.name;
    const found = r.detail ? `${r.value}\n${pc.dim(r.detail)}` : r.value;
    table.push([name, MARK[r.status], found, r.fix ?? '']);
  }
  const verdict = report.ok
    ? pc.green('ready: this node can pause, hibernate and resume sandboxes')
    : pc.red('not ready: fix the required rows marked missing');
  return `${table.toString()}\n${verdict}\n`;
}

export function registerDoctor(program: Command): void {
  program
    .command('doctor')
    .description("this node's capability matrix: what pause/hibernate/resume can rely on here")
    .option('--json', 'print one JSON value ({ ok, rows, criuEnv })')
    .option(
      '--data-dir <dir>',
      'the data directory to measure (default $DORMANT_DATA_DIR or /var/lib/dormant)',
    )
    .addHelpText(
      'after',
      '\nExit status: 0 when every required capability is present, 1 otherwise.\n\nExample:\n  dormant doctor --json | jq \'.rows[] | select(.status != "supported")\'',
    )
    .action(async (opts) => {
      const { runDoctor } = await import('../../control/doctor.js');
      const report = await runDoctor({ dataDir: opts.dataDir ?? defaultDataDir() });
      if (opts.json) printJson(report);
      else process.stdout.write(renderDoctor(report));
      process.exitCode = report.ok ? EXIT_OK : EXIT_ERROR;
    });
}
