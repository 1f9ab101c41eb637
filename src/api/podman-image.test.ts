/**
 * A dormant checkpoint as an OCI image, restored by podman: a busybox counter hibernates,
 * `dormant checkpoint export --format oci` writes the image layout, skopeo copies it into
 * podman's image store, and bookworm's podman 4.3 restores a container from that image
 * (`podman container restore IMAGE`). The counter goes on from where it was, with the token
 * only the shell's memory held (the file it came from was removed). The same checkpoint exported
 * with `--encrypt` is decrypted by skopeo on its way into podman's store (ocicrypt, the
 * recipient's private key) and restores the same way.
 *
 * podman takes an image as a checkpoint only when its manifest names the runtime the dump was
 * taken with (`io.podman.annotations.checkpoint.runtime.name`, which must be the runtime podman
 * runs): an image without it is "not a checkpoint".
 *
 * Needs podman and skopeo running containers with runc; skipped without. No user namespace:
 * podman restores only dumps taken in the host's. The base image is in podman under the name
 * config.dump gives it, as podman's restore looks it up there. Every container and image the
 * test makes has a name of its own and is removed afterwards.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { generateKeyPairSync, randomBytes } from 'node:crypto';
import { mkdtemp, readFile, writeFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { Daemon } from '../daemon/daemon.js';
import type { DormantClient } from '../sdk/client.js';
import { run } from '../sys/exec.js';
import { startTestDaemon, tearDown } from './testing/daemon.js';
import { eventually } from './testing/host.js';
import { busyboxImage, installed, podman } from './testing/podman.js';

const BIN = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'bin', 'dormant');

const missing = !(await installed('podman')) ? 'podman' : !(await installed('skopeo')) ? 'skopeo' : undefined;

/** pid 1 reads /tok into memory, removes it, then counts into /count (see podman-export.test). */
const COUNTER =
  'while [ ! -f /tok ]; do sleep 0.1; done; tok=$(cat /tok); rm /tok; ' +
  'i=0; while :; do i=$((i+1)); echo "$tok $i" > /count; sleep 0.2; done';

