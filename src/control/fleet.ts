/**
 * A node's membership in a fleet: it registers in the shared database, renews its lease,
 * hibernates its sandboxes while drained, and takes back the sandboxes of nodes whose lease ran
 * out. Leases are timed by the database's clock (FleetStore), never by the nodes'. A node that
 * cannot renew freezes its sandboxes before its lease can run out (fencing, timed by its own
 * monotonic clock from the last renewal that succeeded), and thaws them if it renews in time.
 */
import { performance } from 'node:perf_hooks';
import { asError } from '../domain/errors.js';
import type { NodeCapacity, NodeState } from '../domain/node.js';
import type { FleetStore } from '../state/store.js';
import type { Sandbox } from '../domain/sandbox.js';
import type { FenceEnd, Fenced, Reclaimed } from './ops/nodes.js';

/** What membership needs of the controller. */
export interface FleetTarget {
  listOwn(): Promise<Sandbox[]>;
  hibernate(id: string, tenant: string | undefined, reason: string): Promise<unknown>;
  reclaimLostNode(name: string): Promise<Reclaimed[]>;
  releaseForeign(): Promise<string[]>;
  fence(): Promise<Fenced>;
}

export interface MembershipOptions {
  fleet: FleetStore;
  target: FleetTarget;
  name: string;
  url: string;
  proxyUrl?: string;
  capacity: NodeCapacity;
  leaseMs: number;
  warn: (m: string) => void;
  info?: (m: string) => void;
  /** Default: a third of the lease. */
  renewEveryMs?: number;
  /**
   * How long after sending the last renewal that succeeded the node fences itself if none has
   * succeeded since. Default: three quarters of the lease (the lease at the database runs at
   * least a whole lease from that sending).
   */
  fenceAfterMs?: number;
}

export class NodeMembership {
  private timer: NodeJS.Timeout | undefined;
  private closed = false;
  private ticking: Promise<void> | undefined;
  private draining: Promise<void> | undefined;
  /** Releasing leftovers and judging other nodes: beside the renewals, never in their way. */
  private chores: Promise<void> | undefined;
  /** Others are judged only after this: a node (re)joining, or back from an outage, gives the rest a lease to renew. */
  private judgeAfter: number;
  private lastState: NodeState;
  /** Drain failures already reported, by sandbox. */
  private readonly drainFailed = new Set<string>();
  private fenceTimer: NodeJS.Timeout | undefined;
  /** The last renewal failed. */
  private failing = false;
  /** Set while the node is fenced (or freezing), until a renewal or close lifts it. */
  private fencing: Promise<Fenced | undefined> | undefined;

  private constructor(
    private readonly o: MembershipOptions,
    state: NodeState,
  ) {
    this.lastState = state;
    this.judgeAfter = Date.now() + o.leaseMs;
  }

  /** Registers the node (a draining one stays draining) and starts renewing its lease. */
  static async join(o: MembershipOptions): Promise<NodeMembership> {
    const sent = performance.now();
    const state = await o.fleet.registerNode(
      {
        name: o.name,
        url: o.url,
        ...(o.proxyUrl !== undefined ? { proxyUrl: o.proxyUrl } : {}),
        capacity: o.capacity,
        startedAt: Date.now(),
      },
      o.leaseMs,
    );
    const m = new NodeMembership(o, state);
    m.armFence(sent);
    m.schedule();
    return m;
  }

  /** What the database said of this node at the last renewal. */
  get state(): NodeState {
    return this.lastState;
  }

  private schedule(): void {
    if (this.closed) return;
    const every = this.o.renewEveryMs ?? Math.max(200, Math.floor(this.o.leaseMs / 3));
    this.timer = setTimeout(
      () => {
        this.ticking = this.tick().finally(() => {
          this.ticking = undefined;
          this.schedule();
        });
      },
      // After a failed renewal, the next one comes sooner: a short outage should end in a
      // renewal, not in the fence (which comes three quarters of a lease after the last one).
      this.failing ? Math.min(every, Math.max(200, Math.floor(this.o.leaseMs / 10))) : every,
    );
    this.timer.unref();
  }

  /** One renewal, and what follows from it; exported for tests that cannot wait. */
  async tick(): Promise<void> {
    const { fleet, name, leaseMs } = this.o;
    let state: NodeState | undefined;
    const sent = performance.now();
    try {
      state = await fleet.renewNode(name, leaseMs);
    } catch (e) {
      // Out of reach: the others cannot mark anyone lost either. Once back, this node waits a
      // lease before judging them, so nodes that were cut off as long have time to renew.
      this.failing = true;
      this.judgeAfter = Date.now() + leaseMs;
      this.o.warn(`node ${name}: could not renew its lease: ${asError(e).message}`);
      return;
    }
    this.failing = false;
    // No fence may start while the one in place is lifted; the clock restarts after.
    if (this.fenceTimer) clearTimeout(this.fenceTimer);
    if (state === undefined) {
      // The others took this node's sandboxes back: what still runs here is a stale copy,
      // frozen if the fence came first, and ended now without running again.
      const frozen = await this.unfence('end');
      const ended = await this.release();
      this.o.warn(
        `node ${name} was marked lost by the fleet (its lease ran out); it ended what it still held of the sandboxes taken back to their checkpoints (${frozen} frozen by its fence, ${ended.length} more released), and joins again`,
      );
      const again = performance.now();
      try {
        state = await fleet.registerNode(
          {
            name,
            url: this.o.url,
            ...(this.o.proxyUrl !== undefined ? { proxyUrl: this.o.proxyUrl } : {}),
            capacity: this.o.capacity,
            startedAt: Date.now(),
          },
          leaseMs,
        );
      } catch (e) {
        this.o.warn(`node ${name}: could not join again: ${asError(e).message}`);
        return;
      }
      this.judgeAfter = Date.now() + leaseMs;
      this.armFence(again);
    } else {
      // Renewed in time: what the fence froze is still this node's, and goes on.
      const thawed = await this.unfence('thaw');
      this.armFence(sent);
      if (thawed > 0)
        this.o.warn(`node ${name} renewed its lease in time: ${thawed} sandbox(es) frozen meanwhile go on`);
    }
    this.lastState = state;
    if (state === 'draining') this.drain();
    else this.drainFailed.clear();
    // Not awaited: a renewal never waits on sandbox operations (a long hibernate holding a
    // sandbox's lock), or a busy node would lose its lease to its own work.
    this.chores ??= (async () => {
      // Sandboxes that moved to another node (or were removed through one) leave their
      // leftovers here.
      if (this.draining === undefined) await this.release();
      if (Date.now() >= this.judgeAfter) await this.judgeOthers();
    })().finally(() => {
      this.chores = undefined;
    });
  }

