/** `dormant node ls|drain|undrain`: a fleet's nodes (admin only), over the HTTP API (docs/FLEET.md). */
import type { Command } from '@commander-js/extra-typings';
import Table from 'cli-table3';
import pc from 'picocolors';
import { formatBytes, formatDurationMs } from '../../domain/units.js';
import { clientFromEnv } from '../client.js';
import { printJson } from '../output.js';

/** A node as GET /v1/nodes answers it (api/fleet.ts nodeView). */
export interface NodeRow {
  name: string;
  url: string;
  proxyUrl: string | null;
  state: string;
  leaseUntil: string;
  startedAt: string;
  lostAt: string | null;
  capacity: { memoryBytes: number; cpus: number; arch: string; criuVersion?: string; runtimes: string[] };
  sandboxes: Record<string, number>;
  memoryUsedBytes: number;
}

const STATE_COLOUR: Record<string, (s: string) => string> = {
  active: pc.green,
  draining: pc.yellow,
  unreachable: pc.red,
  lost: pc.red,
};

export function nodeTable(nodes: readonly NodeRow[], here: string | null): string {
  if (nodes.length === 0) return 'no nodes: this daemon is not in a fleet (its state is not in PostgreSQL)\n';
  const t = new Table({
    head: ['node', 'state', 'sandboxes', 'memory', 'cpus', 'lease', 'url'].map((h) => pc.bold(h)),
    style: { head: [], border: [] },
  });
  for (const n of nodes) {
    const counts = Object.entries(n.sandboxes)
      .sort(([a], [b]) => (a < b ? -1 : 1))
      .map(([s, k]) => `${k} ${s}`)
      .join(', ');
    const left = Date.parse(n.leaseUntil) - Date.now();
    t.push([
      n.name === here ? `${n.name} ${pc.dim('(this)')}` : n.name,
      (STATE_COLOUR[n.state] ?? ((s: string) => s))(n.state),
      counts || pc.dim('none'),
      `${formatBytes(n.memoryUsedBytes)} / ${formatBytes(n.capacity.memoryBytes)}`,
      String(n.capacity.cpus),
      left >= 0 ? `${formatDurationMs(left)} left` : pc.red(`ran out ${formatDurationMs(-left)} ago`),
      n.url,
    ]);
  }
  return `${t.toString()}\n`;
}

export function registerNodes(program: Command): void {
  const node = program
    .command('node')
    .description("a fleet's nodes: list, drain, undrain (admin; docs/FLEET.md)")
    .addHelpText(
      'after',
      `
Examples:
  dormant node ls
  dormant node drain n2            # its sandboxes hibernate; it takes none until undrained
  dormant node undrain n2
  dormant resume agent --node n3   # wake a sleeping sandbox on a chosen node`,
    );

  node
    .command('ls')
    .description('every node: state, sandboxes by state, memory, lease')
    .option('--json', 'print JSON')
    .action(async (o) => {
      const r = await clientFromEnv().request<{ node: string | null; nodes: NodeRow[] }>('GET', '/v1/nodes');
      if (o.json) printJson(r);
      else process.stdout.write(nodeTable(r.nodes, r.node));
    });

  for (const [verb, what] of [
    ['drain', 'hibernate every sandbox of the node and keep it out of placement'],
    ['undrain', 'let the node take sandboxes again'],
  ] as const) {
    node
      .command(verb)
      .description(what)
      .argument('<name>')
      .option('--json', 'print the node as JSON')
      .action(async (name, o) => {
        const n = await clientFromEnv().request<NodeRow>(
          'POST',
          `/v1/nodes/${encodeURIComponent(name)}/${verb}`,
        );
        if (o.json) printJson(n);
        else process.stdout.write(`${n.name} ${n.state}\n`);
      });
  }
}
