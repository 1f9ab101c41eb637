/**
 * What E2B's protocol costs over dormant's own: the same command (`true`, run the way E2B's
 * SDK runs every command: `/bin/bash -l -c true`) through the E2B front with E2B's own SDK
 * (`sandbox.commands.run('true')`: a Connect server stream) and through dormant's API
 * (POST /v1/sandboxes/ID/commands: an ndjson stream), alternated, into the same sandbox; and a
 * small file read both ways.
 */
import { chmod, mkdtemp, rm, symlink } from 'node:fs/promises';
import { cpus, loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { startDaemon } from '../daemon/daemon.js';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';
import { loadE2bSdk } from '../api/e2b/testing/sdk.js';
import { newE2bKey } from '../api/e2b/front.js';
import { hashToken } from '../api/auth.js';
import type { BenchRow, BenchSuite } from './harness.js';
import { median, timed } from './harness.js';

export const e2bSuite: BenchSuite = {
  name: 'e2b',
  async run({ quick }) {
    const { Sandbox } = await loadE2bSdk();
    const loadAtStart = loadavg()[0] ?? 0;
    const tmp = await mkdtemp(join(tmpdir(), 'dormant-bench-e2b-'));
    // Searchable by the sandboxes' user namespace (the default), as a data folder's parents must be.
    await chmod(tmp, 0o711);
    const rootfs = join(tmp, 'rootfs');
    await buildBusyboxRootfs(rootfs);
    await rm(join(rootfs, 'bin', 'bash'), { force: true });
    await symlink('/usr/bin/bash', join(rootfs, 'bin', 'bash'));
    const d = await startDaemon({
      dataDir: join(tmp, 'data'),
      listen: '127.0.0.1:0',
      policy: false,
      proxy: false,
      readonlyBinds: [{ source: '/usr', destination: '/usr' }],
      e2b: { listen: '127.0.0.1:0', templates: { base: { rootfs } } },
      warn: () => undefined,
    });
    const saved = { ...process.env };
    const rounds = quick ? 20 : 100;
    try {
      const key = newE2bKey();
      await d.store.insertToken({
        hash: hashToken(key),
        tenant: 'bench',
        admin: false,
        createdAt: Date.now(),
      });
      process.env.E2B_API_URL = d.e2b!.url;
      process.env.E2B_SANDBOX_URL = d.e2b!.url;
      process.env.E2B_API_KEY = key;
      const sandbox = await Sandbox.create('base');
      const headers = { authorization: `Bearer ${d.adminToken}`, 'content-type': 'application/json' };
      const base = `${d.url}/v1/sandboxes/${sandbox.sandboxId}`;
      const viaApi = async (): Promise<void> => {
        const res = await fetch(`${base}/commands`, {
          method: 'POST',
          headers,
          body: JSON.stringify({ args: ['/bin/bash', '-l', '-c', 'true'] }),
        });
        if (!(await res.text()).includes('"exitCode":0')) throw new Error('the command failed');
      };
      await sandbox.files.write('/tmp/small.txt', 'x'.repeat(4096));
      const readApi = async (): Promise<void> => {
        const res = await fetch(`${base}/files?path=/tmp/small.txt`, { headers });
        if ((await res.text()).length !== 4096) throw new Error('short read');
      };
      // The agent starts on the first call: not part of a round trip.
      await sandbox.commands.run('true');
      await viaApi();
      const e2bRun: number[] = [];
      const apiRun: number[] = [];
      const e2bRead: number[] = [];
      const apiRead: number[] = [];
      for (let i = 0; i < rounds; i++) {
        e2bRun.push(await timed(() => sandbox.commands.run('true')));
        apiRun.push(await timed(viaApi));
        e2bRead.push(await timed(() => sandbox.files.read('/tmp/small.txt')));
        apiRead.push(await timed(readApi));
      }
      await sandbox.kill();
      const rows: BenchRow[] = [
        {
          name: "commands.run('true') round trip",
          dormant: median(e2bRun),
          peer: median(apiRun),
          peerName: "dormant's API",
          unit: 'ms',
          better: 'lower',
        },
        {
          name: 'files.read of 4 KiB',
          dormant: median(e2bRead),
          peer: median(apiRead),
          peerName: "dormant's API",
          unit: 'ms',
          better: 'lower',
        },
      ];
      return {
        title: "The E2B front: E2B's SDK against dormant's own API",
        description: `One busybox sandbox (bash from the host's /usr). dormant's figure is E2B's own SDK (the \`e2b\` package) through the E2B front (envd's Connect protocol, loopback), the peer's is dormant's HTTP API with fetch, the same command (\`/bin/bash -l -c true\`, as E2B runs every command) and the same file. ${rounds} rounds, alternated; medians. Goal: the E2B figure at most 1.2x the API's.`,
        rows,
        notes: [
          `Load average at the start: ${loadAtStart.toFixed(1)} on ${String(cpus().length)} cores.`,
          "Both go through the same toolbox operation and the same in-sandbox agent; the difference is the protocol and the client (E2B's SDK parses every message with protobuf-es).",
        ],
      };
    } finally {
      process.env = saved;
      for (const s of await d.controller.list()) await d.controller.remove(s.id).catch(() => undefined);
      await d.close();
      await rm(tmp, { recursive: true, force: true });
    }
  },
};
