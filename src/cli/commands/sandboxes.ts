/** The sandbox lifecycle commands, over the HTTP API. */
import { GPU_POLICIES, type GpuPolicy } from '../../domain/gpu.js';
import { Option, type Command } from '@commander-js/extra-typings';
import Table from 'cli-table3';
import pc from 'picocolors';
import { resolve } from 'node:path';
import { DormantError, ErrorCode } from '../../domain/errors.js';
import { formatBytes, formatDurationMs } from '../../domain/units.js';
import { DormantApiError, type SandboxInfo } from '../../sdk/client.js';
import { clientFromEnv } from '../client.js';
import { printJson } from '../output.js';
import { withProgress as showProgress } from '../progress.js';

const collect = (v: string, prev: string[] = []): string[] => [...prev, v];

function usage(message: string): DormantError {
  return new DormantError(ErrorCode.INVALID_ARGUMENT, message);
}

/** `--label k=v` options as labels (the daemon checks keys and values). */
function labelsOf(flag: string, args: readonly string[]): Record<string, string> {
  const out: Record<string, string> = {};
  for (const kv of args) {
    const i = kv.indexOf('=');
    if (i <= 0) throw usage(`${flag} ${kv}: expected KEY=VALUE`);
    out[kv.slice(0, i)] = kv.slice(i + 1);
  }
  return out;
}

/** `k=v,k2=v2` for a table cell. */
const labelText = (labels: Record<string, string>): string =>
  Object.entries(labels)
    .map(([k, v]) => `${k}=${v}`)
    .join(',');

const STATE_COLOR: Record<string, (s: string) => string> = {
  running: pc.green,
  paused: pc.cyan,
  hibernated: pc.blue,
  archived: pc.dim,
  failed: pc.red,
};

function age(iso: string): string {
  return formatDurationMs(Math.max(0, Date.now() - Date.parse(iso)));
}

function sandboxTable(list: SandboxInfo[]): string {
  if (list.length === 0) return 'no sandboxes\n';
  // The labels column only when some sandbox has labels: most lists stay as narrow as before.
  const labelled = list.some((s) => Object.keys(s.labels).length > 0);
  const t = new Table({
    head: [
      'id',
      'name',
      'state',
      'for',
      'memory',
      'ports',
      'address',
      'gpu',
      ...(labelled ? ['labels'] : []),
    ].map((h) => pc.bold(h)),
    style: { head: [], border: [] },
  });
  for (const s of list) {
    const color = STATE_COLOR[s.state] ?? ((x: string) => x);
    t.push([
      s.id,
      s.name === s.id ? '' : s.name,
      color(s.state),
      age(s.stateSince),
      s.memoryBytes > 0 ? formatBytes(s.memoryBytes) : '-',
      s.ports.map((p) => p.port).join(',') || '-',
      s.address ?? '-',
      s.gpus === null ? '-' : `${s.gpus} (${s.gpuPolicy})`,
      ...(labelled ? [labelText(s.labels) || '-'] : []),
    ]);
  }
  return `${t.toString()}\n`;
}

function sandboxDetail(s: SandboxInfo): string {
  const rows: [string, string][] = [
    ['id', s.id],
    ['name', s.name],
    ['state', `${s.state} (for ${age(s.stateSince)})`],
    ['command', s.command.join(' ')],
    ['ports', s.ports.map((p) => `${p.port}${p.public ? ' (public)' : ''}`).join(', ') || '-'],
    ['address', s.address ?? '-'],
    [
      'memory',
      `${s.memoryBytes > 0 ? formatBytes(s.memoryBytes) : 'none held'} (limit ${formatBytes(s.memoryLimitBytes)})`,
    ],
    ['disk quota', typeof s.diskLimitBytes === 'number' ? formatBytes(s.diskLimitBytes) : 'none'],
    ['created', s.createdAt],
    ['last active', `${s.lastActiveAt} (${age(s.lastActiveAt)} ago)`],
    ['checkpoint', s.checkpointId ?? '-'],
    ['gpus', s.gpus ?? 'none'],
    ['gpu policy', s.gpuPolicy],
    ['labels', labelText(s.labels) || '-'],
    ['egress', s.egress ?? 'none (made before egress)'],
    ['runtime', s.runtime],
    [
      'policy',
      Object.entries(s.policy)
        .map(([k, v]) => `${k.replace(/Ms$/, '')} ${formatDurationMs(v)}`)
        .join(', ') || 'the defaults',
    ],
  ];
  if (s.lastError) rows.push(['last error', s.lastError]);
  return `${rows.map(([k, v]) => `${pc.bold(k.padEnd(12))} ${v}`).join('\n')}\n`;
}

