/**
 * Writers and gc exclude each other, across processes on one machine. A writer may reuse any
 * chunk already in an index, so gc must never sweep while a write is between "found the chunk"
 * and "committed the manifest"; grace periods cannot cover that, a lock can.
 *
 * Files under `<vault>/locks`: each writer holds `w-<pid>-<rand>`, gc holds `gc` (O_EXCL).
 * Both create their own file first and then look for the other kind, so at least one of two
 * racing parties sees the other and backs off. A lock whose process is gone (kill -9) is
 * stale and is removed by whoever finds it. Exact on one machine only: nodes that share a
 * bucket prefix use PostgreSQL's advisory locks instead (locks.ts, state/pg-locks.ts).
 */
import { mkdir, open, readdir, readFile, rm } from 'node:fs/promises';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';

export type Release = () => Promise<void>;

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (e) {
    return errnoCode(e) === 'EPERM';
  }
}

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

export class LocalLock {
  constructor(private readonly dir: string) {}

  private async ensure(): Promise<void> {
    await mkdir(this.dir, { recursive: true, mode: 0o700 });
  }

  private async ownerAlive(file: string): Promise<boolean> {
    let text: string;
    try {
      text = await readFile(join(this.dir, file), 'utf8');
    } catch (e) {
      if (errnoCode(e) === 'ENOENT') return false;
      throw e;
    }
    const pid = Number.parseInt(text, 10);
    // A file still being written (empty) counts as alive: its owner is between open and write.
    if (!Number.isFinite(pid)) return true;
    if (alive(pid)) return true;
    await rm(join(this.dir, file), { force: true });
    return false;
  }

  private async liveWriters(): Promise<number> {
    let n = 0;
    for (const f of await readdir(this.dir)) {
      if (f.startsWith('w-') && (await this.ownerAlive(f))) n++;
    }
    return n;
  }

  /** A writer's lock; waits while gc runs (up to `timeoutMs`). */
  async shared(opts: { timeoutMs: number; signal?: AbortSignal }): Promise<Release> {
    await this.ensure();
    const deadline = Date.now() + opts.timeoutMs;
    const mine = join(this.dir, `w-${process.pid}-${randomBytes(6).toString('hex')}`);
    for (;;) {
      await writePid(mine, 'w');
      if (!(await this.ownerAlive('gc'))) return () => rm(mine, { force: true });
      await rm(mine, { force: true });
      if (opts.signal?.aborted) throw abortError(opts.signal);
      if (Date.now() > deadline) throw busy('a garbage collection is running');
      await sleep(50);
    }
  }

  /** gc's lock: keeps new writers out, then waits for running ones to finish. */
  async exclusive(opts: { timeoutMs: number; signal?: AbortSignal }): Promise<Release> {
    await this.ensure();
    const deadline = Date.now() + opts.timeoutMs;
    const mine = join(this.dir, 'gc');
    for (;;) {
      try {
        await writePid(mine, 'wx');
        break;
      } catch (e) {
        if (errnoCode(e) !== 'EEXIST') throw e;
        if (!(await this.ownerAlive('gc'))) continue;
      }
      if (Date.now() > deadline) throw busy('another garbage collection is running');
      await sleep(50);
    }
    const release: Release = () => rm(mine, { force: true });
    try {
      while ((await this.liveWriters()) > 0) {
        if (opts.signal?.aborted) throw abortError(opts.signal);
        if (Date.now() > deadline) throw busy('checkpoints are being written');
        await sleep(50);
      }
    } catch (e) {
      await release();
      throw e;
    }
    return release;
  }
}

async function writePid(path: string, flags: 'w' | 'wx'): Promise<void> {
  const h = await open(path, flags, 0o600);
  try {
    await h.writeFile(String(process.pid));
  } finally {
    await h.close();
  }
}

function busy(why: string): DormantError {
  return new DormantError(ErrorCode.VAULT_BUSY, `vault is busy: ${why}`, {
    hint: 'try again later; gc waits for writes and writes wait for gc',
  });
}

function abortError(signal: AbortSignal): DormantError {
  return new DormantError(ErrorCode.COMMAND_ABORTED, 'vault operation aborted', { cause: signal.reason });
}
