/**
 * Whether a sandbox has a listener on a TCP port, without connecting (a connection would spend
 * an accept of a one-shot server). A runtime with its own network stack (gVisor's netstack)
 * answers itself: its listeners are not in the host kernel's tables. Otherwise the tables of
 * the sandbox's process's network namespace are read.
 */
import type { Runtime } from '../runtime/runtime.js';
import { tcpListening } from '../sys/listening.js';

/** Undefined when it has no process or neither source can be read. `pid` saves a state call. */
export async function sandboxListens(
  runtime: Runtime,
  id: string,
  port: number,
  pid?: number,
): Promise<boolean | undefined> {
  const inside = await runtime.listening?.(id, port);
  if (inside !== undefined) return inside;
  const p = pid ?? (await runtime.state(id).catch(() => undefined))?.pid;
  return p === undefined ? undefined : tcpListening(p, port);
}
