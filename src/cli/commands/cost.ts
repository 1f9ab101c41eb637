/** `dormant cost`: what was spent, what staying warm would have cost, what sleeping saved. */
import type { Command } from '@commander-js/extra-typings';
import Table from 'cli-table3';
import pc from 'picocolors';
import { DormantError, ErrorCode } from '../../domain/errors.js';
import { formatBytes, formatDurationMs, parseDurationMs } from '../../domain/units.js';
import { clientFromEnv } from '../client.js';
import { printJson } from '../output.js';

interface Row {
  sandboxId?: string;
  tenant: string;
  spent: number;
  alwaysWarm: number;
  saved: number;
  memoryHoursFreed: number;
  secondsByState?: Record<string, number>;
}

interface CostAnswer {
  currency: string;
  since: string;
  until: string;
  totals: { spent: number; alwaysWarm: number; saved: number; savedRatio: number; memoryHoursFreed: number };
  sandboxes?: Row[];
  tenants: Row[];
  neverSlept: { sandboxId: string; tenant: string; spent: number }[];
  capacity: { averageResidentBytes: number; averageStoredBytes: number; warm: number; hibernated: number };
}

function money(n: number, currency: string): string {
  const digits = Math.abs(n) >= 1 ? 2 : Math.abs(n) >= 0.01 ? 4 : 6;
  return `${n.toFixed(digits)} ${currency}`;
}

export function registerCost(program: Command): void {
  program
    .command('cost')
    .description('what was spent, what staying warm would have cost, what sleeping saved')
    .option('--since <duration>', 'only the last DURATION (e.g. 24h, 7d); default: all time')
    .option('--by <what>', 'sandbox or tenant', 'sandbox')
    .option('--json', 'print the report as JSON')
    .addHelpText('after', '\nExamples:\n  dormant cost --since 24h\n  dormant cost --by tenant --json')
    .action(async (o) => {
      if (o.by !== 'sandbox' && o.by !== 'tenant')
        throw new DormantError(ErrorCode.INVALID_ARGUMENT, `--by ${o.by}: expected sandbox or tenant`);
      if (o.since !== undefined) {
        try {
          parseDurationMs(o.since);
        } catch (e) {
          throw new DormantError(ErrorCode.INVALID_ARGUMENT, `--since ${o.since}: ${(e as Error).message}`);
        }
      }
      const q = new URLSearchParams({ by: o.by, ...(o.since !== undefined ? { since: o.since } : {}) });
      const r = await clientFromEnv().request<CostAnswer>('GET', `/v1/cost?${q.toString()}`);
      if (o.json) {
        printJson(r);
        return;
      }
      const c = r.currency;
      const t = r.totals;
      const lines = [
        `${pc.bold('window')}        ${r.since} .. ${r.until} (${formatDurationMs(Date.parse(r.until) - Date.parse(r.since))})`,
        `${pc.bold('spent')}         ${money(t.spent, c)}`,
        `${pc.bold('always warm')}   ${money(t.alwaysWarm, c)}`,
        `${pc.bold('saved')}         ${pc.green(money(t.saved, c))} (${(t.savedRatio * 100).toFixed(1)}%)`,
        `${pc.bold('memory freed')}  ${t.memoryHoursFreed.toFixed(2)} GiB-hours`,
        `${pc.bold('capacity')}      ${r.capacity.warm} idle sandboxes of ${formatBytes(r.capacity.averageResidentBytes)} warm, ${r.capacity.hibernated} hibernated (${formatBytes(r.capacity.averageStoredBytes)} each on disk)`,
      ];
      process.stdout.write(`${lines.join('\n')}\n`);
      const rows = o.by === 'tenant' ? r.tenants : (r.sandboxes ?? []);
      if (rows.length > 0) {
        const table = new Table({
          head: [o.by, 'spent', 'always warm', 'saved', 'GiB-h freed'].map((h) => pc.bold(h)),
          style: { head: [], border: [] },
        });
        for (const x of rows)
          table.push([
            x.sandboxId ?? x.tenant,
            money(x.spent, c),
            money(x.alwaysWarm, c),
            money(x.saved, c),
            x.memoryHoursFreed.toFixed(2),
          ]);
        process.stdout.write(`${table.toString()}\n`);
      }
      if (r.neverSlept.length > 0) {
        process.stdout.write(
          `${pc.yellow('never slept')} (most expensive first): ${r.neverSlept.map((n) => `${n.sandboxId} ${money(n.spent, c)}`).join(', ')}\n`,
        );
      }
    });
}
