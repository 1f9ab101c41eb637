/**
 * Metering and the cost report, as a pure function of persisted facts: state transitions,
 * periodic resource samples and checkpoint lifetimes, over a time window, with a clock the
 * caller supplies. A restart of the daemon changes none of the inputs, so it loses nothing
 * and counts nothing twice.
 *
 * Prices for owned hardware follow from what a node costs per hour and what it holds: a share
 * of the hourly cost pays for its vCPUs, the rest for its memory; storage has its own price per
 * GiB-month. "Always warm" is the same sandbox kept running for its whole life in the window:
 * the same CPU work, its average resident memory held the whole time, no checkpoint storage.
 */
import type { SandboxState, Transition } from './sandbox.js';

const GIB = 1024 ** 3;
const MONTH_S = 30 * 86_400;

export interface PriceSheet {
  currency: string;
  /** What the node costs per hour, all in (hardware amortised, power, space). */
  nodeCostPerHour: number;
  nodeVcpus: number;
  nodeMemoryBytes: number;
  /** Fraction of the node's cost attributed to its CPUs; the rest pays for memory. */
  cpuShare: number;
  storagePerGiBMonth: number;
}

export interface UnitPrices {
  perVcpuSecond: number;
  perGiBSecond: number;
  perGiBMonth: number;
}

export function unitPrices(p: PriceSheet): UnitPrices {
  return {
    perVcpuSecond: (p.nodeCostPerHour * p.cpuShare) / p.nodeVcpus / 3600,
    perGiBSecond: (p.nodeCostPerHour * (1 - p.cpuShare)) / (p.nodeMemoryBytes / GIB) / 3600,
    perGiBMonth: p.storagePerGiBMonth,
  };
}

export interface MeterSample {
  sandboxId: string;
  at: number;
  memoryBytes: number;
  /** The cgroup's cumulative CPU time; it starts again from 0 when a restore makes a new cgroup. */
  cpuUsageUsec: number;
}

export interface CheckpointLife {
  sandboxId: string;
  createdAt: number;
  deletedAt?: number;
  /** Stored bytes attributed to this checkpoint after deduplication. */
  storedBytes: number;
}

/** States in which a sandbox's processes exist and hold memory. */
const HOLDING: ReadonlySet<SandboxState> = new Set([
  'creating',
  'running',
  'paused',
  'hibernating',
  'resuming',
]);
/** States in which it is asleep: they count as having slept. */
const SLEEPING: ReadonlySet<SandboxState> = new Set(['paused', 'hibernated', 'archived']);

export interface SandboxCost {
  sandboxId: string;
  tenant: string;
  /** Seconds spent in each state within the window. */
  secondsByState: Partial<Record<SandboxState, number>>;
  existedSeconds: number;
  cpuSeconds: number;
  memoryGiBSeconds: number;
  storageGiBMonths: number;
  /** Mean resident memory while its processes existed (bytes). */
  averageResidentBytes: number;
  spent: number;
  alwaysWarm: number;
  saved: number;
  memoryHoursFreed: number;
  slept: boolean;
}

export interface CostReport {
  currency: string;
  since: number;
  until: number;
  prices: UnitPrices;
  totals: {
    spent: number;
    alwaysWarm: number;
    saved: number;
    savedRatio: number;
    memoryHoursFreed: number;
    storageGiBMonths: number;
  };
  sandboxes: SandboxCost[];
  tenants: {
    tenant: string;
    spent: number;
    alwaysWarm: number;
    saved: number;
    savedRatio: number;
    memoryHoursFreed: number;
  }[];
  /** Sandboxes that never paused, hibernated or archived in the window, most expensive first. */
  neverSlept: { sandboxId: string; tenant: string; spent: number }[];
}

interface Interval {
  from: number;
  to: number;
  state: SandboxState;
}

