/**
 * `dormant registry login|logout|ls` (a tenant's registry credentials) and `dormant image
 * ls|prune` (the node's image cache, admin only), over the HTTP API (docs/IMAGES.md).
 */
import type { Command } from '@commander-js/extra-typings';
import Table from 'cli-table3';
import pc from 'picocolors';
import { DormantError, ErrorCode } from '../../domain/errors.js';
import { clientFromEnv } from '../client.js';
import { printJson } from '../output.js';

/** The password from stdin: all of it, less one trailing newline (what `echo` adds). */
async function readPassword(): Promise<string> {
  const chunks: Buffer[] = [];
  for await (const c of process.stdin) chunks.push(c as Buffer);
  return Buffer.concat(chunks)
    .toString('utf8')
    .replace(/\r?\n$/, '');
}

export function registerImages(program: Command): void {
  const registry = program
    .command('registry')
    .description("this tenant's registry logins: create --image HOST/NAME:TAG pulls with them")
    .addHelpText(
      'after',
      `
Examples:
  printf %s "$PASSWORD" | dormant registry login registry.example.com --username ci --password-stdin
  dormant create --image registry.example.com/team/agent:1.4
  dormant registry ls
  dormant registry logout registry.example.com`,
    );

  registry
    .command('login')
    .description('store a login (checked with the registry first; kept sealed by the daemon)')
    .argument('<host>', 'the registry: HOST or HOST:PORT')
    .requiredOption('--username <user>', 'the registry user')
    .option('--password-stdin', 'read the password from stdin (the only way: never on the command line)')
    .option('--json', 'print the login as JSON')
    .action(async (host, o) => {
      if (!o.passwordStdin)
        throw new DormantError(ErrorCode.INVALID_ARGUMENT, 'give --password-stdin and the password on stdin');
      const password = await readPassword();
      const l = await clientFromEnv().registryLogin(host, { username: o.username, password });
      if (o.json) printJson(l);
      else process.stdout.write(`logged in to ${l.host} as ${l.username}\n`);
    });

  registry
    .command('logout')
    .description('forget the login to a registry')
    .argument('<host>', 'the registry: HOST or HOST:PORT')
    .action(async (host) => {
      await clientFromEnv().registryLogout(host);
    });

  registry
    .command('ls')
    .description('the registries logged in to (never a password)')
    .option('--json', 'print JSON')
    .action(async (o) => {
      const list = await clientFromEnv().listRegistryLogins();
      if (o.json) return printJson(list);
      if (list.length === 0) return void process.stdout.write('no registry logins\n');
      const t = new Table({
        head: ['host', 'username', 'tenant', 'since'].map((h) => pc.bold(h)),
        style: { head: [], border: [] },
      });
      for (const l of list) t.push([l.host, l.username, l.tenant, l.createdAt]);
      process.stdout.write(`${t.toString()}\n`);
    });

  const image = program.command('image').description("the node's cache of unpacked images (admin)");

  image
    .command('ls')
    .description('the unpacked images and the sandboxes using each')
    .option('--json', 'print JSON')
    .action(async (o) => {
      const list = await clientFromEnv().listImages();
      if (o.json) return printJson(list);
      if (list.length === 0) return void process.stdout.write('no images\n');
      const t = new Table({
        head: ['digest', 'sandboxes', 'refs', 'unpacked'].map((h) => pc.bold(h)),
        style: { head: [], border: [] },
      });
      for (const i of list)
        t.push([i.digest.slice(0, 19), String(i.sandboxes), i.refs.join('\n'), i.unpackedAt]);
      process.stdout.write(`${t.toString()}\n`);
    });

  image
    .command('prune')
    .description(
      'remove the unpacked images and downloaded blobs no sandbox uses (the daemon also does, hourly)',
    )
    .option('--json', 'print JSON')
    .action(async (o) => {
      const r = await clientFromEnv().pruneImages();
      if (o.json) printJson(r);
      else process.stdout.write(`removed ${r.images.length} image(s) and ${r.blobs} blob(s)\n`);
    });
}
