/**
 * A node's backup (`dormant vault export` while the daemon runs) imported into a fresh data
 * directory (`dormant vault import`) brings a hibernated sandbox back with its memory on the
 * new node, given the same master key; a damaged backup, a wrong key and a data directory
 * that already belongs to a node are refused before anything is written.
 */
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { existsSync } from 'node:fs';
import { appendFile, readFile, writeFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { Daemon } from './daemon.js';
import type { DormantClient, SandboxInfo } from '../sdk/client.js';
import { COUNTER_SERVER_PY } from '../api/testing/servers.js';
import { eventually, httpGet } from '../api/testing/host.js';
import { startTestDaemon, stopTestDaemon, tearDown, testFolder } from '../api/testing/daemon.js';

const BIN = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'bin', 'dormant');

function dormant(args: string[], env: Record<string, string> = {}): Promise<{ code: number; out: string }> {
  return new Promise((done) => {
    execFile(
      process.execPath,
      [BIN, ...args],
      { env: { ...process.env, ...env }, timeout: 120_000 },
      (err, o, e) =>
        done({ code: err ? (typeof err.code === 'number' ? err.code : -1) : 0, out: `${o}${e}` }),
    );
  });
}

let dir: string;
let rootfs: string;
let first: Daemon | undefined;
let second: Daemon | undefined;

before(async () => {
  ({ dir, rootfs } = await testFolder('backup', { 'srv/server.py': COUNTER_SERVER_PY }));
});
after(() => tearDown(dir, first, second));

test('a backup made while the daemon runs resumes a hibernated sandbox with its memory on a fresh node', async () => {
  const a = join(dir, 'a');
  let client: DormantClient;
  ({ daemon: first, client } = await startTestDaemon({ dataDir: a, policy: false }));
  const sb: SandboxInfo = await client.createSandbox({
    name: 'counter',
    rootfs,
    command: ['/usr/bin/python3', '-u', '/srv/server.py'],
    ports: [8080],
  });
  await eventually('server', () => httpGet(sb.address!, 8080));
  const token = (await httpGet(sb.address!, 8080)).split(' ')[1];
  await client.hibernate(sb.id);

  const backup = join(dir, 'backup');
  const made = await dormant(['vault', 'export', backup, '--data-dir', a]);
  assert.equal(made.code, 0, made.out);
  assert.match(made.out, /backed up .* file\(s\)/);
  const manifest = JSON.parse(await readFile(join(backup, 'BACKUP.json'), 'utf8')) as {
    files: { path: string }[];
  };
  assert.ok(manifest.files.some((f) => f.path === 'state.db'));
  assert.ok(
    !manifest.files.some((f) => f.path.includes('master.key')),
    'the master key is not in the backup',
  );

  // The old node lets go of the sandbox (its network and ids are host-wide), then stops.
  await stopTestDaemon(first);
  first = undefined;

  const b = join(dir, 'b');
  const key = { DORMANT_MASTER_KEY_FILE: join(a, 'master.key') };
  // A wrong key is refused before anything is written.
  const wrongKey = join(dir, 'wrong.key');
  await writeFile(wrongKey, `${'ab'.repeat(32)}\n`, { mode: 0o600 });
  const refused = await dormant(['vault', 'import', backup, '--data-dir', b], {
    DORMANT_MASTER_KEY_FILE: wrongKey,
  });
  assert.notEqual(refused.code, 0, refused.out);
  assert.ok(!existsSync(join(b, 'state.db')), 'nothing written with a wrong key');

  const imported = await dormant(['vault', 'import', backup, '--data-dir', b], key);
  assert.equal(imported.code, 0, imported.out);
  // Again into the same folder: it belongs to a node now.
  const twice = await dormant(['vault', 'import', backup, '--data-dir', b], key);
  assert.notEqual(twice.code, 0);
  assert.match(twice.out, /already has a state\.db/);

  ({ daemon: second, client } = await startTestDaemon({
    dataDir: b,
    masterKey: { file: join(a, 'master.key'), create: false },
    policy: false,
  }));
  assert.equal((await client.getSandbox(sb.id)).state, 'hibernated');
  const back = await client.resume(sb.id);
  assert.equal(back.state, 'running');
  const answer = await eventually('server after resume', () => httpGet(back.address!, 8080));
  assert.equal(answer.split(' ')[1], token, 'the same process, memory intact, on the new node');
  assert.equal(Number(answer.split(' ')[0]), 3, 'the counter carried on (2 requests before)');
});

test('a damaged backup is refused, naming the file', async () => {
  const backup = join(dir, 'backup');
  const m = JSON.parse(await readFile(join(backup, 'BACKUP.json'), 'utf8')) as { files: { path: string }[] };
  const victim = m.files.find((f) => f.path.startsWith('vault/'))!.path;
  await appendFile(join(backup, victim), 'x');
  const r = await dormant(['vault', 'import', backup, '--data-dir', join(dir, 'c')], {
    DORMANT_MASTER_KEY_FILE: join(dir, 'a', 'master.key'),
  });
  assert.notEqual(r.code, 0);
  assert.match(r.out, new RegExp(`${victim.replaceAll('.', '\\.')} is missing or damaged`));
  assert.ok(!existsSync(join(dir, 'c', 'state.db')));
});

test('a node whose state is in PostgreSQL is not backed up as a folder: the refusal says what to use', async () => {
  const out = join(dir, 'pg-backup');
  const r = await dormant(['vault', 'export', out, '--data-dir', join(dir, 'a')], {
    DORMANT_STATE: 'postgres://dormant:pw@127.0.0.1:1/dormant',
  });
  assert.equal(r.code, 2, r.out);
  assert.match(r.out, /database of record is PostgreSQL/);
  assert.match(r.out, /pg_dump/);
  assert.ok(!r.out.includes(':pw@'));
  assert.ok(!existsSync(out), 'nothing written');
  const i = await dormant(['vault', 'import', join(dir, 'backup'), '--data-dir', join(dir, 'd')], {
    DORMANT_STATE: 'postgres://dormant@127.0.0.1:1/dormant',
  });
  assert.equal(i.code, 2, i.out);
  assert.ok(!existsSync(join(dir, 'd')), 'nothing written');
});
