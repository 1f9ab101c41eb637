/**
 * `dormant version` (the CLI's and the daemon's versions, or why the daemon is unreachable)
 * and `dormant completion bash`, driven through bash's own completion machinery.
 */
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile, spawnSync } from 'node:child_process';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { Daemon } from '../daemon/daemon.js';
import { DORMANT_VERSION } from '../domain/version.js';
import { startTestDaemon, tearDown, testFolder } from '../api/testing/daemon.js';

const BIN = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'bin', 'dormant');

function dormant(
  args: string[],
  env: Record<string, string> = {},
): Promise<{ code: number; stdout: string }> {
  return new Promise((done) => {
    execFile(
      process.execPath,
      [BIN, ...args],
      { env: { ...process.env, ...env }, timeout: 60_000 },
      (err, stdout) => done({ code: err ? (typeof err.code === 'number' ? err.code : -1) : 0, stdout }),
    );
  });
}

let dir: string | undefined;
let daemon: Daemon | undefined;
before(async () => {
  ({ dir } = await testFolder('version'));
  ({ daemon } = await startTestDaemon({ dataDir: join(dir, 'data'), readonlyBinds: [], policy: false }));
});
after(() => tearDown(dir, daemon));

test("version names the CLI's and the daemon's versions, or says the daemon is unreachable", async () => {
  const up = await dormant(['version', '--json'], {
    DORMANT_URL: daemon!.url,
    DORMANT_TOKEN: daemon!.adminToken,
  });
  assert.equal(up.code, 0);
  assert.deepEqual(JSON.parse(up.stdout), {
    client: DORMANT_VERSION,
    server: DORMANT_VERSION,
    url: daemon!.url,
  });
  // A port nothing listens on (the daemon's own, once closed, could be reused: use port 9).
  const down = await dormant(['version'], { DORMANT_URL: 'http://127.0.0.1:9' });
  assert.equal(down.code, 0);
  assert.match(down.stdout, new RegExp(`client: ${DORMANT_VERSION.replaceAll('.', '\\.')}`));
  assert.match(down.stdout, /server: unreachable at http:\/\/127\.0\.0\.1:9/);
});

test('bash completion completes commands, subcommands and their flags', async () => {
  const script = (await dormant(['completion', 'bash'])).stdout;
  const complete = (words: string[]): string[] => {
    const r = spawnSync(
      'bash',
      [
        '-c',
        `${script}\nCOMP_WORDS=(${words.map((w) => `'${w}'`).join(' ')}); COMP_CWORD=${words.length - 1}; _dormant_complete; printf '%s\\n' "\${COMPREPLY[@]}"`,
      ],
      { encoding: 'utf8' },
    );
    assert.equal(r.status, 0, r.stderr);
    return r.stdout.split('\n').filter((l) => l !== '');
  };
  assert.deepEqual(complete(['dormant', 'hib']), ['hibernate']);
  assert.deepEqual(complete(['dormant', 'checkpoint', 'insp']), ['inspect']);
  assert.ok(complete(['dormant', 'create', '--na']).includes('--name'));
  // Flags and their values between the words do not lose the command.
  assert.ok(complete(['dormant', '--json', 'checkpoint', 'ls', '--']).includes('--json'));
  assert.equal((await dormant(['completion', 'fish'])).code, 2);
});
