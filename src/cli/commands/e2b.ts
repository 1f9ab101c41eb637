/**
 * `dormant e2b`: what to set so a program written for E2B's SDK runs on this node (the E2B
 * front, docs/E2B.md). The key is the tenant's own: `dormant token create --tenant T --e2b`.
 */
import type { Command } from '@commander-js/extra-typings';
import { clientFromEnv } from '../client.js';
import { printJson } from '../output.js';

interface E2bInfo {
  apiUrl: string;
  sandboxUrl: string;
  domain: string | null;
}

/** Shell `export` lines for `info`, one a line (safe to eval: the values are quoted). */
export function e2bExports(info: E2bInfo): string {
  const q = (v: string): string => `'${v.replace(/'/g, `'\\''`)}'`;
  return [
    `export E2B_API_URL=${q(info.apiUrl)}`,
    `export E2B_SANDBOX_URL=${q(info.sandboxUrl)}`,
    ...(info.domain !== null ? [`export E2B_DOMAIN=${q(info.domain)}`] : []),
  ]
    .map((l) => `${l}\n`)
    .join('');
}

export function registerE2b(program: Command): void {
  program
    .command('e2b')
    .description("what to set so a program written for E2B's SDK runs on this node")
    .option('--json', 'print { apiUrl, sandboxUrl, domain } as JSON')
    .addHelpText(
      'after',
      `
Examples:
  eval "$(dormant e2b)"
  export E2B_API_KEY=$(dormant token create --tenant acme --e2b)
  node my-e2b-program.mjs`,
    )
    .action(async (o) => {
      const info = await clientFromEnv().request<E2bInfo>('GET', '/v1/e2b');
      if (o.json) printJson(info);
      else process.stdout.write(e2bExports(info));
    });
}
