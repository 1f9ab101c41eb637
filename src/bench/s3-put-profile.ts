/**
 * Where the S3 vault's hibernate spends its CPU: one `putCheckpoint` of 256 MiB of random bytes
 * (what a hibernate's `vault put` step does), into a fresh vault on local disk and into a fresh
 * vault in a bucket on the test radosgw (the daemon's store: checkServer, the default pack
 * cache and part size), each in a child process of its own under `node --cpu-prof`. Prints the
 * CPU each child used during the put (process.cpuUsage: its seal workers included), radosgw's,
 * and the profile's self time per function and per file, so the two can be compared.
 *
 * With `--phase get`, the same for a cold read instead: the checkpoint is put by a child that is
 * not profiled, then a second child opens the vault with an empty pack cache (a node that never
 * had the packs) and restores the checkpoint into a tmpfs folder (what a resume's `vault fetch`
 * step does), under `--cpu-prof`; it also counts the S3 requests it made.
 *
 *   node dist/bench/s3-put-profile.js [--phase put|get] [--mib 256] [--rounds 2] [--out DIR (default /tmp/dormant-s3-put-profile)]
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
  /** put: store `src`; get: restore what a put child stored into `dest`. */
  phase: 'put' | 'get';
  src: string;
  dest: string;
  /** The master key, hex: the get child opens what the put child stored. */
  key: string;
  vaultDir: string;
  rgw?: { endpoint: string; bucket: string; accessKeyId: string; secretAccessKey: string; prefix: string };
}

interface ChildResult {
  wallMs: number;
  userMs: number;
  systemMs: number;
  storedBytes: number;
  minorFaults: number;
  /** get: S3 requests by command, and the bytes the GETs received. */
  requests?: Record<string, number>;
  receivedBytes?: number;
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
      // The get child's cache is a folder of its own, empty: every pack comes from the bucket.
      cache: { dir: join(cfg.vaultDir, `cache-${cfg.phase}`), maxBytes: DEFAULTS.vault.cacheBytes },
      partSizeBytes: DEFAULTS.vault.partSizeBytes,
    });
    await s3.checkServer();
    store = s3;
  }
  const requests: Record<string, number> = {};
  let receivedBytes = 0;
  s3?.client.middlewareStack.add(
    (next, context) => async (args) => {
      const name = ((context as { commandName?: string }).commandName ?? 'unknown').replace(/Command$/, '');
      requests[name] = (requests[name] ?? 0) + 1;
      const out = await next(args);
      const len = (out.output as { ContentLength?: number }).ContentLength;
      if (name === 'GetObject' && typeof len === 'number') receivedBytes += len;
      return out;
    },
    { step: 'initialize', name: 'dormantProfileCount' },
  );
  const vault = await openVault({
    dir: cfg.vaultDir,
    masterKey: { key: Buffer.from(cfg.key, 'hex') },
    onWarning: () => undefined,
    ...(store ? { store } : {}),
  });
  const f0 = process.resourceUsage().minorPageFault;
  const c0 = process.cpuUsage();
  const t0 = performance.now();
  let storedBytes = 0;
  if (cfg.phase === 'put') {
    const put = await vault.putCheckpoint({
      tenant: 't',
      sandboxId: 'sb',
      checkpointId: 'ck',
      srcDir: cfg.src,
    });
    storedBytes = put.storedBytes;
  } else {
    await vault.restoreCheckpoint({ tenant: 't', checkpointId: 'ck', destDir: cfg.dest });
  }
  const wallMs = performance.now() - t0;
  const c = process.cpuUsage(c0);
  const minorFaults = process.resourceUsage().minorPageFault - f0;
  await vault.close();
  s3?.destroy();
  const out: ChildResult = {
    wallMs,
    userMs: c.user / 1000,
    systemMs: c.system / 1000,
    storedBytes,
    minorFaults,
    ...(cfg.phase === 'get' ? { requests, receivedBytes } : {}),
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
      phase: { type: 'string', default: 'put' },
      mib: { type: 'string', default: '256' },
      rounds: { type: 'string', default: '2' },
      out: { type: 'string' },
    },
  });
  const phase = values.phase === 'get' ? 'get' : 'put';
  const key = randomBytes(32).toString('hex');
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
          phase: 'put',
          src,
          dest: join(root, `dest-${mode}-${round}`),
          key,
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
        const run = async (c: ChildConfig, profiled: boolean): Promise<{ r: ChildResult; rgwMs: number }> => {
          const g0 = await cpuMsOf(rgw.pid());
          const child = spawn(
            process.execPath,
            [
              ...(profiled ? ['--cpu-prof', `--cpu-prof-dir=${profDir}`] : []),
              fileURLToPath(import.meta.url),
              '--child',
              JSON.stringify(c),
            ],
            { stdio: ['ignore', 'pipe', 'inherit'] },
          );
          let text = '';
          child.stdout.on('data', (d: Buffer) => (text += d.toString()));
          const [code] = (await once(child, 'exit')) as [number | null];
          if (code !== 0) throw new Error(`child ${mode} ${c.phase} exited ${code}`);
          const rgwMs = (await cpuMsOf(rgw.pid())) - g0;
          return { r: JSON.parse(text.trim().split('\n').pop()!) as ChildResult, rgwMs };
        };
        const put = await run(cfg, phase === 'put');
        const { r, rgwMs } = phase === 'put' ? put : await run({ ...cfg, phase: 'get' }, true);
        results[mode]!.push({ r, rgwMs });
        const requests = r.requests
          ? `; requests ${Object.entries(r.requests)
              .map(([k, v]) => `${k} ${v}`)
              .join(', ')}, ${((r.receivedBytes ?? 0) / MiB).toFixed(1)} MiB received`
          : '';
        console.log(
          `${mode} round ${round}: ${phase} ${r.wallMs.toFixed(0)} ms wall, CPU user ${r.userMs.toFixed(0)} + system ${r.systemMs.toFixed(0)} = ${(r.userMs + r.systemMs).toFixed(0)} ms, radosgw ${rgwMs.toFixed(0)} ms (whole child), stored ${(put.r.storedBytes / MiB).toFixed(1)} MiB, ${r.minorFaults} minor page faults${requests}`,
        );
        await rm(cfg.dest, { recursive: true, force: true });
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
