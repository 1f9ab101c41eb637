/**
 * Hostile archives: each is refused with a clear error and nothing lands outside the
 * target folder. Plus a seeded fuzz of the archive reader over mutated real archives.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, readdir, rm, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { compress } from 'zstd-napi';
import { gzipSync } from 'node:zlib';
import { DormantError } from '../domain/errors.js';
import { extractArchive } from './archive.js';
import { TAR_END, tarHeader, tarPadding } from './tar.js';
import { rng } from '../sys/testing/rng.js';

function entry(name: string, body: string | Buffer, typeflag = '0', linkName = ''): Buffer {
  const b = Buffer.isBuffer(body) ? body : Buffer.from(body);
  const h = tarHeader({ name, size: typeflag === '0' ? b.length : 0, type: 'file' });
  // Rewrite the typeflag (and link name) of the last header block, then its checksum.
  const at = h.length - 512;
  h.write(typeflag, at + 156, 'latin1');
  if (linkName) h.write(linkName, at + 157, 100, 'utf8');
  h.write('        ', at + 148, 'latin1');
  let sum = 0;
  for (let i = 0; i < 512; i++) sum += h[at + i]!;
  h.write(`${sum.toString(8).padStart(6, '0')}\0 `, at + 148, 'latin1');
  return typeflag === '0' ? Buffer.concat([h, b, tarPadding(b.length)]) : h;
}

describe('hostile checkpoint archives', () => {
  let dir = '';
  let n = 0;
  before(async () => {
    dir = await mkdtemp('/dev/shm/dormant-archive-test-');
  });
  after(async () => {
    await rm(dir, { recursive: true, force: true });
  });

  async function attempt(
    archive: Buffer,
    limits: { maxBytes?: number } = {},
  ): Promise<{ err: unknown; outside: string[] }> {
    const case_ = join(dir, `case-${n++}`);
    const target = join(case_, 'target');
    const { mkdir } = await import('node:fs/promises');
    await mkdir(target, { recursive: true });
    const file = join(case_, 'in.tar');
    await writeFile(file, archive);
    let err: unknown;
    try {
      await extractArchive(file, target, limits);
    } catch (e) {
      err = e;
    }
    const outside = (await readdir(case_)).filter((x) => x !== 'target' && x !== 'in.tar');
    return { err, outside };
  }

  const cases: [string, () => Buffer, RegExp, string][] = [
    [
      'path traversal',
      () => Buffer.concat([entry('checkpoint/../../evil', 'x'), TAR_END]),
      /climbs out/,
      'CHECKPOINT_ARCHIVE_INVALID',
    ],
    [
      'absolute path',
      () => Buffer.concat([entry('/tmp/evil', 'x'), TAR_END]),
      /absolute path/,
      'CHECKPOINT_ARCHIVE_INVALID',
    ],
    [
      'symlink out',
      () => Buffer.concat([entry('checkpoint', '', '2', '/etc'), entry('checkpoint/passwd', 'x'), TAR_END]),
      /a link to/,
      'CHECKPOINT_ARCHIVE_INVALID',
    ],
    [
      'hard link',
      () => Buffer.concat([entry('x', '', '1', '/etc/shadow'), TAR_END]),
      /a link to/,
      'CHECKPOINT_ARCHIVE_INVALID',
    ],
    [
      'device node',
      () => Buffer.concat([entry('dev-sda', '', '4'), TAR_END]),
      /blockdev/,
      'CHECKPOINT_ARCHIVE_INVALID',
    ],
    [
      'char device',
      () => Buffer.concat([entry('null', '', '3'), TAR_END]),
      /chardev/,
      'CHECKPOINT_ARCHIVE_INVALID',
    ],
    [
      'truncated',
      () => Buffer.concat([entry('checkpoint/pages-1.img', Buffer.alloc(100_000, 7))]).subarray(0, 50_000),
      /truncated/,
      'CHECKPOINT_ARCHIVE_INVALID',
    ],
    [
      'duplicate member',
      () => Buffer.concat([entry('a', 'x'), entry('a', 'y'), TAR_END]),
      /appears twice/,
      'CHECKPOINT_ARCHIVE_INVALID',
    ],
    [
      'not a tar',
      () => Buffer.from('hello, this is not an archive at all'.repeat(40)),
      /checksum|not a tar/,
      'CHECKPOINT_ARCHIVE_INVALID',
    ],
    [
      'damaged gzip',
      () => gzipSync(Buffer.concat([entry('a', 'x'), TAR_END])).subarray(0, 30),
      /./,
      'CHECKPOINT_ARCHIVE_INVALID',
    ],
  ];
  for (const [name, make, msg, code] of cases) {
    test(name, async () => {
      const { err, outside } = await attempt(make());
      assert.ok(err instanceof DormantError, `${name}: ${String(err)}`);
      assert.equal(err.code, code);
      assert.match(err.message, msg);
      assert.deepEqual(outside, [], 'nothing written outside the target');
    });
  }

  test('decompression bomb: zstd of 64 MiB of zeros stops at the cap', async () => {
    const bomb = compress(
      Buffer.concat([entry('checkpoint/pages-1.img', Buffer.alloc(64 * 1024 * 1024)), TAR_END]),
    );
    assert.ok(bomb.length < 1024 * 1024);
    const { err } = await attempt(bomb, { maxBytes: 8 * 1024 * 1024 });
    assert.ok(err instanceof DormantError);
    assert.equal(err.code, 'CHECKPOINT_ARCHIVE_TOO_LARGE');
  });

  test('a well-formed archive unpacks', async () => {
    const ok = compress(
      Buffer.concat([entry('checkpoint/inventory.img', 'abc'), entry('config.dump', '{}'), TAR_END]),
    );
    const { err } = await attempt(ok);
    assert.equal(err, undefined);
  });

  test('members left in place are stepped over, found where they lie, and truncation still caught', async () => {
    // Bigger than one read (1 MiB), with a member after it that must still be unpacked.
    const pages = Buffer.alloc(3 * 1024 * 1024 + 4096);
    for (let i = 0; i < pages.length; i += 4096) pages.writeUInt32LE(i, i);
    const tar = Buffer.concat([
      entry('checkpoint/inventory.img', 'abc'),
      entry('checkpoint/pages-1.img', pages),
      entry('checkpoint/pstree.img', 'tree'),
      TAR_END,
    ]);
    const file = join(dir, `in-place-${++n}.tar`);
    await writeFile(file, tar);
    const dest = await mkdtemp(join(dir, 'x-'));
    const r = await extractArchive(file, dest, { leaveInPlace: (rel) => rel === 'checkpoint/pages-1.img' });
    assert.deepEqual(r.files.sort(), ['checkpoint/inventory.img', 'checkpoint/pstree.img']);
    const at = r.inPlace.get('checkpoint/pages-1.img')!;
    assert.equal(at.size, pages.length);
    assert.ok(tar.subarray(at.offset, at.offset + at.size).equals(pages), 'the member lies at its offset');
    assert.equal(r.bytes, tar.length);

    const cut = join(dir, `in-place-${++n}.tar`);
    await writeFile(cut, tar.subarray(0, at.offset + 2 * 1024 * 1024));
    await assert.rejects(
      extractArchive(cut, await mkdtemp(join(dir, 'x-')), {
        leaveInPlace: (rel) => rel.endsWith('pages-1.img'),
      }),
      /truncated inside checkpoint\/pages-1.img/,
    );
  });

  test('fuzz: 300 mutations of a real-shaped archive (seed 7) fail only with archive errors', async () => {
    const src = Buffer.concat([
      entry('checkpoint/inventory.img', 'a'.repeat(700)),
      entry('config.dump', '{"id":"x"}'),
      entry('spec.dump', '{}'),
      TAR_END,
    ]);
    const r = rng(7);
    for (let i = 0; i < 300; i++) {
      const b = Buffer.from(src);
      for (let k = 0; k < 1 + Math.floor(r() * 6); k++) b[Math.floor(r() * b.length)] = Math.floor(r() * 256);
      const cut = r() < 0.3 ? b.subarray(0, Math.floor(r() * b.length)) : b;
      const { err, outside } = await attempt(cut);
      if (err !== undefined) {
        assert.ok(
          err instanceof DormantError,
          `round ${i}: ${err instanceof Error ? err.message : typeof err}`,
        );
        assert.match(err.code, /^CHECKPOINT_ARCHIVE_/);
      }
      assert.deepEqual(outside, []);
    }
  });
});
