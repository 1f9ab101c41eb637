/**
 * `scripts/fleet.sh up N` and `down` (issue 27) run as a user would: `up` prints one JSON line
 * naming the nodes and a token that works on each of them; a sandbox made on node 1 is seen
 * from node 2 (they share the database); `up` over a running fleet is refused; `down` leaves
 * no process it started, no mount, no /dev/shm folder, no sandbox and no folder.
 *
 * Needs root, PostgreSQL and dormant-radosgw (scripts/setup.sh installs both); skipped without.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { createHash } from 'node:crypto';
import { existsSync, readFileSync, readdirSync } from 'node:fs';
import { rm } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { DormantClient } from '../sdk/client.js';
import { pgMissing } from '../state/testing/postgres.js';
import { rgwMissing } from '../vault/testing/rgw.js';
import { leftovers } from '../api/testing/host.js';
import { testFolder } from '../api/testing/daemon.js';

const ROOT = join(dirname(fileURLToPath(import.meta.url)), '..', '..');
const FLEET_SH = join(ROOT, 'scripts', 'fleet.sh');

const missing =
  process.getuid?.() !== 0
    ? 'needs root (the nodes run sandboxes)'
    : ((await pgMissing()) ?? (await rgwMissing()));

/** Two nodes: enough to see them share the database and forward to each other. */
const NODES = 2;

interface Run {
  code: number;
  stdout: string;
  stderr: string;
}

function fleet(args: string[], env: Record<string, string>, timeoutMs = 240_000): Promise<Run> {
  return new Promise((resolve) => {
    execFile(
      'bash',
      [FLEET_SH, ...args],
      { env: { ...process.env, ...env }, timeout: timeoutMs, maxBuffer: 16 * 1024 * 1024 },
      (e, stdout, stderr) => {
        const code = e === null ? 0 : typeof e.code === 'number' ? e.code : 1;
        resolve({ code, stdout, stderr });
      },
    );
  });
}

/** Whether `pid` runs: a zombie (ended, not yet reaped by its parent) does not. */
function alive(pid: number): boolean {
  let stat: string;
  try {
    stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
  } catch (e) {
    if ((e as { code?: string }).code === 'ENOENT') return false;
    throw e;
  }
  return !/^\d+ \(.*\) Z /.test(stat);
}

/** Processes whose command line names `path` (a node restarted by `down` has no pid we read). */
function processesNaming(path: string): string[] {
  const found: string[] = [];
  for (const p of readdirSync('/proc')) {
    if (!/^\d+$/.test(p) || Number(p) === process.pid) continue;
    let cmdline: string;
    try {
      cmdline = readFileSync(`/proc/${p}/cmdline`, 'utf8').replaceAll('\0', ' ');
    } catch {
      continue; // gone meanwhile
    }
    if (cmdline.includes(path)) found.push(`${p}: ${cmdline.slice(0, 200)}`);
  }
  return found;
}

/**
 * {@link leftovers}, and what a fleet's node names after itself: the sandbox's network
 * namespace (`dormant-NODE-ID`) and cgroup (`dormant/NODE/ID`), and the node's cgroup folder.
 */
function fleetLeftovers(id: string, node: string): string[] {
  const found = leftovers(id);
  if (existsSync(`/run/netns/dormant-${node}-${id}`)) found.push(`network namespace dormant-${node}-${id}`);
  const roots = existsSync('/sys/fs/cgroup/cgroup.controllers')
    ? ['/sys/fs/cgroup']
    : readdirSync('/sys/fs/cgroup').map((h) => `/sys/fs/cgroup/${h}`);
  for (const root of roots)
    for (const path of [`${root}/dormant/${node}/${id}`, `${root}/dormant/${node}`])
      if (existsSync(path)) found.push(`cgroup ${path}`);
  return found;
}

/** `dormant serve`'s staging folder for a data folder (stagingDirFor in daemon.ts). */
function stagingDir(dataDir: string): string {
  return `/dev/shm/dormant-${createHash('sha256').update(dataDir).digest('hex').slice(0, 12)}`;
}

