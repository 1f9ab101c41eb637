/** `dormant token create|ls|revoke`: API tokens per tenant (admin only), over the HTTP API. */
import type { Command } from '@commander-js/extra-typings';
import Table from 'cli-table3';
import pc from 'picocolors';
import { formatDurationMs } from '../../domain/units.js';
import type { TokenInfo } from '../../sdk/client.js';
import { clientFromEnv } from '../client.js';
import { printJson } from '../output.js';

function ago(iso: string): string {
  return `${formatDurationMs(Math.max(0, Date.now() - Date.parse(iso)))} ago`;
}

export function tokenTable(list: TokenInfo[]): string {
  if (list.length === 0) return 'no tokens\n';
  const t = new Table({
    head: ['id', 'tenant', 'admin', 'created', 'revoked'].map((h) => pc.bold(h)),
    style: { head: [], border: [] },
  });
  for (const k of list)
    t.push([
      k.revokedAt ? pc.dim(k.id) : k.id,
      k.tenant,
      k.admin ? pc.yellow('admin') : '',
      ago(k.createdAt),
      k.revokedAt ? pc.red(ago(k.revokedAt)) : '',
    ]);
  return `${t.toString()}\n`;
}

export function registerTokens(program: Command): void {
  const token = program
    .command('token')
    .description('API tokens: one per tenant (or admin); a token sees only its tenant')
    .addHelpText(
      'after',
      `
Examples:
  dormant token create --tenant acme            # prints the token once
  dormant token create --tenant acme --e2b      # an E2B_API_KEY for E2B's SDK
  DORMANT_TOKEN=$(dormant token create --tenant acme) dormant ls
  dormant token ls
  dormant token revoke 3f9a1c2b7d4e`,
    );

  token
    .command('create')
    .description('mint a token for a tenant (needs the admin token); prints it once')
    .requiredOption('--tenant <name>', 'lowercase letters, digits, - and _')
    .option('--admin', 'a token that sees and manages every tenant')
    .option('--e2b', "a key in E2B's format (e2b_...) for E2B's SDK (dormant e2b; docs/E2B.md)")
    .option('--json', 'print { id, token, tenant, admin, createdAt } as JSON (--e2b: and key)')
    .action(async (o) => {
      const t = await clientFromEnv().createToken({
        tenant: o.tenant,
        admin: !!o.admin,
        ...(o.e2b ? { e2b: true } : {}),
      });
      if (o.json) {
        printJson(o.e2b ? { key: t.token, ...t } : t);
        return;
      }
      process.stdout.write(`${t.token}\n`);
      if (process.stderr.isTTY)
        process.stderr.write(
          `${pc.dim(`token ${t.id} for tenant ${t.tenant}${t.admin ? ' (admin)' : ''}; shown only now, stored hashed`)}\n`,
        );
    });

  token
    .command('ls')
    .description('every token: public id, tenant, when created and revoked')
    .option('--json', 'print JSON')
    .action(async (o) => {
      const list = await clientFromEnv().listTokens();
      if (o.json) printJson(list);
      else process.stdout.write(tokenTable(list));
    });

  token
    .command('revoke')
    .description('revoke a token by its id (from token ls); requests with it are refused at once')
    .argument('<id>', 'the token id: 8 or more hex digits')
    .option('--json', 'print the revoked token as JSON')
    .action(async (id, o) => {
      const t = await clientFromEnv().revokeToken(id);
      if (o.json) printJson(t);
      else process.stdout.write(`${t.id} revoked (tenant ${t.tenant})\n`);
    });
}
