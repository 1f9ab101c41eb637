/**
 * The meter: samples what every sandbox with processes holds (memory, cumulative CPU time)
 * from its cgroup, and its writable layer's use, at a fixed interval and persists it, and turns the persisted transitions,
 * samples and checkpoint lifetimes into the cost report. Nothing is kept only in memory, so a
 * restart of the daemon neither loses nor double-counts anything.
 */
import { cpus, totalmem } from 'node:os';
import { capacity, computeCost, type Capacity, type CostReport, type PriceSheet } from '../domain/cost.js';
import type { StateStore, StoredSample } from '../state/store.js';
import { asError } from '../domain/errors.js';
import type { Clock } from './options.js';

export interface MeterSource {
  list(): Promise<{ id: string; state: string }[]>;
  /** In a fleet, the sandboxes on this node: the only ones whose usage it can read. Default: list. */
  listOwn?(): Promise<{ id: string; state: string }[]>;
  usage(id: string): Promise<{ memoryBytes: number; cpuUsageUsec: number } | undefined>;
  /** Bytes used on the sandbox's writable layer, when that is cheap to know (one statfs). */
  diskUsage?(id: string): Promise<number | undefined>;
  /** Each sandbox's egress counter (bytes sent beyond the node; it may start again at 0), by id. */
  egressBytes?(): Promise<Map<string, number>>;
}

/** A sandbox's samples as GET /v1/sandboxes/{id}/metrics shows them. */
export interface MetricPoint {
  at: number;
  /** CPU used since the sample before, in percent of one CPU; null: none before to compare. */
  cpuPercent: number | null;
  memoryBytes: number;
  diskBytes: number | null;
  /** All it sent beyond the node up to then; null: not known (no egress, or made before). */
  egressBytes: number | null;
}

/** Most samples one metrics answer holds. */
export const MAX_METRIC_POINTS = 10_000;

/**
 * Samples (oldest first, possibly led by one before `since`) as metric points from `since` on.
 * The CPU share comes from the cumulative counter's rise between two samples; where it went
 * down (a restore made a new cgroup, whose counter starts again) there is nothing to compare.
 */
export function metricPoints(samples: readonly StoredSample[], since: number): MetricPoint[] {
  const out: MetricPoint[] = [];
  let prev: StoredSample | undefined;
  for (const x of samples) {
    if (x.at >= since && out.length < MAX_METRIC_POINTS) {
      const rose = prev !== undefined && x.cpuUsageUsec >= prev.cpuUsageUsec && x.at > prev.at;
      out.push({
        at: x.at,
        cpuPercent: rose ? ((x.cpuUsageUsec - prev!.cpuUsageUsec) / ((x.at - prev!.at) * 1000)) * 100 : null,
        memoryBytes: x.memoryBytes,
        diskBytes: x.diskBytes ?? null,
        egressBytes: x.egressBytes ?? null,
      });
    }
    prev = x;
  }
  return out;
}

const GIB = 1024 ** 3;
/** What owned hardware costs per vCPU-hour and per GiB-hour of memory by default (docs/COST.md). */
export const DEFAULT_VCPU_HOUR = 0.0046;
export const DEFAULT_GIB_HOUR = 0.00086;
export const DEFAULT_STORAGE_GIB_MONTH = 0.02;

/** The price sheet for this node: configured values over defaults derived from its size. */
export function priceSheet(overrides: Partial<PriceSheet> = {}): PriceSheet {
  const nodeVcpus = overrides.nodeVcpus ?? cpus().length;
  const nodeMemoryBytes = overrides.nodeMemoryBytes ?? totalmem();
  const cpuCost = nodeVcpus * DEFAULT_VCPU_HOUR;
  const memCost = (nodeMemoryBytes / GIB) * DEFAULT_GIB_HOUR;
  return {
    currency: overrides.currency ?? 'USD',
    nodeCostPerHour: overrides.nodeCostPerHour ?? cpuCost + memCost,
    nodeVcpus,
    nodeMemoryBytes,
    cpuShare: overrides.cpuShare ?? cpuCost / (cpuCost + memCost),
    storagePerGiBMonth: overrides.storagePerGiBMonth ?? DEFAULT_STORAGE_GIB_MONTH,
  };
}

