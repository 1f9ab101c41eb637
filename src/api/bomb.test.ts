/**
 * Decompression bombs sent to the real import route (issue 20, hole 4): a .tar.zst of ~130 KB
 * that unpacks to one 4 GiB member of zeros, and a .tar.gz of the same. The daemon runs in a
 * child process of its own, so the peak RSS read from its /proc/PID/status (VmHWM, reset
 * through clear_refs before each import) is the daemon's alone.
 *
 * With the default caps (a member may be 32 GiB: a big sandbox's pages image) the bomb streams
 * through staging and the import is refused afterwards for what it lacks; with a 1 GiB member
 * cap it is refused at the member's header, naming the member and the cap. Either way the
 * daemon's peak RSS stays under 600 MiB and nothing is left in staging.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, type ChildProcess } from 'node:child_process';
import { readFileSync, writeFileSync } from 'node:fs';
import { mkdtemp, readdir, rm } from 'node:fs/promises';
import { createInterface } from 'node:readline';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { stagingDirFor } from '../daemon/daemon.js';
import { DormantClient } from '../sdk/client.js';
import { DormantApiError } from '../sdk/errors.js';
import { writeZeroBomb } from '../checkpoint/testing/bomb.js';

const BOMB_DAEMON = fileURLToPath(new URL('./testing/bomb-daemon.js', import.meta.url));
const GIB = 1024 ** 3;
const MIB = 1024 ** 2;
/** What the issue asks of a 4 GiB bomb. */
const MAX_PEAK_RSS = 600 * MIB;
const MEMBER = 'checkpoint/pages-1.img';

interface Child {
  proc: ChildProcess;
  pid: number;
  client: DormantClient;
  dataDir: string;
  stderr: () => string;
}

