/**
 * The vault against restic and borg, side by side on the same inputs in one run, each with
 * its own encryption on: one big checkpoint (real CRIU images of a python process holding
 * mixed memory), and a base sandbox plus ten forks (real CRIU images). Repositories live on
 * the machine's disk (where a vault lives); inputs on /dev/shm, and every tool's restores into
 * one staging tmpfs made by `prepareStaging` (huge=within_size), the folder dormant's resume
 * restores into.
 */
import { spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import {
  mkdir,
  mkdtemp,
  open as openFile,
  readFile,
  readdir,
  rm,
  stat,
  type FileHandle,
} from 'node:fs/promises';
import { randomBytes } from 'node:crypto';
import { loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { run } from '../sys/exec.js';
import { prepareStaging, releaseStaging } from '../runtime/staging.js';
import { openVault } from '../vault/index.js';
import { readCriuImages } from '../criu/images/reader.js';
import { isPagesImage, startPageServer, writeEagerPages, type PageSource } from '../criu/page-server.js';
import { criuDump, killPid, startForkFamily, startMixedPython } from '../vault/testing/fixtures.js';
import type { BenchRow, BenchSuite } from './harness.js';

const MB = 1e6;

async function duBytes(dir: string): Promise<number> {
  let n = 0;
  for (const e of await readdir(dir, { withFileTypes: true, recursive: true })) {
    if (e.isFile()) n += (await stat(join(e.parentPath, e.name))).size;
  }
  return n;
}

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)]!;
}

/**
 * Waits until `pid` has left /proc (dead and reaped): criu restores a task under its dumped pid
 * and refuses ("Can't fork for PID: File exists") while that pid is still taken. An orphan here
 * is reaped by PID 1, which took ~2 s.
 */
