/** Remove: the sandbox, its runtime side and (crypto-shredded) its checkpoints are gone. */

import { LifecycleContext } from '../context.js';

export async function removeSandbox(
  ctx: LifecycleContext,
  id: string,
  tenant: string | undefined,
  reason: string,
): Promise<void> {
  const s = await ctx.get(id, tenant);
  if (s.state !== 'deleting') await ctx.store.transition(id, s.state, 'deleting', reason, ctx.clock.now());
  await ctx.runtime.destroy(id);
  for (const op of ['hibernate', 'resume', 'fork'] as const) ctx.timings.delete(`${op}:${id}`);
  // Crypto-shredding: without the sandbox's key its checkpoints cannot be read again.
  await ctx.vault.destroySandboxKey({ tenant: s.tenant, sandboxId: id });
  await ctx.store.deleteSandbox(id, reason, ctx.clock.now());
}
