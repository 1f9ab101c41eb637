/**
 * One holder at a time among the processes of this machine (the daemon, `dormant vault`
 * commands): an O_EXCL lock file holding the owner's pid, removed by whoever finds its owner
 * dead (kill -9). Within a process, callers queue on a promise chain first, so the file is
 * taken once per call, not raced for.
 */
import { mkdir, open, readFile, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (e) {
    return errnoCode(e) === 'EPERM';
  }
}

export class LocalMutex {
  private tail: Promise<unknown> = Promise.resolve();
  private readonly file: string;

  constructor(
    private readonly dir: string,
    name: string,
    private readonly timeoutMs = 60_000,
  ) {
    this.file = join(dir, name);
  }

  /** Runs `fn` while holding the lock. */
  run<T>(fn: () => Promise<T>): Promise<T> {
    const mine = this.tail.then(async () => {
      await this.take();
      try {
        return await fn();
      } finally {
        await rm(this.file, { force: true });
      }
    });
    this.tail = mine.catch(() => undefined);
    return mine;
  }

  private async take(): Promise<void> {
    await mkdir(this.dir, { recursive: true, mode: 0o700 });
    const deadline = Date.now() + this.timeoutMs;
    for (;;) {
      try {
        const h = await open(this.file, 'wx', 0o600);
        try {
          await h.writeFile(String(process.pid));
        } finally {
          await h.close();
        }
        return;
      } catch (e) {
        if (errnoCode(e) !== 'EEXIST') throw e;
      }
      const text = await readFile(this.file, 'utf8').catch(() => '');
      const pid = Number.parseInt(text, 10);
      // An empty file is an owner between open and write: alive.
      if (Number.isFinite(pid) && !alive(pid)) {
        await rm(this.file, { force: true });
        continue;
      }
      if (Date.now() > deadline) {
        throw new DormantError(
          ErrorCode.VAULT_BUSY,
          `vault is busy: ${this.file} is held by process ${text}`,
          {
            hint: 'another dormant process on this node is writing a vault key; retry',
          },
        );
      }
      await sleep(20);
    }
  }
}
