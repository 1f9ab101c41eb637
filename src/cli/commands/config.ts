/**
 * `dormant config check [FILE]`: the configuration `dormant serve` would run with (file,
 * environment and defaults, secrets redacted), or every error in it.
 */
import type { Command } from '@commander-js/extra-typings';
import { EXIT_OK, printJson } from '../output.js';

export function registerConfig(program: Command): void {
  const config = program.command('config').description("the daemon's configuration (docs/CONFIG.md)");
  config
    .command('check')
    .description(
      'validate a configuration file and print the effective configuration (file, DORMANT_* environment, defaults; secrets redacted)',
    )
    .argument('[file]', 'the file (default $DORMANT_CONFIG, else /etc/dormant/config.json when it exists)')
    .option('--json', 'errors as one JSON value too')
    .addHelpText(
      'after',
      '\nExit status: 0 when the configuration is valid (it is printed as JSON, itself a valid file), 2 when it is not (every error is named with its file and key, variable or flag).',
    )
    .action(async (file) => {
      const { configFileView, loadConfig } = await import('../../daemon/config.js');
      // An invalid configuration throws INVALID_ARGUMENT, which the CLI reports with exit 2.
      const loaded = loadConfig(file !== undefined ? { file } : {});
      if (loaded.file !== undefined) process.stderr.write(`dormant: configuration from ${loaded.file}\n`);
      else process.stderr.write('dormant: no configuration file; environment and defaults\n');
      printJson(configFileView(loaded.config));
      process.exitCode = EXIT_OK;
    });
}
