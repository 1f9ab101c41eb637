/**
 * The policy loop: every interval it reads each sandbox from the database, samples its CPU,
 * asks `decide()` what is next and applies that through the controller. It keeps no
 * countdown of its own: everything it decides from is persisted (timestamps, states, policy)
 * or live (connections, execs, CPU), so a restarted daemon picks up exactly where the old one
 * was, without forgetting a sandbox that was due nor repeating a step that was done (the
 * step moved the sandbox to another state, and `decide` starts the next countdown from it).
 */
import { asError, isDormantError } from '../domain/errors.js';
import type { Sandbox } from '../domain/sandbox.js';
import {
  decide,
  NO_ACTIVITY,
  type ActivitySignals,
  type PolicyDecision,
  type PolicyDefaults,
} from './policy.js';
import type { Clock } from './options.js';

/** What the loop needs of the controller (SandboxController implements it). */
export interface PolicyTarget {
  list(): Promise<Sandbox[]>;
  /** Rejects when the sandbox is gone. */
  get(id: string): Promise<Sandbox>;
  pause(id: string, tenant?: string, reason?: string): Promise<unknown>;
  hibernate(id: string, tenant?: string, reason?: string): Promise<unknown>;
  archive(id: string, tenant?: string, reason?: string): Promise<unknown>;
  remove(id: string, tenant?: string): Promise<unknown>;
  usage(id: string): Promise<{ cpuUsageUsec: number } | undefined>;
  touch(id: string): Promise<void>;
  /** Records an event on the sandbox without changing its state (why a step was skipped). */
  note?(id: string, reason: string): Promise<void>;
}

export interface PolicyLoopOptions {
  target: PolicyTarget;
  clock: Clock;
  /** Milliseconds between ticks; 0: no timer, the caller ticks (tests). Default 5000. */
  intervalMs?: number;
  defaults?: PolicyDefaults;
  /** Live signals per sandbox (open proxied connections, running execs). */
  activity?: (id: string) => ActivitySignals;
  /**
   * CPU use, as a share of one CPU averaged between two ticks, above which a sandbox counts
   * as active (a build or a test run with nobody connected). Default 0.05.
   */
  cpuActiveShare?: number;
  /** Told once when passes start failing (again after a pass that worked). */
  warn?: (message: string) => void;
  /** Steps applied at once (each hibernate is a CRIU dump and a vault write). Default 2. */
  maxConcurrent?: number;
  /** First wait after a failed step; doubles per failure up to 30 minutes. Default 60 s. */
  retryAfterMs?: number;
  /** Told about every step taken, and every failure. */
  onStep?: (e: PolicyStep) => void;
}

export interface PolicyStep {
  sandboxId: string;
  action: Exclude<PolicyDecision['action'], 'none'>;
  reason: string;
  at: number;
  error?: string;
  /** The step was not taken, and why (a GPU sandbox whose policy forbids hibernating it). */
  skipped?: string;
}

const MAX_RETRY_MS = 30 * 60_000;

export class PolicyLoop {
  private readonly opts: PolicyLoopOptions;
  private readonly clock: Clock;
  private timer: NodeJS.Timeout | undefined;
  private readonly inFlight = new Map<string, Promise<void>>();
  private readonly cpu = new Map<string, { usec: number; at: number }>();
  private readonly backoff = new Map<string, { until: number; failures: number }>();
  /** The last skip recorded per sandbox, so an unchanged reason is recorded once, not every tick. */
  private readonly noted = new Map<string, string>();
  private readonly waiting: (() => void)[] = [];
  private running = 0;
  private closed = false;
  private looking = false;
  private failing = false;

  constructor(opts: PolicyLoopOptions) {
    this.opts = opts;
    this.clock = opts.clock;
  }

  start(): void {
    const every = this.opts.intervalMs ?? 5000;
    if (every <= 0 || this.timer) return;
    this.timer = setInterval(() => {
      // A pass still looking is not doubled; steps in flight do not hold the next pass back
      // (a hibernate takes seconds, and other sandboxes may be due meanwhile).
      if (!this.looking)
        this.look().then(
          () => (this.failing = false),
          (e: unknown) => {
            if (!this.failing) this.opts.warn?.(`policy: a pass failed: ${asError(e).message}`);
            this.failing = true;
          },
        );
    }, every);
    this.timer.unref();
  }

  /** Stops the timer and waits for steps in flight (a hibernate is not cut in half). */
  async close(): Promise<void> {
    this.closed = true;
    if (this.timer) clearInterval(this.timer);
    this.timer = undefined;
    await Promise.allSettled([...this.inFlight.values()]);
  }

  /** One pass over every sandbox; resolves once the steps it started are done. */
  async tick(): Promise<PolicyStep[]> {
    const started = await this.look();
    return (await Promise.all(started)).filter((x): x is PolicyStep => x !== undefined);
  }

  /** Looks at every sandbox and starts the steps that are due; resolves once they are started. */
  private async look(): Promise<Promise<PolicyStep | undefined>[]> {
    this.looking = true;
    try {
      return await this.lookOnce();
    } finally {
      this.looking = false;
    }
  }

