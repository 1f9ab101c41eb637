/**
 * What confines a sandbox's root, seen from inside, against the real runc and CRIU: the default
 * seccomp profile (config/seccomp-default.json) refuses nested user namespaces, keyrings,
 * io_uring, userfaultfd, BPF, perf and mounts, for the sandbox's own command and for what exec
 * starts, and still does after a checkpoint and restore.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import { RuncRuntime } from './runc.js';
import {
  cannotRun,
  CRIU,
  removeRuntimeFolders,
  runtimeFolders,
  type RuntimeFolders,
} from './testing/host.js';

const skip = await cannotRun('criu', 'python3');

/**
 * Prints `name errno` for each call the profile must refuse (0: it went through), with the
 * x86_64 numbers; then the Seccomp line of /proc/self/status.
 */
const PROBE_PY = `
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def try_call(name, nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(nr, *[ctypes.c_long(a) for a in args])
    print(name, 0 if r >= 0 else ctypes.get_errno(), flush=True)
try_call('unshare_user', 272, 0x10000000)
try_call('unshare_mount', 272, 0x00020000)
try_call('clone_user', 56, 0x10000000 | 17, 0, 0, 0, 0)
try_call('keyctl', 250, 0, -3, 0, 0, 0)
try_call('add_key', 248, 0, 0, 0, 0, -3)
try_call('io_uring_setup', 425, 8, 0)
try_call('userfaultfd', 323, 0)
try_call('bpf', 321, 0, 0, 0)
try_call('perf_event_open', 298, 0, 0, -1, -1, 0)
try_call('mount', 165, 0, 0, 0, 0, 0)
try_call('clone3', 435, 0, 0)
for line in open('/proc/self/status'):
    if line.startswith('Seccomp:'): print('seccomp', line.split()[1], flush=True)
`;

const EPERM = 1;
const ENOSYS = 38;

function parseProbe(out: string): Record<string, number> {
  const r: Record<string, number> = {};
  for (const line of out.trim().split('\n')) {
    const [k, v] = line.split(' ');
    if (k !== undefined && v !== undefined) r[k] = Number(v);
  }
  return r;
}

function assertConfined(probe: Record<string, number>, when: string): void {
  assert.equal(probe.seccomp, 2, `${when}: a seccomp filter is in force`);
  for (const call of [
    'unshare_user',
    'unshare_mount',
    'clone_user',
    'keyctl',
    'add_key',
    'io_uring_setup',
    'userfaultfd',
    'bpf',
    'perf_event_open',
    'mount',
  ])
    assert.equal(probe[call], EPERM, `${when}: ${call} is refused with EPERM (got ${String(probe[call])})`);
  assert.equal(probe.clone3, ENOSYS, `${when}: clone3 answers ENOSYS, so libc falls back to clone`);
}

describe('confinement of a sandbox (real runc + CRIU)', { skip }, () => {
  let tmp: string;
  let shm: string;
  let rootfs: string;
  const suffix = randomBytes(3).toString('hex');
  const runtimes: RuncRuntime[] = [];

  let folders: RuntimeFolders;

  before(async () => {
    folders = await runtimeFolders('confine', { 'srv/probe.py': PROBE_PY });
    ({ tmp, shm, rootfs } = folders);
  });

  after(() => removeRuntimeFolders(folders, runtimes));

  const spec = (id: string) => ({
    id,
    rootfs,
    args: ['sh', '-c', 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done'],
    readonlyBinds: [{ source: '/usr', destination: '/usr' }],
    limits: { memoryBytes: 128 * 1024 * 1024, pids: 64 },
  });

  test('the default profile refuses the calls escapes start from, before and after checkpoint/restore', async () => {
    const rt = new RuncRuntime({ stateDir: join(tmp, 'state'), criuPath: CRIU });
    runtimes.push(rt);
    const id = `seccomp-${suffix}`;
    await rt.create(spec(id));
    await rt.start(id);
    const probe = async () => parseProbe((await rt.exec(id, ['/usr/bin/python3', '/srv/probe.py'])).stdout);
    assertConfined(await probe(), 'after create');
    // The sandbox's own command carries the filter too, not only what exec starts.
    const status = (await rt.exec(id, ['cat', '/proc/1/status'])).stdout;
    assert.match(status, /^Seccomp:\s+2$/m, 'pid 1 is filtered');

    const imagesDir = join(shm, 'images');
    await rt.checkpoint(id, { imagesDir, workDir: join(tmp, 'work') });
    await rt.restore(id, { imagesDir, workDir: join(tmp, 'work-restore') });
    assert.match(
      (await rt.exec(id, ['cat', '/proc/1/status'])).stdout,
      /^Seccomp:\s+2$/m,
      'restored pid 1 too',
    );
    assertConfined(await probe(), 'after restore');
  });
});