export class Meter {
  private timer: NodeJS.Timeout | undefined;
  private running: Promise<number> | undefined;

  constructor(
    private readonly opts: {
      source: MeterSource;
      store: StateStore;
      clock: Clock;
      prices: PriceSheet;
      intervalMs?: number;
      freeDiskBytes?: () => Promise<number>;
      /** Stored bytes per live checkpoint with shared chunks split among their users (the vault's). */
      attribution?: () => Promise<{ checkpointId: string; storedBytes: number }[]>;
      /** Told once when sampling starts failing (again after a pass that worked). */
      warn?: (message: string) => void;
    },
  ) {}

  private failing = false;

  /** Each sandbox's last egress total and raw counter (from its last sample after a restart). */
  private readonly egress = new Map<string, { total: number; counter: number }>();

  /** The running egress total of `id` given its counter now: increases add, a reset starts over. */
  private async egressTotal(
    id: string,
    counter: number,
    at: number,
  ): Promise<{ total: number; counter: number }> {
    let prev = this.egress.get(id);
    if (prev === undefined) {
      const last = (await this.opts.store.sandboxSamples(id, { since: at + 1, limit: 0 }))[0];
      prev =
        last?.egressBytes !== undefined && last.egressCounter !== undefined
          ? { total: last.egressBytes, counter: last.egressCounter }
          : { total: 0, counter: 0 };
    }
    const next = {
      total: prev.total + (counter >= prev.counter ? counter - prev.counter : counter),
      counter,
    };
    this.egress.set(id, next);
    return next;
  }

  /** A timed pass: its failure is told once per run of failures, never thrown. */
  private tick(): void {
    this.sample().then(
      () => (this.failing = false),
      (e: unknown) => {
        if (!this.failing) this.opts.warn?.(`metering: a sampling pass failed: ${asError(e).message}`);
        this.failing = true;
      },
    );
  }

  /** Takes one sample of every sandbox whose processes exist. Returns how many were sampled. */
  sample(): Promise<number> {
    // One sampling pass at a time; a call during a pass shares it.
    if (this.running) return this.running;
    const pass = this.samplePass().finally(() => {
      if (this.running === pass) this.running = undefined;
    });
    this.running = pass;
    return pass;
  }

  private async samplePass(): Promise<number> {
    // Yield first so that `running` is set before the pass can finish.
    await Promise.resolve();
    const at = this.opts.clock.now();
    const out: StoredSample[] = [];
    // One read of every counter per pass; a failure leaves this pass's samples without egress.
    const counters = await this.opts.source.egressBytes?.().catch(() => undefined);
    const live = new Set<string>();
    for (const s of await (this.opts.source.listOwn?.() ?? this.opts.source.list())) {
      if (s.state !== 'running' && s.state !== 'paused') continue;
      const u = await this.opts.source.usage(s.id);
      if (!u) continue;
      // The layer's use is a nicety: a failure to read it leaves the sample without it.
      const disk = await this.opts.source.diskUsage?.(s.id).catch(() => undefined);
      live.add(s.id);
      const counter = counters?.get(s.id);
      const egress = counter !== undefined ? await this.egressTotal(s.id, counter, at) : undefined;
      out.push({
        sandboxId: s.id,
        at,
        memoryBytes: u.memoryBytes,
        cpuUsageUsec: u.cpuUsageUsec,
        ...(disk !== undefined ? { diskBytes: disk } : {}),
        ...(egress !== undefined ? { egressBytes: egress.total, egressCounter: egress.counter } : {}),
      });
    }
    // Hibernated ones keep theirs (read back from the store anyway); removed ones go.
    for (const id of this.egress.keys()) if (!live.has(id) && !counters?.has(id)) this.egress.delete(id);
    await this.opts.store.insertSamples(out);
    return out.length;
  }

