/**
 * Update: a sandbox's labels and its own idle policy, changed after create. The policy loop
 * reads each sandbox's policy from the database on every pass, so a new value acts from the
 * next pass on, without a restart or anything kept in memory here.
 */

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
export function updateSandbox(
  ctx: LifecycleContext,
  id: string,
  tenant: string | undefined,
  u: SandboxUpdate,
): Sandbox {
  const found = ctx.get(id, tenant);
  return ctx.store.atomically(() => {
    const s = ctx.get(found.id);
    const policy = Object.fromEntries(
      Object.entries({ ...s.spec.policy, ...u.policy }).filter(([, v]) => v !== null && v !== undefined),
    ) as SandboxPolicy;
    const labels = u.labels !== undefined ? patchLabels(s.spec.labels ?? {}, u.labels) : s.spec.labels;
    const spec = { ...s.spec, policy };
    if (labels !== undefined && Object.keys(labels).length > 0) spec.labels = labels;
    else delete spec.labels;
    ctx.store.updateSandbox(s.id, { spec });
    const what = describe(u);
    if (what !== '') ctx.store.note(s.id, `update: ${what}`, ctx.clock.now());
    return ctx.get(s.id);
  });
}
