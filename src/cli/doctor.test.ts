/** `dormant doctor` through the real binary, on this machine. */
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { execFile } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { dirname, join } from 'node:path';
import { versionAtLeast } from '../domain/version.js';
import type { DoctorReport } from '../control/doctor.js';
import { criuCheck, locateCriu } from '../criu/criu.js';

const BIN = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'bin', 'dormant');

function dormant(
  args: string[],
  env: NodeJS.ProcessEnv = process.env,
): Promise<{ code: number; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    execFile(process.execPath, [BIN, ...args], { env, timeout: 60_000 }, (err, stdout, stderr) => {
      const code = err ? (typeof err.code === 'number' ? err.code : -1) : 0;
      resolve({ code, stdout, stderr });
    });
  });
}

function row(report: DoctorReport, id: string) {
  const r = report.rows.find((x) => x.id === id);
  assert.ok(r, `row ${id} is in the report`);
  return r;
}

describe('dormant doctor', () => {
  test('--json after setup: CRIU >= 4.2, the breakpoint finding and its fallback, exit 0', async () => {
    const { code, stdout } = await dormant(['doctor', '--json']);
    const report = JSON.parse(stdout) as DoctorReport;
    assert.equal(code, 0, `doctor failed: ${stdout}`);
    assert.equal(report.ok, true);
    const criu = row(report, 'criu');
    assert.equal(criu.status, 'supported');
    const version = /^(\S+)/.exec(criu.value)?.[1] ?? '';
    assert.ok(versionAtLeast(version, '4.2'), `criu ${version} >= 4.2`);
    assert.equal(row(report, 'criu-check').status, 'supported');
    assert.equal(row(report, 'runc').status, 'supported');
    assert.equal(row(report, 'freezer').status, 'supported');

    // What doctor says about breakpoints must match what criu itself finds on this machine.
    const check = await criuCheck((await locateCriu())!);
    const bp = row(report, 'hw-breakpoints');
    if (check.hardwareBreakpointsWork) {
      assert.equal(bp.status, 'supported');
      assert.deepEqual(report.criuEnv, {});
    } else {
      assert.equal(bp.status, 'degraded');
      assert.match(bp.value, /CRIU_FAULT=130/);
      assert.deepEqual(report.criuEnv, { CRIU_FAULT: '130' });
    }
    for (const id of [
      'platform',
      'cgroups',
      'lazy-restore',
      'soft-dirty',
      'podman',
      'checkpointctl',
      'nvidia',
      'cuda-checkpoint',
      'cuda-helper',
      'data-dir',
    ]) {
      const r = row(report, id);
      assert.ok(['supported', 'degraded', 'missing'].includes(r.status));
      if (r.status !== 'supported' && r.required) assert.ok(r.fix, `${id} says what to do`);
    }
    // Sandboxes have user namespaces by default: whether they resume lazily is the sysctl's.
    if (row(report, 'lazy-restore').status === 'supported') {
      const sysctl = readFileSync('/proc/sys/vm/unprivileged_userfaultfd', 'utf8').trim();
      const r = row(report, 'lazy-restore-userns');
      assert.equal(r.status, sysctl === '1' ? 'supported' : 'degraded');
      if (sysctl !== '1') assert.match(r.fix ?? '', /vm\.unprivileged_userfaultfd=1/);
    }
  });

  test('with criu removed from PATH: exit 1, and it says how to install it', async () => {
    const env: NodeJS.ProcessEnv = { ...process.env, PATH: '/usr/sbin:/usr/bin:/sbin:/bin' };
    delete env.DORMANT_CRIU;
    const { code, stdout } = await dormant(['doctor', '--json'], env);
    assert.equal(code, 1);
    const report = JSON.parse(stdout) as DoctorReport;
    assert.equal(report.ok, false);
    const criu = row(report, 'criu');
    assert.equal(criu.status, 'missing');
    assert.equal(criu.required, true);
    assert.match(criu.fix ?? '', /scripts\/setup\.sh/);

    const human = await dormant(['doctor'], env);
    assert.equal(human.code, 1);
    assert.match(human.stdout, /not ready/);
    assert.match(human.stdout, /setup\.sh/);
  });

  test('DORMANT_CRIU pointing at something that is not criu is reported, not trusted', async () => {
    const { code, stdout } = await dormant(['doctor', '--json'], {
      ...process.env,
      DORMANT_CRIU: '/nonexistent/criu',
    });
    assert.equal(code, 1);
    const criu = row(JSON.parse(stdout) as DoctorReport, 'criu');
    assert.equal(criu.status, 'missing');
    assert.match(criu.detail ?? '', /DORMANT_CRIU/);
  });

  test('an unknown command is a usage error (exit 2)', async () => {
    const { code, stderr } = await dormant(['no-such-command']);
    assert.equal(code, 2);
    assert.match(stderr, /unknown command/);
  });
});