/**
 * Progress on a terminal (progress.ts). The label is `OP REF`: REF's transitions give the phase
 * (`creating` has no sandbox yet, so it shows only the clock).
 */
async function withProgress<T>(label: string, json: boolean, fn: () => Promise<T>): Promise<T> {
  const ref = /^\w+ (\S+)$/.exec(label)?.[1];
  return showProgress(label, json, fn, {
    client: clientFromEnv(),
    ...(ref !== undefined ? { sandbox: ref } : {}),
  });
}

/** `create --template`: what the template does not bring (name, labels, policy) is all that is sent. */
async function createFromTemplate(
  template: string,
  command: string[],
  o: {
    name?: string;
    label: string[];
    idle?: string;
    archiveAfter?: string;
    lifetime?: string;
    onResume?: string;
    json?: true;
  },
): Promise<void> {
  if (command.length > 0)
    throw usage('a sandbox made from a template runs what the template runs: give no command');
  const labels = labelsOf('--label', o.label);
  const s = await withProgress('creating', !!o.json, () =>
    clientFromEnv().createSandbox({
      template,
      ...(o.name ? { name: o.name } : {}),
      ...(o.idle !== undefined ? { idle: o.idle } : {}),
      ...(o.archiveAfter !== undefined ? { archiveAfter: o.archiveAfter } : {}),
      ...(o.lifetime ? { lifetime: o.lifetime } : {}),
      ...(o.onResume ? { onResume: ['sh', '-c', o.onResume] } : {}),
      ...(Object.keys(labels).length > 0 ? { labels } : {}),
    }),
  );
  if (o.json) printJson(s);
  else process.stdout.write(`${s.id}\n`);
}

