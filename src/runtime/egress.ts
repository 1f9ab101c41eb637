/**
 * A sandbox's way out (domain/egress.ts has the policy): NAT through the node, DNS, and the
 * policy, enforced on the HOST side where the sandbox (no CAP_NET_ADMIN, its own namespace)
 * cannot touch it. The in-namespace rules (network.ts firewallRules) are the second wall.
 *
 * Node-wide chains, made once per daemon process and idempotently (a host whose FORWARD
 * policy is DROP still forwards ours: the jumps go at the top):
 *
 *   filter FORWARD  -> DORMANT-FWD     replies to sandboxes pass; from a sandbox:
 *                                      DORMANT-EGRESS, then DROP; nothing else enters one
 *   filter          DORMANT-EGRESS     two rules per sandbox: -i dmh<n> -j DMO-<n>, then
 *                                      -i dmh<n> -j ACCEPT (what its chain let RETURN)
 *   filter INPUT    -> DORMANT-IN      from a sandbox to any of the node's own addresses (its
 *                                      API, the proxy, ssh): only replies and ping
 *   nat POSTROUTING -> DORMANT-NAT     MASQUERADE of the sandbox subnet leaving by another link
 *
 * Per sandbox, chain DMO-<n> (n its slot), rewritten whole with one `iptables-restore
 * --noflush` (declaring a chain there flushes it): other sandboxes rejected first, then DNS
 * to the resolvers, then the policy: RETURN for what it allows, REJECT for the rest. The byte
 * counter of the sandbox's ACCEPT rule in DORMANT-EGRESS is its egress (the meter reads them
 * all with one iptables-save); that rule is never rewritten while the sandbox lives, so a
 * list's names resolved anew do not reset it.
 *
 * DNS: the sandbox's /etc/resolv.conf (a runtime-owned file bound read-only) names the node's
 * resolvers (its /etc/resolv.conf's non-loopback ones, or those configured), admitted through
 * the policy on port 53. Chosen over a forwarder in the daemon because a forwarder would die
 * with the daemon (every sandbox without DNS across a restart) and sit on the daemon's
 * event loop; host names in a list are resolved with the same resolvers, so the sandbox and
 * the node see the same answers.
 */
import { Resolver } from 'node:dns/promises';
import { readFileSync } from 'node:fs';
import { writeFile } from 'node:fs/promises';
import { DormantError, ErrorCode } from '../domain/errors.js';
import { NON_INTERNET, type EgressPolicy } from '../domain/egress.js';
import { run } from '../sys/exec.js';
import type { SandboxNetwork } from './runtime.js';

const IPT_TIMEOUT_MS = 10_000;
/** Re-resolution of a list's names: no sooner than this, whatever the TTL says... */
export const MIN_REFRESH_MS = 30_000;
/** ...and no later than this. */
export const MAX_REFRESH_MS = 300_000;

export interface EgressSettings {
  /** Resolvers the sandboxes' /etc/resolv.conf names. Default: nodeResolvers(). */
  resolvers: readonly string[];
}

/** The node's own resolvers that a sandbox can use: not loopback (that would be its own lo). */
export function nodeResolvers(read: (path: string) => string = (p) => readFileSync(p, 'utf8')): string[] {
  const from = (path: string): string[] => {
    try {
      return [...read(path).matchAll(/^\s*nameserver\s+(\d+\.\d+\.\d+\.\d+)\s*$/gm)]
        .map((m) => m[1]!)
        .filter((a) => !a.startsWith('127.'));
    } catch {
      return [];
    }
  };
  const direct = from('/etc/resolv.conf');
  // systemd-resolved's stub is 127.0.0.53; the servers it forwards to are listed here.
  return direct.length > 0 ? direct : from('/run/systemd/resolve/resolv.conf');
}

/** The sandbox's /etc/resolv.conf. */
export function resolvConfText(policy: EgressPolicy, resolvers: readonly string[]): string {
  if (policy.mode === 'none' || resolvers.length === 0)
    return '# dormant: this sandbox has no DNS (egress none, or the node has no resolver)\n';
  return `# dormant: the node's resolvers\n${resolvers
    .slice(0, 3)
    .map((r) => `nameserver ${r}\n`)
    .join('')}`;
}

