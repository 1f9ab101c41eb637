/**
 * What a person waits for at the prompt: `dormant --version` and `dormant ls` (against a
 * daemon on loopback with a few sandboxes' worth of nothing: an empty list, so the figure is
 * start-up and one request), each against `node -e ''` (the floor any Node CLI pays) run
 * alternately in the same rounds so the machine's drift falls on both. Then what the CLI adds
 * to a hibernate and a resume of a small sandbox: `dormant hibernate` against the same call
 * made to the API from this process, alternated.
 */
import { spawn } from 'node:child_process';
import { chmod, mkdtemp, rm } from 'node:fs/promises';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';
import { loadavg, tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { startDaemon } from '../daemon/daemon.js';
import type { BenchRow, BenchSuite } from './harness.js';
import { median } from './harness.js';

const BIN = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'bin', 'dormant');

/** Runs a command to its end; not spawnSync: the daemon answering it lives in this process. */
async function timedRun(args: string[], env: NodeJS.ProcessEnv): Promise<number> {
  const t = performance.now();
  const child = spawn(process.execPath, args, { env, stdio: ['ignore', 'ignore', 'pipe'] });
  let stderr = '';
  child.stderr.setEncoding('utf8');
  child.stderr.on('data', (d: string) => (stderr += d));
  const code = await new Promise<number | null>((resolve, reject) => {
    child.once('error', reject);
    child.once('close', resolve);
  });
  const ms = performance.now() - t;
  if (code !== 0) throw new Error(`bench cli: ${args.join(' ')} exited ${code}: ${stderr}`);
  return ms;
}

export const cliSuite: BenchSuite = {
  name: 'cli',
  async run({ quick }) {
    const loadAtStart = loadavg()[0] ?? 0;
    const dir = await mkdtemp(join(tmpdir(), 'dormant-bench-cli-'));
    // Searchable by the sandboxes' user namespace (the default), as a data folder's parents must be.
    await chmod(dir, 0o711);
    const rootfs = join(dir, 'rootfs');
    await buildBusyboxRootfs(rootfs);
    const daemon = await startDaemon({
      dataDir: join(dir, 'data'),
      listen: '127.0.0.1:0',
      policy: false,
      proxy: false,
      warn: () => undefined,
    });
    const env = { ...process.env, DORMANT_URL: daemon.url, DORMANT_TOKEN: daemon.adminToken, NO_COLOR: '1' };
    const t: Record<string, number[]> = { node: [], version: [], ls: [] };
    const ops: Record<'hibernate' | 'resume', { api: number[]; cli: number[] }> = {
      hibernate: { api: [], cli: [] },
      resume: { api: [], cli: [] },
    };
    const rounds = quick ? 9 : 25;
    const opRounds = quick ? 3 : 7;
    const call = async (method: string, path: string, body?: object): Promise<{ id: string }> => {
      const res = await fetch(`${daemon.url}${path}`, {
        method,
        headers: {
          authorization: `Bearer ${daemon.adminToken}`,
          ...(body ? { 'content-type': 'application/json' } : {}),
        },
        ...(body ? { body: JSON.stringify(body) } : {}),
      });
      const text = await res.text();
      if (!res.ok) throw new Error(`bench cli: ${method} ${path}: HTTP ${res.status} ${text}`);
      return (text ? JSON.parse(text) : {}) as { id: string };
    };
    /** One lifecycle call through the API, from this process (its fetch warm): the API's own time. */
    const api = async (op: string, id: string): Promise<number> => {
      const t0 = performance.now();
      await call('POST', `/v1/sandboxes/${id}/${op}`);
      return performance.now() - t0;
    };
    try {
      for (let i = 0; i < rounds; i++) {
        t.node!.push(await timedRun(['-e', ''], env));
        t.version!.push(await timedRun([BIN, '--version'], env));
        t.ls!.push(await timedRun([BIN, 'ls'], env));
      }
      const sb = await call('POST', '/v1/sandboxes', {
        rootfs,
        command: ['/bin/sh', '-c', 'while true; do sleep 1; done'],
        memory: '64M',
      });
      // Each operation after the same pause: a hibernate right after a (lazy) resume waits for
      // the pages still coming in, which would charge whichever side ran second.
      const settled = async <T>(fn: () => Promise<T>): Promise<T> => {
        await new Promise((r) => setTimeout(r, 1000));
        return fn();
      };
      for (let i = 0; i < opRounds; i++) {
        ops.hibernate.api.push(await settled(() => api('hibernate', sb.id)));
        ops.resume.api.push(await settled(() => api('resume', sb.id)));
        ops.hibernate.cli.push(await settled(() => timedRun([BIN, 'hibernate', sb.id], env)));
        ops.resume.cli.push(await settled(() => timedRun([BIN, 'resume', sb.id], env)));
      }
      await call('DELETE', `/v1/sandboxes/${sb.id}`);
    } finally {
      await daemon.close();
      await rm(dir, { recursive: true, force: true });
    }
    const floor = median(t.node!);
    const rows: BenchRow[] = [
      {
        name: 'dormant --version',
        dormant: median(t.version!),
        peer: floor,
        peerName: "node -e ''",
        unit: 'ms',
        better: 'lower',
      },
      {
        name: 'dormant ls (one request)',
        dormant: median(t.ls!),
        peer: floor,
        peerName: "node -e ''",
        unit: 'ms',
        better: 'lower',
      },
      ...(['hibernate', 'resume'] as const).map((op): BenchRow => ({
        name: `dormant ${op} (a small sandbox)`,
        dormant: median(ops[op].cli),
        peer: median(ops[op].api),
        peerName: `POST /v1/sandboxes/ID/${op}`,
        unit: 'ms',
        better: 'lower',
      })),
    ];
    const added = (op: 'hibernate' | 'resume'): string =>
      `${op} ${Math.round(median(ops[op].cli) - median(ops[op].api))} ms`;
    return {
      title: 'CLI start-up',
      description: `median of ${rounds} alternated runs each of \`node -e ''\`, \`dormant --version\` and \`dormant ls\` (a daemon on loopback, empty list); goals: --version at most 1.5x and ls at most 2.0x of node's own start`,
      rows,
      notes: [
        `load average ${loadAtStart.toFixed(1)} at the start (2 cores: figures move with it)`,
        `what the CLI adds to the API's time (medians of ${opRounds} alternated runs, a busybox shell loop of 64 MiB limit): ${added('hibernate')}, ${added('resume')} (goal: at most 150 ms)`,
      ],
    };
  },
};
