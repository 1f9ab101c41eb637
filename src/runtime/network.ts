/**
 * A sandbox's network: its own network namespace, made with `ip netns add` so it outlives
 * the container (runc joins it; CRIU treats it as external, so a checkpoint neither dumps
 * nor needs to rebuild it), and a veth pair into it carrying a private /30:
 *
 *   subnet 10.213.0.0/16 (configurable), slot n in [0, 16384):
 *     host end   base + 4n + 1   (interface dmh<n>, also the sandbox's default gateway)
 *     sandbox    base + 4n + 2   (interface eth0 inside)
 *
 * Slots are reserved by creating `<netDir>/<n>` with O_EXCL (the file holds the sandbox id),
 * so two creates, in one process or two, never get the same slot; the first slot tried is
 * a hash of the id, so a sandbox usually keeps the same address if it is made again.
 *
 * Inside the namespace a small iptables ruleset lets the host reach only the declared TCP
 * ports and keeps the sandbox from opening connections to the host. A sandbox with an egress
 * policy gets its way out through the host (egress.ts: NAT, DNS, the policy's host-side chain);
 * one without (made before egress existed) has none.
 */
import { createHash } from 'node:crypto';
import { mkdir, readFile, readdir, rm, stat, unlink, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';
import { run } from '../sys/exec.js';
import type { EgressPolicy } from '../domain/egress.js';
import type { SandboxNetwork } from './runtime.js';
import { AGENT_PORT } from './agent-client.js';
import { applyEgress, ensureNodeChains, removeEgress, resolvConfText, sandboxRules } from './egress.js';

const IP_TIMEOUT_MS = 10_000;
/** Where `ip netns add` pins namespaces. */
const NETNS_DIR = '/run/netns';

export interface Subnet {
  /** The network's first address as a 32-bit number. */
  base: number;
  prefixLength: number;
  /** How many /30 slots fit. */
  slots: number;
}

export function parseSubnet(cidr: string): Subnet {
  const m = /^(\d+)\.(\d+)\.(\d+)\.(\d+)\/(\d+)$/.exec(cidr);
  const octets = m ? m.slice(1, 5).map(Number) : [];
  const prefix = m ? Number(m[5]) : NaN;
  if (!m || octets.some((o) => o > 255) || !(prefix >= 8 && prefix <= 28))
    throw new DormantError(
      ErrorCode.INVALID_ARGUMENT,
      `subnet "${cidr}" is not an IPv4 CIDR between /8 and /28`,
      {
        status: 400,
      },
    );
  const raw = octets.reduce((acc, o) => acc * 256 + o, 0);
  const size = 2 ** (32 - prefix);
  const base = raw - (raw % size);
  return { base, prefixLength: prefix, slots: size / 4 };
}

export function ipv4(n: number): string {
  return [24, 16, 8, 0].map((s) => Math.floor(n / 2 ** s) % 256).join('.');
}

/** The first slot to try for an id (then the following ones, wrapping around). */
export function preferredSlot(id: string, slots: number): number {
  return createHash('sha256').update(id).digest().readUInt32BE(0) % slots;
}

export function netnsName(id: string): string {
  return `dormant-${id}`;
}

/**
 * The addresses of slot `slot`. Pure. `node`: in a fleet, the node holding it, whose name is
 * in the namespace's: nodes sharing a host (scripts/fleet.sh) each hold their own copy of a
 * sandbox that moved between them, and remove theirs without touching the other's.
 */
export function slotNetwork(id: string, subnet: Subnet, slot: number, node?: string): SandboxNetwork {
  const first = subnet.base + slot * 4;
  return {
    netns: node !== undefined ? `dormant-${node}-${id}` : netnsName(id),
    hostAddress: ipv4(first + 1),
    address: ipv4(first + 2),
    prefixLength: 30,
    hostInterface: `dmh${slot}`,
  };
}

/**
 * Reserves a slot for `id` in `netDir` and returns it. Idempotent: a slot already held by
 * the same id is returned again.
 */
export async function reserveSlot(netDir: string, id: string, subnet: Subnet): Promise<number> {
  await mkdir(netDir, { recursive: true, mode: 0o700 });
  const existing = await findSlot(netDir, id);
  if (existing !== undefined) return existing;
  const first = preferredSlot(id, subnet.slots);
  for (let i = 0; i < subnet.slots; i++) {
    const slot = (first + i) % subnet.slots;
    try {
      // O_EXCL: the file system decides who owns the slot, even across processes.
      await writeFile(join(netDir, String(slot)), id, { flag: 'wx', mode: 0o600 });
      return slot;
    } catch (e) {
      if (errnoCode(e) !== 'EEXIST') throw e;
    }
  }
  throw new DormantError(ErrorCode.RUNTIME_NO_ADDRESS, `no free address for sandbox ${id}`, {
    status: 503,
    hint: 'destroy unused sandboxes or configure a larger subnet',
  });
}

export async function findSlot(netDir: string, id: string): Promise<number | undefined> {
  let names: string[];
  try {
    names = await readdir(netDir);
  } catch (e) {
    if (errnoCode(e) === 'ENOENT') return undefined;
    throw e;
  }
  for (const name of names) {
    if (!/^\d+$/.test(name)) continue;
    try {
      if ((await readFile(join(netDir, name), 'utf8')) === id) return Number(name);
    } catch (e) {
      if (errnoCode(e) !== 'ENOENT') throw e;
    }
  }
  return undefined;
}

export async function releaseSlot(netDir: string, slot: number): Promise<void> {
  try {
    await unlink(join(netDir, String(slot)));
  } catch (e) {
    if (errnoCode(e) !== 'ENOENT') throw e;
  }
}

async function ip(args: string[], signal?: AbortSignal): Promise<void> {
  await run('ip', args, { timeoutMs: IP_TIMEOUT_MS, signal });
}

/**
 * Deletes a host-side link that may vanish on its own meanwhile: deleting a network namespace
 * takes its veth peer, and with it the host end, a moment later.
 */
async function deleteLink(name: string, signal?: AbortSignal): Promise<void> {
  try {
    await ip(['link', 'del', name], signal);
  } catch (e) {
    const out = e instanceof DormantError && typeof e.details?.output === 'string' ? e.details.output : '';
    if (!/Cannot find device/.test(out)) throw e;
  }
}

async function netnsExists(name: string): Promise<boolean> {
  return (await netnsIdentity(name)) !== undefined;
}

async function linkExists(name: string, netns?: string): Promise<boolean> {
  if (netns === undefined) return hostLinkPresent(name);
  const r = await run('ip', ['-n', netns, 'link', 'show', name], {
    timeoutMs: IP_TIMEOUT_MS,
    okExitCodes: [0, 1],
  });
  return r.exitCode === 0;
}

/** The iptables ruleset inside the sandbox's namespace; `egress` absent or none: no way out. */
export function firewallRules(net: SandboxNetwork, ports: readonly number[], egress?: EgressPolicy): string {
  const out = egress !== undefined && egress.mode !== 'none';
  return [
    '*filter',
    ':INPUT DROP [0:0]',
    ':FORWARD DROP [0:0]',
    ':OUTPUT ACCEPT [0:0]',
    '-A INPUT -i lo -j ACCEPT',
    '-A INPUT -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT',
    '-A INPUT -p icmp -j ACCEPT',
    ...ports.map((p) => `-A INPUT -i eth0 -p tcp -m tcp --dport ${p} -j ACCEPT`),
    // The toolbox agent's port, for the daemon only (runtime/runc-agent.ts).
    `-A INPUT -i eth0 -s ${net.hostAddress} -p tcp -m tcp --dport ${AGENT_PORT} -j ACCEPT`,
    // The sandbox may answer, but not open connections to the host; beyond it, only with an
    // egress policy, which the host enforces (egress.ts): this is the second wall.
    '-A OUTPUT -o lo -j ACCEPT',
    '-A OUTPUT -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT',
    `-A OUTPUT -o eth0 -d ${net.hostAddress} -p icmp -j ACCEPT`,
    ...(out ? [`-A OUTPUT -o eth0 -d ${net.hostAddress} -j REJECT`, '-A OUTPUT -o eth0 -j ACCEPT'] : []),
    '-A OUTPUT -o eth0 -j REJECT',
    'COMMIT',
    '',
  ].join('\n');
}

/** The identity of a live network namespace (its nsfs inode), or undefined when absent. */
async function netnsIdentity(name: string): Promise<string | undefined> {
  try {
    const st = await stat(join(NETNS_DIR, name));
    // nsfs inode numbers are reused once a namespace is freed, and deterministically so after
    // a reboot: the boot id tells a namespace of this boot from one of an earlier boot.
    const boot = (await readFile('/proc/sys/kernel/random/boot_id', 'utf8')).trim();
    return `${boot}:${st.dev}:${st.ino}`;
  } catch (e) {
    if (errnoCode(e) === 'ENOENT') return undefined;
    throw e;
  }
}

/** A sandbox's egress as setUpNetwork applies it (egress.ts). */
export interface EgressSetUp {
  policy: EgressPolicy;
  /** The sandbox subnet (other sandboxes, refused whatever the policy). */
  subnet: string;
  resolvers: readonly string[];
  /** What the list's host names resolve to now. */
  addresses: readonly string[];
  /** The runtime-owned file bound at the sandbox's /etc/resolv.conf. */
  resolvConfPath: string;
}

/**
 * Creates (or completes, after a crash) the namespace, the veth pair and the firewall.
 * `markerPath` records which namespace (by inode) was fully set up with which rules, so the
 * common case (restore right after a stop, nothing changed) costs one stat, not a handful of
 * `ip` and `iptables` processes; a namespace made again after a reboot has another inode.
 */
export function setUpNetwork(
  net: SandboxNetwork,
  ports: readonly number[],
  opts: {
    markerPath: string;
    signal?: AbortSignal;
    egress?: EgressSetUp;
    /**
     * The pid of a process whose network namespace becomes the sandbox's (pinned as
     * `ip netns` would), instead of one made here: a sandbox in a user namespace, whose network
     * namespace runc made inside it (created) or CRIU did (restored; its veth pair with it).
     */
    adoptFrom?: number;
    /** Only a network already set up (its marker there): a refresh that must not revive one torn down. */
    onlyIfSetUp?: boolean;
  },
): Promise<void> {
  return locked(net.netns, async () => {
    if (
      opts.onlyIfSetUp === true &&
      !(await readFile(opts.markerPath).then(
        () => true,
        () => false,
      ))
    )
      return;
    await setUp(net, ports, opts);
  });
}

/**
 * One change at a time to a sandbox's network in this process: the daemon serializes
 * lifecycle operations, but an egress list's names are refreshed on a timer (runc-host.ts),
 * which must neither interleave with a teardown nor bring back what it removed.
 */
const netLocks = new Map<string, Promise<unknown>>();

async function locked<T>(key: string, fn: () => Promise<T>): Promise<T> {
  const prev = netLocks.get(key) ?? Promise.resolve();
  const next = prev.then(fn, fn);
  const tail = next.catch(() => undefined);
  netLocks.set(key, tail);
  try {
    return await next;
  } finally {
    if (netLocks.get(key) === tail) netLocks.delete(key);
  }
}

async function setUp(
  net: SandboxNetwork,
  ports: readonly number[],
  opts: { markerPath: string; signal?: AbortSignal; egress?: EgressSetUp; adoptFrom?: number },
): Promise<void> {
  const { signal, egress, adoptFrom } = opts;
  const rules = firewallRules(net, ports, egress?.policy);
  const hostRules = egress !== undefined ? sandboxRules(net, egress.policy, egress) : '';
  const resolvConf = egress !== undefined ? resolvConfText(egress.policy, egress.resolvers) : '';
  const want = (identity: string): string =>
    JSON.stringify({
      netns: identity,
      rules: createHash('sha256').update(rules).update(hostRules).update(resolvConf).digest('hex'),
    });
  let before = await netnsIdentity(net.netns);
  if (before !== undefined && adoptFrom !== undefined && !(await sameNamespace(net.netns, adoptFrom))) {
    // The pin holds an earlier namespace (a crash before it was released): replaced.
    await ip(['netns', 'del', net.netns], signal);
    before = undefined;
  }
  if (before !== undefined) {
    try {
      if ((await readFile(opts.markerPath, 'utf8')) === want(before)) return;
    } catch (e) {
      if (errnoCode(e) !== 'ENOENT') throw e;
    }
  }
  try {
    // The common cases are batched: a namespace made from nothing (or runc's, adopted, which
    // has only lo) costs four `ip` processes, and CRIU's restored one with its veth five; the
    // steps one by one below complete what a crash left half made.
    const pristine = before === undefined && !(await hostLinkPresent(net.hostInterface));
    const withEth0 = adoptFrom !== undefined && (await processHasLink(adoptFrom, 'eth0'));
    if (pristine && !withEth0) await makeFreshNetwork(net, rules, signal, adoptFrom);
    else if (before === undefined && withEth0 && (await hostLinkPresent(net.hostInterface)))
      await adoptRestoredNetwork(net, rules, adoptFrom, signal);
    else {
      if (before === undefined && adoptFrom !== undefined)
        await ip(['netns', 'attach', net.netns, String(adoptFrom)], signal);
      else if (before === undefined) await ip(['netns', 'add', net.netns], signal);
      await ip(['-n', net.netns, 'link', 'set', 'lo', 'up'], signal);
      if (!(await linkExists('eth0', net.netns))) {
        if (await linkExists(net.hostInterface)) await deleteLink(net.hostInterface, signal);
        if (adoptFrom !== undefined) await dropHold(net, signal);
        const peer = `${net.hostInterface}c`;
        await ip(['link', 'add', net.hostInterface, 'type', 'veth', 'peer', 'name', peer], signal);
        await ip(['link', 'set', peer, 'netns', net.netns], signal);
        await ip(['-n', net.netns, 'link', 'set', peer, 'name', 'eth0'], signal);
        // No IPv6 on the link: the firewall is IPv4 only, and link-local addresses would
        // otherwise let the sandbox reach host services listening on [::].
        await run(
          'ip',
          ['netns', 'exec', net.netns, 'sh', '-c', 'echo 1 > /proc/sys/net/ipv6/conf/eth0/disable_ipv6'],
          {
            timeoutMs: IP_TIMEOUT_MS,
            signal,
          },
        );
        await writeFile(`/proc/sys/net/ipv6/conf/${net.hostInterface}/disable_ipv6`, '1');
        await ip(
          ['-n', net.netns, 'addr', 'add', `${net.address}/${net.prefixLength}`, 'dev', 'eth0'],
          signal,
        );
        await ip(['-n', net.netns, 'link', 'set', 'eth0', 'up'], signal);
        await ip(['-n', net.netns, 'route', 'add', 'default', 'via', net.hostAddress], signal);
        await ip(['addr', 'add', `${net.hostAddress}/${net.prefixLength}`, 'dev', net.hostInterface], signal);
        await ip(['link', 'set', net.hostInterface, 'up'], signal);
      } else if (adoptFrom !== undefined) await adoptLink(net, signal);
      await restoreFirewall(net, rules, signal);
    }
    if (egress !== undefined) {
      await writeFile(egress.resolvConfPath, resolvConf, { mode: 0o644 });
      await ensureNodeChains(egress.subnet);
      await applyEgress(net, hostRules);
    }
  } catch (e) {
    throw new DormantError(
      ErrorCode.RUNTIME_NETWORK_FAILED,
      `network for ${net.netns} could not be set up: ${(e as Error).message}`,
      { cause: e, hint: 'dormant needs root, iproute2 and iptables (scripts/setup.sh)' },
    );
  }
  const identity = await netnsIdentity(net.netns);
  if (identity !== undefined) await writeFile(opts.markerPath, want(identity), { mode: 0o600 });
}

/** `ip -batch`, on the host or in namespace `netns`: the lines in one process. */
function ipBatch(signal?: AbortSignal): (lines: string[], netns?: string) => Promise<unknown> {
  return (lines, netns) =>
    run('ip', [...(netns !== undefined ? ['-n', netns] : []), '-batch', '-'], {
      timeoutMs: IP_TIMEOUT_MS,
      ...(signal !== undefined ? { signal } : {}),
      input: lines.join('\n') + '\n',
    });
}

/** Whether the network namespace of process `pid` has a link named `name` (its /proc view). */
async function processHasLink(pid: number, name: string): Promise<boolean> {
  const dev = await readFile(`/proc/${String(pid)}/net/dev`, 'utf8');
  return new RegExp(`^\\s*${name}:`, 'm').test(dev);
}

/**
 * The namespace CRIU restored with the sandbox's veth pair (user namespaces: runtime/userns.ts)
 * pinned, wired by {@link adoptLink} (its address from the sandbox's record, a fork's own; the
 * default route; the host end's address) and given its firewall.
 */
async function adoptRestoredNetwork(
  net: SandboxNetwork,
  rules: string,
  pid: number,
  signal?: AbortSignal,
): Promise<void> {
  await ipBatch(signal)([`netns attach ${net.netns} ${String(pid)}`]);
  await adoptLink(net, signal);
  await restoreFirewall(net, rules, signal);
}

/** The namespace's firewall: `rules` (iptables-restore) inside it. */
async function restoreFirewall(net: SandboxNetwork, rules: string, signal?: AbortSignal): Promise<void> {
  await run('ip', ['netns', 'exec', net.netns, 'iptables-restore'], {
    timeoutMs: IP_TIMEOUT_MS,
    ...(signal !== undefined ? { signal } : {}),
    input: rules,
  });
}

/** Whether the host has a link named `name` (its sysfs entry: no process to ask). */
async function hostLinkPresent(name: string): Promise<boolean> {
  return stat(join('/sys/class/net', name)).then(
    () => true,
    (e: unknown) => {
      if (errnoCode(e) === 'ENOENT') return false;
      throw e;
    },
  );
}

/**
 * A new namespace, its veth pair, addresses, route and firewall, in the order the steps one
 * by one take (IPv6 off on both ends and the firewall in before a link is up), batched:
 * `ip -batch` on each side and one shell inside, four processes where the steps one by one
 * spawn sixteen (most of a create's host side, profiled in docs/BENCHMARKS.md).
 */
async function makeFreshNetwork(
  net: SandboxNetwork,
  rules: string,
  signal?: AbortSignal,
  adoptFrom?: number,
): Promise<void> {
  const batch = ipBatch(signal);
  // The /30 a sleeping sandbox's address was held in (userns.ts) goes before its link comes.
  if (adoptFrom !== undefined) await dropHold(net, signal);
  // The peer is made inside the namespace under its final name.
  await batch([
    adoptFrom !== undefined ? `netns attach ${net.netns} ${String(adoptFrom)}` : `netns add ${net.netns}`,
    `link add ${net.hostInterface} type veth peer name eth0 netns ${net.netns}`,
  ]);
  await writeFile(`/proc/sys/net/ipv6/conf/${net.hostInterface}/disable_ipv6`, '1');
  await run(
    'ip',
    [
      'netns',
      'exec',
      net.netns,
      'sh',
      '-c',
      'echo 1 > /proc/sys/net/ipv6/conf/eth0/disable_ipv6 && exec iptables-restore',
    ],
    { timeoutMs: IP_TIMEOUT_MS, signal, input: rules },
  );
  await batch(
    [
      'link set lo up',
      `addr add ${net.address}/${net.prefixLength} dev eth0`,
      'link set eth0 up',
      `route add default via ${net.hostAddress}`,
    ],
    net.netns,
  );
  await batch([
    `addr add ${net.hostAddress}/${net.prefixLength} dev ${net.hostInterface}`,
    `link set ${net.hostInterface} up`,
  ]);
}

/** Whether the namespace pinned as `name` is the network namespace of process `pid`. */
async function sameNamespace(name: string, pid: number): Promise<boolean> {
  const [pinned, theirs] = await Promise.all([
    stat(join(NETNS_DIR, name)),
    stat(`/proc/${String(pid)}/ns/net`),
  ]);
  return pinned.dev === theirs.dev && pinned.ino === theirs.ino;
}

/**
 * The link CRIU restored (its `veth-pair eth0=<host end>`: the pair is made again with the
 * namespace) given this sandbox's addresses: the checkpoint's are another sandbox's for a
 * fork. The host end comes back with neither address nor state.
 */
async function adoptLink(net: SandboxNetwork, signal?: AbortSignal): Promise<void> {
  const batch = ipBatch(signal);
  await batch(
    [
      'link set lo up',
      'addr flush dev eth0',
      `addr add ${net.address}/${net.prefixLength} dev eth0`,
      'link set eth0 up',
      `route replace default via ${net.hostAddress}`,
    ],
    net.netns,
  );
  await dropHold(net, signal);
  await writeFile(`/proc/sys/net/ipv6/conf/${net.hostInterface}/disable_ipv6`, '1');
  await batch([
    `addr replace ${net.hostAddress}/${net.prefixLength} dev ${net.hostInterface}`,
    `link set ${net.hostInterface} up`,
  ]);
}

/**
 * Unpins the sandbox's network namespace (one runc or CRIU made, see adoptFrom) once its
 * processes are gone: the namespace and its veth pair go with the pin, so that the next restore
 * can make both again under the same names. The host-side egress chain stays (it names the
 * host end, which comes back).
 */
export function releaseNetwork(
  net: SandboxNetwork,
  opts: { markerPath: string; signal?: AbortSignal },
): Promise<void> {
  return locked(net.netns, async () => {
    await rm(opts.markerPath, { force: true });
    if (await netnsExists(net.netns)) await ip(['netns', 'del', net.netns], opts.signal);
    // The host end goes with its peer a moment later; gone now, so a restore can take its name.
    if (await linkExists(net.hostInterface)) await deleteLink(net.hostInterface, opts.signal);
    // Without the link, the host would route the sandbox's address out of its default route:
    // it is held unreachable until the link is back (dropHold).
    await ip(['route', 'replace', 'unreachable', linkPrefix(net)], opts.signal);
  });
}

/** The sandbox's /30, as a route prefix. */
function linkPrefix(net: SandboxNetwork): string {
  const host = net.hostAddress.split('.').reduce((acc, o) => acc * 256 + Number(o), 0);
  return `${ipv4(host - 1)}/${String(net.prefixLength)}`;
}

/** Removes the unreachable route releaseNetwork held the sandbox's /30 with, if there is one. */
async function dropHold(net: SandboxNetwork, signal?: AbortSignal): Promise<void> {
  await run('ip', ['route', 'del', 'unreachable', linkPrefix(net)], {
    timeoutMs: IP_TIMEOUT_MS,
    okExitCodes: [0, 2],
    ...(signal !== undefined ? { signal } : {}),
  });
}

/**
 * Removes CRIU's network lock if a failed dump or restore left it behind: while it is there
 * the sandbox's traffic is dropped. CRIU locks with nftables (a `CRIU-<pid>` table; criu.conf
 * asks for it) or, for checkpoints made before, with an iptables `CRIU` chain: both go.
 */
export async function clearCriuNetworkLock(net: SandboxNetwork): Promise<void> {
  // A namespace CRIU made is gone with a failed restore, and its lock with it.
  if (!(await netnsExists(net.netns))) return;
  // nft may be missing (CRIU links libnftables itself): then there is nothing to list.
  const tables = await run('ip', ['netns', 'exec', net.netns, 'nft', 'list', 'tables'], {
    timeoutMs: IP_TIMEOUT_MS,
    okExitCodes: Array.from({ length: 256 }, (_, i) => i),
  }).catch(() => undefined);
  for (const m of (tables?.stdout ?? '').matchAll(/^table (\S+) (CRIU-\d+)$/gm)) {
    await run('ip', ['netns', 'exec', net.netns, 'nft', 'delete', 'table', m[1]!, m[2]!], {
      timeoutMs: IP_TIMEOUT_MS,
      okExitCodes: [0, 1],
    });
  }
  for (const tool of ['iptables', 'ip6tables']) {
    const r = await run('ip', ['netns', 'exec', net.netns, tool, '-S'], {
      timeoutMs: IP_TIMEOUT_MS,
      okExitCodes: [0, 1, 2],
    });
    if (!r.stdout.includes('-N CRIU')) continue;
    for (const chain of ['INPUT', 'OUTPUT']) {
      // Delete every jump to CRIU (a failed run can leave more than one).
      for (let i = 0; i < 8; i++) {
        const d = await run('ip', ['netns', 'exec', net.netns, tool, '-D', chain, '-j', 'CRIU'], {
          timeoutMs: IP_TIMEOUT_MS,
          okExitCodes: [0, 1, 2],
        });
        if (d.exitCode !== 0) break;
      }
    }
    await run('ip', ['netns', 'exec', net.netns, tool, '-F', 'CRIU'], {
      timeoutMs: IP_TIMEOUT_MS,
      okExitCodes: [0, 1],
    });
    await run('ip', ['netns', 'exec', net.netns, tool, '-X', 'CRIU'], {
      timeoutMs: IP_TIMEOUT_MS,
      okExitCodes: [0, 1],
    });
  }
}

/** Deletes the namespace (which takes the veth pair with it) and a stray host end. */
export function tearDownNetwork(
  net: SandboxNetwork,
  opts: { markerPath?: string; signal?: AbortSignal } = {},
): Promise<void> {
  return locked(net.netns, () => tearDown(net, opts));
}

async function tearDown(
  net: SandboxNetwork,
  opts: { markerPath?: string; signal?: AbortSignal },
): Promise<void> {
  const { signal } = opts;
  if (opts.markerPath !== undefined) await rm(opts.markerPath, { force: true });
  // The host-side chain first: it names the interface the namespace's deletion takes away.
  await removeEgress(net);
  if (await netnsExists(net.netns)) await ip(['netns', 'del', net.netns], signal);
  if (await linkExists(net.hostInterface)) await deleteLink(net.hostInterface, signal);
  await dropHold(net, signal);
}