describe('scripts/fleet.sh: a fleet on one machine', { skip: missing }, () => {
  let dir: string;
  let rootfs: string;
  let fleetDir: string;
  let env: Record<string, string>;
  let out: { nodes: { name: string; url: string }[]; token: string };
  let upRun: Run;
  /** Every process `up` started, read from the folder while it is there. */
  const pids: { what: string; pid: number }[] = [];
  const dataDirs: string[] = [];
  let sandboxId: string | undefined;

  before(async () => {
    ({ dir, rootfs } = await testFolder('fleetsh'));
    fleetDir = join(dir, 'fleet');
    env = { DORMANT_FLEET_DIR: fleetDir };
    upRun = await fleet(['up', String(NODES)], env);
    if (existsSync(fleetDir)) {
      for (const what of ['pg', 'rgw', ...readdirSync(join(fleetDir, 'nodes')).map((n) => `nodes/${n}`)]) {
        const file = join(fleetDir, what, 'pid');
        if (existsSync(file)) pids.push({ what, pid: Number(readFileSync(file, 'utf8').trim()) });
        if (what.startsWith('nodes/')) dataDirs.push(join(fleetDir, what, 'data'));
      }
    }
  });

  after(async () => {
    // A failed test still takes its fleet down.
    if (existsSync(fleetDir)) await fleet(['down'], env);
    await rm(dir, { recursive: true, force: true });
  });

  test(`up ${NODES} prints one JSON line: the nodes' names and URLs and a token`, () => {
    assert.equal(upRun.code, 0, upRun.stderr);
    const lines = upRun.stdout.split('\n').filter((l) => l !== '');
    assert.equal(lines.length, 1, `stdout is one line, progress goes to stderr: ${upRun.stdout}`);
    out = JSON.parse(lines[0]!) as typeof out;
    assert.deepEqual(
      out.nodes.map((n) => n.name),
      Array.from({ length: NODES }, (_, i) => `node${i + 1}`),
    );
    for (const n of out.nodes) assert.match(n.url, /^http:\/\/127\.0\.0\.1:\d+$/);
    assert.equal(new Set(out.nodes.map((n) => n.url)).size, NODES, 'each node has its own port');
    assert.match(out.token, /^dmt_[A-Za-z0-9_-]{43}$/);
    assert.match(upRun.stderr, /fleet: node1: http:\/\/127\.0\.0\.1:\d+/);
    // PostgreSQL, the S3 server and each node: 2 + N processes, all running.
    assert.equal(pids.length, 2 + NODES, JSON.stringify(pids));
    for (const p of pids) assert.ok(alive(p.pid), `${p.what} (pid ${p.pid}) runs`);
  });

  test('the token works on every node: health, and the list of sandboxes', async () => {
    for (const n of out.nodes) {
      const c = new DormantClient({ url: n.url, token: out.token });
      assert.equal((await c.health()).ok, true);
      assert.deepEqual(await c.listSandboxes(), [], `${n.name} lists no sandbox yet`);
    }
  });

  test('a sandbox made on node 1 runs, and is listed there', async () => {
    const c1 = new DormantClient({ url: out.nodes[0]!.url, token: out.token });
    const sb = await c1.createSandbox({ rootfs, command: ['sleep', '3600'], memory: 64 * 1024 * 1024 });
    sandboxId = sb.id;
    assert.equal(sb.state, 'running');
    assert.equal(sb.node, 'node1');
    assert.deepEqual(
      (await c1.listSandboxes()).map((s) => s.id),
      [sb.id],
    );
    assert.notDeepEqual(leftovers(sb.id), [], 'the sandbox has processes on the host');
  });

  test('node 2 lists the sandbox node 1 made (one database)', async () => {
    const c2 = new DormantClient({ url: out.nodes[1]!.url, token: out.token });
    assert.deepEqual(
      (await c2.listSandboxes()).map((s) => [s.id, s.node]),
      [[sandboxId, 'node1']],
    );
    // Asked of node 2, answered by node 1 (forwarded): the sandbox runs there.
    assert.equal((await c2.exec(sandboxId!, ['echo', 'from node 1'])).stdout, 'from node 1\n');
  });

  test('up over a running fleet is refused, and changes nothing', async () => {
    const again = await fleet(['up', '1'], env);
    assert.equal(again.code, 1);
    assert.equal(again.stdout, '');
    assert.match(again.stderr, /a fleet is already in .*fleet\.sh down/);
    for (const p of pids) assert.ok(alive(p.pid), `${p.what} (pid ${p.pid}) still runs`);
    assert.equal((await new DormantClient({ url: out.nodes[0]!.url, token: out.token }).health()).ok, true);
  });

  test('down leaves nothing: no process, sandbox, mount or /dev/shm folder; the folder is gone', async () => {
    const down = await fleet(['down'], env);
    assert.equal(down.code, 0, down.stderr);
    assert.equal(down.stdout, '');
    // Each node removes its own: node 1 the one sandbox, node 2 none.
    assert.match(down.stderr, /node1: removed 1 sandbox/);
    assert.match(down.stderr, /node2: removed 0 sandbox/);
    for (const p of pids) assert.ok(!alive(p.pid), `${p.what} (pid ${p.pid}) ended`);
    assert.ok(!existsSync(fleetDir), `${fleetDir} removed`);
    assert.deepEqual(processesNaming(fleetDir), []);
    assert.ok(sandboxId !== undefined);
    assert.deepEqual(fleetLeftovers(sandboxId, 'node1'), [], 'the sandbox left nothing on the host');
    const mounts = readFileSync('/proc/self/mountinfo', 'utf8');
    assert.ok(!mounts.includes(fleetDir), 'nothing mounted under the fleet folder');
    for (const d of dataDirs) {
      const shm = stagingDir(d);
      assert.ok(!mounts.includes(shm), `${shm} not mounted`);
      for (const p of [shm, `${shm}-bundles`]) assert.ok(!existsSync(p), `${p} removed`);
    }
    // Again: nothing to do, and says so.
    const twice = await fleet(['down'], env);
    assert.equal(twice.code, 0, twice.stderr);
    assert.match(twice.stderr, /no fleet in/);
  });
});

