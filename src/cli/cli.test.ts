/**
 * The CLI through the real binary against a real daemon: tokens (create, ls, revoke) with
 * their JSON shapes and exit codes, errors with a code and a hint, the people's table, the
 * dashboard address, and the progress line of a hibernate and a resume (phase from the
 * event stream, then the checkpoint's sizes).
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { Daemon } from '../daemon/daemon.js';
import { DormantClient, type SandboxInfo, type TokenInfo } from '../sdk/client.js';
import { withProgress } from './progress.js';
import { startTestDaemon, tearDown, testFolder } from '../api/testing/daemon.js';

const BIN = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'bin', 'dormant');

describe('the CLI', () => {
  let dir: string;
  let rootfs: string;
  let daemon: Daemon;
  let sb: SandboxInfo;

  const dormant = (
    args: string[],
    token = daemon.adminToken,
  ): Promise<{ code: number; stdout: string; stderr: string }> =>
    new Promise((resolve) => {
      execFile(
        process.execPath,
        [BIN, ...args],
        {
          env: { ...process.env, DORMANT_URL: daemon.url, DORMANT_TOKEN: token, NO_COLOR: '1' },
          timeout: 120_000,
        },
        (err, stdout, stderr) => {
          const code = err ? (typeof err.code === 'number' ? err.code : -1) : 0;
          resolve({ code, stdout, stderr });
        },
      );
    });

  before(async () => {
    ({ dir, rootfs } = await testFolder('cli'));
    ({ daemon } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      readonlyBinds: [],
      policy: false,
    }));
  });

  after(() => tearDown(dir, daemon));

  test('token create / ls / revoke: JSON shapes, the token printed once, refused after revoke', async () => {
    const created = await dormant(['token', 'create', '--tenant', 'acme', '--json']);
    assert.equal(created.code, 0, created.stderr);
    const t = JSON.parse(created.stdout) as TokenInfo & { token: string };
    assert.match(t.token, /^dmt_/);
    assert.match(t.id, /^[0-9a-f]{12}$/);
    assert.equal(t.tenant, 'acme');

    const plain = await dormant(['token', 'create', '--tenant', 'acme']);
    assert.match(plain.stdout, /^dmt_\S+\n$/, 'people get just the token on stdout (for $(...))');

    const ls = await dormant(['token', 'ls', '--json']);
    const list = JSON.parse(ls.stdout) as TokenInfo[];
    assert.deepEqual(
      list.map((x) => x.tenant),
      ['default', 'acme', 'acme'],
    );
    assert.ok(!ls.stdout.includes(t.token));
    const table = await dormant(['token', 'ls']);
    assert.match(table.stdout, new RegExp(`${t.id}.*acme`));

    // A tenant's token may not mint tokens: exit 1, code and hint.
    const forbidden = await dormant(['token', 'create', '--tenant', 'other'], t.token);
    assert.equal(forbidden.code, 1);
    assert.match(forbidden.stderr, /FORBIDDEN: creating a token needs an admin token/);
    assert.match(forbidden.stderr, /hint: /);
    const forbiddenJson = await dormant(['token', 'create', '--tenant', 'other', '--json'], t.token);
    assert.equal(forbiddenJson.code, 1);
    assert.equal((JSON.parse(forbiddenJson.stdout) as { error: { code: string } }).error.code, 'FORBIDDEN');

    const revoked = await dormant(['token', 'revoke', t.id, '--json']);
    assert.equal(revoked.code, 0, revoked.stderr);
    assert.ok((JSON.parse(revoked.stdout) as TokenInfo).revokedAt);
    const refused = await dormant(['ls'], t.token);
    assert.equal(refused.code, 1);
    assert.match(refused.stderr, /UNAUTHORIZED: this API token was revoked/);

    const usage = await dormant(['token', 'create']);
    assert.equal(usage.code, 2, 'a missing --tenant is a usage error');
  });

  test('create, the ls table, and the dashboard address', async () => {
    const c = await dormant([
      'create',
      '--name',
      'cli-test',
      '--rootfs',
      rootfs,
      '--memory',
      '64M',
      '--json',
      '--',
      'sh',
      '-c',
      'while true; do sleep 1; done',
    ]);
    assert.equal(c.code, 0, c.stderr);
    sb = JSON.parse(c.stdout) as SandboxInfo;
    assert.equal(sb.state, 'running');
    const ls = await dormant(['ls']);
    assert.match(ls.stdout, new RegExp(`${sb.id}.*cli-test.*running`));
    assert.equal((await dormant(['ls', '-q', '--state', 'running'])).stdout, `${sb.id}\n`, 'ls -q: ids only');
    const d = await dormant(['dashboard', '--json']);
    assert.equal(d.code, 0, d.stderr);
    const url = (JSON.parse(d.stdout) as { url: string }).url;
    assert.equal(url, `${daemon.url}/#token=${encodeURIComponent(daemon.adminToken)}`);
    const missing = await dormant(['hibernate', 'no-such-sandbox']);
    assert.equal(missing.code, 1);
    assert.match(missing.stderr, /SANDBOX_NOT_FOUND/);
  });

  test('progress: the phase from the event stream, then the time and the checkpoint sizes', async () => {
    const ANSI_COLOUR = new RegExp(`${String.fromCharCode(27)}\\[[0-9;]*m`, 'g');
    const client = new DormantClient({ url: daemon.url, token: daemon.adminToken });
    // Colours are on where CI is set (picocolors): keep the text without them.
    let drawn = '';
    const stream = {
      isTTY: true,
      write: (s: string) => ((drawn += s.replace(ANSI_COLOUR, '')), true),
    } as unknown as NodeJS.WriteStream;
    const h = await withProgress(
      `hibernate ${sb.name}`,
      false,
      () => client.hibernate(sb.id),
      { client, sandbox: sb.name },
      { stream },
    );
    assert.equal(h.state, 'hibernated');
    assert.match(drawn, /hibernate cli-test · hibernating · \d/, 'the phase was shown while it ran');
    assert.match(
      drawn,
      /✔ hibernate cli-test: hibernated in [\d.]+m?s · checkpoint [\d.]+ \w+ \([\d.]+ \w+ stored\)\n$/,
    );

    drawn = '';
    const r = await withProgress(
      `resume ${sb.name}`,
      false,
      () => client.resume(sb.id),
      { client, sandbox: sb.name },
      { stream },
    );
    assert.equal(r.state, 'running');
    assert.match(drawn, /✔ resume cli-test: running in [\d.]+m?s · restored [\d.]+ \w+/);

    drawn = '';
    await assert.rejects(
      withProgress('exec nothing', false, () => client.exec('nope', ['true']), undefined, { stream }),
    );
    assert.match(drawn, /✖ exec nothing: failed after/);

    const json = await dormant(['hibernate', sb.id, '--json']);
    assert.equal(json.code, 0);
    assert.equal(json.stderr, '', 'no progress with --json');
    assert.equal((JSON.parse(json.stdout) as SandboxInfo).state, 'hibernated');
  });
});