/** The sandbox's states as intervals clipped to [since, until]. `deleting` ends its life. */
function intervals(ts: readonly Transition[], since: number, until: number): Interval[] {
  const out: Interval[] = [];
  const sorted = [...ts].sort((a, b) => a.at - b.at || a.id - b.id);
  for (let i = 0; i < sorted.length; i++) {
    const t = sorted[i]!;
    if (t.to === 'deleting' && i === sorted.length - 1) break;
    const end = i + 1 < sorted.length ? sorted[i + 1]!.at : until;
    const from = Math.max(t.at, since);
    const to = Math.min(end, until);
    if (to > from) out.push({ from, to, state: t.to });
  }
  return out;
}

/** Memory held over [from, to): each sample's value holds until the next one. */
function memoryIntegralBytesMs(samples: readonly MeterSample[], from: number, to: number): number {
  if (samples.length === 0) return 0;
  let total = 0;
  // The value at `from`: the last sample at or before it, else the first one after it.
  let idx = -1;
  for (let i = 0; i < samples.length && samples[i]!.at <= from; i++) idx = i;
  let cur = from;
  let value = samples[Math.max(idx, 0)]!.memoryBytes;
  for (let i = idx + 1; i < samples.length && samples[i]!.at < to; i++) {
    const s = samples[i]!;
    total += value * (s.at - cur);
    cur = s.at;
    value = s.memoryBytes;
  }
  total += value * (to - cur);
  return total;
}

function cpuUsecIn(samples: readonly MeterSample[], since: number, until: number): number {
  let total = 0;
  for (let i = 1; i < samples.length; i++) {
    const a = samples[i - 1]!;
    const b = samples[i]!;
    if (b.at <= since || b.at > until) continue;
    // A drop means a new cgroup (a restore): it counted from 0 since then.
    total += b.cpuUsageUsec >= a.cpuUsageUsec ? b.cpuUsageUsec - a.cpuUsageUsec : b.cpuUsageUsec;
  }
  return total;
}

export interface CostInputs {
  transitions: readonly Transition[];
  samples: readonly MeterSample[];
  checkpoints: readonly CheckpointLife[];
  prices: PriceSheet;
  since: number;
  until: number;
}

