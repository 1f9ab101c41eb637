/**
 * Files inside a sandbox through the toolbox, against a real daemon and real sandboxes: a
 * 1 MiB random file byte for byte both ways through the API and through `dormant cp`, the
 * folder operations and their errors, paths that try to leave the sandbox (`..`, a symlink to
 * /) staying inside it, a watch, and a hibernated sandbox woken by a file read.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { createHash, randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { readFile, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import type { Daemon } from '../daemon/daemon.js';
import type { DormantClient, SandboxInfo } from '../sdk/client.js';
import { eventually } from './testing/host.js';
import { startTestDaemon, tearDown, testFolder } from './testing/daemon.js';
import { call, dormant, json, lines, type Line } from './testing/toolbox.js';

interface FileInfo {
  name: string;
  path: string;
  type: string;
  size: number;
  mode: number;
}

describe('the toolbox: files', () => {
  let dir: string;
  let daemon: Daemon;
  let client: DormantClient;
  let sb: SandboxInfo;
  const files = (rest: string, path: string): string =>
    `/v1/sandboxes/${sb.id}/files${rest}?path=${encodeURIComponent(path)}`;
  const read = async (path: string): Promise<Buffer> => {
    const res = await call(daemon, 'GET', files('', path));
    assert.equal(res.status, 200, `GET ${path}`);
    return Buffer.from(await res.arrayBuffer());
  };
  const errorCode = async (res: Response): Promise<string> =>
    ((await res.json()) as { error: { code: string } }).error.code;

  before(async () => {
    let rootfs: string;
    ({ dir, rootfs } = await testFolder('files'));
    ({ daemon, client } = await startTestDaemon({ dataDir: join(dir, 'data'), policy: false }));
    sb = await client.createSandbox({
      name: 'files',
      rootfs,
      command: ['/bin/sh', '-c', 'while true; do sleep 1; done'],
      memory: '128M',
    });
  });

  after(() => tearDown(dir, daemon));

  test('a 1 MiB random file through the API, both ways, byte for byte', async () => {
    const data = randomBytes(1024 * 1024);
    const put = await call(daemon, 'PUT', `${files('', '/srv/in/random.bin')}&mode=600`, data);
    assert.deepEqual(await json(put), { path: '/srv/in/random.bin', size: data.length });
    const back = await call(daemon, 'GET', files('', '/srv/in/random.bin'));
    assert.equal(back.headers.get('content-length'), String(data.length));
    assert.ok(Buffer.from(await back.arrayBuffer()).equals(data), 'the bytes read are the bytes written');
    const sum = await client.exec(sb.id, ['sh', '-c', 'md5sum /srv/in/random.bin | cut -d" " -f1']);
    assert.equal(sum.stdout.trim(), createHash('md5').update(data).digest('hex'));
    const st = await json<FileInfo>(await call(daemon, 'GET', files('/stat', '/srv/in/random.bin')));
    assert.deepEqual([st.type, st.size, st.mode & 0o777], ['file', data.length, 0o600]);
  });

  test('dormant cp: 1 MiB both ways byte for byte, stdin and stdout, a folder refused', async () => {
    const data = randomBytes(1024 * 1024);
    const local = join(dir, 'up.bin');
    await writeFile(local, data);
    const up = await dormant(daemon, ['cp', local, `${sb.id}:/srv/cp/`]);
    assert.equal(up.code, 0, up.stderr);
    assert.ok((await read('/srv/cp/up.bin')).equals(data), 'into a folder: under its own name');
    const down = join(dir, 'down.bin');
    const got = await dormant(daemon, ['cp', `${sb.id}:/srv/cp/up.bin`, down]);
    assert.equal(got.code, 0, got.stderr);
    assert.ok((await readFile(down)).equals(data));
    const toStdout = await dormant(daemon, ['cp', `files:/srv/cp/up.bin`, '-']);
    assert.ok(toStdout.stdout.equals(data), 'by name, to stdout');
    const fromStdin = await dormant(
      daemon,
      ['cp', '-', `${sb.id}:/srv/cp/stdin.bin`],
      data.subarray(0, 1000),
    );
    assert.equal(fromStdin.code, 0, fromStdin.stderr);
    assert.ok((await read('/srv/cp/stdin.bin')).equals(data.subarray(0, 1000)));
    const folder = await dormant(daemon, ['cp', dir, `${sb.id}:/srv/`]);
    assert.notEqual(folder.code, 0);
    assert.match(folder.stderr, /folder/);
    const missing = await dormant(daemon, ['cp', `${sb.id}:/nope`, down]);
    assert.match(missing.stderr, /FILE_NOT_FOUND/);
  });

  test('list, mkdir, rename, remove, and their errors', async () => {
    const post = (op: string, body: unknown) =>
      call(daemon, 'POST', `/v1/sandboxes/${sb.id}/files/${op}`, body);
    assert.deepEqual(await json(await post('mkdir', { path: '/srv/d/e' })), { created: true });
    assert.deepEqual(await json(await post('mkdir', { path: '/srv/d/e' })), { created: false });
    await json(await call(daemon, 'PUT', files('', '/srv/d/e/f.txt'), Buffer.from('hello')));
    const ls = await json<{ entries: FileInfo[] }>(
      await call(daemon, 'GET', `${files('/list', '/srv/d')}&depth=2`),
    );
    assert.deepEqual(
      ls.entries.map((e) => [e.path, e.type]),
      [
        ['/srv/d/e', 'dir'],
        ['/srv/d/e/f.txt', 'file'],
      ],
    );
    assert.deepEqual(await json(await post('rename', { from: '/srv/d/e/f.txt', to: '/srv/d/g.txt' })), {});
    assert.equal((await read('/srv/d/g.txt')).toString(), 'hello');
    const gone = await call(daemon, 'GET', files('/stat', '/srv/d/e/f.txt'));
    assert.deepEqual([gone.status, await errorCode(gone)], [404, 'FILE_NOT_FOUND']);
    const dirRead = await call(daemon, 'GET', files('', '/srv/d'));
    assert.deepEqual([dirRead.status, await errorCode(dirRead)], [400, 'IS_A_DIRECTORY']);
    assert.deepEqual(await json(await post('remove', { path: '/srv/d' })), {});
    const again = await post('remove', { path: '/srv/d' });
    assert.deepEqual([again.status, await errorCode(again)], [404, 'FILE_NOT_FOUND']);
    const bad = await call(daemon, 'GET', `/v1/sandboxes/${sb.id}/files/stat`);
    assert.equal(bad.status, 400);
  });

  test('paths stay inside the sandbox: .. and a symlink to / are contained', async () => {
    // A file only the host has (this test's folder), and one only the sandbox has.
    const hostFile = join(dir, 'host-only.txt');
    await writeFile(hostFile, 'host');
    await json(await call(daemon, 'PUT', files('', '/srv/where.txt'), Buffer.from('inside')));
    assert.equal((await read('/../../../srv/where.txt')).toString(), 'inside');
    const viaDots = await call(daemon, 'GET', files('', `/../../..${hostFile}`));
    assert.deepEqual([viaDots.status, await errorCode(viaDots)], [404, 'FILE_NOT_FOUND']);
    await client.exec(sb.id, ['ln', '-s', '/', '/tmp/root']);
    assert.equal((await read('/tmp/root/srv/where.txt')).toString(), 'inside');
    const viaLink = await call(daemon, 'GET', files('', `/tmp/root${hostFile}`));
    assert.deepEqual([viaLink.status, await errorCode(viaLink)], [404, 'FILE_NOT_FOUND']);
    const marker = `dormant-escape-${randomBytes(6).toString('hex')}`;
    await json(await call(daemon, 'PUT', files('', `/tmp/root/tmp/${marker}`), Buffer.from('x')));
    await json(await call(daemon, 'PUT', files('', `../../../../tmp/${marker}-2`), Buffer.from('x')));
    assert.equal(existsSync(`/tmp/${marker}`), false, 'nothing written on the host through the symlink');
    assert.equal(existsSync(`/tmp/${marker}-2`), false, 'nothing written on the host through ..');
    const inside = await client.exec(sb.id, ['ls', `/tmp/${marker}`, `/tmp/${marker}-2`]);
    assert.equal(inside.exitCode, 0, 'both landed inside the sandbox');
  });

  test('watch: a change under the folder arrives as an event', async () => {
    await json(await call(daemon, 'POST', `/v1/sandboxes/${sb.id}/files/mkdir`, { path: '/srv/w' }));
    const ac = new AbortController();
    const res = await call(
      daemon,
      'GET',
      `${files('/watch', '/srv/w')}&recursive=true`,
      undefined,
      ac.signal,
    );
    assert.equal(res.status, 200);
    const seen: Line[] = [];
    const reading = (async () => {
      try {
        for await (const l of lines(res)) seen.push(l);
      } catch {
        // aborted below
      }
    })();
    await eventually('an event for the new file', async () => {
      await client.exec(sb.id, ['sh', '-c', 'echo hi >> /srv/w/new.txt']);
      assert.ok(
        seen.some((e) => e['path'] === '/srv/w/new.txt'),
        JSON.stringify(seen),
      );
    });
    ac.abort();
    await reading;
  });

  test('a file read wakes a hibernated sandbox', async () => {
    await json(await call(daemon, 'PUT', files('', '/srv/sleep.txt'), Buffer.from('zzz')));
    assert.equal((await client.hibernate(sb.id)).state, 'hibernated');
    assert.equal((await read('/srv/sleep.txt')).toString(), 'zzz');
    assert.equal((await client.getSandbox(sb.id)).state, 'running');
  });
});
