/**
 * Checkpoints real podman made, during the test, on this machine: a busybox container with a
 * counter in its shell's memory, busybox httpd serving it and a second TCP listener, checkpointed
 * with `podman container checkpoint --export`, imported by a tenant (an upload) and resumed.
 * The counter carries on, both listeners answer, and the mounts podman gave it (/dev/shm with
 * its file, /etc/hostname) hold what they held. A container with a bind of a host folder is
 * refused at import, naming the mount.
 *
 * Needs podman (scripts/setup.sh installs it) running containers with runc; skipped without.
 * Each container and image the test makes has a name of its own and is removed afterwards.
 * podman runs the containers in a network namespace the test made (nothing reaches outside),
 * with the ulimits these machines' processes can set (they lack CAP_SYS_RESOURCE).
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { mkdir, mkdtemp, readFile, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import type { Daemon } from '../daemon/daemon.js';
import { DormantClient } from '../sdk/client.js';
import { run } from '../sys/exec.js';
import { apiError, startTestDaemon, tearDown } from './testing/daemon.js';
import { eventually, httpGet } from './testing/host.js';
import { busyboxImage, installed, podman } from './testing/podman.js';
import { connect } from 'node:net';
import type { Field } from '../criu/images/proto.js';
import { editSub, rewriteImage, rewriteMessage } from '../criu/images/write.js';

const hasPodman = await installed('podman');

/** What a TCP listener sends on connect, until it closes. */
function readAll(host: string, port: number): Promise<string> {
  return new Promise((resolve, reject) => {
    const s = connect({ host, port });
    let out = '';
    s.setTimeout(5000, () => s.destroy(new Error('timeout')));
    s.on('data', (d) => (out += d.toString()));
    s.on('end', () => resolve(out));
    s.on('error', reject);
  });
}

