/**
 * `dormant serve --config FILE` end to end: the real binary, runc and the policy loop, started
 * from a configuration file. The file's per-tenant policy default pauses one tenant's idle
 * sandbox and leaves another tenant's running; its allowed source root lets a tenant token name
 * a rootfs; a flag (`--no-proxy`) wins over the file's proxy.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, type ChildProcess } from 'node:child_process';
import { chmod, mkdtemp, readFile, readdir, rename, rm, stat, writeFile } from 'node:fs/promises';
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
    // Searchable by others: sandboxes' mapped roots walk through it (user namespaces).
    await chmod(dir, 0o711);
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

/**
 * SIGHUP and the log file: a real `dormant serve --config` whose log goes to its own file
 * (0600, rotated by size, two old files kept). A tenant's policy default added to the file and
 * a SIGHUP: the next sandbox of that tenant is paused by it; an invalid file is refused (the
 * error names file and key) and the daemon keeps serving on the configuration it had.
 */
describe('dormant serve: SIGHUP reload and --log-file', () => {
  let dir: string;
  let config: string;
  let logPath: string;
  let daemon: ChildProcess | undefined;
  let stderr = '';
  let admin: DormantClient;
  const base = {
    listen: '127.0.0.1:0',
    dataDir: 'data',
    proxy: { enabled: false },
    policy: { interval: '200ms' },
    sandbox: { allowedSourceRoots: ['images'] },
    // Every request logged, so the test can make the log grow past its limit.
    log: true,
    logFile: 'log/dormant.log',
    logMaxSize: '32K',
    logKeep: 2,
  };

  /** The log file's lines so far, each parsed (a line that is not JSON fails the test). */
  const logLines = async (): Promise<Record<string, unknown>[]> =>
    (await readFile(logPath, 'utf8').catch(() => ''))
      .split('\n')
      .filter((l) => l !== '')
      .map((l) => {
        try {
          return JSON.parse(l) as Record<string, unknown>;
        } catch {
          return assert.fail(`a log line that is not JSON: ${l}`);
        }
      });
  const logLine = (what: string, match: (l: Record<string, unknown>) => boolean) =>
    eventually(
      what,
      async () => {
        const l = (await logLines()).find(match);
        return l ?? Promise.reject(new Error((await readFile(logPath, 'utf8').catch(() => '')).slice(-1500)));
      },
      30_000,
    );
  const hangup = () => {
    assert.ok(daemon && daemon.exitCode === null, `the daemon runs: ${stderr}`);
    daemon.kill('SIGHUP');
  };

  before(async () => {
    dir = await mkdtemp('/tmp/dormant-serve-reload-');
    // Searchable by others: sandboxes' mapped roots walk through it (user namespaces).
    await chmod(dir, 0o711);
    await buildBusyboxRootfs(join(dir, 'images', 'rootfs'));
    config = join(dir, 'config.json');
    logPath = join(dir, 'log', 'dormant.log');
    await writeFile(config, JSON.stringify(base));
    const env = Object.fromEntries(Object.entries(process.env).filter(([k]) => !k.startsWith('DORMANT_')));
    const child = spawn(process.execPath, [BIN, 'serve', '--config', config], {
      env,
      stdio: ['ignore', 'ignore', 'pipe'],
    });
    daemon = child;
    child.stderr.setEncoding('utf8');
    child.stderr.on('data', (d: string) => (stderr += d));
    const serving = await eventually(
      'the daemon serving (said in its log file)',
      async () => {
        if (child.exitCode !== null) throw new Error(`exited ${child.exitCode}: ${stderr}`);
        const l = (await logLines()).find((x) => /^serving on /.test(String(x.msg)));
        return l ?? Promise.reject(new Error('not yet'));
      },
      60_000,
    );
    const token = (await readFile(join(dir, 'data', 'admin-token'), 'utf8')).trim();
    admin = new DormantClient({ url: String(serving.url), token });
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

  test('the log goes to its file, 0600, and not to stderr', async () => {
    assert.equal((await stat(logPath)).mode & 0o777, 0o600);
    assert.doesNotMatch(stderr, /serving on/);
  });

  test("a tenant's policy default added to the file applies after SIGHUP; a restart-only key is named", async () => {
    const t = await admin.createToken({ tenant: 'acme' });
    const acme = new DormantClient({ url: admin.url, token: t.token });
    const make = () =>
      acme.createSandbox({
        rootfs: join(dir, 'images', 'rootfs'),
        command: ['sleep', '1000'],
        memory: '64M',
      });
    const before = await make();
    // Under the node's default (hibernate after 15 min) it stays running.
    await new Promise((r) => setTimeout(r, 1500));
    assert.equal((await acme.getSandbox(before.id)).state, 'running');

    await writeFile(
      config,
      JSON.stringify({
        ...base,
        policy: { interval: '200ms', tenants: { acme: { pauseAfter: '1s' } } },
        checkpoint: { timeout: '5m' },
      }),
    );
    hangup();
    await logLine(
      'the live change logged',
      (l) => l.key === 'policy.tenants.acme.pauseAfter' && l.to === '1s' && l.level === 30,
    );
    await logLine('the restart-only change named', (l) => l.key === 'checkpoint.timeout' && l.level === 40);
    const after = await make();
    await eventually(
      "the new sandbox paused by its tenant's new default",
      async () => assert.equal((await acme.getSandbox(after.id)).state, 'paused'),
      30_000,
    );
  });

  test('an invalid file is refused, naming file and key, and the daemon keeps serving as it was', async () => {
    await writeFile(
      config,
      JSON.stringify({ ...base, policy: { interval: '200ms', tenants: { acme: { pauseAfter: 'soon' } } } }),
    );
    hangup();
    const err = await logLine('the refusal', (l) => l.level === 50 && /not reloaded/.test(String(l.msg)));
    assert.match(String(err.msg), new RegExp(`${config}: policy\\.tenants\\.acme\\.pauseAfter`));
    assert.equal(daemon!.exitCode, null, 'still running');
    assert.equal((await admin.health()).ok, true);
    // The policy in force is still the last good one: acme's next sandbox is paused too.
    const t = await admin.createToken({ tenant: 'acme' });
    const acme = new DormantClient({ url: admin.url, token: t.token });
    const sb = await acme.createSandbox({
      rootfs: join(dir, 'images', 'rootfs'),
      command: ['sleep', '1000'],
      memory: '64M',
    });
    await eventually(
      'paused by the kept default',
      async () => assert.equal((await acme.getSandbox(sb.id)).state, 'paused'),
      30_000,
    );
  });

  test('the log file rotates past its size with two old ones kept; SIGHUP reopens it after an outside move', async () => {
    // Each request is two lines of a few hundred bytes: enough for several rotations.
    for (let i = 0; i < 400; i++) await admin.health();
    const names = (await readdir(join(dir, 'log'))).sort();
    assert.deepEqual(names, ['dormant.log', 'dormant.log.1', 'dormant.log.2']);
    for (const n of names) {
      const s = await stat(join(dir, 'log', n));
      assert.equal(s.mode & 0o777, 0o600, `${n} private`);
      assert.ok(s.size <= 32 * 1024, `${n} within its limit (${s.size})`);
      for (const l of (await readFile(join(dir, 'log', n), 'utf8')).split('\n').filter((x) => x !== ''))
        JSON.parse(l);
    }
    // logrotate's way: the file moved aside, then SIGHUP; new lines start a new file.
    await rename(logPath, `${logPath}.moved`);
    await writeFile(config, JSON.stringify(base)); // valid again
    hangup();
    await logLine('the reload, in a new file', (l) => /configuration reloaded/.test(String(l.msg)));
    assert.equal((await logLines())[0]?.msg, 'SIGHUP: reloading the configuration', 'a new file');
    assert.match(
      await readFile(`${logPath}.moved`, 'utf8'),
      /\/v1\/health/,
      'the old lines stay where they were moved',
    );
  });
});

describe('user namespaces are the default', () => {
  test('a data folder below one that others cannot search is refused at start, naming it and what to do', async () => {
    const { startDaemon, stagingDirFor } = await import('./daemon.js');
    const dir = await mkdtemp('/tmp/dormant-serve-userns-'); // 0700
    try {
      const opts = { listen: '127.0.0.1:0', proxy: false, policy: false, warn: () => undefined } as const;
      await assert.rejects(
        startDaemon({ ...opts, dataDir: join(dir, 'data') }),
        (e: Error & { hint?: string }) => {
          assert.match(e.message, new RegExp(`${dir} is not searchable by others`));
          assert.match(e.hint ?? '', /o\+x.*--no-user-namespace/);
          return true;
        },
      );
      await assert.rejects(stat(stagingDirFor(join(dir, 'data'))), 'no staging made (nor left mounted)');
      // Without user namespaces the same folder serves.
      const d = await startDaemon({ ...opts, dataDir: join(dir, 'data'), userNamespace: false });
      await d.close();
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});
