/**
 * CRIU hangs during hibernate (on VMs whose hardware breakpoints do not fire, an old criu waits
 * forever for a trap). The daemon runs criu through a wrapper that, once a flag
 * file exists, never answers: the dump must be ended at its timeout with its whole process
 * group, the sandbox thawed and running with its memory, the error saying it hung, and nothing
 * of the hung dump left behind.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { chmod, mkdtemp, readFile, readdir, rm, writeFile } from 'node:fs/promises';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { stagingDirFor, type Daemon } from '../daemon/daemon.js';
import { DormantApiError, DormantClient, type SandboxInfo } from '../sdk/client.js';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';
import { locateCriu } from '../criu/criu.js';
import { eventually, httpGet, leftovers } from './testing/host.js';
import { startTestDaemon, tearDown } from './testing/daemon.js';
import { pythonServer } from './testing/servers.js';

const SERVER = pythonServer({
  setup: `
import hashlib, os
blob = os.urandom(4 * 1024 * 1024)
digest = hashlib.sha256(blob).hexdigest()[:16]`,
  answer: '"%d %s" % (count, hashlib.sha256(blob).hexdigest()[:16] == digest and digest)',
});

describe('faults: criu hangs during hibernate', () => {
  let dir: string;
  let daemon: Daemon | undefined;
  let client: DormantClient;
  let flag: string;
  let hungPidFile: string;
  const savedCriu = process.env.DORMANT_CRIU;

  before(async () => {
    dir = await mkdtemp('/tmp/dormant-hang-');
    const real = await locateCriu();
    assert.ok(real, 'criu is installed (scripts/setup.sh)');
    flag = join(dir, 'hang');
    hungPidFile = join(dir, 'hung.pid');
    const wrapper = join(dir, 'criu');
    // Answers like criu until the flag exists; then never answers (and never exits).
    await writeFile(
      wrapper,
      `#!/bin/sh\nif [ -e '${flag}' ]; then echo $$ > '${hungPidFile}'; exec sleep 3600; fi\nexec '${real}' "$@"\n`,
    );
    await chmod(wrapper, 0o755);
    process.env.DORMANT_CRIU = wrapper;
    await buildBusyboxRootfs(join(dir, 'rootfs'), { 'srv/server.py': SERVER });
    ({ daemon, client } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      proxy: false,
      policy: false,
      checkpointTimeoutMs: 4000,
    }));
  });

  after(async () => {
    await rm(flag, { force: true });
    if (savedCriu === undefined) delete process.env.DORMANT_CRIU;
    else process.env.DORMANT_CRIU = savedCriu;
    await tearDown(dir, daemon);
  });

  const serve = async (sb: SandboxInfo): Promise<[number, string]> => {
    const body = await eventually('server', () => httpGet(sb.address!, 8080), 30_000);
    assert.match(body, /^\d+ [0-9a-f]{16}$/, 'memory intact (the digest still matches)');
    const [n, digest] = body.split(' ');
    return [Number(n), digest!];
  };

  test('the hung dump is ended at its timeout; the sandbox runs on with its memory; it hibernates later', async (t) => {
    assert.ok(daemon);
    const sb = await client.createSandbox({
      name: 'hangs',
      rootfs: join(dir, 'rootfs'),
      command: ['/usr/bin/python3', '-u', '/srv/server.py'],
      ports: [8080],
    });
    const [n, digest] = await serve(sb);
    await writeFile(flag, '');
    const started = Date.now();
    let err: unknown;
    try {
      await client.hibernate(sb.id);
    } catch (e) {
      err = e;
    }
    const took = Date.now() - started;
    await rm(flag);
    assert.ok(err instanceof DormantApiError, String(err));
    t.diagnostic(`${String(took)} ms: ${err.message.slice(0, 400)}`);
    assert.equal(err.code, 'HIBERNATE_FAILED');
    assert.match(err.message, /hung: criu did not finish within 4 s/);
    assert.match(err.message, /running again/);
    assert.ok(took < 60_000, `ended at its timeout, not at the default (${String(took)} ms)`);

    await t.test('the hung criu is gone', async () => {
      const pid = Number((await readFile(hungPidFile, 'utf8')).trim());
      assert.ok(pid > 0);
      await eventually('hung criu ended', () =>
        alive(pid) ? Promise.reject(new Error(`pid ${String(pid)} still runs`)) : Promise.resolve(),
      );
    });

    await t.test('the sandbox is running with the same process and memory', async () => {
      assert.equal((await client.getSandbox(sb.id)).state, 'running');
      assert.deepEqual(await serve(sb), [n + 1, digest]);
      assert.deepEqual(await client.listCheckpoints(sb.id), []);
      assert.deepEqual(await readdir(stagingDirFor(join(dir, 'data'))), [], 'staging wiped');
    });

    await t.test('with criu answering again, it hibernates and resumes', async () => {
      assert.equal((await client.hibernate(sb.id)).state, 'hibernated');
      assert.equal((await client.resume(sb.id)).state, 'running');
      assert.deepEqual(await serve(sb), [n + 2, digest]);
    });

    await client.remove(sb.id);
    assert.deepEqual(leftovers(sb.id), []);
  });
});

/** The process exists and is not a zombie. */
function alive(pid: number): boolean {
  try {
    return !/^State:\s+Z/m.test(readFileSync(`/proc/${String(pid)}/status`, 'utf8'));
  } catch {
    return false;
  }
}
