/** `dormant checkpoint ...`: checkpoints in the vault and in archives. */
import type { Command } from '@commander-js/extra-typings';
import Table from 'cli-table3';
import pc from 'picocolors';
import { formatBytes } from '../../domain/units.js';
import { clientFromEnv } from '../client.js';
import { printJson } from '../output.js';

export function registerCheckpoint(program: Command): void {
  const ck = program.command('checkpoint').description('checkpoints: list, inspect, scan, export, import');
  ck.command('ls')
    .description('checkpoints, newest first')
    .argument('[id]', 'only this sandbox')
    .option('--json', 'print JSON')
    .action(async (id, o) => {
      const list = await clientFromEnv().listCheckpoints(id);
      if (o.json) {
        printJson(list);
        return;
      }
      if (list.length === 0) {
        process.stdout.write('no checkpoints\n');
        return;
      }
      const t = new Table({
        head: ['id', 'sandbox', 'kind', 'created', 'logical', 'stored'].map((h) => pc.bold(h)),
        style: { head: [], border: [] },
      });
      for (const c of list)
        t.push([
          c.id,
          c.sandboxId,
          c.kind,
          c.createdAt,
          formatBytes(c.logicalBytes),
          formatBytes(c.storedBytes),
        ]);
      process.stdout.write(`${t.toString()}\n`);
    });
}
