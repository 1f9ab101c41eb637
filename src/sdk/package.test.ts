/**
 * The workspace package @dormant/sdk (packages/sdk): it compiles from src/sdk alone (no
 * import reaches past it), and once built (`npm run build`) it resolves by name and exports
 * what src/sdk/index.ts exports.
 */
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { existsSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import * as sdk from './index.js';

const ROOT = join(dirname(fileURLToPath(import.meta.url)), '..', '..');
const PKG = join(ROOT, 'packages', 'sdk');

describe('@dormant/sdk, the workspace package', () => {
  test('compiles from src/sdk on its own', async () => {
    const tsc = join(ROOT, 'node_modules', 'typescript', 'bin', 'tsc');
    const r = await new Promise<{ code: number; out: string }>((resolve) => {
      execFile(
        process.execPath,
        [tsc, '-p', join(PKG, 'tsconfig.json'), '--noEmit'],
        { timeout: 120_000 },
        (err, stdout, stderr) => resolve({ code: err ? 1 : 0, out: stdout + stderr }),
      );
    });
    assert.equal(r.code, 0, r.out);
  });

  test(
    'resolves by name after a build, with the same exports',
    { skip: !existsSync(join(PKG, 'dist', 'index.js')) && 'not built (npm run build)' },
    async () => {
      const name = '@dormant/sdk';
      const pkg = (await import(name)) as Record<string, unknown>;
      assert.deepEqual(Object.keys(pkg).sort(), Object.keys(sdk).sort());
      assert.equal(typeof pkg.Sandbox, 'function');
    },
  );
});
