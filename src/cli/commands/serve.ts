import { Command, Option } from '@commander-js/extra-typings';
import { DEFAULT_CONFIG_FILE, SETTINGS } from '../../daemon/settings.js';

const collect = (v: string, prev: string[] = []): string[] => [...prev, v];

/**
 * The configuration's flags, one per key of SETTINGS (docs/CONFIG.md). None has a commander
 * default: a flag not given leaves the key to the environment, the file or the defaults.
 */
function addConfigFlags(cmd: Command): void {
  for (const s of SETTINGS) {
    if (s.flag === undefined) continue;
    if (s.kind === 'paths') {
      cmd.addOption(new Option(s.flag, s.help).argParser(collect));
      continue;
    }
    cmd.addOption(new Option(s.flag, s.help));
    // `--no-proxy` has its `--proxy`, so a flag can turn back on what the file turned off.
    if (s.flag.startsWith('--no-')) cmd.addOption(new Option(s.flag.replace('--no-', '--')).hideHelp());
  }
}

export function registerServe(program: Command): void {
  const serve = program
    .command('serve')
    .description(
      'run the daemon: API, dashboard, wake proxy, policy loop, on the embedded defaults (SQLite, local vault)',
    )
    .option(
      '--config <file>',
      `the configuration file (default $DORMANT_CONFIG, else ${DEFAULT_CONFIG_FILE} when it exists); flags win over the environment, which wins over the file`,
    )
    .addHelpText(
      'after',
      '\nEvery flag has a key in the configuration file and a DORMANT_* variable: docs/CONFIG.md.\n\nExamples:\n  dormant serve\n  dormant serve --config /etc/dormant/config.json\n  dormant serve --listen 0.0.0.0:7420 --proxy-domain sandboxes.example.com --allow-root /srv/images',
    );
  addConfigFlags(serve);
  serve.action(async (o, cmd) => {
    // Loaded here, not at the top: every other command starts without the daemon's modules.
    const { flagLayerRaw, loadConfig } = await import('../../daemon/config.js');
    const { optionsFromConfig, startDaemon } = await import('../../daemon/daemon.js');
    const { configReloader } = await import('../../daemon/reload.js');
    const { LogFile } = await import('../../sys/log.js');
    const values = cmd.opts() as Record<string, unknown>;
    // Read again, the same way, on SIGHUP.
    const load = () =>
      loadConfig({
        ...(o.config !== undefined ? { file: o.config } : {}),
        flags: flagLayerRaw(values, (attr) => cmd.getOptionValueSource(attr) === 'cli'),
      });
    const { config, file } = load();
    const logFile =
      config.logFile !== undefined
        ? new LogFile({ path: config.logFile, maxBytes: config.logMaxBytes, keep: config.logKeep })
        : undefined;
    const d = await startDaemon(optionsFromConfig(config, logFile));
    const { log } = d;
    for (const r of d.reconciled)
      log.info({ sandbox: r.id, from: r.from, to: r.to }, `reconciled ${r.id}: ${r.from} -> ${r.to}`);
    const dataDir = config.dataDir;
    if (file !== undefined) log.info({ file }, `configuration from ${file}`);
    log.info(
      { url: d.url, dataDir },
      `serving on ${d.url} (data in ${dataDir}; admin token in ${dataDir}/admin-token)`,
    );
    log.info(`dashboard at ${d.url}/ (\`dormant dashboard\` prints it signed in)`);
    const reload = configReloader({ load, started: config, daemon: d, log });
    // SIGHUP: the log file opened again (after logrotate moved it), then the configuration.
    const onHangup = (): void => {
      try {
        logFile?.reopen();
      } catch (e) {
        process.stderr.write(`dormant: reopening ${config.logFile}: ${(e as Error).message}\n`);
      }
      log.info('SIGHUP: reloading the configuration');
      reload();
    };
    process.on('SIGHUP', onHangup);
    await new Promise<void>((done) => {
      process.once('SIGINT', () => done());
      process.once('SIGTERM', () => done());
    });
    process.off('SIGHUP', onHangup);
    log.info('shutting down (sandboxes keep running)');
    await d.close();
    logFile?.close();
  });
}
