/** `dormant template create|ls|get|rm|publish`: warmed checkpoints new sandboxes start from. */
import type { Command } from '@commander-js/extra-typings';
import Table from 'cli-table3';
import pc from 'picocolors';
import { resolve } from 'node:path';
import { DormantError, ErrorCode } from '../../domain/errors.js';
import { formatBytes, formatDurationMs } from '../../domain/units.js';
import type { CreateTemplateOptions, TemplateInfo } from '../../sdk/client.js';
import { clientFromEnv } from '../client.js';
import { printJson } from '../output.js';
import { withProgress } from '../progress.js';

const collect = (v: string, prev: string[] = []): string[] => [...prev, v];
const usage = (message: string): DormantError => new DormantError(ErrorCode.INVALID_ARGUMENT, message);

function ago(iso: string): string {
  return `${formatDurationMs(Math.max(0, Date.now() - Date.parse(iso)))} ago`;
}

export function templateTable(list: TemplateInfo[]): string {
  if (list.length === 0) return 'no templates\n';
  const t = new Table({
    head: ['name', 'id', 'tenant', 'from', 'size', 'stored', 'created'].map((h) => pc.bold(h)),
    style: { head: [], border: [] },
  });
  for (const x of list)
    t.push([
      x.public ? `${x.name} ${pc.yellow('(public)')}` : x.name,
      x.id,
      x.tenant,
      x.origin,
      x.logicalBytes === null ? '-' : formatBytes(x.logicalBytes),
      x.storedBytes === null ? pc.red('missing') : formatBytes(x.storedBytes),
      ago(x.createdAt),
    ]);
  return `${t.toString()}\n`;
}

function portOf(flag: string, p: string): number {
  const n = Number(p);
  if (!Number.isInteger(n) || n < 1 || n > 65535) throw usage(`${flag} ${p}: expected a port number 1-65535`);
  return n;
}

export function registerTemplates(program: Command): void {
  const template = program
    .command('template')
    .description('templates: a warmed checkpoint that new sandboxes start from (create --template)')
    .addHelpText(
      'after',
      `
Examples:
  dormant template create py --from agent              # checkpoint a running sandbox (it keeps running)
  dormant template create web --rootfs ./rootfs --ready-port 8080 -- python3 -m http.server 8080
  dormant create --template web                        # memory, processes and files as the template's
  dormant template ls
  dormant template publish web                         # admin: every tenant sees it
  dormant template rm web`,
    );

  template
    .command('create')
    .description('make a template from a running sandbox, or from a builder sandbox once it is ready')
    .argument('<name>', 'lowercase letters, digits and dashes')
    .argument('[command...]', 'with --rootfs/--image: the command the builder runs, after --')
    .option('--from <sandbox>', 'a running or paused sandbox to checkpoint (it keeps running)')
    .option('--rootfs <dir>', 'or: build from this root filesystem folder')
    .option('--image <ref>', 'or: build from this image')
    .option('--port <port>', 'a port the sandboxes expose (repeatable)', collect, [])
    .option('--env <K=V>', 'an environment variable (repeatable)', collect, [])
    .option('--memory <size>', 'memory limit of the builder and its sandboxes, e.g. 512M')
    .option('--cpus <n>', 'CPU limit in cores')
    .option('--disk <size>', 'disk quota of the writable layer, e.g. 10G')
    .option('--ready-port <port>', 'checkpoint once something listens on this TCP port inside')
    .option('--ready-cmd <cmd>', 'checkpoint once this shell command, run inside, exits 0')
    .option('--ready-timeout <duration>', 'how long to wait for the probe (default 60s)')
    .option('--public', 'every tenant sees and uses it (admin token)')
    .option('--json', 'print the template as JSON')
    .action(async (name, command, o) => {
      const build = o.rootfs !== undefined || o.image !== undefined;
      if (build === (o.from !== undefined))
        throw usage('give --from SANDBOX, or --rootfs DIR / --image REF and a command');
      const env: Record<string, string> = {};
      for (const kv of o.env) {
        const i = kv.indexOf('=');
        if (i <= 0) throw usage(`--env ${kv}: expected KEY=VALUE`);
        env[kv.slice(0, i)] = kv.slice(i + 1);
      }
      const cpus = o.cpus !== undefined ? Number(o.cpus) : undefined;
      if (cpus !== undefined && !(cpus > 0))
        throw usage(`--cpus ${o.cpus ?? ''}: expected a positive number`);
      const ready =
        o.readyPort !== undefined || o.readyCmd !== undefined || o.readyTimeout !== undefined
          ? {
              ...(o.readyPort !== undefined ? { port: portOf('--ready-port', o.readyPort) } : {}),
              ...(o.readyCmd !== undefined ? { command: ['sh', '-c', o.readyCmd] } : {}),
              ...(o.readyTimeout !== undefined ? { timeout: o.readyTimeout } : {}),
            }
          : undefined;
      const body: CreateTemplateOptions = {
        name,
        ...(o.public ? { public: true } : {}),
        ...(o.from !== undefined ? { from: o.from } : {}),
        ...(o.rootfs !== undefined ? { rootfs: resolve(o.rootfs) } : {}),
        ...(o.image !== undefined ? { image: o.image } : {}),
        ...(command.length > 0 ? { command } : {}),
        ...(Object.keys(env).length > 0 ? { env } : {}),
        ...(o.port.length > 0 ? { ports: o.port.map((p) => portOf('--port', p)) } : {}),
        ...(o.memory !== undefined ? { memory: o.memory } : {}),
        ...(cpus !== undefined ? { cpus } : {}),
        ...(o.disk !== undefined ? { disk: o.disk } : {}),
        ...(ready !== undefined ? { ready } : {}),
      };
      const t = await withProgress(`template ${name}`, !!o.json, () => clientFromEnv().createTemplate(body));
      if (o.json) printJson(t);
      else process.stdout.write(`${t.id}\n`);
    });

  template
    .command('ls')
    .description("the templates this token sees: its tenant's and the public ones")
    .option('--json', 'print JSON')
    .action(async (o) => {
      const list = await clientFromEnv().listTemplates();
      if (o.json) printJson(list);
      else process.stdout.write(templateTable(list));
    });

  template
    .command('get')
    .description('show one template')
    .argument('<name>', 'name or id')
    .option('--json', 'print JSON')
    .action(async (name, o) => {
      const t = await clientFromEnv().getTemplate(name);
      if (o.json) printJson(t);
      else process.stdout.write(templateTable([t]));
    });

  template
    .command('rm')
    .description('remove a template and its checkpoint (sandboxes made from it stay)')
    .argument('<name>', 'name or id')
    .action(async (name) => {
      await clientFromEnv().removeTemplate(name);
    });

  template
    .command('publish')
    .description('admin: every tenant sees the template (a tenant’s own template of that name wins)')
    .argument('<name>', 'name or id')
    .option('--undo', 'only its own tenant sees it again')
    .option('--json', 'print the template as JSON')
    .action(async (name, o) => {
      const t = await clientFromEnv().publishTemplate(name, !o.undo);
      if (o.json) printJson(t);
      else process.stdout.write(`${t.name} is ${t.public ? 'public' : `private to tenant ${t.tenant}`}\n`);
    });
}
