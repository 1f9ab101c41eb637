/**
 * `dormant serve --config FILE` end to end: the real binary, runc and the policy loop, started
 * from a configuration file. The file's per-tenant policy default pauses one tenant's idle
 * sandbox and leaves another tenant's running; its allowed source root lets a tenant token name
 * a rootfs; a flag (`--no-proxy`) wins over the file's proxy.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, type ChildProcess } from 'node:child_process';
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';
import { DormantApiError, DormantClient } from '../sdk/client.js';
import { eventually } from '../api/testing/host.js';

const BIN = fileURLToPath(new URL('../../bin/dormant', import.meta.url));

describe('dormant serve --config', () => {
  let dir: string;
  let daemon: ChildProcess | undefined;
  let stderr = '';
  let admin: DormantClient;

  before(async () => {
    dir = await mkdtemp('/tmp/dormant-serve-config-');
    const images = join(dir, 'images');
    await buildBusyboxRootfs(join(images, 'rootfs'));
    const config = join(dir, 'config.json');
    await writeFile(
      config,
      JSON.stringify({
        listen: '127.0.0.1:0',
        dataDir: 'data', // relative to the file's folder
        proxy: { enabled: true, listen: '127.0.0.1:0' },
        policy: { interval: '200ms', tenants: { acme: { pauseAfter: '1s' } } },
        sandbox: { allowedSourceRoots: ['images'] },
      }),
    );
    // Only the file and the flag: none of the caller's DORMANT_* variables.
    const env = Object.fromEntries(Object.entries(process.env).filter(([k]) => !k.startsWith('DORMANT_')));
    const child = spawn(process.execPath, [BIN, 'serve', '--config', config, '--no-proxy'], {
      env,
      stdio: ['ignore', 'ignore', 'pipe'],
    });
    daemon = child;
    child.stderr.setEncoding('utf8');
    child.stderr.on('data', (d: string) => (stderr += d));
    const url = await eventually(
      'the daemon serving',
      () => {
        const m = /serving on (http:\/\/\S+)/.exec(stderr);
        if (!m) {
          if (child.exitCode !== null) throw new Error(`exited ${child.exitCode}: ${stderr}`);
          return Promise.reject(new Error(stderr));
        }
        return Promise.resolve(m[1]!);
      },
      60_000,
    );
    assert.match(stderr, new RegExp(`configuration from ${config}`));
    const token = (await readFile(join(dir, 'data', 'admin-token'), 'utf8')).trim();
    admin = new DormantClient({ url, token });
  });

  after(async () => {
    if (admin) {
      for (const s of await admin.listSandboxes().catch(() => []))
        await admin.remove(s.id).catch(() => undefined);
    }
    if (daemon && daemon.exitCode === null) {
      const exited = new Promise((r) => daemon!.once('exit', r));
      daemon.kill('SIGTERM');
      await exited;
    }
    await rm(dir, { recursive: true, force: true });
  });

  test("the file's per-tenant policy default applies to that tenant only", async () => {
    const rootfs = join(dir, 'images', 'rootfs');
    const make = async (tenant: string): Promise<{ client: DormantClient; id: string }> => {
      const t = await admin.createToken({ tenant });
      const client = new DormantClient({ url: admin.url, token: t.token });
      // A tenant token names a host path only under the file's allowed source root.
      const sb = await client.createSandbox({ rootfs, command: ['sleep', '1000'], memory: '64M' });
      return { client, id: sb.id };
    };
    const acme = await make('acme');
    const other = await make('other');
    await eventually(
      'acme paused by its tenant default (pause after 1 s idle)',
      async () => {
        const s = await acme.client.getSandbox(acme.id);
        assert.equal(s.state, 'paused');
      },
      30_000,
    );
    const s = await other.client.getSandbox(other.id);
    assert.equal(s.state, 'running', 'the node default hibernates after 15 min only');
  });

  test("the log is one JSON object a line, and an operation's line carries its request's id", async () => {
    const [s] = await admin.listSandboxes();
    const token = (await readFile(join(dir, 'data', 'admin-token'), 'utf8')).trim();
    const res = await fetch(`${admin.url}/v1/sandboxes/${s!.id}/hibernate`, {
      method: 'POST',
      headers: { authorization: `Bearer ${token}` },
    });
    assert.equal(res.status, 200, await res.text());
    const reqId = res.headers.get('x-request-id');
    assert.match(reqId ?? '', /^[0-9a-f]{12}$/, 'the answer names its request id');
    const lines = (): Record<string, unknown>[] =>
      stderr
        .split('\n')
        .filter((l) => l !== '')
        .map((l) => {
          try {
            return JSON.parse(l) as Record<string, unknown>;
          } catch {
            assert.fail(`a log line that is not JSON: ${l}`);
          }
        });
    const line = await eventually(
      "the hibernate's line",
      () => {
        const l = lines().find((x) => x.op === 'hibernate' && x.sandbox === s!.id);
        return l ? Promise.resolve(l) : Promise.reject(new Error(stderr.slice(-2000)));
      },
      30_000,
    );
    assert.equal(line.reqId, reqId, 'the line made deep in the controller names the request');
    assert.equal(line.ok, true);
    for (const l of lines()) {
      assert.equal(typeof l.level, 'number');
      assert.equal(typeof l.time, 'number');
      assert.equal(typeof l.msg, 'string');
    }
    assert.doesNotMatch(stderr, /DeprecationWarning|FSTDEP/, 'no deprecation noise');
  });

  test('a flag wins over the file: --no-proxy', async () => {
    const [s] = await admin.listSandboxes();
    await assert.rejects(
      admin.sandboxUrl(s!.id, 8080),
      (e: unknown) => e instanceof DormantApiError && e.code === 'PROXY_DISABLED',
    );
  });
});
