/**
 * A sandbox from a template against a plain create of the same workload, each until it
 * answers: a python HTTP server (the host's python, bound read-only as /usr) that imports a
 * few modules and then listens, reached through its address on the sandbox network. Timed
 * through the HTTP API (the API's own answer, and until the server answers) and through the
 * CLI (`dormant create --template`, a process of its own as a person runs it). The template
 * path's steps come from the controller's timer.
 */
import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import { chmod, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { loadavg, tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { startDaemon, type Daemon } from '../daemon/daemon.js';
import type { OperationTimings } from '../domain/timings.js';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';
import { httpGet } from '../api/testing/host.js';
import { pythonServer } from '../api/testing/servers.js';
import type { BenchRow, BenchSuite } from './harness.js';
import { median } from './harness.js';

const BIN = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'bin', 'dormant');

/** An app that does some work before it listens (imports, a table built), as a real one does. */
const APP_PY = pythonServer({
  setup: `import os, json, email.parser, http.client, urllib.request, hashlib
token = os.urandom(8).hex()
table = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(200000)]`,
  answer: '"%d %s" % (count, token)',
});

async function api(
  d: Daemon,
  method: string,
  path: string,
  body?: object,
): Promise<{ id: string; address: string }> {
  const res = await fetch(`${d.url}${path}`, {
    method,
    headers: {
      authorization: `Bearer ${d.adminToken}`,
      ...(body !== undefined ? { 'content-type': 'application/json' } : {}),
    },
    ...(body !== undefined ? { body: JSON.stringify(body) } : {}),
  });
  if (!res.ok) throw new Error(`${method} ${path}: HTTP ${res.status} ${await res.text()}`);
  return res.status === 204
    ? { id: '', address: '' }
    : ((await res.json()) as { id: string; address: string });
}

/** Milliseconds from `t0` until the server at `address` answers (polled every millisecond). */
async function untilAnswers(address: string, t0: number): Promise<number> {
  for (;;) {
    try {
      await httpGet(address, 8080, '/', 1000);
      return performance.now() - t0;
    } catch {
      if (performance.now() - t0 > 60_000) throw new Error(`${address} did not answer in 60 s`);
      await new Promise((r) => setTimeout(r, 1));
    }
  }
}

export const templateSuite: BenchSuite = {
  name: 'template',
  async run({ quick }) {
    const loadAtStart = loadavg()[0] ?? 0;
    const tmp = await mkdtemp(join(tmpdir(), 'dormant-bench-template-'));
    // Searchable by the sandboxes' user namespace (the default), as a data folder's parents must be.
    await chmod(tmp, 0o711);
    const rootfs = join(tmp, 'rootfs');
    await buildBusyboxRootfs(rootfs);
    await writeFile(join(rootfs, 'srv', 'app.py'), APP_PY);
    const timings: OperationTimings[] = [];
    const d = await startDaemon({
      dataDir: join(tmp, 'data'),
      listen: '127.0.0.1:0',
      policy: false,
      proxy: false,
      readonlyBinds: [{ source: '/usr', destination: '/usr' }],
      warn: () => undefined,
      onTimings: (t) => timings.push(t),
    });
    const spec = { rootfs, command: ['/usr/bin/python3', '/srv/app.py'], ports: [8080], memory: '256M' };
    const rounds = quick ? 5 : 15;
    const cliRounds = quick ? 3 : 7;
    const plainApi: number[] = [];
    const plainReady: number[] = [];
    const tplApi: number[] = [];
    const tplReady: number[] = [];
    const cliReady: number[] = [];
    const cliOnly: number[] = [];
    const env = { ...process.env, DORMANT_URL: d.url, DORMANT_TOKEN: d.adminToken, NO_COLOR: '1' };
    try {
      await api(d, 'POST', '/v1/templates', { name: 'app', ...spec, ready: { port: 8080, timeout: '60s' } });
      const one = async (body: object, apiMs: number[], readyMs: number[]): Promise<void> => {
        const t0 = performance.now();
        const s = await api(d, 'POST', '/v1/sandboxes', body);
        apiMs.push(performance.now() - t0);
        readyMs.push(await untilAnswers(s.address, t0));
        await api(d, 'DELETE', `/v1/sandboxes/${s.id}`);
      };
      // Alternated, so the machine's drift falls on both.
      for (let i = 0; i < rounds; i++) {
        await one(spec, plainApi, plainReady);
        await one({ template: 'app' }, tplApi, tplReady);
      }
      for (let i = 0; i < cliRounds; i++) {
        const t0 = performance.now();
        // Not spawnSync: the daemon runs in this process and must answer the CLI meanwhile.
        const r = await promisify(execFile)(
          process.execPath,
          [BIN, 'create', '--template', 'app', '--json'],
          {
            env,
          },
        );
        const cliMs = performance.now() - t0;
        const s = JSON.parse(r.stdout) as { id: string; address: string };
        cliOnly.push(cliMs);
        cliReady.push(await untilAnswers(s.address, t0));
        await api(d, 'DELETE', `/v1/sandboxes/${s.id}`);
      }
    } finally {
      await d.close();
      await rm(tmp, { recursive: true, force: true });
    }
    // The median of each step of the template path (ms), in the order they ran.
    const steps = new Map<string, number[]>();
    for (const t of timings.filter((x) => x.op === 'template' && x.sandboxId.startsWith('sb-')))
      for (const s of t.steps) steps.set(s.step, [...(steps.get(s.step) ?? []), s.ms]);
    const stepLine = [...steps].map(([k, v]) => `${k} ${median(v).toFixed(1)}`).join(', ');
    const rows: BenchRow[] = [
      {
        name: 'create until the server answers (API)',
        dormant: median(tplReady),
        peer: median(plainReady),
        peerName: 'plain create',
        unit: 'ms',
        better: 'lower',
      },
      {
        name: "create: the API's answer",
        dormant: median(tplApi),
        peer: median(plainApi),
        peerName: 'plain create',
        unit: 'ms',
        better: 'lower',
      },
      {
        name: '`dormant create --template` (the CLI process)',
        dormant: median(cliOnly),
        unit: 'ms',
        better: 'lower',
      },
      {
        name: '`dormant create --template` until the server answers',
        dormant: median(cliReady),
        unit: 'ms',
        better: 'lower',
      },
    ];
    return {
      title: 'Templates',
      description: `median of ${rounds} alternated rounds: a sandbox from a template (a python HTTP server that imports modules and builds a table before it listens, checkpointed once listening) and a plain create of the same, each timed to the API's answer and until the server answers through its address; then ${cliRounds} runs of \`dormant create --template\`; goals: template until answering at most 0.5x of the plain create's, under 300 ms through the API`,
      rows,
      notes: [
        `template path steps (median ms): ${stepLine}`,
        `load average ${loadAtStart.toFixed(1)} at the start (2 cores: figures move with it)`,
      ],
    };
  },
};
