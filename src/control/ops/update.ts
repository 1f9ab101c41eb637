/**
 * Update: a sandbox's labels and its own idle policy, changed after create. The policy loop
 * reads each sandbox's policy from the database on every pass, so a new value acts from the
 * next pass on, without a restart or anything kept in memory here. Its egress policy changes
 * the runtime's firewall too (updateEgress).
 */

import { egressText, parseEgressPolicy } from '../../domain/egress.js';
import { isDormantError } from '../../domain/errors.js';
import { formatDurationMs } from '../../domain/units.js';
import { patchLabels, type Sandbox, type SandboxPolicy } from '../../domain/sandbox.js';
import { LifecycleContext } from '../context.js';

/** The policy fields an update may set; null drops the sandbox's own value. */
export type PolicyPatch = { [K in keyof SandboxPolicy]?: number | null };

export interface SandboxUpdate {
  /** A string sets the label, null removes it; labels not named are kept. */
  labels?: Record<string, string | null>;
  policy?: PolicyPatch;
}

/** The policy fields by the names the API and the CLI give them. */
const SHOWN: Record<keyof SandboxPolicy, string> = {
  hibernateAfterMs: 'idle',
  pauseAfterMs: 'pauseAfter',
  archiveAfterMs: 'archiveAfter',
  deleteAfterMs: 'deleteAfter',
  lifetimeMs: 'lifetime',
};

/** What changed, for the event: `idle 1s; labels +team -old`. */
function describe(u: SandboxUpdate): string {
  const parts: string[] = [];
  for (const [k, v] of Object.entries(u.policy ?? {}) as [keyof SandboxPolicy, number | null | undefined][])
    parts.push(`${SHOWN[k]} ${v === null || v === undefined ? 'default' : formatDurationMs(v)}`);
  const l = Object.entries(u.labels ?? {}).map(([k, v]) => `${v === null ? '-' : '+'}${k}`);
  if (l.length > 0) parts.push(`labels ${l.join(' ')}`);
  return parts.join('; ');
}

/**
 * Applies `u` to the sandbox and records it as an event (a transition to the same state).
 * Not under the sandbox's lock: an update answers at once even while a hibernate runs, and the
 * read and write of the spec are one transaction, so no other write of it comes between.
 */
export async function updateSandbox(
  ctx: LifecycleContext,
  id: string,
  tenant: string | undefined,
  u: SandboxUpdate,
): Promise<Sandbox> {
  const found = await ctx.get(id, tenant);
  return await ctx.store.atomically(async (tx) => {
    const s = await ctx.get(found.id, undefined, tx);
    const policy = Object.fromEntries(
      Object.entries({ ...s.spec.policy, ...u.policy }).filter(([, v]) => v !== null && v !== undefined),
    ) as SandboxPolicy;
    const labels = u.labels !== undefined ? patchLabels(s.spec.labels ?? {}, u.labels) : s.spec.labels;
    const spec = { ...s.spec, policy };
    if (labels !== undefined && Object.keys(labels).length > 0) spec.labels = labels;
    else delete spec.labels;
    await tx.updateSandbox(s.id, { spec });
    const what = describe(u);
    if (what !== '') await tx.note(s.id, `update: ${what}`, ctx.clock.now());
    return await ctx.get(s.id, undefined, tx);
  });
}

/**
 * Gives the sandbox another egress policy (`internet`, `none` or a list, as create takes it):
 * checked whole first (EGRESS_POLICY_INVALID, EGRESS_HOST_UNRESOLVABLE: nothing changes), then
 * the runtime's firewall (at once when its network is up; a sleeping sandbox's record, for its
 * next resume), then the database and an event. Call under the sandbox's lock: a resume
 * compares the runtime's record with the database's spec.
 */
export async function updateEgress(
  ctx: LifecycleContext,
  id: string,
  tenant: string | undefined,
  asked: string | string[],
): Promise<Sandbox> {
  const s = await ctx.get(id, tenant);
  const policy = parseEgressPolicy(asked);
  await ctx.runtime.checkEgress?.(policy);
  const set = async (p: typeof policy): Promise<void> => {
    try {
      await ctx.runtime.setEgress?.(s.id, p);
    } catch (e) {
      // A sandbox the runtime does not hold (never started, or archived) gets it when prepared.
      if (!isDormantError(e, 'RUNTIME_SANDBOX_NOT_FOUND')) throw e;
    }
  };
  try {
    await set(policy);
  } catch (e) {
    // Half applied: the old policy back, so the firewall and the record say the same.
    const old = s.spec.egress;
    if (old !== undefined) await set(old).catch((x: unknown) => ctx.warnCleanup(s.id, 'egress back', x));
    throw e;
  }
  return await ctx.store.atomically(async (tx) => {
    const cur = await ctx.get(s.id, undefined, tx);
    await tx.updateSandbox(s.id, { spec: { ...cur.spec, egress: policy } });
    await tx.note(s.id, `update: egress ${egressText(policy)}`, ctx.clock.now());
    return await ctx.get(s.id, undefined, tx);
  });
}
