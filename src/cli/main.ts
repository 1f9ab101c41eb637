/**
 * The `dormant` command line. Each command lives in ./commands and registers itself on the
 * program; handlers compute data, and the printing is kept to the edge.
 */
// First: sizes libuv's thread pool before anything uses it.
import '../sys/threadpool.js';
import { Command, CommanderError } from '@commander-js/extra-typings';
import { registerDoctor } from './commands/doctor.js';
import { registerVault } from './commands/vault.js';
import { registerSandboxes } from './commands/sandboxes.js';
import { registerToolbox } from './commands/toolbox.js';
import { registerServe } from './commands/serve.js';
import { registerConfig } from './commands/config.js';
import { registerCheckpoint } from './commands/checkpoint.js';
import { registerCost } from './commands/cost.js';
import { registerUrl } from './commands/url.js';
import { registerTokens } from './commands/tokens.js';
import { registerImages } from './commands/images.js';
import { registerTemplates } from './commands/templates.js';
import { registerDashboard } from './commands/dashboard.js';
import { registerService } from './commands/service.js';
import { registerVersion } from './commands/version.js';
import { registerE2b } from './commands/e2b.js';
import { registerNodes } from './commands/nodes.js';
import { DORMANT_VERSION } from '../domain/version.js';
import { EXIT_USAGE, reportError } from './output.js';
import { DEFAULT_URL } from '../sdk/client.js';

export function buildProgram(): Command {
  const program = new Command()
    .name('dormant')
    .description('Pause and resume for AI-agent sandboxes on machines you own.')
    .version(DORMANT_VERSION)
    .showHelpAfterError('(run with --help for usage)')
    .addHelpText(
      'after',
      `
A session:
  dormant serve &                                   # API, dashboard, wake proxy, idle policy
  dormant create --name agent --rootfs ./rootfs --idle 10m -- python3 -m http.server 8080
  dormant exec agent -- ls /srv
  dormant hibernate agent                           # checkpoint into the vault, memory freed
  dormant ls
  dormant resume agent                              # processes and memory back
  dormant dashboard                                 # the fleet in a browser

Environment: DORMANT_URL (default ${DEFAULT_URL}), DORMANT_TOKEN (default: the
admin token in $DORMANT_DATA_DIR/admin-token). Every command takes --json.
The daemon's configuration (file, DORMANT_* variables, flags): docs/CONFIG.md.`,
    )
    .exitOverride();
  registerServe(program);
  registerConfig(program);
  registerSandboxes(program);
  registerToolbox(program);
  registerCheckpoint(program);
  registerTemplates(program);
  registerCost(program);
  registerUrl(program);
  registerE2b(program);
  registerTokens(program);
  registerNodes(program);
  registerImages(program);
  registerDashboard(program);
  registerDoctor(program);
  registerVault(program);
  registerService(program);
  registerVersion(program);
  return program;
}

export async function main(argv: string[]): Promise<number> {
  const program = buildProgram();
  const json = argv.includes('--json');
  try {
    await program.parseAsync(argv, { from: 'user' });
    return typeof process.exitCode === 'number' ? process.exitCode : 0;
  } catch (e) {
    if (e instanceof CommanderError) {
      // Help and version exit 0; everything else commander rejects is a usage error.
      return e.exitCode === 0 ? 0 : EXIT_USAGE;
    }
    return reportError(e, json);
  }
}
