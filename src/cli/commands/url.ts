/** `dormant url ID PORT`: the address through the wake proxy that wakes the sandbox. */
import type { Command } from '@commander-js/extra-typings';
import { DormantError } from '../../domain/errors.js';
import { clientFromEnv } from '../client.js';
import { printJson } from '../output.js';

export function registerUrl(program: Command): void {
  program
    .command('url')
    .description('the address through the wake proxy that wakes the sandbox')
    .argument('<id>')
    .argument('<port>', 'a port the sandbox declared')
    .option('--json', 'print { url, host, tcp, public, auth } as JSON')
    .action(async (id, portText, o) => {
      const port = Number(portText);
      if (!Number.isInteger(port) || port < 1 || port > 65535) {
        throw new DormantError('INVALID_ARGUMENT', `invalid port ${portText.slice(0, 20)}`);
      }
      const u = await clientFromEnv().sandboxUrl(id, port);
      if (o.json) {
        printJson(u);
        return;
      }
      process.stdout.write(`${u.url}\n`);
      if (process.stderr.isTTY) {
        if (u.tcp !== null) process.stderr.write(`tcp: ${u.tcp}\n`);
        if (!u.public) process.stderr.write('send your token: Authorization: Bearer $DORMANT_TOKEN\n');
      }
    });
}
