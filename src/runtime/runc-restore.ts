/**
 * RuncRuntime's restore (runc.ts), the parts that need nothing of the runtime: the watch over
 * a running restore, the copy kept of a failed one's CRIU log, and CRIU's lazy-pages daemon.
 */
import { open, readFile, readdir, rename, rm, stat } from 'node:fs/promises';
import { join, resolve } from 'node:path';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';
import { run } from '../sys/exec.js';
import type { RestoreOptions } from './runtime.js';
import { exists } from '../sys/fs.js';
import { readEnd, readStart, sigkill } from './runc-host.js';

/** What of a failed restore's CRIU log is kept: its start and its end. */
const KEPT_LOG_HEAD_BYTES = 256 * 1024;
const KEPT_LOG_TAIL_BYTES = 1024 * 1024;

/**
 * A restore whose CRIU log grows past this is taken as stuck: a truncated pages image makes
 * CRIU 4.2 retry a read at the end of the file forever, logging each try ("Advanced iov 0
 * bytes" lazily, the restorer's "Preadv" / "returned 0" eagerly), until the restore timeout. A healthy restore logs a few MiB at most.
 */
const RESTORE_LOG_LIMIT_BYTES = 64 * 1024 * 1024;

/** How long runc restore may go on after the lazy-pages daemon failed before it is ended. */
const LAZY_FAILURE_GRACE_MS = 3000;

/**
 * Watches a running restore: aborts (through the returned signal, which also follows
 * `outer`) when CRIU's log passes RESTORE_LOG_LIMIT_BYTES or the lazy-pages daemon fails
 * before the restore is done. `stuck()` says which.
 */
