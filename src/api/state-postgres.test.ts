/**
 * A daemon whose database of record is PostgreSQL (`--state postgres://...`): sandboxes made,
 * hibernated and resumed with their memory, their rows in PostgreSQL and no state.db on the
 * node; a restarted daemon finds them; a second process as the same node (the host's name) is
 * refused until the first lets go of it.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { hostname } from 'node:os';
import pg from 'pg';
import { stagingDirFor, type Daemon } from '../daemon/daemon.js';
import { DormantError } from '../domain/errors.js';
import type { DormantClient, SandboxInfo } from '../sdk/client.js';
import { pgMissing, startPostgres, type TestPostgres } from '../state/testing/postgres.js';
import { COUNTER_SERVER_PY } from './testing/servers.js';
import { eventually, httpGet } from './testing/host.js';
import { startTestDaemon, stopTestDaemon, tearDown, testFolder } from './testing/daemon.js';

const missing = await pgMissing();

describe('the database of record in PostgreSQL', { skip: missing }, () => {
  let server: TestPostgres;
  let url: string;
  let dir: string;
  let rootfs: string;
  let daemon: Daemon | undefined;
  let client: DormantClient;
  let sb: SandboxInfo;

  const start = async (dataDir: string): Promise<void> => {
    ({ daemon, client } = await startTestDaemon({ dataDir, state: { url } }));
  };
  const stateOf = async (id: string): Promise<string | undefined> => {
    const c = new pg.Client({ connectionString: url });
    await c.connect();
    try {
      const r = await c.query<{ state: string }>('SELECT state FROM sandboxes WHERE id = $1', [id]);
      return r.rows[0]?.state;
    } finally {
      await c.end();
    }
  };

  before(async () => {
    server = await startPostgres();
    url = await server.createDatabase('node');
    ({ dir, rootfs } = await testFolder('pgstate', { 'srv/server.py': COUNTER_SERVER_PY }));
    await start(join(dir, 'data'));
  });

  after(async () => {
    await tearDown(dir, daemon);
    await server.stop();
  });

  test('a sandbox hibernates and resumes with its memory; its rows are in PostgreSQL, no state.db on the node', async () => {
    sb = await client.createSandbox({
      name: 'counter',
      rootfs,
      command: ['/usr/bin/python3', '-u', '/srv/server.py'],
      ports: [8080],
    });
    const [n1, token] = (await eventually('server', () => httpGet(sb.address!, 8080))).split(' ');
    assert.equal(n1, '1');
    assert.equal(await stateOf(sb.id), 'running');
    const h = await client.hibernate(sb.id);
    assert.equal(h.state, 'hibernated');
    assert.equal(await stateOf(sb.id), 'hibernated');
    const r = await client.resume(sb.id);
    assert.equal(r.state, 'running');
    assert.equal(await eventually('resumed server', () => httpGet(r.address!, 8080)), `2 ${token}`);
    assert.equal(existsSync(join(dir, 'data', 'state.db')), false, 'no SQLite database beside PostgreSQL');
  });

  test('a second process as the same node on the database is refused, naming the first; nothing of it is made', async () => {
    const other = join(dir, 'other');
    await assert.rejects(
      startTestDaemon({ dataDir: other, state: { url } }),
      (e: unknown) =>
        e instanceof DormantError &&
        e.code === 'STATE_IN_USE' &&
        e.message.includes(`node ${hostname()} is already running on the state database`) &&
        e.message.includes('(dormant node ') &&
        !e.message.includes(server.password),
    );
    assert.equal(existsSync(join(other, 'state.db')), false);
    // Nor its staging tmpfs: a refused start releases it.
    assert.ok(
      !readFileSync('/proc/mounts', 'utf8').includes(` ${stagingDirFor(other)} `),
      'the refused node left its staging mounted',
    );
    assert.equal(await stateOf(sb.id), 'running', 'the first node’s sandbox is untouched');
  });

  test('a restarted daemon finds its sandbox running, from PostgreSQL', async () => {
    await daemon!.close();
    daemon = undefined;
    await start(join(dir, 'data'));
    const s = await client.getSandbox(sb.id);
    assert.equal(s.state, 'running');
    assert.match(await httpGet(s.address!, 8080), /^3 /);
  });

  test('once the first node is gone, another may take the database', async () => {
    await stopTestDaemon(daemon);
    daemon = undefined;
    await start(join(dir, 'other'));
    assert.deepEqual(await client.listSandboxes(), []);
  });
});