export function egressChain(net: SandboxNetwork): string {
  return `DMO-${net.hostInterface.replace(/^dmh/, '')}`;
}

async function ipt(args: string[], table = 'filter', ok = [0]): Promise<number> {
  const r = await run('iptables', ['-w', '-t', table, ...args], {
    timeoutMs: IPT_TIMEOUT_MS,
    okExitCodes: ok,
  });
  return r.exitCode ?? -1;
}

async function restore(text: string): Promise<void> {
  await run('iptables-restore', ['-w', '--noflush'], { timeoutMs: IPT_TIMEOUT_MS, input: text });
}

/** The node-wide chains' fixed rules (rewritten whole: they are the same for every daemon). */
export function nodeRules(): string {
  return [
    '*filter',
    ':DORMANT-FWD - [0:0]',
    ':DORMANT-IN - [0:0]',
    '-A DORMANT-FWD -o dmh+ -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT',
    // From a sandbox first: its chain rejects another sandbox at once (a drop would hang it).
    '-A DORMANT-FWD -i dmh+ -j DORMANT-EGRESS',
    '-A DORMANT-FWD -i dmh+ -j DROP',
    '-A DORMANT-FWD -o dmh+ -j DROP',
    '-A DORMANT-IN -i dmh+ -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT',
    '-A DORMANT-IN -i dmh+ -p icmp -m icmp --icmp-type 8 -j ACCEPT',
    '-A DORMANT-IN -i dmh+ -p tcp -j REJECT --reject-with tcp-reset',
    '-A DORMANT-IN -i dmh+ -j REJECT',
    'COMMIT',
    '',
  ].join('\n');
}

const nodeSetUp = new Map<string, Promise<void>>();

/** Makes the node-wide chains and jumps for `subnet` (once per process; safe to repeat). */
export function ensureNodeChains(subnet: string): Promise<void> {
  let p = nodeSetUp.get(subnet);
  if (p === undefined) {
    p = setUpNode(subnet);
    nodeSetUp.set(subnet, p);
    p.catch(() => nodeSetUp.delete(subnet));
  }
  return p;
}

async function setUpNode(subnet: string): Promise<void> {
  // Forwarding is what NAT needs; a host that had it off gets it on (as container engines do).
  if (readFileSync('/proc/sys/net/ipv4/ip_forward', 'utf8').trim() !== '1')
    await writeFile('/proc/sys/net/ipv4/ip_forward', '1');
  // DORMANT-EGRESS holds every sandbox's jump: made if missing, never flushed here.
  await ipt(['-N', 'DORMANT-EGRESS'], 'filter', [0, 1]);
  await ipt(['-N', 'DORMANT-NAT'], 'nat', [0, 1]);
  await restore(nodeRules());
  for (const [table, parent, chain] of [
    ['filter', 'FORWARD', 'DORMANT-FWD'],
    ['filter', 'INPUT', 'DORMANT-IN'],
    ['nat', 'POSTROUTING', 'DORMANT-NAT'],
  ] as const)
    if ((await ipt(['-C', parent, '-j', chain], table, [0, 1])) !== 0)
      await ipt(['-I', parent, '1', '-j', chain], table);
  const masq = ['DORMANT-NAT', '-s', subnet, '!', '-o', 'dmh+', '-j', 'MASQUERADE'];
  if ((await ipt(['-C', ...masq], 'nat', [0, 1])) !== 0) await ipt(['-A', ...masq], 'nat');
}

/** The rules of a sandbox's DMO chain; `addresses`: what the list's host names resolved to. */
export function sandboxRules(
  net: SandboxNetwork,
  policy: EgressPolicy,
  opts: { subnet: string; resolvers: readonly string[]; addresses: readonly string[] },
): string {
  const chain = egressChain(net);
  const rules = [`-A ${chain} -d ${opts.subnet} -j REJECT`];
  if (policy.mode !== 'none')
    for (const r of opts.resolvers)
      for (const proto of ['udp', 'tcp'])
        rules.push(`-A ${chain} -d ${r}/32 -p ${proto} -m ${proto} --dport 53 -j RETURN`);
  if (policy.mode === 'internet') {
    for (const range of NON_INTERNET) rules.push(`-A ${chain} -d ${range} -j REJECT`);
    rules.push(`-A ${chain} -j RETURN`);
  } else {
    if (policy.mode === 'list')
      for (const c of [...policy.cidrs, ...opts.addresses.map((a) => `${a}/32`)])
        rules.push(`-A ${chain} -d ${c} -j RETURN`);
    rules.push(`-A ${chain} -j REJECT`);
  }
  return ['*filter', `:${chain} - [0:0]`, ...rules, 'COMMIT', ''].join('\n');
}

