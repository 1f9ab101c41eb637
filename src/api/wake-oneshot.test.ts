/**
 * The wake proxy finds out that a woken sandbox listens without connecting to it: a server
 * that accepts one connection (busybox `nc -l`) must serve the client that woke it, not a
 * probe of the proxy's (issue 24: the client was lost on 2 of 3 wakes).
 */
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { connect } from 'node:net';
import { join } from 'node:path';
import type { Daemon } from '../daemon/daemon.js';
import type { DormantClient } from '../sdk/client.js';
import { startTestDaemon, tearDown, testFolder } from './testing/daemon.js';

let dir: string;
let rootfs: string;
let daemon: Daemon;
let client: DormantClient;

before(async () => {
  ({ dir, rootfs } = await testFolder('oneshot'));
  ({ daemon, client } = await startTestDaemon({
    dataDir: join(dir, 'data'),
    policy: false,
    proxy: { domain: 'dormant.test', tcp: 'all' },
  }));
});

after(() => tearDown(dir, daemon));

/** Everything a TCP server sends before it closes. */
function readAll(host: string, port: number): Promise<string> {
  return new Promise((resolve, reject) => {
    const s = connect({ host, port });
    let got = '';
    s.setTimeout(60_000, () => s.destroy(new Error('timeout')));
    s.setEncoding('utf8');
    s.on('data', (d: string) => (got += d));
    s.on('end', () => resolve(got));
    s.on('error', reject);
  });
}

test('a raw TCP client that wakes a one-shot server gets its one answer', async () => {
  const sb = await client.createSandbox({
    name: 'oneshot',
    rootfs,
    // Accepts once, answers its hostname, and stays up (so the sandbox keeps running).
    command: ['sh', '-c', 'nc -l -p 9090 -e /bin/hostname; sleep 3600'],
    ports: [9090],
    memory: '64M',
  });
  // Listening before the hibernate, so the checkpoint holds the listener.
  for (let i = 0; i < 100 && !(await daemon.controller.listensOn(sb.id, 9090)); i++)
    await new Promise((r) => setTimeout(r, 50));
  await client.hibernate(sb.id);
  const { tcp } = await client.sandboxUrl(sb.id, 9090);
  const [host, port] = tcp!.split(':');
  assert.equal((await readAll(host!, Number(port))).trim(), 'oneshot');
});