export function registerSandboxes(program: Command): void {
  program
    .command('create')
    .description('start a sandbox; prints its id')
    .option('--name <name>', 'a name (lowercase letters, digits, dashes)')
    .option('--rootfs <dir>', 'root filesystem folder (read-only below the sandbox)')
    .option(
      '--image <ref>',
      'a registry image REGISTRY/NAME:TAG or REGISTRY/NAME@sha256:DIGEST (pulled by the daemon: dormant registry login), or an OCI image layout folder DIR[:TAG]',
    )
    .option('--template <name>', 'start from a template (dormant template ls): its memory and files')
    .option('--port <port>', 'a port inside the sandbox to expose (repeatable)', collect, [])
    .option('--env <K=V>', 'an environment variable (repeatable)', collect, [])
    .option('--memory <size>', 'memory limit, e.g. 512M', '512M')
    .option('--cpus <n>', 'CPU limit in cores', '1')
    .option('--disk <size>', "disk quota of the sandbox's writable layer, e.g. 10G (default: the daemon's)")
    .option('--idle <duration>', 'hibernate after this long idle (default: the tenant or node default, 15m)')
    .option('--archive-after <duration>', 'archive after this long hibernated (default: 7d)')
    .option('--lifetime <duration>', 'end the sandbox after this long')
    .option('--on-resume <cmd>', 'shell command run inside after every resume')
    .option('--gpus <list>', 'GPUs for the sandbox: all, or indexes like 0,1 (needs an NVIDIA driver)')
    .option(
      '--gpu-policy <policy>',
      'when it holds GPU state: keep-running (never hibernate), filesystem-only (archive instead), checkpoint (CUDA checkpoint)',
    )
    .option('--label <k=v>', 'a label (repeatable); dormant ls --label k=v finds it', collect, [])
    .option(
      '--egress <policy>',
      "where it may connect beyond the node: internet, none, or CIDRs and host names like 198.18.0.0/15,pypi.org (default: the tenant's, else internet)",
    )
    .option(
      '--runtime <runtime>',
      "runc, or runsc (gVisor's user-space kernel; default: the tenant's, else runc)",
    )
    .option('--json', 'print the sandbox as JSON')
    .argument('[command...]', "the command to run, after -- (default with --image: the image's entrypoint)")
    .addHelpText(
      'after',
      '\nExamples:\n  dormant create --rootfs /srv/rootfs --port 8080 -- python3 -m http.server 8080\n  dormant create --name agent --idle 5m --rootfs ./rootfs -- sh -c "sleep infinity"',
    )
    .action(async (command, o) => {
      if (o.template !== undefined) {
        await createFromTemplate(o.template, command, o);
        return;
      }
      if (!o.rootfs && !o.image)
        throw usage(
          'give --rootfs DIR, --image REGISTRY/NAME:TAG (or an OCI layout DIR), or --template NAME',
        );
      const env: Record<string, string> = {};
      for (const kv of o.env) {
        const i = kv.indexOf('=');
        if (i <= 0) throw usage(`--env ${kv}: expected KEY=VALUE`);
        env[kv.slice(0, i)] = kv.slice(i + 1);
      }
      const ports = o.port.map((p) => {
        const n = Number(p);
        if (!Number.isInteger(n) || n < 1 || n > 65535)
          throw usage(`--port ${p}: expected a port number 1-65535`);
        return n;
      });
      if (o.gpuPolicy !== undefined && !(GPU_POLICIES as readonly string[]).includes(o.gpuPolicy))
        throw usage(`--gpu-policy ${o.gpuPolicy}: expected one of ${GPU_POLICIES.join(', ')}`);
      const cpus = Number(o.cpus);
      if (!(cpus > 0)) throw usage(`--cpus ${o.cpus}: expected a positive number`);
      const labels = labelsOf('--label', o.label);
      const s = await withProgress('creating', !!o.json, () =>
        clientFromEnv().createSandbox({
          command,
          ...(o.name ? { name: o.name } : {}),
          ...(o.rootfs ? { rootfs: resolve(o.rootfs) } : {}),
          // A folder given relative to here is made absolute; anything else is a registry reference.
          ...(o.image ? { image: /^\.\.?\//.test(o.image) ? resolve(o.image) : o.image } : {}),
          env,
          ports,
          memory: o.memory,
          cpus,
          ...(o.disk !== undefined ? { disk: o.disk } : {}),
          ...(o.idle !== undefined ? { idle: o.idle } : {}),
          ...(o.archiveAfter !== undefined ? { archiveAfter: o.archiveAfter } : {}),
          ...(o.lifetime ? { lifetime: o.lifetime } : {}),
          ...(o.onResume ? { onResume: ['sh', '-c', o.onResume] } : {}),
          ...(o.gpus !== undefined ? { gpus: o.gpus } : {}),
          ...(o.gpuPolicy !== undefined ? { gpuPolicy: o.gpuPolicy as GpuPolicy } : {}),
          ...(Object.keys(labels).length > 0 ? { labels } : {}),
          ...(o.egress !== undefined ? { egress: o.egress } : {}),
          ...(o.runtime !== undefined ? { runtime: o.runtime as 'runc' | 'runsc' } : {}),
        }),
      );
      if (o.json) printJson(s);
      else process.stdout.write(`${s.id}\n`);
    });

  program
    .command('ls')
    .description('list sandboxes')
    .option(
      '--label <k=v>',
      'only sandboxes with this label (repeatable: all must match); k alone: has the label',
      collect,
      [],
    )
    .option('--state <states>', 'only sandboxes in these states, comma-separated (running,paused)')
    .option('-q, --quiet', 'print only the ids, one a line')
    .option('--json', 'print JSON')
    .addHelpText(
      'after',
      '\nExamples:\n  dormant ls\n  dormant ls --state hibernated --label team=search\n  dormant ls -q --state paused | xargs -n1 dormant resume',
    )
    .action(async (o) => {
      const list: SandboxInfo[] = [];
      // Every page: a listing is short enough to print whole.
      for await (const s of clientFromEnv().allSandboxes({
        limit: 1000,
        ...(o.label.length > 0 ? { label: o.label } : {}),
        ...(o.state !== undefined ? { state: o.state } : {}),
      }))
        list.push(s);
      if (o.json) printJson(list);
      else if (o.quiet) process.stdout.write(list.map((s) => `${s.id}\n`).join(''));
      else process.stdout.write(sandboxTable(list));
    });

  program
    .command('get')
    .description('show one sandbox')
    .argument('<id>')
    .option('--json', 'print JSON')
    .action(async (id, o) => {
      const s = await clientFromEnv().getSandbox(id);
      if (o.json) printJson(s);
      else process.stdout.write(sandboxDetail(s));
    });

  program
    .command('logs')
    .description("the sandbox's output, across hibernations")
    .argument('<id>')
    .option('-f, --follow', 'keep printing as it grows')
    .option('--restore', "CRIU's log of the sandbox's last failed restore instead of its output")
    .option('--json', 'print { logs } as JSON')
    .action(async (id, o) => {
      const client = clientFromEnv();
      if (o.restore) {
        if (o.follow) throw usage('--restore and --follow cannot be combined');
        const text = await client.restoreLog(id);
        if (o.json) printJson({ logs: text });
        else process.stdout.write(text);
        return;
      }
      if (o.follow) {
        const ac = new AbortController();
        process.once('SIGINT', () => ac.abort());
        await client
          .followLogs(id, (t) => process.stdout.write(t), { signal: ac.signal })
          .catch((e: unknown) => {
            if (!ac.signal.aborted) throw e;
          });
        return;
      }
      const text = await client.logs(id);
      if (o.json) printJson({ logs: text });
      else process.stdout.write(text);
    });

  const simple: [string, string, 'pause' | 'hibernate' | 'archive', string][] = [
    [
      'pause',
      'freeze (memory kept)',
      'pause',
      'dormant pause agent        # thaw with: dormant resume agent',
    ],
    [
      'hibernate',
      'CRIU checkpoint into the vault; processes gone, memory freed',
      'hibernate',
      'dormant hibernate agent    # shows the phase, then the checkpoint size\n  dormant hibernate agent --json | jq .checkpointId',
    ],
    [
      'archive',
      'keep only the filesystem',
      'archive',
      'dormant archive agent      # resume starts its command afresh',
    ],
  ];
  for (const [name, description, op, examples] of simple) {
    program
      .command(name)
      .description(description)
      .argument('<id>', 'the sandbox id or name')
      .option('--json', 'print the sandbox as JSON')
      .addHelpText('after', `\nExamples:\n  ${examples}`)
      .action(async (id, o) => {
        const s = await withProgress(`${op} ${id}`, !!o.json, () => clientFromEnv()[op](id));
        if (o.json) printJson(s);
        else process.stdout.write(`${s.id} ${s.state}\n`);
      });
  }

  program
    .command('resume')
    .description('back to running from paused, hibernated or archived')
    .argument('<id>')
    .option(
      '--from <checkpoint>',
      'restore this older checkpoint instead of the newest (when the newest is damaged)',
    )
    .option('--node <name>', 'in a fleet, wake a sleeping sandbox on this node (dormant node ls)')
    .option('--json', 'print the sandbox as JSON')
    .addHelpText(
      'after',
      '\nExamples:\n  dormant resume agent\n  dormant resume agent --from ck-abcdefghijklmnop   # see: dormant checkpoint ls agent',
    )
    .action(async (id, o) => {
      const client = clientFromEnv();
      const path = `/v1/sandboxes/${encodeURIComponent(id)}/resume${o.node !== undefined ? `?node=${encodeURIComponent(o.node)}` : ''}`;
      const s = await withProgress(`resume ${id}`, !!o.json, () =>
        o.from === undefined && o.node === undefined
          ? client.resume(id)
          : client.request<SandboxInfo>('POST', path, o.from !== undefined ? { from: o.from } : undefined),
      );
      if (o.json) printJson(s);
      else process.stdout.write(`${s.id} ${s.state}\n`);
    });

  program
    .command('fork')
    .description("a new sandbox restored from ID's latest checkpoint")
    .argument('<id>')
    .option('--name <name>')
    .option('--label <k=v>', "the fork's labels instead of its parent's (repeatable)", collect, [])
    .option('--json', 'print the new sandbox as JSON')
    .action(async (id, o) => {
      const s = await clientFromEnv().fork(id, {
        ...(o.name ? { name: o.name } : {}),
        ...(o.label.length > 0 ? { labels: labelsOf('--label', o.label) } : {}),
      });
      if (o.json) printJson(s);
      else process.stdout.write(`${s.id}\n`);
    });

  program
    .command('keepalive')
    .description('tell the policy the sandbox is busy (an agent waiting on a model)')
    .argument('<id>')
    .addOption(new Option('--for <duration>', 'how long').default('30m'))
    .option('--json', 'print the sandbox as JSON')
    .action(async (id, o) => {
      const s = await clientFromEnv().keepalive(id, o.for);
      if (o.json) printJson(s);
      else process.stdout.write(`${s.id} kept alive until ${s.lastActiveAt}\n`);
    });

  program
    .command('update')
    .description("change a sandbox's labels, idle policy and egress")
    .argument('<id>', 'the sandbox id or name')
    .option(
      '--idle <duration>',
      'hibernate after this long idle; `default`: the tenant or node default again',
    )
    .option('--pause-after <duration>', 'freeze after this long idle; `default` drops it')
    .option('--archive-after <duration>', 'archive after this long hibernated; `default` drops it')
    .option('--lifetime <duration>', 'end the sandbox this long after it was created; `default` drops it')
    .option('--label <k=v>', 'set a label (repeatable)', collect, [])
    .option('--unlabel <k>', 'remove a label (repeatable)', collect, [])
    .option('--egress <policy>', 'internet, none, or CIDRs and host names; a running sandbox follows at once')
    .option('--json', 'print the sandbox as JSON')
    .addHelpText(
      'after',
      '\nExamples:\n  dormant update agent --idle 5m --label team=search\n  dormant update agent --unlabel team --lifetime default\n  dormant update agent --egress none',
    )
    .action(async (id, o) => {
      const d = (v: string | undefined) => (v === undefined ? undefined : v === 'default' ? null : v);
      const labels: Record<string, string | null> = labelsOf('--label', o.label);
      for (const k of o.unlabel) labels[k] = null;
      const u = {
        ...(Object.keys(labels).length > 0 ? { labels } : {}),
        ...(o.idle !== undefined ? { idle: d(o.idle) } : {}),
        ...(o.pauseAfter !== undefined ? { pauseAfter: d(o.pauseAfter) } : {}),
        ...(o.archiveAfter !== undefined ? { archiveAfter: d(o.archiveAfter) } : {}),
        ...(o.lifetime !== undefined ? { lifetime: d(o.lifetime) } : {}),
        ...(o.egress !== undefined ? { egress: o.egress } : {}),
      };
      if (Object.keys(u).length === 0)
        throw usage(
          'nothing to change: give --idle, --pause-after, --archive-after, --lifetime, --label, --unlabel or --egress',
        );
      const s = await clientFromEnv().updateSandbox(id, u);
      if (o.json) printJson(s);
      else process.stdout.write(sandboxDetail(s));
    });

  program
    .command('rm')
    .alias('kill')
    .description('delete the sandbox and its data (one already gone is not an error)')
    .argument('<id>')
    .option('--json', 'print { deleted, alreadyGone } as JSON')
    .action(async (id, o) => {
      const client = clientFromEnv();
      // The daemon answers a delete of a gone sandbox like any other (it is idempotent); asked
      // first, the CLI can say which it was.
      const there = await client.getSandbox(id).then(
        () => true,
        (e: unknown) => {
          if (e instanceof DormantApiError && e.code === 'SANDBOX_NOT_FOUND') return false;
          throw e;
        },
      );
      if (there) await client.remove(id);
      if (o.json) printJson({ deleted: id, alreadyGone: !there });
      else process.stdout.write(there ? `${id} deleted\n` : `${id}: no such sandbox (already deleted?)\n`);
    });
}
