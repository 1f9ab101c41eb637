/**
 * A keeper: a small shell process that holds duplicates of some sockets open and, should this
 * process die before it releases the keeper, SIGKILLs every process of a cgroup before those
 * sockets close.
 *
 * Why: a lazy restore's pages come from a page server in this process. If this process dies
 * (SIGKILL, the OOM killer), the kernel would close the server's connections at once, and
 * CRIU's lazy-pages daemon, its page server gone, fills every page it still lacks with zeros:
 * the restored processes run on wrong memory until someone ends them. With a keeper holding
 * the connection, the daemon sees nothing close; the processes stay blocked on the pages they
 * are waiting for while the keeper ends them, and only then does the connection drop.
 *
 * The keeper learns of this process's death from its stdin (a pipe only this process writes:
 * end of file without the word "release"). It ignores SIGHUP, SIGINT, SIGTERM and SIGQUIT,
 * so a terminal's ^C or a service manager's SIGTERM, which this process answers by waiting
 * for the pages, does not drop the connection under it. It says "ready" once those signals are
 * ignored, and startKeeper waits for that: between the exec and the trap a SIGTERM would end it.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import type { Socket } from 'node:net';
import { DormantError, ErrorCode } from '../domain/errors.js';

const SCRIPT = `
trap '' HUP INT TERM QUIT PIPE
echo ready
IFS= read -r word
[ "$word" = release ] && exit 0
procs=
for f in "$@"; do
  if [ -e "$f" ]; then procs=$f; break; fi
done
[ -n "$procs" ] || exit 0
# Until the cgroup has been seen empty three times in a row (a fork between reading and
# killing shows up on the next round), for at most ~10 s.
n=0
empty=0
while [ "$n" -lt 200 ] && [ "$empty" -lt 3 ]; do
  pids=$(cat "$procs" 2>/dev/null)
  if [ -z "$pids" ]; then
    empty=$((empty + 1))
  else
    empty=0
    kill -KILL $pids 2>/dev/null
  fi
  sleep 0.05
  n=$((n + 1))
done
`;

export interface Keeper {
  /** The keeper's pid. */
  readonly pid: number;
  /** Tells the keeper to exit without ending anything; resolves once it has exited. */
  release(): Promise<void>;
}

/**
 * Starts a keeper holding `hold` open. `procsFiles` are cgroup.procs files of the processes
 * to end if this process dies first (the first one that exists is used).
 */
export async function startKeeper(o: {
  hold: readonly Socket[];
  procsFiles: readonly string[];
}): Promise<Keeper> {
  const child: ChildProcess = spawn('/bin/sh', ['-c', SCRIPT, 'dormant-keeper', ...o.procsFiles], {
    // Its own process group: a signal to this process's group does not reach it.
    detached: true,
    stdio: ['pipe', 'pipe', 'ignore', ...o.hold],
  });
  const exited = once(child, 'exit').then(
    () => undefined,
    () => undefined,
  );
  await new Promise<void>((resolve, reject) => {
    child.stdout!.once('data', () => resolve());
    child.once('error', (e) =>
      reject(
        new DormantError(ErrorCode.COMMAND_FAILED, `the keeper (/bin/sh) could not start: ${e.message}`, {
          cause: e,
        }),
      ),
    );
    void exited.then(() =>
      reject(new DormantError(ErrorCode.COMMAND_FAILED, 'the keeper (/bin/sh) exited before it was ready')),
    );
  });
  // It writes nothing more.
  child.stdout!.destroy();
  child.on('error', () => undefined);
  child.stdin?.on('error', () => undefined);
  // Neither the keeper nor its pipe keeps this process's event loop alive.
  child.unref();
  (child.stdin as unknown as { unref?: () => void } | null)?.unref?.();
  let released: Promise<void> | undefined;
  return {
    pid: child.pid!,
    release() {
      released ??= (async () => {
        if (child.exitCode !== null || child.signalCode !== null) return;
        child.stdin?.end('release\n');
        let timer: NodeJS.Timeout | undefined;
        const gone = await Promise.race([
          exited.then(() => true),
          new Promise<false>((r) => (timer = setTimeout(() => r(false), 5000))),
        ]);
        clearTimeout(timer);
        if (!gone) {
          child.kill('SIGKILL');
          await exited;
        }
      })();
      return released;
    },
  };
}
