/**
 * The Python SDK (packages/python, package `dormant_sdk`): its hand-kept error table knows every
 * code of the daemon's (src/domain/errors.ts) in the same family, and the E2B-shaped program
 * of e2b-shape.test.ts, in Python (packages/python/tests/e2b_shape.py) and with AsyncSandbox
 * (e2b_shape_async.py), runs against a real daemon.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { Daemon } from '../daemon/daemon.js';
import { ERRORS } from '../domain/errors.js';
import { startTestDaemon, tearDown, testFolder } from '../api/testing/daemon.js';

const ROOT = join(dirname(fileURLToPath(import.meta.url)), '..', '..');
const PKG = join(ROOT, 'packages', 'python');

/** Runs python3 with the SDK on its path; resolves with its exit code and output. */
function python(
  args: string[],
  env: Record<string, string> = {},
  timeoutMs = 240_000,
): Promise<{ code: number; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    execFile(
      'python3',
      args,
      {
        cwd: ROOT,
        timeout: timeoutMs,
        maxBuffer: 16 * 1024 * 1024,
        // No __pycache__ left in the repository.
        env: { ...process.env, PYTHONPATH: PKG, PYTHONDONTWRITEBYTECODE: '1', ...env },
      },
      (err, stdout, stderr) =>
        resolve({ code: err ? (typeof err.code === 'number' ? err.code : 1) : 0, stdout, stderr }),
    );
  });
}

describe('Python SDK', () => {
  test('its error table knows every code of the daemon, in the same family', async () => {
    const r = await python(['-c', 'import json, dormant_sdk; print(json.dumps(dormant_sdk.ERROR_FAMILIES))']);
    assert.equal(r.code, 0, r.stderr);
    const py = JSON.parse(r.stdout) as Record<string, string>;
    const missing = Object.entries(ERRORS)
      .filter(([code, e]) => py[code] !== e.family)
      .map(([code, e]) => `${code}: ${e.family} (python: ${py[code] ?? 'missing'})`);
    assert.deepEqual(missing, [], 'update packages/python/dormant_sdk/errors.py');
  });

  describe('against a running daemon', () => {
    let dir: string;
    let daemon: Daemon;
    let env: Record<string, string>;

    before(async () => {
      let rootfs: string;
      ({ dir, rootfs } = await testFolder('python-sdk'));
      ({ daemon } = await startTestDaemon({
        dataDir: join(dir, 'data'),
        readonlyBinds: [],
        policy: false,
        meterIntervalMs: 250,
      }));
      env = { DORMANT_URL: daemon.url, DORMANT_TOKEN: daemon.adminToken, DORMANT_ROOTFS: rootfs };
    });

    after(() => tearDown(dir, daemon));

    test('the E2B-shaped program, in Python (Sandbox)', async () => {
      const r = await python([join(PKG, 'tests', 'e2b_shape.py')], env);
      assert.equal(r.code, 0, r.stdout + r.stderr);
      assert.match(r.stdout, /e2b_shape\.py: ok/);
    });

    test('the same with AsyncSandbox', async () => {
      const r = await python([join(PKG, 'tests', 'e2b_shape_async.py')], env);
      assert.equal(r.code, 0, r.stdout + r.stderr);
      assert.match(r.stdout, /e2b_shape_async\.py: ok/);
    });

    test('typed errors carry the API code', async () => {
      const r = await python(
        [
          '-c',
          [
            'from dormant_sdk import Sandbox, NotFoundError',
            'try:',
            '    Sandbox.connect("sb-0000000000000000")',
            'except NotFoundError as e:',
            '    print(e.code, e.status)',
          ].join('\n'),
        ],
        env,
      );
      assert.equal(r.code, 0, r.stderr);
      assert.equal(r.stdout.trim(), 'SANDBOX_NOT_FOUND 404');
    });
  });
});