  /** (Re)starts the fence's clock from the sending of a renewal that succeeded. */
  private armFence(sent: number): void {
    if (this.fenceTimer) clearTimeout(this.fenceTimer);
    if (this.closed) return;
    const after = this.o.fenceAfterMs ?? Math.floor((this.o.leaseMs * 3) / 4);
    this.fenceTimer = setTimeout(() => this.fence(after), Math.max(0, sent + after - performance.now()));
    this.fenceTimer.unref();
  }

  /** Fences the node, unless a fence is in place (held until a renewal or close lifts it). */
  private fence(after: number): void {
    if (this.closed || this.fencing) return;
    this.fencing = this.o.target.fence().then(
      (f) => {
        this.o.warn(
          `node ${this.o.name} has not renewed its lease for ${after} ms: it froze ${f.ids.length} sandbox(es), so that none runs on beside a copy another node may wake; they go on if it renews in time, and end if the fleet marked it lost`,
        );
        return f;
      },
      (e: unknown) => {
        this.o.warn(`node ${this.o.name}: fencing failed: ${asError(e).message}; trying again`);
        this.fencing = undefined;
        // Again in a moment, unless a renewal restarts the clock first.
        if (!this.closed) {
          this.fenceTimer = setTimeout(() => this.fence(after), 1_000);
          this.fenceTimer.unref();
        }
        return undefined;
      },
    );
  }

  /** Lifts the fence, if any: answers how many sandboxes it had frozen. */
  private async unfence(how: FenceEnd): Promise<number> {
    const f = await this.fencing;
    this.fencing = undefined;
    if (f === undefined) return 0;
    await f.lift(how);
    return f.ids.length;
  }

  private async release(): Promise<string[]> {
    return this.o.target.releaseForeign().catch((e: unknown) => {
      this.o.warn(`node ${this.o.name}: releasing sandboxes no longer its own failed: ${asError(e).message}`);
      return [];
    });
  }

  /** Nodes whose lease ran out: their sandboxes taken back (one node does it; reclaimLostNode). */
  private async judgeOthers(): Promise<void> {
    let expired: string[];
    try {
      expired = (await this.o.fleet.expiredNodes()).filter((n) => n !== this.o.name);
    } catch (e) {
      this.o.warn(`node ${this.o.name}: could not look for lost nodes: ${asError(e).message}`);
      return;
    }
    for (const lost of expired) {
      try {
        const back = await this.o.target.reclaimLostNode(lost);
        if (back.length > 0)
          this.o.warn(
            `node ${lost} is lost (its lease ran out): ${back.length} sandbox(es) taken back to their checkpoints by ${this.o.name}`,
          );
      } catch (e) {
        this.o.warn(
          `node ${this.o.name}: taking back lost node ${lost}'s sandboxes failed: ${asError(e).message}`,
        );
      }
    }
  }

  /** Hibernates this node's awake sandboxes, one at a time, while it is draining. */
  private drain(): void {
    if (this.draining) return;
    this.draining = (async () => {
      for (const s of await this.o.target.listOwn()) {
        if (this.closed || this.lastState !== 'draining') return;
        if (s.state !== 'running' && s.state !== 'paused') continue;
        try {
          await this.o.target.hibernate(s.id, undefined, `node ${this.o.name} drained`);
        } catch (e) {
          if (this.drainFailed.has(s.id)) continue;
          this.drainFailed.add(s.id);
          this.o.warn(
            `node ${this.o.name} is draining but sandbox ${s.id} did not hibernate: ${asError(e).message}`,
          );
        }
      }
    })()
      .catch((e: unknown) => this.o.warn(`node ${this.o.name}: drain pass failed: ${asError(e).message}`))
      .finally(() => {
        this.draining = undefined;
      });
  }

  /** Stops renewing (the lease runs out by itself unless the node starts again within it). */
  async close(): Promise<void> {
    this.closed = true;
    if (this.timer) clearTimeout(this.timer);
    if (this.fenceTimer) clearTimeout(this.fenceTimer);
    await this.ticking;
    // A fenced node closing keeps its sandboxes frozen: the next start's reconcile thaws those
    // still its own, and releases those the fleet took back.
    await this.unfence('keep');
    await this.chores;
    await this.draining;
  }
}
