/**
 * Output to a closed pipe (`dormant cost | head`, `dormant ls | true`) ends the CLI quietly,
 * as other command-line tools do, instead of an unhandled EPIPE with a stack trace. The pipe's
 * read end is closed before the CLI starts, so every write fails: no timing is involved.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const BIN = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'bin', 'dormant');

// python3 makes a pipe, closes its read end, and runs the CLI with stdout on the write end.
const SCRIPT = `
import os, subprocess, sys
r, w = os.pipe()
os.close(r)
p = subprocess.run(sys.argv[1:], stdout=w, stderr=subprocess.PIPE)
sys.stdout.write(f"{p.returncode}\\n{p.stderr.decode()}")
`;

test('output to a closed pipe exits quietly with status 0', () => {
  const r = spawnSync('python3', ['-c', SCRIPT, process.execPath, BIN, '--help'], {
    encoding: 'utf8',
    timeout: 60_000,
  });
  assert.equal(r.status, 0, r.stderr);
  const [code, ...stderr] = r.stdout.split('\n');
  assert.equal(stderr.join('\n').trim(), '', 'nothing on stderr');
  assert.equal(code, '0');
});
