/** A sandbox from an OCI image layout, through the real daemon: the image's defaults apply. */
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdir, mkdtemp, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { type Daemon } from '../daemon/daemon.js';
import { DormantClient } from '../sdk/client.js';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';
import { startTestDaemon, tearDown } from './testing/daemon.js';
import { writeOciLayout } from '../runtime/testing/oci-layout.js';

let dir: string;
let daemon: Daemon;
let client: DormantClient;

before(async () => {
  dir = await mkdtemp('/tmp/dormant-image-e2e-');
  const base = join(dir, 'base');
  await buildBusyboxRootfs(base);
  await mkdir(join(base, 'srv'), { recursive: true });
  await writeFile(join(base, 'srv', 'data.txt'), 'from the image\n');
  await writeOciLayout(join(dir, 'layout'), {
    layers: [base],
    tag: 'latest',
    config: {
      config: {
        Env: ['GREETING=hello from the image config'],
        Cmd: ['sh', '-c', 'echo "$GREETING"; exec sleep 100000'],
        WorkingDir: '/srv',
      },
    },
  });
  ({ daemon, client } = await startTestDaemon({ dataDir: join(dir, 'data'), readonlyBinds: [] }));
});

after(() => tearDown(dir, daemon));

test('create --image without a command runs the image entrypoint with its env and workdir, and hibernates', async () => {
  const sb = await client.createSandbox({ image: `${join(dir, 'layout')}:latest`, env: { EXTRA: 'x' } });
  assert.equal(sb.state, 'running');
  assert.deepEqual(sb.command, ['sh', '-c', 'echo "$GREETING"; exec sleep 100000']);
  const r = await client.exec(sb.id, ['sh', '-c', 'pwd; cat data.txt; echo "$EXTRA"']);
  assert.equal(
    r.stdout,
    '/srv\nfrom the image\nx\n',
    'workdir, files and env (image and user) apply to exec too',
  );
  await client.hibernate(sb.id);
  await client.resume(sb.id);
  assert.match(await client.logs(sb.id), /hello from the image config/);
  const bad = await client.createSandbox({ image: `${join(dir, 'layout')}:nope` }).catch((e: unknown) => e);
  assert.ok(bad instanceof Error);
  assert.match(bad.message, /no image tagged "nope"/);
});