export function computeCost(input: CostInputs): CostReport {
  const unit = unitPrices(input.prices);
  const { since, until } = input;
  const bySandbox = new Map<string, Transition[]>();
  for (const t of input.transitions) {
    const list = bySandbox.get(t.sandboxId) ?? [];
    list.push(t);
    bySandbox.set(t.sandboxId, list);
  }
  const samplesBy = new Map<string, MeterSample[]>();
  for (const s of [...input.samples].sort((a, b) => a.at - b.at)) {
    const list = samplesBy.get(s.sandboxId) ?? [];
    list.push(s);
    samplesBy.set(s.sandboxId, list);
  }
  const sandboxes: SandboxCost[] = [];
  for (const [sandboxId, ts] of bySandbox) {
    const iv = intervals(ts, since, until);
    if (iv.length === 0) continue;
    const samples = samplesBy.get(sandboxId) ?? [];
    const secondsByState: Partial<Record<SandboxState, number>> = {};
    let memBytesMs = 0;
    let holdingMs = 0;
    let existedMs = 0;
    let slept = false;
    for (const i of iv) {
      const ms = i.to - i.from;
      secondsByState[i.state] = (secondsByState[i.state] ?? 0) + ms / 1000;
      existedMs += ms;
      if (SLEEPING.has(i.state)) slept = true;
      if (HOLDING.has(i.state)) {
        holdingMs += ms;
        memBytesMs += memoryIntegralBytesMs(samples, i.from, i.to);
      }
    }
    const cpuSeconds = cpuUsecIn(samples, since, until) / 1e6;
    const memoryGiBSeconds = memBytesMs / 1000 / GIB;
    let storageGiBMonths = 0;
    for (const c of input.checkpoints) {
      if (c.sandboxId !== sandboxId) continue;
      const from = Math.max(c.createdAt, since);
      const to = Math.min(c.deletedAt ?? until, until);
      if (to > from) storageGiBMonths += ((c.storedBytes / GIB) * ((to - from) / 1000)) / MONTH_S;
    }
    const averageResidentBytes = holdingMs > 0 ? memBytesMs / holdingMs : 0;
    const spent =
      cpuSeconds * unit.perVcpuSecond +
      memoryGiBSeconds * unit.perGiBSecond +
      storageGiBMonths * unit.perGiBMonth;
    const warmGiBSeconds = (averageResidentBytes / GIB) * (existedMs / 1000);
    const alwaysWarm = cpuSeconds * unit.perVcpuSecond + warmGiBSeconds * unit.perGiBSecond;
    sandboxes.push({
      sandboxId,
      tenant: ts[0]!.tenant,
      secondsByState,
      existedSeconds: existedMs / 1000,
      cpuSeconds,
      memoryGiBSeconds,
      storageGiBMonths,
      averageResidentBytes,
      spent,
      alwaysWarm,
      saved: alwaysWarm - spent,
      memoryHoursFreed: Math.max(0, warmGiBSeconds - memoryGiBSeconds) / 3600,
      slept,
    });
  }
  sandboxes.sort((a, b) => b.spent - a.spent || a.sandboxId.localeCompare(b.sandboxId));
  const sum = (
    xs: SandboxCost[],
    k: 'spent' | 'alwaysWarm' | 'saved' | 'memoryHoursFreed' | 'storageGiBMonths',
  ): number => xs.reduce((a, x) => a + x[k], 0);
  const ratio = (saved: number, warm: number): number => (warm > 0 ? saved / warm : 0);
  const tenants = [...new Set(sandboxes.map((s) => s.tenant))].sort().map((tenant) => {
    const xs = sandboxes.filter((s) => s.tenant === tenant);
    const spent = sum(xs, 'spent');
    const alwaysWarm = sum(xs, 'alwaysWarm');
    return {
      tenant,
      spent,
      alwaysWarm,
      saved: alwaysWarm - spent,
      savedRatio: ratio(alwaysWarm - spent, alwaysWarm),
      memoryHoursFreed: sum(xs, 'memoryHoursFreed'),
    };
  });
  const spent = sum(sandboxes, 'spent');
  const alwaysWarm = sum(sandboxes, 'alwaysWarm');
  return {
    currency: input.prices.currency,
    since,
    until,
    prices: unit,
    totals: {
      spent,
      alwaysWarm,
      saved: alwaysWarm - spent,
      savedRatio: ratio(alwaysWarm - spent, alwaysWarm),
      memoryHoursFreed: sum(sandboxes, 'memoryHoursFreed'),
      storageGiBMonths: sum(sandboxes, 'storageGiBMonths'),
    },
    sandboxes,
    tenants,
    neverSlept: sandboxes
      .filter((s) => !s.slept)
      .map((s) => ({ sandboxId: s.sandboxId, tenant: s.tenant, spent: s.spent })),
  };
}

export interface Capacity {
  averageResidentBytes: number;
  averageStoredBytes: number;
  /** Idle sandboxes of the average size the node's memory holds warm. */
  warm: number;
  /** The same, hibernated: bounded by free disk instead of memory. */
  hibernated: number;
}

/** How many idle sandboxes of the current average size fit, warm against hibernated. */
export function capacity(opts: {
  nodeMemoryBytes: number;
  freeDiskBytes: number;
  residentBytes: readonly number[];
  storedBytes: readonly number[];
}): Capacity {
  const mean = (xs: readonly number[]): number =>
    xs.length === 0 ? 0 : xs.reduce((a, b) => a + b, 0) / xs.length;
  const averageResidentBytes = mean(opts.residentBytes);
  const averageStoredBytes = mean(opts.storedBytes);
  return {
    averageResidentBytes,
    averageStoredBytes,
    warm: averageResidentBytes > 0 ? Math.floor(opts.nodeMemoryBytes / averageResidentBytes) : 0,
    hibernated: averageStoredBytes > 0 ? Math.floor(opts.freeDiskBytes / averageStoredBytes) : 0,
  };
}
