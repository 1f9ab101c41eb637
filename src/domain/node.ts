/**
 * Nodes of a fleet: machines that share one database of record (PostgreSQL) and one vault
 * (S3), each running the sandboxes placed on it. No I/O here.
 */
import type { SandboxState } from './sandbox.js';
import { restoreProblems, type PlatformFacts } from './compat.js';

/**
 * `active`: takes placements. `draining`: hibernates what runs there and takes none (until
 * undrained). `lost`: its lease ran out; its sandboxes were taken back to their checkpoints.
 */
export const NODE_STATES = ['active', 'draining', 'lost'] as const;
export type NodeState = (typeof NODE_STATES)[number];

/** What a node has, as it registers: what placement and compatibility look at. */
export interface NodeCapacity {
  memoryBytes: number;
  cpus: number;
  arch: string;
  criuVersion?: string;
  /** The CPU flags a checkpoint may depend on (domain/compat.ts). */
  cpuFlags?: string[];
  /** The container runtimes it has: runc, runsc. */
  runtimes: string[];
}

export interface NodeInfo {
  name: string;
  /** Where the other nodes reach its API. */
  url: string;
  /** Where the other nodes reach its wake proxy, if it runs one. */
  proxyUrl?: string;
  state: NodeState;
  capacity: NodeCapacity;
  startedAt: number;
  /** When its lease runs out (the database's clock), unless renewed. */
  leaseUntil: number;
  /** Whether the lease ran out (by the database's clock, when this was read). */
  expired: boolean;
  lostAt?: number;
  /** Its sandboxes by state (empty where the listing left them out: placement's). */
  sandboxes: Partial<Record<SandboxState, number>>;
  /** Its awake sandboxes, and the memory they may use (their limits, summed). */
  awakeSandboxes: number;
  memoryUsedBytes: number;
}

/** States in which a sandbox's processes (or what is left of them) are on its node. */
export const AWAKE_STATES: readonly SandboxState[] = [
  'creating',
  'running',
  'paused',
  'hibernating',
  'resuming',
  'deleting',
];

/** A node name: what `--node` accepts (it appears in URLs, logs and cgroup-free names). */
export const NODE_NAME_PATTERN = /^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$/;

/** What a node must have to wake a sandbox: its checkpoint's facts and its runtime. */
export interface WakeNeeds {
  facts: Partial<PlatformFacts>;
  runtime: string;
}

/** Whether node `n` can wake a sandbox that needs `needs` (only what the node told of itself is compared). */
export function canWake(n: NodeInfo, needs: WakeNeeds): boolean {
  if (!n.capacity.runtimes.includes(needs.runtime)) return false;
  const c = n.capacity;
  const from: Partial<PlatformFacts> = {
    ...(needs.facts.arch !== undefined ? { arch: needs.facts.arch } : {}),
    ...(needs.facts.criuVersion !== undefined && c.criuVersion !== undefined
      ? { criuVersion: needs.facts.criuVersion }
      : {}),
    ...(needs.facts.cpuFlags !== undefined && c.cpuFlags !== undefined
      ? { cpuFlags: needs.facts.cpuFlags }
      : {}),
  };
  return (
    restoreProblems(from, { arch: c.arch, criuVersion: c.criuVersion ?? '0', cpuFlags: c.cpuFlags ?? [] })
      .length === 0
  );
}

/**
 * Where a sleeping sandbox wakes: among the nodes that take placements and can restore it
 * (`needs`), its own node (its packs are in that node's cache), else `here`, else the one with
 * the most memory free. Undefined: none.
 */
export function placeWake(
  nodes: readonly NodeInfo[],
  last: string | undefined,
  here: string,
  needs?: WakeNeeds,
): NodeInfo | undefined {
  const open = nodes.filter((n) => n.state === 'active' && !n.expired && (!needs || canWake(n, needs)));
  return open.find((n) => n.name === last) ?? open.find((n) => n.name === here) ?? mostRoom(open);
}

/** The open node with the most memory free (ties: the fewest awake sandboxes, then by name). */
export function mostRoom(open: readonly NodeInfo[]): NodeInfo | undefined {
  const free = (n: NodeInfo): number => n.capacity.memoryBytes - n.memoryUsedBytes;
  return [...open].sort(
    (a, b) =>
      free(b) - free(a) ||
      a.awakeSandboxes - b.awakeSandboxes ||
      (a.name < b.name ? -1 : a.name > b.name ? 1 : 0),
  )[0];
}

const isLoopback = (host: string): boolean =>
  /^127\./.test(host) || host === '[::1]' || host === '::1' || host.toLowerCase() === 'localhost';

/**
 * What is wrong with a node's registered URLs for other hosts, if anything: a proxy on
 * loopback while the API is reachable from elsewhere (other nodes' proxies relay to this one).
 */
export function proxyUrlProblem(apiUrl: string, proxyUrl: string | undefined): string | undefined {
  if (proxyUrl === undefined) return undefined;
  const api = new URL(apiUrl).hostname;
  const proxy = new URL(proxyUrl).hostname;
  if (isLoopback(proxy) && !isLoopback(api))
    return `its wake proxy listens on loopback (${proxyUrl}) while its API is at ${apiUrl}: other hosts' proxies cannot relay to it; set the proxy's listen address (proxy.listen, --proxy-listen) to one they reach`;
  return undefined;
}