describe(
  'dormant checkpoint images for podman',
  { skip: missing ? `${missing} is not installed` : false },
  () => {
    const tag = randomBytes(4).toString('hex');
    const base = `localhost/dormant-image-test-base-${tag}:latest`;
    const ckptImage = `localhost/dormant-image-test-ckpt-${tag}:latest`;
    const encImage = `localhost/dormant-image-test-enc-${tag}:latest`;
    const container = `dormant-image-test-${tag}`;
    const encContainer = `dormant-image-test-enc-${tag}`;
    /** The hibernated counter: its checkpoint, its token and its count before the hibernate. */
    let counter: { checkpointId: string; token: string; before: number } | undefined;
    let dir: string;
    let layout: string;
    let daemon: Daemon;
    let client: DormantClient;

    before(async () => {
      dir = await mkdtemp('/tmp/dormant-podman-image-');
      layout = await busyboxImage(dir, base);
      ({ daemon, client } = await startTestDaemon({
        dataDir: join(dir, 'data'),
        proxy: false,
        policy: false,
        allowedSourceRoots: [dir],
        userNamespace: false,
      }));
    });

    after(async () => {
      for (const c of [container, encContainer]) await podman(['rm', '-f', c]).catch(() => undefined);
      for (const i of [ckptImage, encImage]) await podman(['rmi', '-f', i]).catch(() => undefined);
      await podman(['rmi', '-f', base]).catch(() => undefined);
      await tearDown(dir, daemon);
    });

    /** `dormant checkpoint export --format oci` with the CLI, as a user would. */
    const exportImage = (checkpointId: string, out: string, extra: string[] = []) =>
      run(
        process.execPath,
        [BIN, 'checkpoint', 'export', checkpointId, '--format', 'oci', '--out', out, '--json', ...extra],
        {
          timeoutMs: 120_000,
          env: { ...process.env, DORMANT_URL: daemon.url, DORMANT_TOKEN: daemon.adminToken, NO_COLOR: '1' },
        },
      );

    /** podman restores `name` from `image`; the counter goes on with the token, pid 1 the shell. */
    const restoresAndCounts = async (image: string, name: string) => {
      assert.ok(counter, 'the counter hibernated');
      await podman(['container', 'restore', '--runtime', 'runc', '--name', name, image]).catch(
        async (e: unknown) => {
          // CRIU's reason is in the restore log podman names, which goes with the container.
          const log = /log file: (\S+)/.exec(e instanceof Error ? e.message : String(e))?.[1];
          const why = log ? (await readFile(log, 'utf8').catch(() => '')).match(/^.*Error.*$/gm) : null;
          throw new Error(`podman's restore failed: ${(why ?? []).join('\n') || String(e)}`, { cause: e });
        },
      );
      const inPodman = async () => (await podman(['exec', name, 'cat', '/count'])).stdout.trim().split(' ');
      const [tok, at] = await inPodman();
      assert.equal(
        tok,
        counter.token,
        "the shell's memory came back: the token it read before /tok was removed",
      );
      assert.ok(
        Number(at) >= counter.before,
        `the counter carried on (${at} after ${counter.before} before the hibernate)`,
      );
      await eventually('the counter goes on under podman', async () =>
        assert.ok(Number((await inPodman())[1]) > Number(at)),
      );
      const pid1 = (await podman(['exec', name, 'cat', '/proc/1/cmdline'])).stdout.split('\0');
      assert.deepEqual(pid1.slice(0, 2), ['sh', '-c'], "pid 1 is the sandbox's shell");
      await podman(['rm', '-f', name]);
    };

    test('a hibernated sandbox exported as an OCI image restores under podman from the image: the counter goes on in its memory', async () => {
      const sb = await client.createSandbox({
        name: 'counter',
        image: layout,
        command: ['sh', '-c', COUNTER],
      });
      const token = randomBytes(6).toString('hex');
      await client.exec(sb.id, ['sh', '-c', `echo ${token} > /tok`]);
      const inSandbox = async () => (await client.exec(sb.id, ['cat', '/count'])).stdout.trim().split(' ');
      await eventually('the counter runs', async () => assert.ok(Number((await inSandbox())[1]) >= 3));
      const before = Number((await inSandbox())[1]);
      const h = await client.hibernate(sb.id);
      assert.ok(h.checkpointId);
      counter = { checkpointId: h.checkpointId, token, before };

      const out = join(dir, 'image');
      await exportImage(h.checkpointId, out, ['--allow-plaintext']);
      await run('skopeo', ['copy', `oci:${out}:latest`, `containers-storage:${ckptImage}`], {
        timeoutMs: 120_000,
      });
      await restoresAndCounts(ckptImage, container);
    });

    test('the same checkpoint exported with --encrypt is decrypted by skopeo into podman and restores the same way', async () => {
      assert.ok(counter, 'the counter hibernated');
      const { publicKey, privateKey } = generateKeyPairSync('rsa', { modulusLength: 2048 });
      const pub = join(dir, 'pub.pem');
      const priv = join(dir, 'priv.pem');
      await writeFile(pub, publicKey.export({ type: 'spki', format: 'pem' }));
      await writeFile(priv, privateKey.export({ type: 'pkcs8', format: 'pem' }), { mode: 0o600 });
      const out = join(dir, 'image-enc');
      await exportImage(counter.checkpointId, out, ['--encrypt', '--recipient', `jwe:${pub}`]);
      await run(
        'skopeo',
        ['copy', '--decryption-key', priv, `oci:${out}:latest`, `containers-storage:${encImage}`],
        { timeoutMs: 120_000 },
      );
      await restoresAndCounts(encImage, encContainer);
    });
  },
);
