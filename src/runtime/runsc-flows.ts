/**
 * The TCP connections a gVisor sandbox may hold, seen from the host. This runsc build cannot
 * save a TCP endpoint that is connected or closing (TIME_WAIT included: the 60 s after the
 * sandbox's side closed a connection first), and a save that fails ends the sandbox: gVisor
 * kills its kernel whatever the save's outcome. So a checkpoint is asked only when no such
 * connection can exist.
 *
 * gVisor's own socket tables (`/proc/net/tcp` inside) list only endpoints that a process
 * holds: one in TIME_WAIT, which no file descriptor holds, is not there. Every packet of the
 * sandbox passes the host's network stack (its veth is routed, not bridged), so the host's
 * connection tracking sees each of its flows; a flow there in a state other than CLOSE may
 * still be an endpoint in gVisor. The tracking table keeps a closed flow longer (TIME_WAIT:
 * 120 s) than gVisor keeps the endpoint (60 s), and cannot tell which side closed first (only
 * that side waits): it errs towards refusing a checkpoint that would have worked, never
 * towards one that ends the sandbox.
 */
import { readFile } from 'node:fs/promises';

/** A tracked TCP flow of the sandbox: who it talks to, in which state, for how much longer. */
export interface TrackedFlow {
  /** The sandbox's end, address:port. */
  local: string;
  /** The other end, address:port. */
  remote: string;
  /** The tracker's TCP state (ESTABLISHED, TIME_WAIT, ...). */
  state: string;
  /** Seconds until the tracker forgets the flow unless more packets come. */
  secondsLeft: number;
}

/** The host's connection tracking table (absent where the kernel does not show it). */
export const CONNTRACK_TABLE = '/proc/net/nf_conntrack';

/**
 * TCP flows in `table` (nf_conntrack's text) with `address` at one end of their original
 * direction, other than those already closed (CLOSE: reset or fully shut, nothing left of them
 * in gVisor).
 */
export function openFlows(table: string, address: string): TrackedFlow[] {
  const out: TrackedFlow[] = [];
  for (const line of table.split('\n')) {
    // `ipv4 2 tcp 6 119 TIME_WAIT src=A dst=B sport=P dport=Q src=B dst=A ... [ASSURED] ...`
    const cols = line.trim().split(/\s+/);
    if (cols[2] !== 'tcp' || cols[5] === undefined || cols[5] === 'CLOSE') continue;
    const field = (name: string): string | undefined =>
      cols.find((c) => c.startsWith(`${name}=`))?.slice(name.length + 1);
    const [src, dst, sport, dport] = [field('src'), field('dst'), field('sport'), field('dport')];
    if (src === undefined || dst === undefined) continue;
    const secondsLeft = Number(cols[4]);
    if (src === address)
      out.push({ local: `${src}:${sport}`, remote: `${dst}:${dport}`, state: cols[5], secondsLeft });
    else if (dst === address)
      out.push({ local: `${dst}:${dport}`, remote: `${src}:${sport}`, state: cols[5], secondsLeft });
  }
  return out;
}

/** The sandbox's open flows on this host; undefined when the table cannot be read here. */
export async function trackedFlows(address: string): Promise<TrackedFlow[] | undefined> {
  const table = await readFile(CONNTRACK_TABLE, 'utf8').catch(() => undefined);
  return table === undefined ? undefined : openFlows(table, address);
}

/** One line naming the flows, for an error: `10.0.0.2:8080 - 10.0.0.1:5000 TIME_WAIT`, ... */
export function describeFlows(flows: readonly TrackedFlow[], max = 3): string {
  const named = flows.slice(0, max).map((f) => `${f.local} - ${f.remote} ${f.state}`);
  return flows.length > max ? `${named.join(', ')} and ${flows.length - max} more` : named.join(', ');
}
