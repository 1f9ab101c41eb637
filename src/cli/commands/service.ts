/**
 * `dormant install-service`: the daemon as a systemd service. Writes the unit (or prints it
 * with --print) and, where systemd runs, reloads it and starts the service now and at boot.
 *
 * Choices the unit makes, and why:
 * - KillMode=process: a stop ends only the daemon. Sandboxes run in their own cgroups (runc),
 *   but the helpers that serve them (log collectors, page servers of lazy restores) are the
 *   daemon's children; killing the whole control group would harm running sandboxes. The
 *   restarted daemon finds and adopts what it left (reconcile), as after `kill -9`.
 * - TimeoutStopSec=300: SIGTERM lets in-flight operations finish (a hibernate of a large
 *   sandbox stores its memory first); only then does systemd escalate to SIGKILL.
 * - Restart=on-failure: a crash or `kill -9` brings it back; `systemctl stop` does not.
 * - LimitCORE=0 and UMask=0077: a core dump of the daemon would hold keys and sandbox memory in
 *   plaintext; files it creates are its own.
 */
import { existsSync, mkdirSync, realpathSync, writeFileSync } from 'node:fs';
import { isAbsolute, join, resolve } from 'node:path';
import type { Command } from '@commander-js/extra-typings';
import { DormantError } from '../../domain/errors.js';
import { run } from '../../sys/exec.js';

export interface UnitOptions {
  /** The node binary that runs the CLI. */
  node: string;
  /** The `dormant` script (bin/dormant of this checkout). */
  bin: string;
  /** A configuration file to pass with --config; absent: serve's own default lookup. */
  config?: string;
  /** DORMANT_DATA_DIR for the service; absent: the configuration's (or the built-in) one. */
  dataDir?: string;
  /** DORMANT_LISTEN (host:port) for the service; absent: the configuration's one. */
  listen?: string;
}

/** The unit's text. Paths must be absolute: systemd does not search PATH for them. */
export function renderUnit(o: UnitOptions): string {
  for (const [what, p] of [
    ['node', o.node],
    ['bin', o.bin],
    ['config', o.config],
    ['data dir', o.dataDir],
  ] as const) {
    if (p === undefined) continue;
    if (!isAbsolute(p) || /[\s"'\\%$]/.test(p)) {
      throw new DormantError(
        'INVALID_ARGUMENT',
        `the service's ${what} path must be absolute and without spaces, quotes, % or $: ${p}`,
      );
    }
  }
  if (o.listen !== undefined && !/^[\w.:[\]-]+$/.test(o.listen)) {
    throw new DormantError('INVALID_ARGUMENT', `the service's listen address must be host:port: ${o.listen}`);
  }
  const exec = [o.node, o.bin, 'serve', ...(o.config !== undefined ? ['--config', o.config] : [])];
  return [
    '# Written by `dormant install-service`. Edit the configuration file, not this unit.',
    '[Unit]',
    'Description=dormant: pause and resume for AI-agent sandboxes',
    'After=network-online.target',
    'Wants=network-online.target',
    '',
    '[Service]',
    'Type=simple',
    `ExecStart=${exec.join(' ')}`,
    '# `systemctl reload dormant`: the configuration read again (docs/CONFIG.md, Reloading).',
    'ExecReload=/bin/kill -HUP $MAINPID',
    ...(o.dataDir !== undefined ? [`Environment=DORMANT_DATA_DIR=${o.dataDir}`] : []),
    ...(o.listen !== undefined ? [`Environment=DORMANT_LISTEN=${o.listen}`] : []),
    'Restart=on-failure',
    'RestartSec=2s',
    '# Only the daemon: the helpers of running sandboxes stay (see the install-service help).',
    'KillMode=process',
    'KillSignal=SIGTERM',
    'TimeoutStopSec=300',
    'LimitNOFILE=1048576',
    'TasksMax=infinity',
    'LimitCORE=0',
    'UMask=0077',
    '',
    '[Install]',
    'WantedBy=multi-user.target',
    '',
  ].join('\n');
}

/**
 * bin/dormant of this checkout: the script this process runs (the CLI has no other entry; this
 * module may run from the bundle in dist/cli, so not a path relative to its own file).
 */
function dormantBin(): string {
  return realpathSync(process.argv[1] ?? 'bin/dormant');
}

/** True where systemd is the running init (what sd_booted checks). */
export function systemdRuns(): boolean {
  return existsSync('/run/systemd/system');
}

export function registerService(program: Command): void {
  program
    .command('install-service')
    .description('run the daemon as a systemd service (dormant.service), started now and at boot')
    .option('--config <file>', 'the configuration file the service reads (absolute path)')
    .option('--data-dir <dir>', 'DORMANT_DATA_DIR for the service (absolute path)')
    .option('--listen <host:port>', 'DORMANT_LISTEN for the service')
    .option('--unit-dir <dir>', 'where the unit goes', '/etc/systemd/system')
    .option('--print', 'print the unit instead of installing it')
    .option('--no-start', 'install and enable, but do not start it now')
    .addHelpText(
      'after',
      '\nStop it with `systemctl stop dormant` (sandboxes keep running); logs: `journalctl -u dormant`.\nA stop ends only the daemon (KillMode=process): the helpers of running sandboxes stay, and\nthe next start adopts them. Where systemd does not run, the unit is written and nothing started.',
    )
    .action(async (o) => {
      const unit = renderUnit({
        node: process.execPath,
        bin: dormantBin(),
        ...(o.config !== undefined ? { config: resolve(o.config) } : {}),
        ...(o.dataDir !== undefined ? { dataDir: resolve(o.dataDir) } : {}),
        ...(o.listen !== undefined ? { listen: o.listen } : {}),
      });
      if (o.print === true) {
        process.stdout.write(unit);
        return;
      }
      mkdirSync(o.unitDir, { recursive: true });
      const file = join(o.unitDir, 'dormant.service');
      writeFileSync(file, unit, { mode: 0o644 });
      process.stdout.write(`wrote ${file}\n`);
      if (!systemdRuns()) {
        process.stdout.write('systemd is not running on this machine: nothing started\n');
        return;
      }
      await run('systemctl', ['daemon-reload']);
      await run('systemctl', ['enable', ...(o.start ? ['--now'] : []), 'dormant.service']);
      process.stdout.write(
        o.start ? 'dormant.service enabled and started\n' : 'dormant.service enabled (not started)\n',
      );
    });
}
