/**
 * A sandbox's egress policy: where it may open connections beyond its node. Pure (no I/O):
 * parsing and the address ranges the policy is built from; the runtime turns a policy into
 * the node's firewall rules (runtime/egress.ts) and resolves its host names.
 *
 *   internet   everything except the ranges of NON_INTERNET (loopback, link-local, the private
 *              ranges, ...), the node's own addresses and other sandboxes (the default)
 *   none       nothing (not even DNS)
 *   a list     `198.18.0.0/15,api.example.com`: those networks and the addresses those names
 *              resolve to (kept current by the node), nothing else
 *
 * Whatever the policy, the node's own addresses (its API, the proxy) and other sandboxes stay
 * out of reach: the runtime rejects them before the policy is looked at.
 */
import { DormantError, ErrorCode } from './errors.js';

export type EgressPolicy =
  { mode: 'internet' } | { mode: 'none' } | { mode: 'list'; cidrs: string[]; hosts: string[] };

/** The ranges `internet` leaves out: not the internet, or the node's neighbourhood. */
export const NON_INTERNET: readonly string[] = Object.freeze([
  '0.0.0.0/8',
  '10.0.0.0/8',
  '100.64.0.0/10', // shared address space (carrier NAT, many overlay networks)
  '127.0.0.0/8',
  '169.254.0.0/16', // link-local, where cloud metadata services live
  '172.16.0.0/12',
  '192.0.0.0/24',
  '192.168.0.0/16',
  '224.0.0.0/4', // multicast
  '240.0.0.0/4', // reserved, and the broadcast address
]);

/** Most entries a list may have (each becomes a rule; a name, one rule per address). */
export const MAX_EGRESS_ENTRIES = 64;

function bad(message: string): DormantError {
  return new DormantError(ErrorCode.EGRESS_POLICY_INVALID, message);
}

/** `a.b.c.d` or `a.b.c.d/n`, returned normalized as a network (`10.1.2.3/8` -> `10.0.0.0/8`). */
export function parseCidr(text: string): string | undefined {
  const m = /^(\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{1,3})(?:\/(\d{1,2}))?$/.exec(text);
  if (!m) return undefined;
  const octets = m.slice(1, 5).map(Number);
  const prefix = m[5] === undefined ? 32 : Number(m[5]);
  if (octets.some((o) => o > 255) || prefix > 32) return undefined;
  // Leading zeros read as octal by some tools: refused rather than guessed.
  if (m.slice(1, 5).some((o) => o.length > 1 && o.startsWith('0'))) return undefined;
  const raw = octets.reduce((acc, o) => acc * 256 + o, 0);
  const size = 2 ** (32 - prefix);
  const base = raw - (raw % size);
  const ip = [24, 16, 8, 0].map((s) => Math.floor(base / 2 ** s) % 256).join('.');
  return `${ip}/${prefix}`;
}

/** A DNS host name (letters, digits, hyphens; at least one dot; not all digits). */
export function isHostName(text: string): boolean {
  if (text.length > 253 || !text.includes('.')) return false;
  const labels = text.replace(/\.$/, '').split('.');
  if (labels.every((l) => /^\d+$/.test(l))) return false;
  return labels.every((l) => /^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$/i.test(l));
}

/**
 * `internet`, `none`, or a comma-separated list (or an array) of IPv4 CIDRs and host names.
 * Throws EGRESS_POLICY_INVALID naming the entry that is neither.
 */
export function parseEgressPolicy(input: string | readonly string[]): EgressPolicy {
  const entries = (typeof input === 'string' ? input.split(',') : input.flatMap((x) => x.split(',')))
    .map((x) => x.trim())
    .filter((x) => x !== '');
  if (entries.length === 0) throw bad('egress policy is empty: give internet, none, or a list');
  if (entries.length === 1 && (entries[0] === 'internet' || entries[0] === 'none'))
    return { mode: entries[0] };
  if (entries.some((x) => x === 'internet' || x === 'none'))
    throw bad('egress: internet and none stand alone, not in a list');
  if (entries.length > MAX_EGRESS_ENTRIES)
    throw bad(`egress list has ${entries.length} entries; at most ${MAX_EGRESS_ENTRIES}`);
  const cidrs: string[] = [];
  const hosts: string[] = [];
  for (const entry of entries) {
    const shown = entry.slice(0, 80);
    if (/^[\d./]+$/.test(entry)) {
      const cidr = parseCidr(entry);
      if (cidr === undefined) throw bad(`egress entry "${shown}" is not an IPv4 address or CIDR`);
      if (!cidrs.includes(cidr)) cidrs.push(cidr);
    } else if (entry.includes(':')) {
      throw bad(`egress entry "${shown}": IPv6 is not supported (sandboxes have IPv4 only)`);
    } else if (isHostName(entry)) {
      const host = entry.toLowerCase().replace(/\.$/, '');
      if (!hosts.includes(host)) hosts.push(host);
    } else throw bad(`egress entry "${shown}" is neither an IPv4 CIDR nor a host name`);
  }
  return { mode: 'list', cidrs, hosts };
}

/** The policy as the CLI takes it back: `internet`, `none`, or the list. */
export function egressText(p: EgressPolicy): string {
  return p.mode === 'list' ? [...p.cidrs, ...p.hosts].join(',') : p.mode;
}