describe('scripts/fleet.sh down after a node was killed', { skip: missing }, () => {
  let dir: string;
  let rootfs: string;
  let fleetDir: string;
  let env: Record<string, string>;

  before(async () => {
    ({ dir, rootfs } = await testFolder('fleetsh-killed'));
    fleetDir = join(dir, 'fleet');
    env = { DORMANT_FLEET_DIR: fleetDir };
  });

  after(async () => {
    if (existsSync(fleetDir)) await fleet(['down'], env);
    await rm(dir, { recursive: true, force: true });
  });

  test('starts the node again to remove its sandboxes, then leaves nothing', async () => {
    const up = await fleet(['up', '1'], env);
    assert.equal(up.code, 0, up.stderr);
    const { nodes, token } = JSON.parse(up.stdout) as { nodes: { url: string }[]; token: string };
    const c = new DormantClient({ url: nodes[0]!.url, token });
    const sb = await c.createSandbox({ rootfs, command: ['sleep', '3600'], memory: 64 * 1024 * 1024 });
    // A crash: the node's own shutdown never runs, its sandbox keeps running.
    const pid = Number(readFileSync(join(fleetDir, 'nodes', 'node1', 'pid'), 'utf8'));
    process.kill(pid, 'SIGKILL');
    for (let i = 0; i < 100 && alive(pid); i++) await new Promise((r) => setTimeout(r, 50));
    assert.notDeepEqual(leftovers(sb.id), [], 'the sandbox outlives its node');

    const down = await fleet(['down'], env);
    assert.equal(down.code, 0, down.stderr);
    assert.match(down.stderr, /node1 is not running: starting it again/);
    assert.match(down.stderr, /node1: removed 1 sandbox/);
    assert.deepEqual(fleetLeftovers(sb.id, 'node1'), [], 'the sandbox left nothing on the host');
    assert.deepEqual(processesNaming(fleetDir), []);
    assert.ok(!existsSync(fleetDir), `${fleetDir} removed`);
  });
});

describe('scripts/fleet.sh up that fails', { skip: missing }, () => {
  let dir: string;

  before(async () => {
    ({ dir } = await testFolder('fleetsh-failed'));
  });

  after(async () => {
    const fleetDir = join(dir, 'fleet');
    if (existsSync(fleetDir)) await fleet(['down'], { DORMANT_FLEET_DIR: fleetDir });
    await rm(dir, { recursive: true, force: true });
  });

  test('a node count outside 1..99 is refused before anything starts', async () => {
    const fleetDir = join(dir, 'fleet');
    for (const n of ['0', 'two', '100']) {
      const r = await fleet(['up', n], { DORMANT_FLEET_DIR: fleetDir });
      assert.equal(r.code, 1);
      assert.match(r.stderr, /N is a number of nodes, 1 to 99/);
      assert.ok(!existsSync(fleetDir));
    }
  });

  test('a node that does not answer in time: its log is shown, and what up started is removed', async () => {
    const fleetDir = join(dir, 'fleet');
    // A bound of 0.1 s: the node cannot answer that soon.
    const r = await fleet(['up', '1'], { DORMANT_FLEET_DIR: fleetDir, DORMANT_FLEET_NODE_START_TENTHS: '1' });
    assert.equal(r.code, 1);
    assert.equal(r.stdout, '');
    assert.match(
      r.stderr,
      /node1 did not answer on http:\/\/127\.0\.0\.1:\d+\/v1\/health; the end of its log/,
    );
    assert.match(r.stderr, /up failed; removing what it started/);
    assert.ok(!existsSync(fleetDir), `${fleetDir} removed`);
    assert.deepEqual(processesNaming(fleetDir), []);
  });
});
