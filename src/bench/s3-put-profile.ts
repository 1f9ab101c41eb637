/**
 * Where the S3 vault's hibernate spends its CPU: one `putCheckpoint` of 256 MiB of random bytes
 * (what a hibernate's `vault put` step does), into a fresh vault on local disk and into a fresh
 * vault in a bucket on the test radosgw (the daemon's store: checkServer, the default pack
 * cache and part size), each in a child process of its own under `node --cpu-prof`. Prints the
 * CPU each child used during the put (process.cpuUsage: its seal workers included), radosgw's,
 * and the profile's self time per function and per file, so the two can be compared.
 *
 *   node dist/bench/s3-put-profile.js [--mib 256] [--rounds 2] [--out DIR (default /tmp/dormant-s3-put-profile)]
 *
 * Not part of `npm run bench`: a tool for reading profiles by hand (docs/BENCHMARKS.md,
 * "S3 vault: profile verdict").
 */
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { once } from 'node:events';
import { mkdir, mkdtemp, readFile, readdir, rm, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { DEFAULTS } from '../daemon/defaults.js';
import { openVault, S3Store, type VaultStore } from '../vault/index.js';
import { startRgw } from '../vault/testing/rgw.js';

const MiB = 1024 * 1024;
/** The kernel's clock ticks per second (USER_HZ), as /proc reports CPU times in. */
const TICKS_PER_S = 100;

interface ChildConfig {
  mode: 'local' | 's3';
  src: string;
  vaultDir: string;
  rgw?: { endpoint: string; bucket: string; accessKeyId: string; secretAccessKey: string; prefix: string };
}

interface ChildResult {
  wallMs: number;
  userMs: number;
  systemMs: number;
  storedBytes: number;
  minorFaults: number;
}

async function child(cfg: ChildConfig): Promise<void> {
  let store: VaultStore | undefined;
  let s3: S3Store | undefined;
  if (cfg.mode === 's3') {
    const r = cfg.rgw!;
    s3 = new S3Store({
      bucket: r.bucket,
      prefix: r.prefix,
      endpoint: r.endpoint,
      credentials: { accessKeyId: r.accessKeyId, secretAccessKey: r.secretAccessKey },
      lockDir: join(cfg.vaultDir, 'locks'),
      cache: { dir: join(cfg.vaultDir, 'cache'), maxBytes: DEFAULTS.vault.cacheBytes },
      partSizeBytes: DEFAULTS.vault.partSizeBytes,
    });
    await s3.checkServer();
    store = s3;
  }
  const vault = await openVault({
    dir: cfg.vaultDir,
    masterKey: { key: randomBytes(32) },
    onWarning: () => undefined,
    ...(store ? { store } : {}),
  });
  const f0 = process.resourceUsage().minorPageFault;
  const c0 = process.cpuUsage();
  const t0 = performance.now();
  const put = await vault.putCheckpoint({
    tenant: 't',
    sandboxId: 'sb',
    checkpointId: 'ck',
    srcDir: cfg.src,
  });
  const wallMs = performance.now() - t0;
  const c = process.cpuUsage(c0);
  const minorFaults = process.resourceUsage().minorPageFault - f0;
  await vault.close();
  s3?.destroy();
  const out: ChildResult = {
    wallMs,
    userMs: c.user / 1000,
    systemMs: c.system / 1000,
    storedBytes: put.storedBytes,
    minorFaults,
  };
  process.stdout.write(`${JSON.stringify(out)}\n`);
}

/** utime + stime of `pid`, in ms. */
async function cpuMsOf(pid: number | undefined): Promise<number> {
  if (pid === undefined) return 0;
  const stat = await readFile(`/proc/${pid}/stat`, 'utf8');
  const f = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
  return ((Number(f[11]) + Number(f[12])) * 1000) / TICKS_PER_S;
}

interface ProfileNode {
  id: number;
  callFrame: { functionName: string; url: string; lineNumber: number };
  hitCount?: number;
}

/** Self time (ms) per function and per file over every .cpuprofile in `dir` (all threads). */
async function selfTimes(
  dir: string,
): Promise<{ fn: Map<string, number>; file: Map<string, number>; total: number }> {
  const fn = new Map<string, number>();
  const file = new Map<string, number>();
  let total = 0;
  for (const f of await readdir(dir)) {
    if (!f.endsWith('.cpuprofile')) continue;
    const p = JSON.parse(await readFile(join(dir, f), 'utf8')) as {
      nodes: ProfileNode[];
      samples: number[];
      timeDeltas: number[];
    };
    const byId = new Map(p.nodes.map((n) => [n.id, n]));
    for (let i = 0; i < p.samples.length; i++) {
      const n = byId.get(p.samples[i]!)!;
      const ms = (p.timeDeltas[i + 1] ?? 0) / 1000;
      const { functionName, url, lineNumber } = n.callFrame;
      if (
        functionName === '(idle)' ||
        functionName === '(program)' ||
        functionName === '(garbage collector)'
      ) {
        if (functionName !== '(idle)') {
          fn.set(functionName, (fn.get(functionName) ?? 0) + ms);
          total += ms;
        }
        continue;
      }
      const where = url.replace(/^.*node_modules\//, '').replace(/^file:\/\/.*\/dist\//, 'dist/');
      const k = `${functionName || '(anonymous)'} ${where}:${lineNumber + 1}`;
      fn.set(k, (fn.get(k) ?? 0) + ms);
      const fk = where.startsWith('@') ? where.split('/').slice(0, 2).join('/') : where || '(native)';
      file.set(fk, (file.get(fk) ?? 0) + ms);
      total += ms;
    }
  }
  return { fn, file, total };
}

const top = (m: Map<string, number>, n: number): string =>
  [...m]
    .sort((a, b) => b[1] - a[1])
    .slice(0, n)
    .map(([k, v]) => `    ${v.toFixed(0).padStart(6)} ms  ${k}`)
    .join('\n');

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      mib: { type: 'string', default: '256' },
      rounds: { type: 'string', default: '2' },
      out: { type: 'string' },
    },
  });
  const mib = Number(values.mib);
  const rounds = Number(values.rounds);
  const root = await mkdtemp('/dev/shm/dormant-s3prof-');
  const out = values.out ?? '/tmp/dormant-s3-put-profile';
  await rm(out, { recursive: true, force: true });
  const rgw = await startRgw({ bucket: 'dormant-prof' });
  try {
    const src = join(root, 'src');
    await mkdir(src);
    for (let i = 0; i < mib; i += 64)
      await writeFile(join(src, `pages-${i}.img`), randomBytes(Math.min(64, mib - i) * MiB));
    await writeFile(join(src, 'core.img'), randomBytes(300_000));
    const results: Record<string, { r: ChildResult; rgwMs: number }[]> = { local: [], s3: [] };
    for (let round = 0; round < rounds; round++) {
      for (const mode of ['local', 's3'] as const) {
        const vaultDir = join(root, `vault-${mode}-${round}`);
        const profDir = join(out, `${mode}-${round}`);
        await mkdir(profDir, { recursive: true });
        const cfg: ChildConfig = {
          mode,
          src,
          vaultDir,
          ...(mode === 's3'
            ? {
                rgw: {
                  endpoint: rgw.endpoint,
                  bucket: rgw.bucket,
                  accessKeyId: rgw.accessKeyId,
                  secretAccessKey: rgw.secretAccessKey,
                  prefix: `r${round}`,
                },
              }
            : {}),
        };
        const g0 = await cpuMsOf(rgw.pid());
        const c = spawn(
          process.execPath,
          [
            '--cpu-prof',
            `--cpu-prof-dir=${profDir}`,
            fileURLToPath(import.meta.url),
            '--child',
            JSON.stringify(cfg),
          ],
          { stdio: ['ignore', 'pipe', 'inherit'] },
        );
        let text = '';
        c.stdout.on('data', (d: Buffer) => (text += d.toString()));
        const [code] = (await once(c, 'exit')) as [number | null];
        if (code !== 0) throw new Error(`child ${mode} exited ${code}`);
        const rgwMs = (await cpuMsOf(rgw.pid())) - g0;
        const r = JSON.parse(text.trim().split('\n').pop()!) as ChildResult;
        results[mode]!.push({ r, rgwMs });
        console.log(
          `${mode} round ${round}: put ${r.wallMs.toFixed(0)} ms wall, CPU user ${r.userMs.toFixed(0)} + system ${r.systemMs.toFixed(0)} = ${(r.userMs + r.systemMs).toFixed(0)} ms, radosgw ${rgwMs.toFixed(0)} ms (whole child), stored ${(r.storedBytes / MiB).toFixed(1)} MiB, ${r.minorFaults} minor page faults`,
        );
        await rm(vaultDir, { recursive: true, force: true });
      }
    }
    for (const mode of ['local', 's3']) {
      const s = await selfTimes(join(out, `${mode}-${rounds - 1}`));
      console.log(
        `\n${mode}, last round's profiles (all threads), ${s.total.toFixed(0)} ms sampled; by file:`,
      );
      console.log(top(s.file, 15));
      console.log('  by function:');
      console.log(top(s.fn, 30));
    }
    console.log(`\nprofiles in ${out}`);
  } finally {
    await rgw.stop();
    await rm(root, { recursive: true, force: true });
  }
}

const i = process.argv.indexOf('--child');
if (i >= 0) await child(JSON.parse(process.argv[i + 1]!) as ChildConfig);
else await main();
