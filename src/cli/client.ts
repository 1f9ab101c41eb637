/** The CLI's connection to the daemon: URL and token from the environment INTERFACE.md lists. */
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { DormantClient } from '../sdk/client.js';
import { daemonUrl, defaultDataDir } from './env.js';

/** DORMANT_TOKEN, else the admin token file under the data directory when it is readable. */
export function tokenFromEnv(env: NodeJS.ProcessEnv = process.env): string | undefined {
  const token = env.DORMANT_TOKEN;
  if (token !== undefined && token !== '') return token;
  try {
    return readFileSync(join(defaultDataDir(env), 'admin-token'), 'utf8').trim() || undefined;
  } catch {
    return undefined;
  }
}

export function clientFromEnv(env: NodeJS.ProcessEnv = process.env): DormantClient {
  const token = tokenFromEnv(env);
  return new DormantClient({ url: daemonUrl(env), ...(token ? { token } : {}) });
}
