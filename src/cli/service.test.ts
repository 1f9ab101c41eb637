/**
 * `dormant install-service`: the unit it writes is one systemd accepts
 * (`systemd-analyze verify`: no warning, the binaries exist), it stops only the daemon and
 * restarts it after a crash, and it writes nothing where systemd is not running but the unit.
 * Starting the unit needs a running systemd, which test machines (containers) lack.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile, spawnSync } from 'node:child_process';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { renderUnit, systemdRuns } from './commands/service.js';

const BIN = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'bin', 'dormant');
const hasAnalyze = spawnSync('systemd-analyze', ['--version']).status === 0;

function dormant(args: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  return new Promise((done) => {
    execFile(process.execPath, [BIN, ...args], { timeout: 60_000 }, (err, stdout, stderr) =>
      done({ code: err ? (typeof err.code === 'number' ? err.code : -1) : 0, stdout, stderr }),
    );
  });
}

function settings(unit: string): Map<string, string> {
  const m = new Map<string, string>();
  for (const line of unit.split('\n')) {
    const i = line.indexOf('=');
    if (i > 0 && !line.startsWith('#')) m.set(line.slice(0, i), line.slice(i + 1));
  }
  return m;
}

test('the unit stops only the daemon, restarts it after a crash and waits for a graceful stop', () => {
  const s = settings(
    renderUnit({ node: '/usr/bin/node', bin: '/opt/dormant/bin/dormant', config: '/etc/d.json' }),
  );
  assert.equal(s.get('ExecStart'), '/usr/bin/node /opt/dormant/bin/dormant serve --config /etc/d.json');
  assert.equal(s.get('KillMode'), 'process');
  assert.equal(s.get('Restart'), 'on-failure');
  assert.ok(Number(s.get('TimeoutStopSec')) >= 120);
  assert.equal(s.get('LimitCORE'), '0');
  assert.equal(s.get('WantedBy'), 'multi-user.target');
  assert.throws(() => renderUnit({ node: 'node', bin: '/x' }), /must be absolute/);
  assert.throws(() => renderUnit({ node: '/n', bin: '/x', config: '/a b.json' }), /without spaces/);
});

test(
  'install-service writes a unit systemd-analyze verifies without a warning',
  { skip: !hasAnalyze && 'no systemd-analyze' },
  async () => {
    const dir = await mkdtemp(join(tmpdir(), 'dormant-unit-'));
    try {
      if (systemdRuns()) {
        // Installing for real would start a second daemon on this machine: only print here.
        const r = await dormant(['install-service', '--print', '--data-dir', dir]);
        assert.equal(r.code, 0, r.stderr);
        return;
      }
      const r = await dormant([
        'install-service',
        '--unit-dir',
        dir,
        '--data-dir',
        join(dir, 'data'),
        '--listen',
        '127.0.0.1:7420',
      ]);
      assert.equal(r.code, 0, r.stderr);
      assert.match(r.stdout, /systemd is not running on this machine: nothing started/);
      const file = join(dir, 'dormant.service');
      const unit = await readFile(file, 'utf8');
      assert.match(unit, new RegExp(`Environment=DORMANT_DATA_DIR=${dir}/data`));
      assert.match(unit, /Environment=DORMANT_LISTEN=127\.0\.0\.1:7420/);
      const v = spawnSync('systemd-analyze', ['verify', file], { encoding: 'utf8' });
      assert.equal(v.status, 0, v.stderr);
      assert.equal(`${v.stdout}${v.stderr}`.trim(), '', 'systemd-analyze has nothing to say');
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  },
);
