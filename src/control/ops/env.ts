/** Environment values sealed at rest. */

import { LifecycleContext } from '../context.js';

/**
 * Seals every environment value still stored in clear (rows from before sealing); returns
 * how many sandboxes changed. The daemon runs it at start, then compacts the database so the
 * old pages (and WAL frames) with the clear values are overwritten.
 */
export async function sealStoredEnv(
  ctx: LifecycleContext,
  isSealed: (env: Readonly<Record<string, string>>) => boolean,
): Promise<number> {
  const secrets = ctx.opts.secrets;
  if (!secrets) return 0;
  let n = 0;
  for (const s of await ctx.store.listSandboxes()) {
    if (isSealed(s.spec.env)) continue;
    await ctx.locks.run(s.id, async () => {
      const cur = await ctx.store.getSandbox(s.id);
      if (!cur || isSealed(cur.spec.env)) return;
      // Values sealed already (none, unless a start was cut short) are opened first.
      const clear: Record<string, string> = {};
      const sealed: Record<string, string> = {};
      for (const [k, v] of Object.entries(cur.spec.env))
        if (isSealed({ [k]: v })) sealed[k] = v;
        else clear[k] = v;
      const opened = await secrets.open(cur.tenant, cur.id, sealed);
      const env = await secrets.seal(cur.tenant, cur.id, { ...opened, ...clear });
      await ctx.store.updateSandbox(cur.id, { spec: { ...cur.spec, env } });
      n++;
    });
  }
  return n;
}
