/**
 * The vault on S3 against the vault on local disk: hibernate and resume of a 256 MiB sandbox
 * on a daemon whose vault is a bucket on a loopback S3 server (Ceph's radosgw with its SQLite
 * dbstore backend, the server the S3 tests run), alternated round by round with the same on a
 * daemon with the local vault. Then a resume after the S3 node's pack cache is emptied: what
 * a resume on another node pays, reading every pack from the bucket.
 */
import { readFileSync } from 'node:fs';
import { mkdtemp, readdir, rm } from 'node:fs/promises';
import { loadavg } from 'node:os';
import { join } from 'node:path';
import type { Daemon } from '../daemon/daemon.js';
import type { OperationTimings } from '../domain/timings.js';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';
import { rgwVault, startTestDaemon, stopTestDaemon } from '../api/testing/daemon.js';
import { eventually, httpGet } from '../api/testing/host.js';
import { pythonServer } from '../api/testing/servers.js';
import { run } from '../sys/exec.js';
import { S3Store } from '../vault/index.js';
import { RADOSGW, rgwMissing, startRgw, type TestRgw } from '../vault/testing/rgw.js';
import type { BenchRow, BenchSuite } from './harness.js';
import { median, stepMedians } from './harness.js';

const MIB = 256;
/** The kernel's clock ticks per second (USER_HZ), as /proc reports CPU times in. */
const TICKS_PER_S = 100;

/**
 * Holds MIB MiB of random bytes (nothing for zstd or dedup to save). GET /refill writes new
 * random bytes over all of it, so every hibernate uploads the whole 256 MiB again rather than
 * finding it in the vault; every GET answers the SHA-256 of the memory, which reads every
 * page: the check that a resume brought it all back, and the moment the last lazy page is in.
 */
export const HOLDER = pythonServer({
  setup: `
import os, sys, hashlib
mib = int(sys.argv[1])
blob = bytearray(mib << 20)
def refill():
    for i in range(mib):
        blob[i << 20:(i + 1) << 20] = os.urandom(1 << 20)
refill()
def digest(path):
    if path == "/refill":
        refill()
    return hashlib.sha256(blob).hexdigest()`,
  answer: 'digest(self.path)',
});

/** The holder's digest, after `path` (waits for it to answer: up to 2 minutes). */
export const digestOf = (host: string, path = '/'): Promise<string> =>
  eventually('holder', () => httpGet(host, 8080, path, 60_000), 120_000);

/** S3 requests of one kind: how many, bytes sent and received, and their summed wall time. */
interface RequestTally {
  count: number;
  sentBytes: number;
  receivedBytes: number;
  ms: number;
}

/**
 * Counts the S3 store's requests by command (PutObject, GetObject, HeadObject, ...) with a
 * middleware on its client. A GET's time is to its response headers: the body streams after.
 */
function countRequests(store: S3Store): Map<string, RequestTally> {
  const tally = new Map<string, RequestTally>();
  store.client.middlewareStack.add(
    (next, context) => async (args) => {
      const t0 = performance.now();
      const name = (context as { commandName?: string }).commandName ?? 'unknown';
      const t = tally.get(name) ?? { count: 0, sentBytes: 0, receivedBytes: 0, ms: 0 };
      tally.set(name, t);
      t.count++;
      const body = (args.input as { Body?: unknown }).Body;
      if (body instanceof Uint8Array) t.sentBytes += body.length;
      try {
        const out = await next(args);
        const len = (out.output as { ContentLength?: number }).ContentLength;
        if (name === 'GetObjectCommand' && typeof len === 'number') t.receivedBytes += len;
        return out;
      } finally {
        t.ms += performance.now() - t0;
      }
    },
    { step: 'initialize', name: 'dormantBenchCount' },
  );
  return tally;
}

/** A copy of the tallies, to subtract from later ones. */
const snapshot = (m: Map<string, RequestTally>): Map<string, RequestTally> =>
  new Map([...m].map(([k, v]) => [k, { ...v }]));

/** What `after` added to `before`, per command. */
function delta(
  before: Map<string, RequestTally>,
  after: Map<string, RequestTally>,
): Map<string, RequestTally> {
  const d = new Map<string, RequestTally>();
  for (const [k, a] of after) {
    const b = before.get(k) ?? { count: 0, sentBytes: 0, receivedBytes: 0, ms: 0 };
    if (a.count === b.count) continue;
    d.set(k, {
      count: a.count - b.count,
      sentBytes: a.sentBytes - b.sentBytes,
      receivedBytes: a.receivedBytes - b.receivedBytes,
      ms: a.ms - b.ms,
    });
  }
  return d;
}