describe('podman checkpoints', { skip: hasPodman ? false : 'podman is not installed' }, () => {
  const tag = randomBytes(4).toString('hex');
  const image = `localhost/dormant-test-${tag}:latest`;
  const netns = `dormant-pmt-${tag}`;
  const containers: string[] = [];
  let dir: string;
  let layout: string;
  let daemon: Daemon;
  let client: DormantClient;
  let counterArchive: string | undefined;

  before(async () => {
    dir = await mkdtemp('/tmp/dormant-podman-');
    layout = await busyboxImage(dir, image);
    await run('ip', ['netns', 'add', netns], { timeoutMs: 10_000 });
    await run('ip', ['-n', netns, 'link', 'set', 'lo', 'up'], { timeoutMs: 10_000 });
    ({ daemon, client } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      proxy: false,
      policy: false,
      allowedSourceRoots: [dir],
      // podman's checkpoints have no user namespace: a node that imports them runs without.
      userNamespace: false,
    }));
  });

  after(async () => {
    for (const c of containers) await podman(['rm', '-f', c]).catch(() => undefined);
    await podman(['rmi', '-f', image]).catch(() => undefined);
    await run('ip', ['netns', 'del', netns], { timeoutMs: 10_000 }).catch(() => undefined);
    await tearDown(dir, daemon);
  });

  /** Runs `script` in a new container of the test's image; returns its name. */
  async function runContainer(
    script: string,
    extra: string[] = [],
    network = `ns:/run/netns/${netns}`,
  ): Promise<string> {
    const name = `dormant-test-${tag}-${containers.length}`;
    containers.push(name);
    await podman([
      'run',
      '-d',
      '--name',
      name,
      '--runtime',
      'runc',
      '--network',
      network,
      '--ulimit',
      'nofile=1024:1024',
      '--ulimit',
      'nproc=4096:4096',
      ...extra,
      image,
      'sh',
      '-c',
      script,
    ]);
    return name;
  }

  const COUNTER =
    'mkdir -p /www; echo from-podman > /dev/shm/note; httpd -p 8080 -h /www; ' +
    'nc -ll -p 9090 -e /bin/hostname & ' +
    'i=0; while :; do i=$((i+1)); echo $i > /www/count; sleep 0.2; done';

  test('a podman checkpoint imports (uploaded by a tenant) and resumes: the counter carries on, the listeners answer, the mounts hold what they held', async () => {
    const name = await runContainer(COUNTER);
    const count = async () => Number((await podman(['exec', name, 'cat', '/www/count'])).stdout.trim());
    await eventually('the counter runs', async () => assert.ok((await count()) >= 3));
    const hostname = (await podman(['exec', name, 'cat', '/etc/hostname'])).stdout.trim();
    const archive = join(dir, 'counter.tar.zst');
    await podman(['container', 'checkpoint', '--export', archive, name]);
    counterArchive = archive;
    // The checkpoint stopped the container; its files say where the counter was.
    const tenant = new DormantClient({
      url: daemon.url,
      token: (await client.createToken({ tenant: 'default' })).token,
    });
    const sb = await tenant.uploadCheckpoint(await readFile(archive), {
      fileName: 'counter.tar.zst',
      image: layout,
      ports: [8080, 9090],
    });
    assert.equal(sb.state, 'hibernated');
    const r = await tenant.resume(sb.id);
    assert.equal(r.state, 'running');
    const at = Number(await eventually('httpd answers', () => httpGet(r.address!, 8080, '/count')));
    assert.ok(at >= 3, `the counter carried on from podman's (${at}), it did not start again`);
    await eventually('the counter goes on', async () =>
      assert.ok(Number(await httpGet(r.address!, 8080, '/count')) > at),
    );
    assert.equal((await readAll(r.address!, 9090)).trim(), hostname, 'the second listener answers');
    const inside = await tenant.exec(sb.id, [
      'sh',
      '-c',
      'cat /dev/shm/note; cat /etc/hostname; echo; ls -d /',
    ]);
    assert.deepEqual(inside.stdout.split('\n').slice(0, 3), ['from-podman', hostname, '/']);
    // It sleeps and wakes again as any sandbox does.
    await tenant.hibernate(sb.id);
    const again = await tenant.resume(sb.id);
    assert.ok(
      Number(await eventually('httpd answers again', () => httpGet(again.address!, 8080, '/count'))) > at,
    );
  });

  test('a podman checkpoint with a bind of a host folder is refused at import, naming the mount', async () => {
    const host = join(dir, 'host-data');
    await mkdir(host);
    await writeFile(join(host, 'secret'), 'host file\n');
    const name = await runContainer('while :; do cat /data/secret >/dev/null; sleep 1; done', [
      '-v',
      `${host}:/data`,
    ]);
    const archive = join(dir, 'bind.tar.zst');
    await podman(['container', 'checkpoint', '--export', archive, name]);
    const before = (await client.listSandboxes()).length;
    const e = await apiError(client.importCheckpoint({ archive, image: layout }));
    assert.equal(e.code, 'CHECKPOINT_OUTSIDE_PROFILE');
    assert.match(e.message, /\/data/);
    assert.equal((await client.listSandboxes()).length, before, 'nothing is left of it');
  });

  test('a podman checkpoint whose processes used a CPU feature this node lacks is refused at import, naming it', async (t) => {
    if (counterArchive === undefined) return t.skip('no podman checkpoint was made');
    const flags = (await readFile('/proc/cpuinfo', 'utf8')).split('\n').find((l) => l.startsWith('flags'));
    if (flags?.includes(' amx_tile')) return t.skip('this CPU has AMX');
    // The archive as made on a CPU with AMX, whose tiles its pid 1 had in use: XSAVE
    // component 17 set in the thread's xstate_bv.
    const tree = join(dir, 'amx');
    await mkdir(tree);
    await run('tar', ['--zstd', '-C', tree, '-xf', counterArchive], { timeoutMs: 60_000 });
    const core = join(tree, 'checkpoint', 'core-1.img');
    const amx = (fields: Field[]): Field[] =>
      fields.map((f) => (f.no === 1 && f.wire === 0 ? { ...f, value: f.value | (1n << 17n) } : f));
    await writeFile(
      core,
      rewriteImage(await readFile(core), (e) => rewriteMessage(e, editSub(2, editSub(3, editSub(13, amx))))),
    );
    const edited = join(dir, 'amx.tar');
    await run('tar', ['-C', tree, '-cf', edited, '.'], { timeoutMs: 60_000 });
    const before = (await client.listSandboxes()).length;
    const e = await apiError(client.importCheckpoint({ archive: edited, image: layout }));
    assert.equal(e.code, 'RESTORE_INCOMPATIBLE', e.message);
    assert.match(e.message, /CPU lacks features [^;]*amx_tile/);
    assert.equal((await client.listSandboxes()).length, before, 'nothing is left of it');
  });

  test('a podman checkpoint of a container with --network none is refused at import, saying why', async () => {
    const name = await runContainer('while :; do sleep 1; done', [], 'none');
    const archive = join(dir, 'none.tar.zst');
    await podman(['container', 'checkpoint', '--export', archive, name]);
    const e = await apiError(client.importCheckpoint({ archive, image: layout }));
    assert.equal(e.code, 'CHECKPOINT_OUTSIDE_PROFILE');
    assert.match(e.message, /network namespace is inside the checkpoint/);
  });

  test("a CRI-O-layout archive (podman's dump with the kubelet's spec.dump and config.dump) imports and resumes", async (t) => {
    if (counterArchive === undefined) return t.skip('no podman checkpoint was made');
    const tree = join(dir, 'crio');
    await mkdir(tree);
    await run('tar', ['--zstd', '-C', tree, '-xf', counterArchive], { timeoutMs: 60_000 });
    // What CRI-O writes: its annotations name the container and image; config.dump holds the
    // image's name and ref (its id), no podman fields.
    const spec = JSON.parse(await readFile(join(tree, 'spec.dump'), 'utf8')) as Record<string, unknown>;
    const podmanConfig = JSON.parse(await readFile(join(tree, 'config.dump'), 'utf8')) as Record<
      string,
      string
    >;
    spec.annotations = {
      'io.kubernetes.cri-o.ContainerName': 'counter',
      'io.kubernetes.cri-o.ImageName': image,
      'io.kubernetes.container.name': 'counter',
      'io.kubernetes.pod.name': 'counter-pod',
    };
    await writeFile(join(tree, 'spec.dump'), JSON.stringify(spec));
    await writeFile(
      join(tree, 'config.dump'),
      JSON.stringify({
        id: podmanConfig.id,
        name: 'k8s_counter_counter-pod_default_0',
        rootfsImageName: image,
        rootfsImageRef: podmanConfig.rootfsImageID,
      }),
    );
    const archive = join(dir, 'crio.tar');
    await run('tar', ['-C', tree, '-cf', archive, '.'], { timeoutMs: 60_000 });
    const sb = await client.importCheckpoint({ archive, image: layout, ports: [8080] });
    assert.equal(sb.name, 'counter', "the name CRI-O's annotations give");
    const r = await client.resume(sb.id);
    const at = Number(await eventually('httpd answers', () => httpGet(r.address!, 8080, '/count')));
    assert.ok(at >= 3, `the counter carried on (${at})`);
  });
});
