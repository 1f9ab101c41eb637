/** The environment variables INTERFACE.md promises, resolved in one place. */
export function defaultDataDir(env: NodeJS.ProcessEnv = process.env): string {
  return env.DORMANT_DATA_DIR && env.DORMANT_DATA_DIR !== '' ? env.DORMANT_DATA_DIR : '/var/lib/dormant';
}

export function daemonUrl(env: NodeJS.ProcessEnv = process.env): string {
  return env.DORMANT_URL && env.DORMANT_URL !== '' ? env.DORMANT_URL : 'http://127.0.0.1:7420';
}