/** `PutObject 18 (256 MiB up, 2950 ms), HeadObject 3 (12 ms)` per operation, averaged over `n`. */
function requestLine(d: Map<string, RequestTally>, n: number): string {
  const mib = (b: number): string => `${(b / n / 1024 ** 2).toFixed(1)} MiB`;
  return [...d]
    .sort((a, b) => b[1].ms - a[1].ms)
    .map(([k, t]) => {
      const bytes = [
        t.sentBytes ? `${mib(t.sentBytes)} up` : '',
        t.receivedBytes ? `${mib(t.receivedBytes)} down` : '',
      ]
        .filter(Boolean)
        .join(', ');
      return `${k.replace(/Command$/, '')} ${(t.count / n).toFixed(1)} (${bytes ? `${bytes}, ` : ''}${Math.round(t.ms / n)} ms)`;
    })
    .join(', ');
}

/** CPU time (user + system) of process `pid` so far, in ms; 0 when it cannot be read. */
function cpuMsOf(pid: number | undefined): number {
  if (pid === undefined) return 0;
  try {
    // Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
    const f = readFileSync(`/proc/${pid}/stat`, 'utf8').split(') ')[1]!.split(' ');
    return ((Number(f[11]) + Number(f[12])) * 1000) / TICKS_PER_S;
  } catch {
    return 0;
  }
}

/** This process's CPU time so far (the daemons, their seal workers), in ms. */
function ownCpuMs(): number {
  const u = process.cpuUsage();
  return (u.user + u.system) / 1000;
}

/** Empties a pack cache folder (the daemon notices missing files and fetches from the bucket). */
async function clearCache(dir: string): Promise<void> {
  for (const e of await readdir(dir).catch(() => [] as string[]))
    await rm(join(dir, e), { recursive: true, force: true });
}

type Side = 'local' | 's3';
type Op = 'hibernate' | 'resume' | 'cold';