/** IPv4 addresses of `hosts` through `resolvers`, and how long they hold (the least TTL). */
export async function resolveHosts(
  hosts: readonly string[],
  resolvers: readonly string[],
  minMs = MIN_REFRESH_MS,
): Promise<{ addresses: string[]; ttlMs: number }> {
  if (hosts.length === 0) return { addresses: [], ttlMs: MAX_REFRESH_MS };
  const resolver = new Resolver({ timeout: 2000, tries: 2 });
  if (resolvers.length > 0) resolver.setServers([...resolvers]);
  const addresses = new Set<string>();
  let ttl = MAX_REFRESH_MS / 1000;
  for (const host of hosts) {
    let answers: { address: string; ttl: number }[];
    try {
      answers = await resolver.resolve4(host, { ttl: true });
    } catch (e) {
      throw new DormantError(
        ErrorCode.EGRESS_HOST_UNRESOLVABLE,
        `egress host ${host} does not resolve to an IPv4 address (${(e as { code?: string }).code ?? (e as Error).message})`,
        { cause: e },
      );
    }
    for (const a of answers) {
      addresses.add(a.address);
      ttl = Math.min(ttl, a.ttl);
    }
  }
  return {
    addresses: [...addresses].sort(),
    ttlMs: Math.min(MAX_REFRESH_MS, Math.max(minMs, ttl * 1000)),
  };
}

/** Writes the sandbox's DMO chain, and its two rules in DORMANT-EGRESS when missing. */
export async function applyEgress(net: SandboxNetwork, rules: string): Promise<void> {
  const chain = egressChain(net);
  const present =
    (await ipt(['-C', 'DORMANT-EGRESS', '-i', net.hostInterface, '-j', chain], 'filter', [0, 1, 2])) === 0;
  // One restore: the chain (made or flushed and filled) and, the first time, the rules to it.
  const jumps = present
    ? []
    : [
        `-A DORMANT-EGRESS -i ${net.hostInterface} -j ${chain}`,
        `-A DORMANT-EGRESS -i ${net.hostInterface} -j ACCEPT`,
      ];
  await restore(rules.replace(/^COMMIT$/m, [...jumps, 'COMMIT'].join('\n')));
}

/** Removes the sandbox's jump and chain; nothing there is no error. */
export async function removeEgress(net: SandboxNetwork): Promise<void> {
  const chain = egressChain(net);
  // -C fails (1 or 2) when the chain or the jump is absent; delete every copy of the jump.
  for (const target of [chain, 'ACCEPT'])
    for (let i = 0; i < 4; i++) {
      const rc = await ipt(
        ['-D', 'DORMANT-EGRESS', '-i', net.hostInterface, '-j', target],
        'filter',
        [0, 1, 2],
      );
      if (rc !== 0) break;
    }
  await ipt(['-F', chain], 'filter', [0, 1]);
  await ipt(['-X', chain], 'filter', [0, 1]);
}

/**
 * Bytes each sandbox sent beyond the node, by host interface (`dmh<n>`): its ACCEPT rule's
 * counter, all read with one iptables-save. A counter starts again at zero when the rule is
 * made again (after a reboot): the meter adds up increases.
 */
export async function egressCounters(): Promise<Map<string, number>> {
  const out = new Map<string, number>();
  const r = await run('iptables-save', ['-c', '-t', 'filter'], {
    timeoutMs: IPT_TIMEOUT_MS,
    okExitCodes: [0, 1],
  });
  for (const m of r.stdout.matchAll(/^\[\d+:(\d+)\] -A DORMANT-EGRESS -i (dmh\d+) -j ACCEPT$/gm))
    out.set(m[2]!, (out.get(m[2]!) ?? 0) + Number(m[1]));
  return out;
}
