/** Pause: the sandbox's processes frozen in place. */

import { assertLegal, isNoop, type Sandbox } from '../../domain/sandbox.js';
import { LifecycleContext } from '../context.js';

export async function pauseSandbox(
  ctx: LifecycleContext,
  id: string,
  tenant: string | undefined,
  reason: string,
): Promise<Sandbox> {
  const s = await ctx.get(id, tenant);
  assertLegal('pause', s.state, id);
  if (isNoop('pause', s.state)) return s;
  await ctx.runtime.freeze(id);
  await ctx.store.transition(id, 'running', 'paused', reason, ctx.clock.now());
  return await ctx.get(id);
}