  start(): void {
    if (this.timer) return;
    const every = this.opts.intervalMs ?? 15_000;
    this.timer = setInterval(() => this.tick(), every);
    this.timer.unref();
    this.tick();
  }

  async close(): Promise<void> {
    if (this.timer) clearInterval(this.timer);
    this.timer = undefined;
    // The pass's failure, if any, was told by tick(); closing only waits for it.
    await this.running?.catch(() => undefined);
  }

  /** The cost report over [since, now], for one tenant or (undefined) all. */
  async report(
    opts: { sinceMs?: number; tenant?: string; points?: number } = {},
  ): Promise<
    CostReport & { capacity: Capacity; series: { at: number; spent: number; alwaysWarm: number }[] }
  > {
    const until = this.opts.clock.now();
    const transitions = (await this.opts.store.transitions({ limit: Number.MAX_SAFE_INTEGER })).filter(
      (t) => opts.tenant === undefined || t.tenant === opts.tenant,
    );
    const ids = new Set(transitions.map((t) => t.sandboxId));
    // All time starts with the first transition on record.
    const since =
      opts.sinceMs !== undefined ? until - opts.sinceMs : Math.min(until, transitions[0]?.at ?? until);
    // Samples just before the window tell what was held at its start.
    const samples = (await this.opts.store.samples({ since: Math.max(0, since - 3_600_000), until })).filter(
      (x) => ids.has(x.sandboxId),
    );
    // Live checkpoints are charged what they occupy now, shared chunks split among their users;
    // deleted ones what they added when they were written.
    const attributed = new Map<string, number>();
    // Without the vault's split (it failed), each checkpoint is counted at its own stored bytes.
    for (const a of (await this.opts.attribution?.().catch(() => [])) ?? [])
      attributed.set(a.checkpointId, a.storedBytes);
    const history = (await this.opts.store.checkpointHistory()).filter((c) => ids.has(c.sandboxId));
    const bytesOf = (c: { id: string; storedBytes: number; deletedAt?: number }): number =>
      c.deletedAt === undefined ? (attributed.get(c.id) ?? c.storedBytes) : c.storedBytes;
    const checkpoints = history.map((c) => ({
      sandboxId: c.sandboxId,
      createdAt: c.createdAt,
      storedBytes: bytesOf(c),
      ...(c.deletedAt !== undefined ? { deletedAt: c.deletedAt } : {}),
    }));
    const report = computeCost({ transitions, samples, checkpoints, prices: this.opts.prices, since, until });
    // Spent against always-warm, cumulative over the window, for a chart.
    const series: { at: number; spent: number; alwaysWarm: number }[] = [];
    const points = Math.min(Math.max(opts.points ?? 0, 0), 200);
    for (let i = 1; i <= points; i++) {
      const at = since + Math.round(((until - since) * i) / points);
      const r = computeCost({
        transitions,
        samples,
        checkpoints,
        prices: this.opts.prices,
        since,
        until: at,
      });
      series.push({ at, spent: r.totals.spent, alwaysWarm: r.totals.alwaysWarm });
    }
    const live = (await (this.opts.source.listOwn?.() ?? this.opts.source.list())).filter((s) =>
      ids.has(s.id),
    );
    const resident: number[] = [];
    for (const s of live) {
      if (s.state !== 'running' && s.state !== 'paused') continue;
      const u = await this.opts.source.usage(s.id);
      if (u && u.memoryBytes > 0) resident.push(u.memoryBytes);
    }
    const stored = history.filter((c) => c.deletedAt === undefined).map(bytesOf);
    return {
      ...report,
      series,
      capacity: capacity({
        nodeMemoryBytes: this.opts.prices.nodeMemoryBytes,
        freeDiskBytes: this.opts.freeDiskBytes ? await this.opts.freeDiskBytes() : 0,
        residentBytes: resident,
        storedBytes: stored,
      }),
    };
  }
}