export function watchRestore(
  logPath: string,
  lazyDone: Promise<void> | undefined,
  outer: AbortSignal | undefined,
): { signal: AbortSignal; stuck(): string | undefined; stop(): void } {
  const abort = new AbortController();
  let why: string | undefined;
  let stopped = false;
  let spins = 0;
  const end = (reason: string): void => {
    if (stopped || why !== undefined) return;
    why = reason;
    abort.abort(new Error(reason));
  };
  const onOuter = (): void => abort.abort(outer?.reason);
  if (outer?.aborted) abort.abort(outer.reason);
  outer?.addEventListener('abort', onOuter, { once: true });
  // Only its failure: a daemon that copied every page may exit before runc restore does.
  // And a grace: the daemon also fails when the restore does, and CRIU's own error (which
  // runc is about to return) says more than the daemon's.
  lazyDone?.then(
    () => undefined,
    () => {
      setTimeout(
        () => end('the lazy-pages daemon failed before the processes were restored'),
        LAZY_FAILURE_GRACE_MS,
      ).unref();
    },
  );
  const timer = setInterval(() => {
    stat(logPath).then(
      async (st) => {
        // The loop's own line, all over the log's end, twice in a row: stuck, whatever the load.
        if (st.size > 64 * 1024) {
          const tailText = await readEnd(logPath, 16 * 1024).catch(() => '');
          const lines = tailText.split('\n').slice(1, -1);
          // Lazy restores loop on `Advanced iov 0 bytes`; eager ones (a sandbox in a user
          // namespace without unprivileged userfaultfd) on the restorer's `Preadv`, `returned 0`.
          const looping =
            lines.length > 100 &&
            lines.every((l) => /Advanced iov 0 bytes|pie: \d+: (Preadv .*iovs\)|`- returned 0)$/.test(l));
          spins = looping ? spins + 1 : 0;
          if (spins >= 2) end('criu is stuck in a loop reading a pages image (is it truncated?)');
        }
        if (st.size > RESTORE_LOG_LIMIT_BYTES)
          end(
            `criu's log passed ${String(RESTORE_LOG_LIMIT_BYTES >> 20)} MiB (criu is stuck in a loop; a damaged image?)`,
          );
      },
      (e: unknown) => {
        if (errnoCode(e) !== 'ENOENT') end(`criu's log cannot be read: ${(e as Error).message}`);
      },
    );
  }, 200);
  timer.unref();
  return {
    signal: abort.signal,
    stuck: () => why,
    stop: () => {
      stopped = true;
      clearInterval(timer);
      outer?.removeEventListener('abort', onOuter);
    },
  };
}

/**
 * Copies the CRIU logs of a failed restore (criu restore's, then the lazy-pages daemon's)
 * out of the work dir, which is wiped with the images, into the sandbox's folder (0600,
 * replacing the previous one). Returns its path.
 */
export async function keepRestoreLog(path: string, workDir: string): Promise<string> {
  const parts: string[] = [];
  for (const name of ['restore.log', 'lazy-pages.log']) {
    try {
      // Bounded: the head says what was restored, the end why it stopped.
      const path = join(workDir, name);
      const size = (await stat(path)).size;
      const text =
        size <= KEPT_LOG_HEAD_BYTES + KEPT_LOG_TAIL_BYTES
          ? await readFile(path, 'utf8')
          : `${await readStart(path, KEPT_LOG_HEAD_BYTES)}\n[... ${String(size - KEPT_LOG_HEAD_BYTES - KEPT_LOG_TAIL_BYTES)} bytes left out ...]\n${await readEnd(path, KEPT_LOG_TAIL_BYTES)}`;
      parts.push(`==> ${name} <==\n${text}`);
    } catch (e) {
      if (errnoCode(e) !== 'ENOENT') throw e;
    }
  }
  const tmp = `${path}.tmp`;
  await rm(tmp, { force: true });
  const fh = await open(tmp, 'wx', 0o600);
  try {
    await fh.writeFile(parts.length > 0 ? parts.join('\n') : 'criu wrote no log\n');
  } finally {
    await fh.close();
  }
  await rename(tmp, path);
  return path;
}

/**
 * Starts `criu lazy-pages` for a lazy restore and waits until it listens: it and the
 * restoring criu meet on `lazy-pages.socket` in the shared work dir.
 */
export async function startLazyPages(
  criuPath: string,
  env: Record<string, string>,
  opts: RestoreOptions,
): Promise<{ abort: AbortController; done: Promise<void> }> {
  const abort = new AbortController();
  opts.signal?.addEventListener('abort', () => abort.abort(), { once: true });
  let exited: unknown = undefined;
  let finished = false;
  const done = run(
    criuPath,
    [
      'lazy-pages',
      '--images-dir',
      opts.imagesDir,
      '--work-dir',
      opts.workDir,
      '-o',
      'lazy-pages.log',
      '-v2',
      ...(opts.pageServer
        ? ['--page-server', '--address', opts.pageServer.address, '--port', String(opts.pageServer.port)]
        : []),
    ],
    { timeoutMs: opts.pagesTimeoutMs ?? 120_000, signal: abort.signal, env: env },
  ).then(
    () => {
      finished = true;
    },
    (e: unknown) => {
      finished = true;
      exited = e;
      throw new DormantError(
        ErrorCode.RUNTIME_RESTORE_FAILED,
        `criu lazy-pages for ${opts.imagesDir} failed: ${(e as Error).message}`,
        { cause: e, details: { criuLog: join(opts.workDir, 'lazy-pages.log') } },
      );
    },
  );
  // Nobody may be listening yet; keep an early failure from becoming an unhandled rejection.
  done.catch(() => undefined);
  const socket = join(opts.workDir, 'lazy-pages.socket');
  const deadline = Date.now() + 10_000;
  while (!(await exists(socket))) {
    if (finished || Date.now() > deadline) {
      abort.abort();
      await done.catch(() => undefined);
      throw new DormantError(
        ErrorCode.RUNTIME_RESTORE_FAILED,
        `criu lazy-pages did not start for ${opts.imagesDir}`,
        {
          cause: exited,
          details: { criuLog: join(opts.workDir, 'lazy-pages.log') },
        },
      );
    }
    await new Promise((res) => setTimeout(res, 10));
  }
  return { abort, done };
}

/** Ends every `criu lazy-pages` daemon serving work dir `workDir`; returns their pids. */
export async function endLazyPagesIn(workDir: string): Promise<number[]> {
  const dir = resolve(workDir);
  const pids: number[] = [];
  for (const p of await readdir('/proc').catch(() => [] as string[])) {
    if (!/^\d+$/.test(p) || Number(p) === process.pid) continue;
    const argv = (await readFile(`/proc/${p}/cmdline`, 'utf8').catch(() => '')).split('\0');
    const at = argv.indexOf('--work-dir');
    if (argv.includes('lazy-pages') && at >= 0 && argv[at + 1] === dir) pids.push(Number(p));
  }
  sigkill(pids);
  // Gone (or a zombie for its parent to reap) before the caller goes on.
  const deadline = Date.now() + 5000;
  for (const pid of pids) {
    while (Date.now() < deadline) {
      const st = await readFile(`/proc/${pid}/stat`, 'utf8').catch(() => '');
      if (st === '' || / Z /.test(st.slice(st.lastIndexOf(')')))) break;
      await new Promise((res) => setTimeout(res, 10));
    }
  }
  return pids;
}
