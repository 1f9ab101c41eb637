/**
 * The CLI's environment, read in this one module: where the daemon is (DORMANT_URL), who is
 * calling (DORMANT_TOKEN) and the data directory the admin token is found in. The daemon's own
 * variables are read by its configuration (daemon/config.ts).
 */
import { DEFAULT_URL } from '../sdk/client.js';
import { DEFAULT_DATA_DIR } from '../daemon/settings.js';

/** The process environment; the functions here take another for tests. */
export function cliEnv(): NodeJS.ProcessEnv {
  return process.env;
}

const nonEmpty = (v: string | undefined): string | undefined => (v === undefined || v === '' ? undefined : v);

export function defaultDataDir(env: NodeJS.ProcessEnv = cliEnv()): string {
  return nonEmpty(env.DORMANT_DATA_DIR) ?? DEFAULT_DATA_DIR;
}

export function daemonUrl(env: NodeJS.ProcessEnv = cliEnv()): string {
  return nonEmpty(env.DORMANT_URL) ?? DEFAULT_URL;
}

export function tokenFromEnvVar(env: NodeJS.ProcessEnv = cliEnv()): string | undefined {
  return nonEmpty(env.DORMANT_TOKEN);
}
