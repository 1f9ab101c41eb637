/**
 * The toolbox agent (native/agent/, docs/ARCHITECTURE.md "The toolbox agent") on the runc
 * runtime: where its binary is, and starting it inside a sandbox.
 */
import { access, constants } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

/**
 * Where the agent's binary may be: $DORMANT_AGENT_BINARY, this checkout's build (so the agent
 * and the client that speaks to it come from the same source), setup.sh's install.
 */
export function agentBinaryCandidates(env: NodeJS.ProcessEnv = process.env): string[] {
  const here = dirname(fileURLToPath(import.meta.url));
  return [
    ...(env.DORMANT_AGENT_BINARY ? [env.DORMANT_AGENT_BINARY] : []),
    join(here, '..', '..', 'build', 'native', 'dormant-agent'),
    '/opt/dormant/bin/dormant-agent',
  ];
}

export async function locateAgentBinary(env: NodeJS.ProcessEnv = process.env): Promise<string | undefined> {
  for (const p of agentBinaryCandidates(env)) {
    if (
      await access(p, constants.X_OK)
        .then(() => true)
        .catch(() => false)
    )
      return p;
    // An explicit setting that does not work is not silently replaced by another binary.
    if (p === env.DORMANT_AGENT_BINARY) return undefined;
  }
  return undefined;
}