export const s3Suite: BenchSuite = {
  name: 's3',
  async run({ quick }) {
    const title = 'S3 vault against the local vault';
    const missing = await rgwMissing();
    if (missing !== undefined)
      return { title, description: 'not run', rows: [], notes: [`not run: ${missing}`] };
    const rgwVersion = (await run(RADOSGW, ['--version'], { timeoutMs: 20_000 })).stdout
      .replace(/\(\w+\).*$/s, '')
      .trim();
    const loadAtStart = loadavg()[0] ?? 0;
    const rounds = quick ? 3 : 5;
    const dir = await mkdtemp('/tmp/dormant-bench-s3-');
    const ms: Record<Side, Record<Op, number[]>> = {
      local: { hibernate: [], resume: [], cold: [] },
      s3: { hibernate: [], resume: [], cold: [] },
    };
    /** Until the resume call returned (processes running, lazy pages still arriving). */
    const callMs: Record<Side, Record<Op, number[]>> = {
      local: { hibernate: [], resume: [], cold: [] },
      s3: { hibernate: [], resume: [], cold: [] },
    };
    /** CPU ms of this process (the daemon) and of radosgw during each timed operation. */
    const cpu: Record<Side, Record<Op, { own: number[]; rgw: number[] }>> = {
      local: { hibernate: { own: [], rgw: [] }, resume: { own: [], rgw: [] }, cold: { own: [], rgw: [] } },
      s3: { hibernate: { own: [], rgw: [] }, resume: { own: [], rgw: [] }, cold: { own: [], rgw: [] } },
    };
    const steps: Record<Side, Record<Op, OperationTimings[]>> = {
      local: { hibernate: [], resume: [], cold: [] },
      s3: { hibernate: [], resume: [], cold: [] },
    };
    const requests = {} as Record<Op, Map<string, RequestTally>>;
    let rgw: TestRgw | undefined;
    const daemons: Partial<Record<Side, Daemon>> = {};
    const stored: string[] = [];
    try {
      rgw = await startRgw({ bucket: 'dormant-bench' });
      const rootfs = join(dir, 'rootfs');
      await buildBusyboxRootfs(rootfs, { 'srv/holder.py': HOLDER });
      daemons.local = (await startTestDaemon({ dataDir: join(dir, 'local') })).daemon;
      daemons.s3 = (
        await startTestDaemon({
          dataDir: join(dir, 's3'),
          vault: rgwVault(rgw, 'bench'),
        })
      ).daemon;
      const store = daemons.s3.vault.store;
      if (!(store instanceof S3Store)) throw new Error('bench s3: the daemon did not open an S3 vault');
      const tally = countRequests(store);
      const cacheDir = join(dir, 's3', 'vault', 'cache');

      const sides: Side[] = ['local', 's3'];
      const sb = {} as Record<Side, { id: string; host: string; digest: string }>;
      for (const side of sides) {
        const d = daemons[side]!;
        const s = await d.controller.create({
          tenant: 'bench',
          // The operator's own bench: its rootfs is a host folder no tenant may name.
          admin: true,
          rootfs,
          command: ['/usr/bin/python3', '/srv/holder.py', String(MIB)],
          ports: [{ port: 8080, public: false }],
          memoryBytes: (MIB + 512) * 1024 * 1024,
        });
        sb[side] = { id: s.id, host: s.address!, digest: await digestOf(s.address!) };
      }

      // Every operation after the same pause, as the cli suite does: what one side left
      // behind (pages still arriving, writes being flushed) must not fall on the other.
      const settled = async <T>(fn: () => Promise<T>): Promise<T> => {
        await new Promise((r) => setTimeout(r, 1000));
        return fn();
      };
      const hibernate = async (side: Side, op: Op | undefined): Promise<void> => {
        const d = daemons[side]!;
        const before = snapshot(tally);
        const [own0, rgw0] = [ownCpuMs(), cpuMsOf(rgw?.pid())];
        const t0 = performance.now();
        await d.controller.hibernate(sb[side].id);
        const took = performance.now() - t0;
        if (op === undefined) return;
        ms[side][op].push(took);
        cpu[side][op].own.push(ownCpuMs() - own0);
        cpu[side][op].rgw.push(cpuMsOf(rgw?.pid()) - rgw0);
        const t = d.controller.lastTimings(sb[side].id, 'hibernate');
        if (t) steps[side][op].push(t);
        if (side === 's3') addRequests(op, delta(before, tally));
      };
      /** Timed until the holder answers its digest: every page read back and checked. */
      const resume = async (side: Side, op: Op): Promise<void> => {
        const d = daemons[side]!;
        const before = snapshot(tally);
        const [own0, rgw0] = [ownCpuMs(), cpuMsOf(rgw?.pid())];
        const t0 = performance.now();
        await d.controller.resume(sb[side].id);
        callMs[side][op].push(performance.now() - t0);
        const digest = await digestOf(sb[side].host);
        ms[side][op].push(performance.now() - t0);
        cpu[side][op].own.push(ownCpuMs() - own0);
        cpu[side][op].rgw.push(cpuMsOf(rgw?.pid()) - rgw0);
        if (digest !== sb[side].digest)
          throw new Error(
            `bench s3: the ${side} sandbox's memory changed across a resume (digest ${digest})`,
          );
        const t = d.controller.lastTimings(sb[side].id, 'resume');
        if (t) steps[side][op].push(t);
        if (side === 's3') addRequests(op, delta(before, tally));
      };
      const addRequests = (op: Op, d: Map<string, RequestTally>): void => {
        const m = (requests[op] ??= new Map());
        for (const [k, v] of d) {
          const t = m.get(k) ?? { count: 0, sentBytes: 0, receivedBytes: 0, ms: 0 };
          m.set(k, {
            count: t.count + v.count,
            sentBytes: t.sentBytes + v.sentBytes,
            receivedBytes: t.receivedBytes + v.receivedBytes,
            ms: t.ms + v.ms,
          });
        }
      };

      for (let i = 0; i < rounds; i++) {
        process.stderr.write(`bench: s3 round ${i + 1}/${rounds}\n`);
        // New random memory on both: each hibernate uploads all 256 MiB.
        for (const side of sides) sb[side].digest = await digestOf(sb[side].host, '/refill');
        for (const side of sides) await settled(() => hibernate(side, 'hibernate'));
        for (const side of sides) await settled(() => resume(side, 'resume'));
        // The same checkpoint again (nothing new to upload), then a resume with the S3 node's
        // pack cache empty: every pack comes from the bucket, as on a node that never had it.
        for (const side of sides) await settled(() => hibernate(side, undefined));
        await clearCache(cacheDir);
        for (const side of sides) await settled(() => resume(side, 'cold'));
      }
      for (const side of sides) {
        // The last fresh one (the other holds nothing new): the most stored.
        const ck = (await daemons[side]!.store.listCheckpoints({ sandboxId: sb[side].id })).sort(
          (a, b) => b.storedBytes - a.storedBytes,
        )[0];
        if (ck)
          stored.push(
            `${side}: ${(ck.logicalBytes / 1024 ** 2).toFixed(0)} MiB logical, ${(ck.storedBytes / 1024 ** 2).toFixed(0)} MiB stored`,
          );
      }
    } finally {
      for (const side of ['local', 's3'] as const) await stopTestDaemon(daemons[side]).catch(() => undefined);
      await rgw?.stop().catch(() => undefined);
      await rm(dir, { recursive: true, force: true });
    }

    const row = (name: string, op: Op): BenchRow => ({
      name,
      dormant: Math.round(median(ms.s3[op])),
      peer: Math.round(median(ms.local[op])),
      peerName: 'local vault',
      unit: 'ms',
      better: 'lower',
    });
    const rows = [
      row(`hibernate, ${MIB} MiB of new random memory`, 'hibernate'),
      row(`resume, ${MIB} MiB, until its memory's digest answers`, 'resume'),
      row(`resume with the pack cache emptied (another node), ${MIB} MiB`, 'cold'),
    ];
    const ratio = (r: BenchRow): string => `${r.name.split(',')[0]} ${(r.dormant / r.peer!).toFixed(2)}x`;
    const round = (xs: number[]): string => xs.map((x) => Math.round(x)).join(', ');
    const notes = [
      `load average ${loadAtStart.toFixed(1)} at the start (2 cores, shared with other work: figures move with it); ${rounds} rounds, medians`,
      `S3 time as a multiple of the local vault's (goal: at most 1.3x): ${rows.map(ratio).join('; ')}`,
      `the S3 server is ${rgwVersion} (radosgw) with its SQLite dbstore backend on loopback (src/vault/testing/rgw.ts). It gets ranged GETs and multipart uploads wrong, so the daemon's store works around both (docs/VAULT.md): one PUT per object instead of up to 4 parts at once, whole-object GETs instead of ranged ones, a new connection per request. The figures are that fallback's, on a server that shares the 2 cores with the daemon and the sandbox`,
      `every round: new random memory in both sandboxes, then hibernate local, hibernate S3, resume local, resume S3, hibernate both again (nothing new), empty the S3 node's pack cache (<dataDir>/vault/cache), resume local, resume S3; each operation after a 1 s pause. A resume is timed until the sandbox answers the SHA-256 of all its memory, the same digest as before the hibernate (checked every time)`,
      `until the resume call returned (processes running, lazy pages behind), medians: resume local ${Math.round(median(callMs.local.resume))} / S3 ${Math.round(median(callMs.s3.resume))} ms; cold local ${Math.round(median(callMs.local.cold))} / S3 ${Math.round(median(callMs.s3.cold))} ms`,
      `CPU during each operation, medians (ms; the daemon is this process with its seal workers, CRIU and the sandbox not counted): ${(['hibernate', 'resume', 'cold'] as const).map((op) => `${op} daemon local ${Math.round(median(cpu.local[op].own))} / S3 ${Math.round(median(cpu.s3[op].own))}, radosgw ${Math.round(median(cpu.s3[op].rgw))}`).join('; ')}`,
      `raw times (ms): hibernate local ${round(ms.local.hibernate)} / S3 ${round(ms.s3.hibernate)}; resume local ${round(ms.local.resume)} / S3 ${round(ms.s3.resume)}; cold local ${round(ms.local.cold)} / S3 ${round(ms.s3.cold)}`,
      ...(stored.length ? [`a fresh checkpoint: ${stored.join('; ')}`] : []),
      ...(['hibernate', 'resume', 'cold'] as const).flatMap((op) => [
        `${op} steps, median ms: local ${stepMedians(steps.local[op])}; S3 ${stepMedians(steps.s3[op])}`,
        ...(requests[op]
          ? [`${op} S3 requests per operation (summed time to headers): ${requestLine(requests[op], rounds)}`]
          : []),
      ]),
    ];
    return {
      title,
      description: `One sandbox per daemon running a python server that holds ${MIB} MiB of random bytes; one daemon keeps its vault on local disk (the peer), the other in a bucket on a loopback S3 server (\`vault.url\` s3://BUCKET/PREFIX, the default 2 GiB pack cache). dormant column: the S3 vault. Goal: S3 at most 1.3x the local time (dormant vs peer at least 0.77x).`,
      rows,
      notes,
    };
  },
};
