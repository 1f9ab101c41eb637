/**
 * The log file: private (0600) whatever was there, rotated by size with N old files kept
 * (numbered like logrotate's, .1 the newest), opened again after an outside rename; and the
 * logger writes JSON lines into it.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, readFile, readdir, rename, rm, stat, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { LogFile, createLogger } from './log.js';

async function withDir(fn: (dir: string) => Promise<void>): Promise<void> {
  const dir = await mkdtemp(join(tmpdir(), 'dormant-logfile-'));
  try {
    await fn(dir);
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}

const mode = async (p: string): Promise<number> => (await stat(p)).mode & 0o777;

test('a log file is made 0600, and one already there is made private too', () =>
  withDir(async (dir) => {
    const fresh = join(dir, 'sub', 'fresh.log');
    const f1 = new LogFile({ path: fresh, maxBytes: 0, keep: 3 });
    f1.write('one\n');
    f1.close();
    assert.equal(await mode(fresh), 0o600);
    const old = join(dir, 'old.log');
    await writeFile(old, 'before\n', { mode: 0o644 });
    const f2 = new LogFile({ path: old, maxBytes: 0, keep: 3 });
    f2.write('after\n');
    f2.close();
    assert.equal(await mode(old), 0o600);
    assert.equal(await readFile(old, 'utf8'), 'before\nafter\n', 'appended, not truncated');
  }));

test('rotates by size: no file past the limit, N old ones kept, newest first, no line lost or cut', () =>
  withDir(async (dir) => {
    const path = join(dir, 'd.log');
    const f = new LogFile({ path, maxBytes: 100, keep: 2 });
    // 40 lines of 10 bytes: 4 files' worth; with 2 kept, the oldest 2 files' worth are gone.
    for (let i = 0; i < 40; i++) f.write(`line ${String(i).padStart(4, '0')}\n`);
    f.close();
    assert.deepEqual((await readdir(dir)).sort(), ['d.log', 'd.log.1', 'd.log.2']);
    const all: string[] = [];
    for (const name of ['d.log.2', 'd.log.1', 'd.log']) {
      const p = join(dir, name);
      assert.ok((await stat(p)).size <= 100, `${name} within the limit`);
      assert.equal(await mode(p), 0o600, `${name} private`);
      all.push(...(await readFile(p, 'utf8')).split('\n').filter((l) => l !== ''));
    }
    // The newest 30 lines, in order, each whole.
    assert.deepEqual(
      all,
      Array.from({ length: 30 }, (_, i) => `line ${String(i + 10).padStart(4, '0')}`),
    );
  }));

test('keep 0: the file starts over, nothing kept beside it', () =>
  withDir(async (dir) => {
    const path = join(dir, 'd.log');
    const f = new LogFile({ path, maxBytes: 20, keep: 0 });
    for (let i = 0; i < 5; i++) f.write(`0123456789\n`);
    f.close();
    assert.deepEqual(await readdir(dir), ['d.log']);
    assert.equal(await readFile(path, 'utf8'), '0123456789\n');
  }));

test('reopen: after logrotate renames the file, the next lines go to a new one', () =>
  withDir(async (dir) => {
    const path = join(dir, 'd.log');
    const f = new LogFile({ path, maxBytes: 0, keep: 1 });
    f.write('before\n');
    await rename(path, `${path}.moved`);
    f.write('still the old file\n');
    f.reopen();
    f.write('after\n');
    f.close();
    assert.equal(await readFile(`${path}.moved`, 'utf8'), 'before\nstill the old file\n');
    assert.equal(await readFile(path, 'utf8'), 'after\n');
    assert.equal(await mode(path), 0o600);
  }));

test('the logger writes one JSON object a line to the file, at its level', () =>
  withDir(async (dir) => {
    const path = join(dir, 'd.log');
    const sink = new LogFile({ path, maxBytes: 0, keep: 1 });
    const log = createLogger({ level: 'info', sink });
    log.debug('not at info');
    log.info({ sandbox: 'sb1' }, 'hello');
    log.level = 'debug';
    log.debug('now it is');
    sink.close();
    const lines = (await readFile(path, 'utf8'))
      .trim()
      .split('\n')
      .map((l) => JSON.parse(l) as Record<string, unknown>);
    assert.deepEqual(
      lines.map((l) => l.msg),
      ['hello', 'now it is'],
    );
    assert.equal(lines[0]!.sandbox, 'sb1');
  }));