async function waitGone(pid: number, timeoutMs = 30_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (existsSync(`/proc/${pid}`)) {
    if (Date.now() > deadline) throw new Error(`pid ${pid} is still in /proc after ${timeoutMs} ms`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

async function timed<T>(fn: () => Promise<T>): Promise<number> {
  const t = performance.now();
  await fn();
  return (performance.now() - t) / 1000;
}

interface Tool {
  name: string;
  init(repo: string): Promise<void>;
  put(repo: string, src: string, id: string): Promise<void>;
  get(repo: string, id: string, src: string, out: string): Promise<void>;
  /** Bytes the repository takes on disk. */
  size(repo: string): Promise<number>;
}

const PASSWORD = randomBytes(16).toString('hex');
const LONG = { timeoutMs: 1_800_000 };

function dormantTool(keyDir: string): Tool {
  const masterKey = { file: join(keyDir, 'master.key') };
  return {
    name: 'dormant',
    async init() {
      // Created on first put.
    },
    async put(repo, src, id) {
      const v = await openVault({ dir: repo, masterKey, onWarning: () => undefined });
      try {
        await v.putCheckpoint({ tenant: 'bench', sandboxId: id, checkpointId: id, srcDir: src });
      } finally {
        await v.close();
      }
    },
    async get(repo, id, _src, out) {
      const v = await openVault({ dir: repo, masterKey });
      try {
        await v.restoreCheckpoint({ tenant: 'bench', checkpointId: id, destDir: out });
      } finally {
        await v.close();
      }
    },
    size: duBytes,
  };
}

/**
 * Restores checkpoint `id` of the dormant repository `repo` as lazy resume does: the non-page
 * images (and the non-lazy pages) into `work`/images, then `criu restore --lazy-pages` with
 * `criu lazy-pages` asking a page server for every lazy page, read from the vault. Returns the
 * seconds until criu restore returned (the process runs) and until every page was in, and the
 * restored pid (the caller ends it).
 */
async function lazyFromVault(
  repo: string,
  keyDir: string,
  id: string,
  work: string,
  pidFile: string,
  /** Serve the pages from these plain images instead (the same page server, no vault decode). */
  plainImages?: string,
): Promise<{ runningS: number; pagesS: number; pid: number }> {
  const t0 = performance.now();
  const v = await openVault({ dir: repo, masterKey: { file: join(keyDir, 'master.key') } });
  let reader: Awaited<ReturnType<typeof v.openCheckpoint>> | undefined;
  let server: Awaited<ReturnType<typeof startPageServer>> | undefined;
  let daemon: ReturnType<typeof spawn> | undefined;
  const images = join(work, 'images');
  const criuWork = join(work, 'work');
  const plainFiles = new Map<string, FileHandle>();
  try {
    await mkdir(criuWork, { recursive: true });
    await v.restoreCheckpoint({
      tenant: 'bench',
      checkpointId: id,
      destDir: images,
      skip: isPagesImage,
    });
    reader = await v.openCheckpoint({ tenant: 'bench', checkpointId: id });
    const dump = await readCriuImages(images);
    const source: PageSource = plainImages === undefined ? reader : plainSource(plainImages, plainFiles);
    await writeEagerPages(
      dump.processes,
      images,
      source,
      reader.list().filter((f) => isPagesImage(f.path)),
    );
    server = await startPageServer({ processes: dump.processes, source, what: `checkpoint ${id}` });
    const d = spawn(
      'criu',
      [
        'lazy-pages',
        '-D',
        images,
        '-W',
        criuWork,
        '-o',
        'lazy-pages.log',
        '--page-server',
        '--address',
        server.address,
        '--port',
        String(server.port),
      ],
      { stdio: 'ignore' },
    );
    daemon = d;
    const exited = new Promise<number | null>((res) => d.once('exit', (code) => res(code)));
    const socket = join(criuWork, 'lazy-pages.socket');
    while (!existsSync(socket)) {
      if (d.exitCode !== null)
        throw new Error(`criu lazy-pages exited (${String(d.exitCode)}); see ${criuWork}/lazy-pages.log`);
      await new Promise((r) => setTimeout(r, 5));
    }
    await run(
      'criu',
      [
        'restore',
        '-D',
        images,
        '-W',
        criuWork,
        '--lazy-pages',
        '--shell-job',
        '-d',
        '-o',
        'restore.log',
        '--pidfile',
        pidFile,
      ],
      { timeoutMs: 600_000 },
    );
    const runningS = (performance.now() - t0) / 1000;
    const pid = Number((await readFile(pidFile, 'utf8')).trim());
    const code = await Promise.race([exited, server.failed]);
    if (code !== 0)
      throw new Error(`criu lazy-pages exited with ${String(code)}; see ${criuWork}/lazy-pages.log`);
    return { runningS, pagesS: (performance.now() - t0) / 1000, pid };
  } finally {
    if (daemon && daemon.exitCode === null) daemon.kill('SIGKILL');
    await server?.close();
    await reader?.close();
    await v.close();
    for (const h of plainFiles.values()) await h.close();
  }
}

/**
 * Decodes every byte of checkpoint `id` (a fresh vault, `openCheckpoint`, each file read in
 * order in 1 MiB pieces, as CRIU's lazy-pages daemon asks for pages, into one reused buffer):
 * the vault's decoding alone, without writing into fresh memory. Returns the seconds.
 */
async function decodeAll(repo: string, keyDir: string, id: string): Promise<number> {
  const t0 = performance.now();
  const v = await openVault({ dir: repo, masterKey: { file: join(keyDir, 'master.key') } });
  try {
    const reader = await v.openCheckpoint({ tenant: 'bench', checkpointId: id });
    try {
      const piece = Buffer.alloc(1 << 20);
      for (const f of reader.list()) {
        if (f.type !== 'file') continue;
        for (let at = 0; at < f.sizeBytes; at += piece.length) {
          const n = Math.min(piece.length, f.sizeBytes - at);
          await reader.read(f.path, at, n, piece, 0);
        }
      }
      piece.fill(0);
    } finally {
      await reader.close();
    }
  } finally {
    await v.close();
  }
  return (performance.now() - t0) / 1000;
}

/** Pages read from plain images in `dir` (the peer of the vault's reader). */
function plainSource(dir: string, open: Map<string, FileHandle>): PageSource {
  return {
    async read(file, offset, length, out, at = 0) {
      let h = open.get(file);
      if (h === undefined) {
        h = await openFile(join(dir, file), 'r');
        open.set(file, h);
      }
      const dst = out ?? Buffer.alloc(length);
      const { bytesRead } = await h.read(dst, out ? at : 0, length, offset);
      if (bytesRead !== length) throw new Error(`${file}: short read at ${String(offset)}`);
      return dst;
    },
  };
}

const resticEnv = {
  RESTIC_PASSWORD: PASSWORD,
  RESTIC_CACHE_DIR: join(tmpdir(), 'dormant-bench-restic-cache'),
};
const restic: Tool = {
  name: 'restic',
  async init(repo) {
    await run('restic', ['init', '--repo', repo], { env: resticEnv });
  },
  async put(repo, src, id) {
    await run('restic', ['backup', '--repo', repo, '--tag', id, '--host', 'bench', '.'], {
      ...LONG,
      env: resticEnv,
      cwd: src,
    });
  },
  async get(repo, id, _src, out) {
    await mkdir(out, { recursive: true });
    await run('restic', ['restore', '--repo', repo, 'latest', '--tag', id, '--target', out], {
      ...LONG,
      env: resticEnv,
    });
  },
  size: duBytes,
};

const borgEnv = {
  BORG_PASSPHRASE: PASSWORD,
  BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK: 'yes',
  BORG_RELOCATED_REPO_ACCESS_IS_OK: 'yes',
  BORG_BASE_DIR: join(tmpdir(), 'dormant-bench-borg-base'),
};
const borg: Tool = {
  name: 'borg',
  async init(repo) {
    await run('borg', ['init', '--encryption=repokey', repo], { env: borgEnv });
  },
  async put(repo, src, id) {
    await run('borg', ['create', `${repo}::${id}`, '.'], { ...LONG, env: borgEnv, cwd: src });
  },
  async get(repo, id, _src, out) {
    await mkdir(out, { recursive: true });
    await run('borg', ['extract', `${repo}::${id}`], { ...LONG, env: borgEnv, cwd: out });
  },
  size: duBytes,
};

interface Figures {
  ingestMBps: number;
  restoreMBps: number;
  storedBytes: number;
  forksIngestMBps: number;
  forksStoredBytes: number;
  forksBaseBytes: number;
}

export const vaultSuite: BenchSuite = {
  name: 'vault',
  async run({ quick }) {
    const bigMiB = quick ? 64 : 1024;
    const forkMiB = quick ? 24 : 256;
    const shm = await mkdtemp('/dev/shm/dormant-bench-vault-');
    const disk = await mkdtemp(join(tmpdir(), 'dormant-bench-vault-'));
    // Where every tool restores to: the huge-page tmpfs dormant's resume restores into (a plain
    // /dev/shm folder where that mount is not possible). Prepared below, released in the finally.
    const staging = `${shm}-staging`;
    const notes: string[] = [];
    const loadBefore = loadavg()[0]!;
    try {
      const stagingKind = await prepareStaging(staging);
      // Inputs: real CRIU dumps.
      const bigPid = await startMixedPython(shm, bigMiB);
      const big = join(shm, 'big');
      await criuDump(bigPid, big, 600_000);
      const bigBytes = await duBytes(big);
      const fam = await startForkFamily(shm, 10, forkMiB);
      const forkDirs: string[] = [];
      try {
        for (const [i, pid] of fam.forks.entries()) {
          const d = join(shm, `fork-${i}`);
          await criuDump(pid, d, 600_000);
          forkDirs.push(d);
        }
        await criuDump(fam.base, join(shm, 'base'), 600_000);
      } finally {
        for (const p of [...fam.forks, fam.base]) killPid(p);
      }
      const familyDirs = [join(shm, 'base'), ...forkDirs];
      let familyBytes = 0;
      for (const d of familyDirs) familyBytes += await duBytes(d);

      const label = quick ? `${bigMiB} MiB` : '1 GiB';
      const figures = new Map<string, Figures>();
      const dormant = dormantTool(disk);
      const dormantBigRepo = join(disk, 'dormant-big');
      for (const tool of [dormant, restic, borg]) {
        const repo = join(disk, `${tool.name}-big`);
        await tool.init(repo);
        const ingestS = await timed(() => tool.put(repo, big, 'big'));
        const storedBytes = await tool.size(repo);
        const out = join(staging, `${tool.name}-out`);
        const restoreS = await timed(() => tool.get(repo, 'big', big, out));
        await rm(out, { recursive: true, force: true });
        // dormant's is kept for the comparison with criu restore below.
        if (repo !== dormantBigRepo) await rm(repo, { recursive: true, force: true });

        const frepo = join(disk, `${tool.name}-forks`);
        await tool.init(frepo);
        await tool.put(frepo, familyDirs[0]!, 'base');
        const forksBaseBytes = await tool.size(frepo);
        let forkS = 0;
        for (const [i, d] of forkDirs.entries()) forkS += await timed(() => tool.put(frepo, d, `fork-${i}`));
        const forksStoredBytes = await tool.size(frepo);
        await rm(frepo, { recursive: true, force: true });
        const familyForkBytes = familyBytes - (await duBytes(familyDirs[0]!));
        figures.set(tool.name, {
          ingestMBps: bigBytes / MB / ingestS,
          restoreMBps: bigBytes / MB / restoreS,
          storedBytes,
          forksIngestMBps: familyForkBytes / MB / forkS,
          forksStoredBytes,
          forksBaseBytes,
        });
        process.stderr.write(`bench vault: ${tool.name} ${JSON.stringify(figures.get(tool.name))}\n`);
      }
      // CRIU's own restore of the same images: the speed restore must stay well above. Whoever
      // restores later finds more guest memory already backed by the host, so dormant and criu
      // take turns (dormant first), ROUNDS each, and the row shows the median of each.
      const ROUNDS = 3;
      const dormantRuns: number[] = [];
      const criuRuns: number[] = [];
      const criuSeconds: number[] = [];
      const lazyRunning: number[] = [];
      const lazyPages: number[] = [];
      const plainPages: number[] = [];
      const decodeRuns: number[] = [];
      let lazyFailed: string | undefined;
      let criuFailed: string | undefined;
      // Outside the images folder: criu refuses to restore when the pidfile already exists.
      const pidFile = join(disk, 'criu-restore.pid');
      // Restored processes not yet seen gone from /proc.
      const live = new Set<number>([bigPid]);
      try {
        // criu restores the task under its dumped pid: the dumped one must be gone first.
        killPid(bigPid);
        await waitGone(bigPid);
        live.delete(bigPid);
        for (let i = 0; i < ROUNDS && criuFailed === undefined; i++) {
          decodeRuns.push(bigBytes / MB / (await decodeAll(dormantBigRepo, disk, 'big')));
          const out = join(staging, 'dormant-out');
          const ds = await timed(() => dormant.get(dormantBigRepo, 'big', big, out));
          dormantRuns.push(bigBytes / MB / ds);
          await rm(out, { recursive: true, force: true });

          await rm(pidFile, { force: true });
          live.add(bigPid);
          try {
            const cs = await timed(() =>
              run(
                'criu',
                ['restore', '-D', big, '--shell-job', '-d', '-o', 'restore.log', '--pidfile', pidFile],
                { timeoutMs: 600_000 },
              ),
            );
            criuRuns.push(bigBytes / MB / cs);
            criuSeconds.push(cs);
          } catch (e) {
            criuFailed = String(e).slice(0, 200);
          }
          const endLive = async (): Promise<void> => {
            const fromFile = Number((await readFile(pidFile, 'utf8').catch(() => '')).trim());
            if (Number.isInteger(fromFile) && fromFile > 0) live.add(fromFile);
            for (const pid of live) {
              killPid(pid);
              await waitGone(pid);
              live.delete(pid);
            }
          };
          await endLive();

          // Lazy resume's way: criu restores the process from the non-page images and the
          // lazy-pages daemon gets every other page from the vault's page server.
          if (lazyFailed === undefined) {
            await rm(pidFile, { force: true });
            live.add(bigPid);
            const work = join(staging, 'dormant-lazy');
            try {
              // The same with the page server reading the plain images (what the vault's
              // decoding costs on top of CRIU's lazy-pages protocol); the two take turns going
              // first, as later runs find more memory backed.
              for (const plain of i % 2 === 0 ? [false, true] : [true, false]) {
                await rm(pidFile, { force: true });
                live.add(bigPid);
                const r = await lazyFromVault(
                  dormantBigRepo,
                  disk,
                  'big',
                  work,
                  pidFile,
                  plain ? big : undefined,
                );
                if (plain) plainPages.push(r.pagesS);
                else {
                  lazyRunning.push(r.runningS);
                  lazyPages.push(r.pagesS);
                }
                await endLive();
                await rm(work, { recursive: true, force: true });
              }
            } catch (e) {
              lazyFailed = String(e).slice(0, 300);
            }
            await endLive();
            await rm(work, { recursive: true, force: true });
          }
        }
      } finally {
        for (const pid of live) killPid(pid);
        for (const pid of live) await waitGone(pid).catch(() => undefined);
        await rm(pidFile, { force: true });
        await rm(dormantBigRepo, { recursive: true, force: true });
      }
      const fmtRuns = (xs: number[]): string => xs.map((x) => x.toFixed(0)).join(', ');
      const criuNote =
        criuFailed === undefined
          ? `restore vs criu restore: median of ${ROUNDS} alternating runs each (dormant, criu, dormant, criu, ...), apart from the one dormant restore in the restic and borg rows; dormant opens a fresh vault each time and restores into the staging folder (output removed after), criu runs \`criu restore -D <images> --shell-job -d\` and its process is killed and gone from /proc before the next run; dormant ${fmtRuns(dormantRuns)} MB/s, criu restore ${fmtRuns(criuRuns)} MB/s`
          : undefined;
      if (criuFailed !== undefined) {
        notes.push(
          `criu restore of the ${label} images failed here (after ${criuRuns.length} good runs), so there is no CRIU row: ${criuFailed}`,
        );
      }
      const d = figures.get('dormant')!;
      const rows: BenchRow[] = [];
      const MiB = 1024 * 1024;
      for (const peer of ['restic', 'borg']) {
        const p = figures.get(peer)!;
        rows.push(
          {
            name: `ingest ${label} checkpoint`,
            dormant: d.ingestMBps,
            peer: p.ingestMBps,
            peerName: peer,
            unit: 'MB/s',
            better: 'higher',
          },
          {
            name: `restore ${label} checkpoint`,
            dormant: d.restoreMBps,
            peer: p.restoreMBps,
            peerName: peer,
            unit: 'MB/s',
            better: 'higher',
          },
          {
            name: `stored size, ${label} checkpoint`,
            dormant: d.storedBytes / MiB,
            peer: p.storedBytes / MiB,
            peerName: peer,
            unit: 'MiB',
            better: 'lower',
          },
          {
            name: 'ingest 10 forks after the base',
            dormant: d.forksIngestMBps,
            peer: p.forksIngestMBps,
            peerName: peer,
            unit: 'MB/s',
            better: 'higher',
          },
          {
            name: 'stored size, base + 10 forks',
            dormant: d.forksStoredBytes / MiB,
            peer: p.forksStoredBytes / MiB,
            peerName: peer,
            unit: 'MiB',
            better: 'lower',
          },
        );
      }
      if (criuFailed === undefined && lazyFailed === undefined && lazyRunning.length > 0) {
        rows.push(
          {
            name: `lazy resume of the ${label} checkpoint from the vault: until the process runs, vs criu restore of the plain images`,
            dormant: median(lazyRunning) * 1000,
            peer: median(criuSeconds) * 1000,
            peerName: 'criu restore',
            unit: 'ms',
            better: 'lower',
          },
          {
            name: `lazy resume of the ${label} checkpoint from the vault: every page in, vs criu restore of the plain images`,
            dormant: bigBytes / MB / median(lazyPages),
            peer: median(criuRuns),
            peerName: 'criu restore',
            unit: 'MB/s',
            better: 'higher',
          },
          {
            name: `lazy resume of the ${label} checkpoint, every page in: pages from the vault vs the same page server reading the plain images`,
            dormant: bigBytes / MB / median(lazyPages),
            peer: bigBytes / MB / median(plainPages),
            peerName: 'plain images',
            unit: 'MB/s',
            better: 'higher',
          },
        );
        notes.push(
          `lazy resume rows: in each of the ${ROUNDS} rounds, after the criu run, a fresh vault is opened, the checkpoint's non-page images go to the staging folder (the lazy pages never do: writeEagerPages puts only the non-lazy ones there), a page server reads the rest from the vault, and \`criu restore --lazy-pages\` runs with \`criu lazy-pages --page-server\` (what dormant's resume does); "runs" is when criu restore returned, "every page in" when the lazy-pages daemon exited. Medians; runs: until running ${lazyRunning.map((x) => (x * 1000).toFixed(0)).join(', ')} ms, every page in ${lazyPages.map((x) => (bigBytes / MB / x).toFixed(0)).join(', ')} MB/s; with the page server reading the plain images from /dev/shm instead of the vault (same rounds, taking turns with the vault run at going first) ${plainPages.map((x) => (bigBytes / MB / x).toFixed(0)).join(', ')} MB/s. CRIU's lazy-pages daemon asks its page server for one 1 MiB piece at a time and waits for each before it copies it in and asks again, so "every page in" is the sum of every step, not the slowest: the vault's share is its decoding (on a decode worker, read ahead of the daemon), which on this 2-core machine also takes CPU from the daemon's copying. The lazy-pages daemon sends its closing message on a corked socket, which adds up to ~200 ms before it exits`,
        );
      }
      if (lazyFailed !== undefined)
        notes.push(`the lazy resume from the vault failed here, so there are no lazy rows: ${lazyFailed}`);
      if (criuFailed === undefined && decodeRuns.length > 0) {
        rows.push({
          name: `decode the ${label} checkpoint (every byte authenticated and decompressed into a reused buffer, as the page server reads it) vs criu restore of the plain images`,
          dormant: median(decodeRuns),
          peer: median(criuRuns),
          peerName: 'criu restore',
          unit: 'MB/s',
          better: 'higher',
        });
        notes.push(
          `decode row: in each round before the folder restore, a fresh vault is opened (index load included) and openCheckpoint reads every file of the checkpoint in order, 1 MiB at a time (CRIU's lazy-pages request size) into one reused buffer, with read-ahead on the decode workers: the vault's own restore speed, without the first touch of fresh memory that bounds a folder restore; runs ${fmtRuns(decodeRuns)} MB/s`,
        );
      }
      if (criuFailed === undefined) {
        rows.push({
          name: `restore ${label} checkpoint vs criu restore of it`,
          dormant: median(dormantRuns),
          peer: median(criuRuns),
          peerName: 'criu restore',
          unit: 'MB/s',
          better: 'higher',
        });
      }
      rows.push({
        name: 'base + 10 forks stored / base stored',
        dormant: d.forksStoredBytes / d.forksBaseBytes,
        peer: figures.get('restic')!.forksStoredBytes / figures.get('restic')!.forksBaseBytes,
        peerName: 'restic',
        unit: 'x',
        better: 'lower',
      });
      notes.push(
        `inputs: real CRIU dumps (criu dump --shell-job into /dev/shm) of a python process holding ${label} of mixed memory (1/4 random, 1/4 JSON-like text, 1/4 zeros, 1/4 pages with 64 random bytes each): ${(bigBytes / MiB).toFixed(0)} MiB of images; and of a base process with ${forkMiB} MiB (half random, half text) plus ten forks that each change one byte per MiB and allocate 256 KiB of their own: ${(familyBytes / MiB).toFixed(0)} MiB of images in all`,
        'repositories on the local disk, each tool with its own encryption: dormant (AES-256-GCM, zstd-1, master key file), restic 0.14 (RESTIC_PASSWORD, repository v2, compression auto), borg 1.2 (`borg init --encryption=repokey`, default lz4)',
        stagingKind === 'tmpfs-huge'
          ? "restores go into a tmpfs with huge=within_size (prepareStaging, as dormant's resume does), one output at a time, removed after; the images criu restores from are on /dev/shm"
          : "restores go into a plain folder on /dev/shm: prepareStaging could not mount its huge=within_size tmpfs here and fell back to 'folder' (dormant's resume would too); the images criu restores from are on /dev/shm",
        'throughput is logical bytes (size of the image folder) per second of wall time; dormant runs in one Node process (the calling thread plus seal workers on ingest, decode workers on restore; a restore opens a fresh vault, so it includes loading the index), restic and borg as commands',
        'every restore writes into fresh pages (tmpfs pages for the tools, process memory for criu restore); the first touch of guest memory that the host has not backed yet costs ~14 us per 4 KiB page in this VM, for every tool and for criu restore alike, so restore figures move a lot between runs with what memory the guest has touched before',
        ...(criuNote === undefined ? [] : [criuNote]),
        `restic and borg cut ~1-2 MiB chunks, so a fork that touches one byte per MiB of a shared heap changes nearly every chunk for them; dormant's 4-64 KiB content-defined chunks keep all but the touched ones`,
        `1-minute load average ${loadBefore.toFixed(1)} at the start and ${loadavg()[0]!.toFixed(1)} at the end${Math.max(loadBefore, loadavg()[0]!) > 2 ? ' (other work ran concurrently on this 2-core machine, so absolute figures are low; the ratios compare tools under the same load)' : ''}`,
      );
      return {
        title: 'Vault: ingest, restore and stored size against restic and borg',
        description: `One ${label} checkpoint and a base sandbox with ten forks, stored by dormant's vault, restic and borg in the same run.`,
        rows,
        notes,
      };
    } finally {
      await releaseStaging(staging);
      await rm(shm, { recursive: true, force: true });
      await rm(disk, { recursive: true, force: true });
    }
  },
};
