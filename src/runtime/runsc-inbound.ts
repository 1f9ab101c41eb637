/**
 * The port firewall of a gVisor sandbox, on the host side of its veth.
 *
 * A runc sandbox's namespace filters what reaches it (network.ts firewallRules: only the
 * declared TCP ports from the host). gVisor's stack takes eth0's packets itself, before the
 * namespace's iptables sees them, so those rules do not apply to it: every port a gVisor
 * sandbox listens on would be reachable from the host, by any local user. Here the host's
 * OUTPUT chain sends what the host opens towards the sandbox's veth through a chain of its own,
 * `DMI-<n>` (n: the slot, as egress.ts's `DMO-<n>`), which lets only the declared ports
 * through. The way out is the host's already, for both runtimes (egress.ts: DORMANT-IN and
 * DORMANT-FWD on the sandbox's veth), and other sandboxes' packets are forwarded ones, which
 * DORMANT-FWD drops.
 */
import { run } from '../sys/exec.js';
import type { SandboxNetwork } from './runtime.js';

const IPT_TIMEOUT_MS = 10_000;

export function inboundChain(net: SandboxNetwork): string {
  return `DMI-${net.hostInterface.replace(/^dmh/, '')}`;
}

/** The chain's rules: replies, ICMP and the declared ports pass; anything else is dropped, as runc's namespace does. */
export function inboundRules(net: SandboxNetwork, ports: readonly number[]): string {
  const chain = inboundChain(net);
  return [
    '*filter',
    `:${chain} - [0:0]`,
    `-A ${chain} -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN`,
    `-A ${chain} -p icmp -j RETURN`,
    ...ports.map((p) => `-A ${chain} -p tcp -m tcp --dport ${p} -j RETURN`),
    `-A ${chain} -j DROP`,
    'COMMIT',
    '',
  ].join('\n');
}

function ipt(args: string[], ok = [0]): Promise<number> {
  return run('iptables', ['-w', ...args], { timeoutMs: IPT_TIMEOUT_MS, okExitCodes: ok }).then(
    (r) => r.exitCode ?? -1,
  );
}

/** Writes the chain (declaring it in a restore flushes it) and its jump, once. Safe to repeat. */
export async function applyInbound(net: SandboxNetwork, ports: readonly number[]): Promise<void> {
  const chain = inboundChain(net);
  await run('iptables-restore', ['-w', '--noflush'], {
    timeoutMs: IPT_TIMEOUT_MS,
    input: inboundRules(net, ports),
  });
  if ((await ipt(['-C', 'OUTPUT', '-o', net.hostInterface, '-j', chain], [0, 1, 2])) !== 0)
    await ipt(['-I', 'OUTPUT', '1', '-o', net.hostInterface, '-j', chain]);
}

/** Removes the jump (every copy) and the chain; none there is no error. */
export async function removeInbound(net: SandboxNetwork): Promise<void> {
  const chain = inboundChain(net);
  while ((await ipt(['-D', 'OUTPUT', '-o', net.hostInterface, '-j', chain], [0, 1, 2])) === 0);
  await ipt(['-F', chain], [0, 1, 2]);
  await ipt(['-X', chain], [0, 1, 2]);
}
