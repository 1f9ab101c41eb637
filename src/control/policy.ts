/**
 * Idle policy: what should happen next to a sandbox, decided from its persisted timestamps,
 * its policy, the tenant's and node's defaults, live activity signals and the time now. Pure:
 * no I/O and no clock of its own, so a test drives it with plain numbers, and the daemon
 * decides the same after a restart as before it (the countdowns live in the database, not
 * in timers).
 */
import { formatDurationMs } from '../domain/units.js';
import { DEFAULT_POLICY, type Sandbox, type SandboxPolicy } from '../domain/sandbox.js';

/** Signals the database does not hold: they are live, and a restart starts them at zero. */
export interface ActivitySignals {
  /** Requests in flight and open WebSocket/TCP tunnels through the wake proxy. */
  openConnections: number;
  /** Exec sessions running inside the sandbox. */
  runningExecs: number;
}

export const NO_ACTIVITY: Readonly<ActivitySignals> = Object.freeze({ openConnections: 0, runningExecs: 0 });

/** Where a sandbox's effective policy comes from, lowest precedence first. */
export interface PolicyDefaults {
  /** The node's defaults. Default: DEFAULT_POLICY (hibernate after 15m idle, archive after 7d). */
  node?: SandboxPolicy;
  /** Per-tenant defaults, over the node's. */
  tenants?: Readonly<Record<string, SandboxPolicy>>;
}

export type PolicyAction = 'pause' | 'hibernate' | 'archive' | 'delete';

export type PolicyDecision =
  | { action: 'none'; why: string; /** When to look again, if anything is counting down. */ nextAt?: number }
  | { action: PolicyAction; reason: string };

/** Only defined fields override: `{hibernateAfterMs: undefined}` keeps what is below it. */
function overlay(base: SandboxPolicy, top: SandboxPolicy | undefined): SandboxPolicy {
  const out: SandboxPolicy = { ...base };
  if (!top) return out;
  for (const k of Object.keys(top) as (keyof SandboxPolicy)[]) {
    const v = top[k];
    if (v !== undefined) out[k] = v;
  }
  return out;
}

/** The policy in force: node defaults < tenant defaults < the sandbox's own. */
export function effectivePolicy(
  sandbox: Pick<Sandbox, 'tenant' | 'spec'>,
  defaults: PolicyDefaults = {},
): SandboxPolicy {
  const node = overlay({}, defaults.node ?? DEFAULT_POLICY);
  const tenant = overlay(node, defaults.tenants?.[sandbox.tenant]);
  return overlay(tenant, sandbox.spec.policy);
}

const f = formatDurationMs;

/**
 * The next step for one sandbox.
 *
 * - lifetime cap: a running, paused or hibernated sandbox older than `lifetimeMs` is archived,
 *   lease or not (a cap the user set is a cap);
 * - running: hibernate once idle `hibernateAfterMs`, else pause once idle `pauseAfterMs`;
 * - paused: hibernate once idle `hibernateAfterMs`;
 * - hibernated: archive once hibernated (and unleased) `archiveAfterMs`;
 * - archived: delete once archived (and unleased) `deleteAfterMs`;
 * - anything else (creating, transient, failed): leave it alone.
 *
 * Idle time is `now - lastActiveAt`; a lease (`dormant keepalive`) is a lastActiveAt in the
 * future, so it blocks every idle step until it runs out. Open proxied connections and running
 * execs make a sandbox active now, whatever its timestamps say.
 */
export function decide(
  sandbox: Pick<Sandbox, 'tenant' | 'state' | 'createdAt' | 'stateSince' | 'lastActiveAt' | 'spec'>,
  now: number,
  opts: { defaults?: PolicyDefaults; activity?: ActivitySignals } = {},
): PolicyDecision {
  const p = effectivePolicy(sandbox, opts.defaults);
  const act = opts.activity ?? NO_ACTIVITY;
  const { state } = sandbox;
  const live = state === 'running' || state === 'paused' || state === 'hibernated';
  if (live && p.lifetimeMs !== undefined && now - sandbox.createdAt >= p.lifetimeMs) {
    return { action: 'archive', reason: `policy: lifetime ${f(p.lifetimeMs)}` };
  }
  const lifetimeAt = live && p.lifetimeMs !== undefined ? sandbox.createdAt + p.lifetimeMs : undefined;
  const soonest = (...at: (number | undefined)[]): { nextAt?: number } => {
    const ts = at.filter((x): x is number => x !== undefined);
    return ts.length > 0 ? { nextAt: Math.min(...ts) } : {};
  };
  if (sandbox.lastActiveAt > now) {
    return { action: 'none', why: 'leased', ...soonest(sandbox.lastActiveAt, lifetimeAt) };
  }
  const idleMs = now - sandbox.lastActiveAt;
  switch (state) {
    case 'running':
    case 'paused': {
      if (act.openConnections > 0 || act.runningExecs > 0) {
        const what =
          act.runningExecs > 0 ? `${act.runningExecs} exec(s)` : `${act.openConnections} connection(s)`;
        return { action: 'none', why: `active: ${what}`, ...soonest(lifetimeAt) };
      }
      const h = p.hibernateAfterMs;
      if (h !== undefined && idleMs >= h) return { action: 'hibernate', reason: `policy: idle ${f(h)}` };
      const pa = p.pauseAfterMs;
      if (state === 'running' && pa !== undefined && idleMs >= pa && (h === undefined || pa < h)) {
        return { action: 'pause', reason: `policy: idle ${f(pa)}` };
      }
      const nextPause = state === 'running' && pa !== undefined ? sandbox.lastActiveAt + pa : undefined;
      const nextHib = h !== undefined ? sandbox.lastActiveAt + h : undefined;
      return { action: 'none', why: `idle ${f(idleMs)}`, ...soonest(nextPause, nextHib, lifetimeAt) };
    }
    case 'hibernated':
    case 'archived': {
      // A lease that ran out while asleep counts from its end, like any other activity.
      const since = Math.max(sandbox.stateSince, sandbox.lastActiveAt);
      const after = state === 'hibernated' ? p.archiveAfterMs : p.deleteAfterMs;
      if (after !== undefined && now - since >= after) {
        return state === 'hibernated'
          ? { action: 'archive', reason: `policy: hibernated ${f(after)}` }
          : { action: 'delete', reason: `policy: archived ${f(after)}` };
      }
      return {
        action: 'none',
        why: `${state} ${f(now - since)}`,
        ...soonest(after !== undefined ? since + after : undefined, lifetimeAt),
      };
    }
    default:
      return { action: 'none', why: `${state}: not managed by the policy` };
  }
}
