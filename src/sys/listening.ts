/**
 * Whether a TCP port is listening in a process's network namespace, read from the kernel's
 * socket tables (/proc/PID/net/tcp and tcp6) instead of by connecting: a connection to find out
 * would spend an accept of the server (a one-shot server's only one).
 */
import { readFile } from 'node:fs/promises';

/** TCP_LISTEN in linux/tcp_states.h, as the tables print it. */
const LISTEN = '0A';

/** Ports in state LISTEN in one table's text (`sl local_address rem_address st ...`). */
export function listeningPorts(table: string): Set<number> {
  const out = new Set<number>();
  for (const line of table.split('\n').slice(1)) {
    const cols = line.trim().split(/\s+/);
    const local = cols[1];
    if (cols[3] !== LISTEN || local === undefined) continue;
    const port = Number.parseInt(local.slice(local.lastIndexOf(':') + 1), 16);
    if (Number.isInteger(port)) out.add(port);
  }
  return out;
}

/** True when `port` listens in `pid`'s network namespace; undefined when the tables cannot be read. */
export async function tcpListening(pid: number, port: number): Promise<boolean | undefined> {
  let readAny = false;
  for (const t of ['tcp', 'tcp6']) {
    const text = await readFile(`/proc/${pid}/net/${t}`, 'utf8').catch(() => undefined);
    if (text === undefined) continue;
    readAny = true;
    if (listeningPorts(text).has(port)) return true;
  }
  return readAny ? false : undefined;
}
