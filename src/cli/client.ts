/** The CLI's connection to the daemon: URL and token from the environment INTERFACE.md lists. */
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { DormantClient } from '../sdk/client.js';
import { daemonUrl, defaultDataDir } from './env.js';

export function clientFromEnv(env: NodeJS.ProcessEnv = process.env): DormantClient {
  let token = env.DORMANT_TOKEN;
  if (token === undefined || token === '') {
    try {
      token = readFileSync(join(defaultDataDir(env), 'admin-token'), 'utf8').trim();
    } catch {
      token = undefined;
    }
  }
  return new DormantClient({ url: daemonUrl(env), ...(token ? { token } : {}) });
}
