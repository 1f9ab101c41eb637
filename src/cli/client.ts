/** The CLI's connection to the daemon: URL and token from the environment (./env.ts), over node:http (./http-fetch.ts). */
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { DormantClient } from '../sdk/client.js';
import { cliEnv, daemonUrl, defaultDataDir, tokenFromEnvVar } from './env.js';
import { httpFetch } from './http-fetch.js';

/** DORMANT_TOKEN, else the admin token file under the data directory when it is readable. */
export function tokenFromEnv(env: NodeJS.ProcessEnv = cliEnv()): string | undefined {
  const token = tokenFromEnvVar(env);
  if (token !== undefined) return token;
  try {
    return readFileSync(join(defaultDataDir(env), 'admin-token'), 'utf8').trim() || undefined;
  } catch {
    return undefined;
  }
}

export function clientFromEnv(env: NodeJS.ProcessEnv = cliEnv()): DormantClient {
  const token = tokenFromEnv(env);
  return new DormantClient({ url: daemonUrl(env), fetch: httpFetch, ...(token ? { token } : {}) });
}