async function startBombDaemon(dataDir: string, limits?: Record<string, number>): Promise<Child> {
  const proc = spawn(process.execPath, [BOMB_DAEMON, dataDir], {
    env: { ...process.env, ...(limits ? { DORMANT_TEST_IMPORT_LIMITS: JSON.stringify(limits) } : {}) },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let err = '';
  proc.stderr.setEncoding('utf8').on('data', (c: string) => (err += c));
  const lines = createInterface({ input: proc.stdout });
  const first = await Promise.race([
    new Promise<string>((resolve) => lines.once('line', resolve)),
    new Promise<never>((_r, reject) => proc.once('exit', () => reject(new Error(`daemon exited: ${err}`)))),
    new Promise<never>((_r, reject) =>
      setTimeout(() => reject(new Error(`daemon did not start in 60 s: ${err}`)), 60_000).unref(),
    ),
  ]);
  const info = JSON.parse(first) as { url: string; token: string; pid: number };
  return {
    proc,
    pid: info.pid,
    client: new DormantClient({ url: info.url, token: info.token }),
    dataDir,
    stderr: () => err,
  };
}

async function stopDaemon(c: Child): Promise<void> {
  if (c.proc.exitCode !== null || c.proc.signalCode !== null) return;
  const gone = new Promise((resolve) => c.proc.once('exit', resolve));
  c.proc.kill('SIGTERM');
  await gone;
}

function statusKiB(pid: number, field: 'VmHWM' | 'VmRSS'): number {
  const m = new RegExp(`^${field}:\\s+(\\d+) kB$`, 'm').exec(readFileSync(`/proc/${pid}/status`, 'utf8'));
  assert.ok(m, `${field} in /proc/${pid}/status`);
  return Number(m[1]);
}

/**
 * Imports `archive` as the admin (admin tokens may name host paths), or as `send` does, and returns the error with
 * the daemon's peak RSS during the request: VmHWM, reset to the current RSS first (clear_refs
 * 5), and VmRSS sampled every 20 ms as a check on it.
 */
async function importMeasured(
  c: Child,
  archive: string,
  send: (archive: string) => Promise<unknown> = (a) => c.client.importCheckpoint({ archive: a }),
): Promise<{ err: DormantApiError; peakBytes: number; sampledPeakBytes: number; ms: number }> {
  writeFileSync(`/proc/${c.pid}/clear_refs`, '5');
  const startKiB = statusKiB(c.pid, 'VmHWM');
  assert.ok(startKiB * 1024 < MAX_PEAK_RSS / 2, `the daemon starts small (${startKiB} KiB)`);
  let sampled = 0;
  const timer = setInterval(() => (sampled = Math.max(sampled, statusKiB(c.pid, 'VmRSS'))), 20);
  const t0 = Date.now();
  const err = await send(archive).then(
    () => undefined,
    (e: unknown) => e,
  );
  const ms = Date.now() - t0;
  clearInterval(timer);
  assert.ok(err instanceof DormantApiError, `the bomb is refused, got ${String(err)}`);
  return { err, peakBytes: statusKiB(c.pid, 'VmHWM') * 1024, sampledPeakBytes: sampled * 1024, ms };
}

async function nothingLeft(c: Child): Promise<void> {
  assert.deepEqual(await readdir(stagingDirFor(c.dataDir)), [], 'nothing is left in staging');
  assert.deepEqual(await c.client.listSandboxes(), [], 'no sandbox is left');
}

describe('decompression bombs sent to import', () => {
  let dir: string;
  let zstdBomb: string;
  let gzipBomb: string;
  let open: Child;
  let capped: Child;

  before(async () => {
    dir = await mkdtemp('/tmp/dormant-bomb-');
    zstdBomb = join(dir, 'bomb.tar.zst');
    gzipBomb = join(dir, 'bomb.tar.gz');
    await writeZeroBomb(zstdBomb, [{ name: MEMBER, sizeBytes: 4 * GIB }], 'zstd');
    await writeZeroBomb(gzipBomb, [{ name: MEMBER, sizeBytes: 4 * GIB }], 'gzip');
    open = await startBombDaemon(join(dir, 'open'));
    capped = await startBombDaemon(join(dir, 'capped'), { maxMemberBytes: GIB });
  });

  after(async () => {
    for (const c of [open, capped]) if (c) await stopDaemon(c);
    await rm(dir, { recursive: true, force: true });
  });

  for (const kind of ['zstd', 'gzip'] as const) {
    test(`${kind}: 4 GiB of zeros streams through staging with default caps, RSS < 600 MiB`, async (t) => {
      const archive = kind === 'zstd' ? zstdBomb : gzipBomb;
      const size = readFileSync(archive).length;
      if (kind === 'zstd') assert.ok(size < 200 * 1024, `the zstd bomb is ${size} bytes`);
      const r = await importMeasured(open, archive);
      t.diagnostic(
        `${kind} bomb ${size} B -> 4 GiB: peak RSS ${(r.peakBytes / MIB).toFixed(0)} MiB (VmHWM), ` +
          `sampled ${(r.sampledPeakBytes / MIB).toFixed(0)} MiB, ${r.ms} ms`,
      );
      assert.ok(r.peakBytes < MAX_PEAK_RSS, `peak RSS ${r.peakBytes} B is under 600 MiB`);
      // All of it was read: the refusal is for what the archive lacks, found after unpacking.
      assert.equal(r.err.status, 422, r.err.message);
      assert.equal(r.err.code, 'CHECKPOINT_ARCHIVE_INVALID', r.err.message);
      assert.match(r.err.message, /spec\.dump is missing/);
      await nothingLeft(open);
    });

    test(`${kind}: with a 1 GiB member cap, refused at the member naming it and the cap`, async (t) => {
      const r = await importMeasured(capped, kind === 'zstd' ? zstdBomb : gzipBomb);
      t.diagnostic(`${kind} bomb, capped: peak RSS ${(r.peakBytes / MIB).toFixed(0)} MiB, ${r.ms} ms`);
      assert.ok(r.peakBytes < MAX_PEAK_RSS, `peak RSS ${r.peakBytes} B is under 600 MiB`);
      assert.equal(r.err.status, 413, r.err.message);
      assert.equal(r.err.code, 'CHECKPOINT_ARCHIVE_TOO_LARGE', r.err.message);
      assert.match(r.err.message, /member "checkpoint\/pages-1\.img" is 4 GiB, over the cap of 1 GiB/);
      await nothingLeft(capped);
    });
  }

  test('a tenant uploads the zstd bomb: the same, through the upload route', async (t) => {
    const minted = await open.client.createToken({ tenant: 'bomber' });
    const tenant = new DormantClient({ url: open.client.url, token: minted.token });
    const r = await importMeasured(open, zstdBomb, (a) =>
      tenant.uploadCheckpoint(readFileSync(a), { fileName: 'bomb.tar.zst' }),
    );
    t.diagnostic(
      `zstd bomb uploaded by a tenant: peak RSS ${(r.peakBytes / MIB).toFixed(0)} MiB, ${r.ms} ms`,
    );
    assert.ok(r.peakBytes < MAX_PEAK_RSS, `peak RSS ${r.peakBytes} B is under 600 MiB`);
    assert.equal(r.err.code, 'CHECKPOINT_ARCHIVE_INVALID', r.err.message);
    assert.match(r.err.message, /spec\.dump is missing/);
    assert.doesNotMatch(r.err.message, /\/dev\/shm|\/tmp\//, 'no host path in what the tenant sees');
    await nothingLeft(open);
  });
});
