/** `dormant dashboard`: the address of the dashboard, signed in with the CLI's token. */
import type { Command } from '@commander-js/extra-typings';
import { DormantError } from '../../domain/errors.js';
import { clientFromEnv, tokenFromEnv } from '../client.js';
import { printJson } from '../output.js';

export function registerDashboard(program: Command): void {
  program
    .command('dashboard')
    .description('print the dashboard address, with your token in its fragment (never sent to a server)')
    .option('--no-token', 'the bare address; paste the token on the page instead')
    .option('--json', 'print { url } as JSON')
    .addHelpText(
      'after',
      `
The token rides in the URL fragment (#token=...), which the browser keeps to itself; the page
saves it in localStorage and removes it from the address bar.

Examples:
  dormant dashboard
  xdg-open "$(dormant dashboard)"`,
    )
    .action(async (o) => {
      const client = clientFromEnv();
      await client.health();
      let url = `${client.url}/`;
      if (o.token) {
        const token = tokenFromEnv();
        if (token === undefined)
          throw new DormantError('UNAUTHORIZED', 'no token to sign the dashboard in with', {
            hint: 'set DORMANT_TOKEN, or run where <data-dir>/admin-token is readable',
          });
        url += `#token=${encodeURIComponent(token)}`;
      }
      if (o.json) printJson({ url });
      else process.stdout.write(`${url}\n`);
    });
}