  private async lookOnce(): Promise<Promise<PolicyStep | undefined>[]> {
    const started: Promise<PolicyStep | undefined>[] = [];
    const seen = new Set<string>();
    for (const s of await this.opts.target.list()) {
      seen.add(s.id);
      if (this.closed) break;
      if (this.inFlight.has(s.id)) continue;
      await this.sampleCpu(s);
      const d = await this.decideNow(s.id);
      if (!d || d.action === 'none') continue;
      const b = this.backoff.get(s.id);
      if (b && this.clock.now() < b.until) continue;
      started.push(this.apply(s.id, d.action));
    }
    for (const id of this.cpu.keys()) if (!seen.has(id)) this.cpu.delete(id);
    for (const id of this.backoff.keys()) if (!seen.has(id)) this.backoff.delete(id);
    for (const id of this.noted.keys()) if (!seen.has(id)) this.noted.delete(id);
    return started;
  }

  /** Decides on fresh state (the sandbox may have moved while the loop looked at others). */
  private async decideNow(id: string): Promise<PolicyDecision | undefined> {
    let s: Sandbox;
    try {
      s = await this.opts.target.get(id);
    } catch {
      return undefined; // removed meanwhile
    }
    return decide(s, this.clock.now(), {
      ...(this.opts.defaults ? { defaults: this.opts.defaults } : {}),
      activity: this.opts.activity?.(id) ?? NO_ACTIVITY,
    });
  }

  /** CPU above the threshold since the last tick counts as activity: the idle clock restarts. */
  private async sampleCpu(s: Sandbox): Promise<void> {
    if (s.state !== 'running') {
      this.cpu.delete(s.id);
      return;
    }
    // No usage (its cgroup just went away): nothing to judge this tick.
    const u = await this.opts.target.usage(s.id).catch(() => undefined);
    if (!u) return;
    const now = this.clock.now();
    const prev = this.cpu.get(s.id);
    this.cpu.set(s.id, { usec: u.cpuUsageUsec, at: now });
    // A restored sandbox has a new cgroup whose counter starts again: take a new baseline.
    if (!prev || u.cpuUsageUsec < prev.usec || now <= prev.at) return;
    const share = (u.cpuUsageUsec - prev.usec) / ((now - prev.at) * 1000);
    if (share > (this.opts.cpuActiveShare ?? 0.05)) await this.opts.target.touch(s.id);
  }

  private async slot(): Promise<() => void> {
    const max = this.opts.maxConcurrent ?? 2;
    if (this.running >= max) await new Promise<void>((r) => this.waiting.push(r));
    this.running++;
    return () => {
      this.running--;
      this.waiting.shift()?.();
    };
  }

  /**
   * Hibernates, unless the sandbox's GPU policy says otherwise: `filesystem-only` archives it
   * instead; `keep-running` (or `checkpoint` on a node that cannot) leaves it running, records
   * why as an event on the sandbox once, and looks again after `retryAfterMs` (its processes
   * may have let go of the GPU by then).
   */
  private async hibernateOrNot(step: PolicyStep): Promise<void> {
    const t = this.opts.target;
    const id = step.sandboxId;
    try {
      await t.hibernate(id, undefined, step.reason);
    } catch (e) {
      if (isDormantError(e, 'GPU_FILESYSTEM_ONLY')) {
        step.action = 'archive';
        step.reason = `${step.reason}; GPU policy filesystem-only: archived instead of hibernated`;
        await t.archive(id, undefined, step.reason);
        return;
      }
      if (isDormantError(e, 'GPU_KEEP_RUNNING') || isDormantError(e, 'GPU_CHECKPOINT_UNSUPPORTED')) {
        step.skipped = e.message;
        const why = `${step.reason}; not hibernated: ${e.message}`;
        if (this.noted.get(id) !== e.code) {
          this.noted.set(id, e.code);
          await t.note?.(id, why);
        }
        this.backoff.set(id, { until: this.clock.now() + (this.opts.retryAfterMs ?? 60_000), failures: 0 });
        return;
      }
      throw e;
    }
  }

  private apply(id: string, first: PolicyStep['action']): Promise<PolicyStep | undefined> {
    let done!: () => void;
    this.inFlight.set(id, new Promise<void>((r) => (done = r)));
    const run = async (): Promise<PolicyStep | undefined> => {
      const release = await this.slot();
      try {
        if (this.closed) return undefined;
        // Decide again now that a slot is ours: a request may have woken or touched it.
        const d = await this.decideNow(id);
        if (!d || d.action !== first) return undefined;
        const step: PolicyStep = { sandboxId: id, action: d.action, reason: d.reason, at: this.clock.now() };
        const t = this.opts.target;
        try {
          if (d.action === 'pause') await t.pause(id, undefined, d.reason);
          else if (d.action === 'hibernate') await this.hibernateOrNot(step);
          else if (d.action === 'archive') await t.archive(id, undefined, d.reason);
          else await t.remove(id);
          if (step.skipped === undefined) {
            this.backoff.delete(id);
            this.noted.delete(id);
          }
        } catch (e) {
          step.error = asError(e).message;
          const failures = (this.backoff.get(id)?.failures ?? 0) + 1;
          const wait = Math.min(MAX_RETRY_MS, (this.opts.retryAfterMs ?? 60_000) * 2 ** (failures - 1));
          this.backoff.set(id, { until: this.clock.now() + wait, failures });
        }
        this.opts.onStep?.(step);
        return step;
      } finally {
        release();
        this.inFlight.delete(id);
        done();
      }
    };
    return run();
  }
}
