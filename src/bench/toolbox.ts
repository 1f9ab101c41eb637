/**
 * What the toolbox costs against `runc exec` on the host, into the same sandbox: one command
 * round trip (`true`) through the HTTP API and the in-sandbox agent, and 100 MiB written and
 * read through the files API against `runc exec ID cat` with the bytes piped in or out.
 */
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { chmod, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { cpus, loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { startDaemon, type Daemon } from '../daemon/daemon.js';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';
import type { BenchRow, BenchSuite } from './harness.js';
import { median, timed } from './harness.js';

/**
 * Runs `cmd`, stdin from `inputFile` (or none), stdout counted by `wc -c` and dropped; its byte
 * count. The bytes are read by processes of their own, as a client's would be, never by this
 * process's thread: that is the daemon's, and reading 100 MiB of curl's output there (as the
 * suite did up to 2026-12) charged the API's figures with the client's work.
 */
function run(cmd: string, args: string[], inputFile = '/dev/null'): Promise<number> {
  return new Promise((resolve, reject) => {
    const child = spawn(
      'bash',
      ['-c', '"$@" < "$IN" | wc -c; exit "${PIPESTATUS[0]}"', 'bash', cmd, ...args],
      {
        stdio: ['ignore', 'pipe', 'inherit'],
        env: { ...process.env, IN: inputFile },
      },
    );
    let out = '';
    child.stdout.on('data', (b: Buffer) => (out += b.toString()));
    child.on('error', reject);
    child.on('close', (code) =>
      code === 0 ? resolve(Number(out.trim())) : reject(new Error(`${cmd} exited ${code}`)),
    );
  });
}

async function api(d: Daemon, method: string, path: string, body?: Buffer | object): Promise<Response> {
  const raw = Buffer.isBuffer(body);
  const res = await fetch(`${d.url}${path}`, {
    method,
    headers: {
      authorization: `Bearer ${d.adminToken}`,
      ...(body !== undefined
        ? { 'content-type': raw ? 'application/octet-stream' : 'application/json' }
        : {}),
    },
    ...(body !== undefined ? { body: raw ? body : JSON.stringify(body) } : {}),
  });
  if (!res.ok) throw new Error(`${method} ${path}: HTTP ${res.status} ${await res.text()}`);
  return res;
}

export const toolboxSuite: BenchSuite = {
  name: 'toolbox',
  async run({ quick }) {
    const loadAtStart = loadavg()[0] ?? 0;
    const tmp = await mkdtemp(join(tmpdir(), 'dormant-bench-toolbox-'));
    // the sandbox's user namespace (host uid 100000) must reach the root filesystem below it
    await chmod(tmp, 0o711);
    const rootfs = join(tmp, 'rootfs');
    await buildBusyboxRootfs(rootfs);
    const dataDir = join(tmp, 'data');
    const d = await startDaemon({
      dataDir,
      listen: '127.0.0.1:0',
      policy: false,
      proxy: false,
      warn: () => undefined,
    });
    const root = join(dataDir, 'runtime', 'runc');
    const rounds = quick ? 20 : 100;
    const fileRounds = quick ? 3 : 5;
    const size = 100 * 1024 * 1024;
    try {
      const sb = await d.controller.get(
        (
          await d.controller.create({
            tenant: 'bench',
            admin: true,
            name: 'bench',
            rootfs,
            command: ['/bin/sh', '-c', 'while true; do sleep 1; done'],
            memoryBytes: 1024 * 1024 * 1024,
            diskBytes: 4 * size,
          })
        ).id,
      );
      const base = `/v1/sandboxes/${sb.id}`;
      // The agent starts on the first call: not part of a round trip.
      await (await api(d, 'POST', `${base}/commands`, { args: ['true'] })).text();
      const viaApi: number[] = [];
      const viaRunc: number[] = [];
      for (let i = 0; i < rounds; i++) {
        viaApi.push(
          await timed(async () => (await api(d, 'POST', `${base}/commands`, { args: ['true'] })).text()),
        );
        viaRunc.push(await timed(() => run('runc', ['--root', root, 'exec', sb.id, 'true'])));
      }
      // The transfers run in processes of their own (curl, runc), as a client's would: the
      // daemon's thread then does only the daemon's work. Both read the same cached file.
      const file = join(tmp, 'data.bin');
      await writeFile(file, randomBytes(size));
      const url = `${d.url}${base}/files`;
      const auth = ['-fsS', '-H', `authorization: Bearer ${d.adminToken}`];
      const put: number[] = [];
      const get: number[] = [];
      const runcIn: number[] = [];
      const runcOut: number[] = [];
      const exact = (n: number): void => {
        if (n !== size) throw new Error(`read ${n} bytes`);
      };
      for (let i = 0; i < fileRounds; i++) {
        put.push(
          await timed(() =>
            run('curl', [...auth, '-o', '/dev/null', '-T', file, `${url}?path=/tmp/api.bin`]),
          ),
        );
        get.push(await timed(async () => exact(await run('curl', [...auth, `${url}?path=/tmp/api.bin`]))));
        runcIn.push(
          await timed(() =>
            run('runc', ['--root', root, 'exec', sb.id, 'sh', '-c', 'cat > /tmp/runc.bin'], file),
          ),
        );
        runcOut.push(
          await timed(async () =>
            exact(await run('runc', ['--root', root, 'exec', sb.id, 'cat', '/tmp/runc.bin'])),
          ),
        );
      }
      const mibps = (ms: number): number => 100 / (ms / 1000);
      const rows: BenchRow[] = [
        {
          name: "command round trip ('true')",
          dormant: median(viaApi),
          peer: median(viaRunc),
          peerName: 'runc exec',
          unit: 'ms',
          better: 'lower',
        },
        {
          name: 'write 100 MiB into the sandbox',
          dormant: mibps(median(put)),
          peer: mibps(median(runcIn)),
          peerName: 'runc exec cat >',
          unit: 'MiB/s',
          better: 'higher',
        },
        {
          name: 'read 100 MiB out of the sandbox',
          dormant: mibps(median(get)),
          peer: mibps(median(runcOut)),
          peerName: 'runc exec cat',
          unit: 'MiB/s',
          better: 'higher',
        },
      ];
      return {
        title: 'Toolbox: commands and files through the in-sandbox agent',
        description: `One busybox sandbox; dormant's figure goes through the HTTP API (loopback) and the sandbox's toolbox agent (POST /v1/sandboxes/ID/commands, PUT and GET /v1/sandboxes/ID/files), the peer's is \`runc exec\` on the host into the same sandbox. The files go through curl (\`PUT -T\`, \`GET\`) and through \`runc exec ID sh -c 'cat > F'\` and \`runc exec ID cat F\`, each a process of its own reading the same cached file (runc's stdin is the file itself), and what they read out is counted by a \`wc -c\` of its own, as a client's would be: this process, the daemon's, does only the daemon's work. ${rounds} command rounds and ${fileRounds} file rounds, alternated; medians.`,
        rows,
        notes: [
          `Load average at the start: ${loadAtStart.toFixed(1)} on ${String(cpus().length)} cores.`,
          'The API figures include the HTTP request and the JSON/ndjson framing; the runc ones do not pay for authentication or the wake check.',
        ],
      };
    } finally {
      for (const s of await d.controller.list()) await d.controller.remove(s.id).catch(() => undefined);
      await d.close();
      await rm(tmp, { recursive: true, force: true });
    }
  },
};
