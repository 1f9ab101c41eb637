/**
 * Bounded memory for archive decompression and parsing, whatever the ratio: the decoders hold
 * no more than about a block beyond what a slow reader asked for, and the caps (member size,
 * total, entries, name length, metadata members, staging room, data after the end) are
 * enforced at each member's header, before its bytes are decoded.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { mkdir, mkdtemp, readFile, readdir, rm, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { setTimeout as sleep } from 'node:timers/promises';
import { gzipSync } from 'node:zlib';
import { compress } from 'zstd-napi';
import { DormantError } from '../domain/errors.js';
import {
  BoundedZstdDecompress,
  extractArchive,
  openTarStream,
  stagingRoom,
  walkArchive,
  type ArchiveLimits,
} from './archive.js';
import { TAR_END, tarHeader, tarPadding } from './tar.js';
import { writeZeroBomb } from './testing/bomb.js';
import { Magic } from '../criu/images/image-file.js';
import { readCriuImages } from '../criu/images/reader.js';

const MIB = 1024 * 1024;
const GIB = 1024 * MIB;

function member(name: string, body: Buffer | string): Buffer {
  const b = Buffer.isBuffer(body) ? body : Buffer.from(body);
  return Buffer.concat([tarHeader({ name, size: b.length, type: 'file' }), b, tarPadding(b.length)]);
}

describe('bounded decompression', () => {
  let dir = '';
  let n = 0;
  before(async () => {
    dir = await mkdtemp('/dev/shm/dormant-bounded-test-');
  });
  after(async () => {
    await rm(dir, { recursive: true, force: true });
  });

  /**
   * A reader that reads nothing for a while, then 64 chunks with a pause after each: the bytes
   * queued in the stream must stay near its high-water mark, not grow toward the 1 GiB inside.
   */
  async function slowReader(
    file: string,
  ): Promise<{ idleQueued: number; maxQueued: number; rssGrowth: number }> {
    const rss0 = process.memoryUsage().rss;
    const { stream } = await openTarStream(file);
    // Let it start: a first read, then nothing.
    stream.read(0);
    await sleep(300);
    const idleQueued = stream.readableLength;
    let maxQueued = idleQueued;
    let chunks = 0;
    for await (const _chunk of stream as AsyncIterable<Buffer>) {
      maxQueued = Math.max(maxQueued, stream.readableLength);
      await sleep(5);
      if (++chunks === 64) break;
    }
    const rssGrowth = process.memoryUsage().rss - rss0;
    stream.destroy();
    return { idleQueued, maxQueued, rssGrowth };
  }

  for (const kind of ['zstd', 'gzip'] as const) {
    test(`${kind}: a slow reader of a 1 GiB bomb gets bounded buffered output`, async () => {
      const file = join(dir, `slow.${kind}`);
      await writeZeroBomb(file, [{ name: 'checkpoint/pages-1.img', sizeBytes: GIB }], kind);
      const r = await slowReader(file);
      assert.ok(r.idleQueued <= 512 * 1024, `queued while idle: ${r.idleQueued} bytes`);
      assert.ok(r.maxQueued <= 512 * 1024, `queued while reading slowly: ${r.maxQueued} bytes`);
      assert.ok(r.rssGrowth < 64 * MIB, `RSS grew by ${r.rssGrowth} bytes`);
    });
  }

  test('BoundedZstdDecompress: round trip over several frames, input in odd-sized pieces', async () => {
    const parts = [randomBytes(300_000), Buffer.alloc(2 * MIB, 7), randomBytes(5)];
    const input = Buffer.concat(parts.map((p) => compress(p)));
    const out: Buffer[] = [];
    const pieces = function* (): Generator<Buffer> {
      for (let i = 0; i < input.length; i += 777) yield input.subarray(i, i + 777);
    };
    await pipeline(
      Readable.from(pieces()),
      new BoundedZstdDecompress(),
      async (src: AsyncIterable<Buffer>) => {
        for await (const c of src) out.push(c);
      },
    );
    assert.ok(Buffer.concat(out).equals(Buffer.concat(parts)));
  });

  test('BoundedZstdDecompress: a stream cut inside a frame is an error', async () => {
    const input = compress(randomBytes(200_000)).subarray(0, 50_000);
    await assert.rejects(
      pipeline(Readable.from([input]), new BoundedZstdDecompress(), async (src: AsyncIterable<Buffer>) => {
        for await (const _ of src);
      }),
      /ends inside a frame/,
    );
  });

  async function extract(
    archive: Buffer,
    limits: ArchiveLimits = {},
  ): Promise<{ err: unknown; files: string[] }> {
    const c = join(dir, `case-${n++}`);
    await mkdir(join(c, 'target'), { recursive: true });
    await writeFile(join(c, 'in'), archive);
    let err: unknown;
    try {
      await extractArchive(join(c, 'in'), join(c, 'target'), limits);
    } catch (e) {
      err = e;
    }
    const files = await readdir(join(c, 'target'), { recursive: true });
    return { err, files: files.sort() };
  }

  function refused(err: unknown, code: string, msg: RegExp): void {
    assert.ok(err instanceof DormantError, String(err));
    assert.equal(err.code, code, err.message);
    assert.match(err.message, msg);
    assert.equal(err.status, code === 'CHECKPOINT_ARCHIVE_TOO_LARGE' ? 413 : 422);
    assert.doesNotMatch(err.message, /\/dev\/shm|\/tmp\//, 'no host path in the message');
  }

  test('a member over its cap is refused at its header: none of its bytes are decoded', async () => {
    const file = join(dir, 'member-cap.zst');
    await writeZeroBomb(
      file,
      [
        { name: 'config.dump', sizeBytes: 10 },
        { name: 'checkpoint/pages-1.img', sizeBytes: 4 * GIB },
      ],
      'zstd',
    );
    const seen: string[] = [];
    let sunk = 0;
    const err = await walkArchive(
      file,
      {
        entry: (h) => {
          seen.push(h.name);
          return (c) => (sunk += c.length);
        },
      },
      { maxMemberBytes: GIB },
    ).then(
      () => undefined,
      (e: unknown) => e,
    );
    refused(
      err,
      'CHECKPOINT_ARCHIVE_TOO_LARGE',
      /member "checkpoint\/pages-1\.img" is 4 GiB, over the cap of 1 GiB/,
    );
    assert.deepEqual(seen, ['config.dump'], 'the oversized member never reaches the visitor');
    assert.equal(sunk, 10);
  });

  test('the total cap counts declared sizes: refused at the member that passes it', async () => {
    const a = Buffer.concat([
      member('checkpoint/a.img', Buffer.alloc(600_000)),
      member('checkpoint/b.img', Buffer.alloc(600_000)),
      TAR_END,
    ]);
    const { err, files } = await extract(compress(a), { maxBytes: MIB });
    refused(
      err,
      'CHECKPOINT_ARCHIVE_TOO_LARGE',
      /member "checkpoint\/b\.img" takes the archive past its cap of 1048576 bytes/,
    );
    assert.deepEqual(files, ['checkpoint', 'checkpoint/a.img']);
  });

  test('metadata members (spec.dump, deleted.files, ...) are capped at 16 MiB', async () => {
    const { err } = await extract(
      Buffer.concat([member('spec.dump', Buffer.alloc(17 * MIB, 0x20)), TAR_END]),
    );
    refused(
      err,
      'CHECKPOINT_ARCHIVE_TOO_LARGE',
      /member "spec\.dump" is 17825792 bytes, over the cap of 16777216 bytes/,
    );
    const log = await extract(
      Buffer.concat([member('checkpoint/dump.log', Buffer.alloc(17 * MIB, 0x20)), TAR_END]),
    );
    refused(log.err, 'CHECKPOINT_ARCHIVE_TOO_LARGE', /member "checkpoint\/dump\.log" is 17825792 bytes/);
    const ok = await extract(Buffer.concat([member('checkpoint/big.img', Buffer.alloc(17 * MIB)), TAR_END]));
    assert.equal(ok.err, undefined, 'an image of that size is fine');
  });

  test('the entry count is capped', async () => {
    const many = Buffer.concat([
      ...Array.from({ length: 11 }, (_, i) => member(`checkpoint/${i}.img`, 'x')),
      TAR_END,
    ]);
    const { err, files } = await extract(many, { maxEntries: 10 });
    refused(err, 'CHECKPOINT_ARCHIVE_TOO_LARGE', /more than 10 entries/);
    assert.equal(files.length, 11, 'the folder and ten files');
  });

  test('names longer than PATH_MAX, or with a part longer than NAME_MAX, are refused', async () => {
    const long = `${'d/'.repeat(2100)}x`;
    refused(
      (await extract(Buffer.concat([member(long, 'x'), TAR_END]))).err,
      'CHECKPOINT_ARCHIVE_INVALID',
      /over the cap of 4096/,
    );
    const wide = `checkpoint/${'n'.repeat(256)}`;
    refused(
      (await extract(Buffer.concat([member(wide, 'x'), TAR_END]))).err,
      'CHECKPOINT_ARCHIVE_INVALID',
      /part over 255 bytes/,
    );
  });

  test('a bomb behind the end of a valid archive is not read', async () => {
    const valid = Buffer.concat([member('config.dump', '{}'), TAR_END]);
    const file = join(dir, 'tail.gz');
    // A second gzip member of 1 GiB of zeros after the archive's end blocks.
    await writeZeroBomb(file, [{ name: 'x', sizeBytes: GIB }], 'gzip');
    const tail = await readFile(file);
    const { err } = await extract(Buffer.concat([gzipSync(valid), tail]));
    refused(err, 'CHECKPOINT_ARCHIVE_INVALID', /bytes after the end of the tar archive/);
    const padded = await extract(gzipSync(Buffer.concat([valid, Buffer.alloc(10240)])));
    assert.equal(padded.err, undefined, 'record padding is fine');
  });

  test('a member that does not fit in staging is refused at its header', async () => {
    const room = await stagingRoom(dir);
    const size = Math.ceil((room + GIB) / 512) * 512;
    // Only the header: the archive would be refused before its bytes are needed.
    const h = tarHeader({ name: 'checkpoint/pages-1.img', size, type: 'file' });
    const { err, files } = await extract(h, { maxMemberBytes: Infinity, maxBytes: Infinity });
    refused(
      err,
      'CHECKPOINT_ARCHIVE_TOO_LARGE',
      /member "checkpoint\/pages-1\.img" \(.* GiB\) does not fit in staging/,
    );
    assert.deepEqual(files, []);
  });

  test('CRIU images: sizes and entry counts from the files are capped before anything is allocated', async () => {
    const images = join(dir, `images-${n++}`);
    await mkdir(images);
    const magic = (m: number): Buffer => {
      const b = Buffer.alloc(4);
      b.writeUInt32LE(m);
      return b;
    };
    // 2,000,000 empty entries: 8 MB of file, but an object each once split.
    await writeFile(
      join(images, 'pstree.img'),
      Buffer.concat([magic(Magic.PSTREE), Buffer.alloc(8_000_000)]),
    );
    await assert.rejects(readCriuImages(images), (e: unknown) => {
      refusedImage(e, /pstree\.img: more than 1000000 entries/);
      return true;
    });
    // One entry that claims to be larger than the file.
    const len = Buffer.alloc(4);
    len.writeUInt32LE(0xfffffff0);
    await writeFile(join(images, 'pstree.img'), Buffer.concat([magic(Magic.PSTREE), len, Buffer.alloc(16)]));
    await assert.rejects(readCriuImages(images), (e: unknown) => {
      refusedImage(e, /runs past the end/);
      return true;
    });
    // A metadata image over the per-image cap is not read at all.
    await writeFile(join(images, 'pstree.img'), Buffer.concat([magic(Magic.PSTREE), Buffer.alloc(65 * MIB)]));
    await assert.rejects(readCriuImages(images), (e: unknown) => {
      refusedImage(e, /pstree\.img is 68157444 bytes, over the 67108864 cap/);
      return true;
    });
  });
});

function refusedImage(e: unknown, msg: RegExp): void {
  assert.ok(e instanceof DormantError, String(e));
  assert.equal(e.code, 'CRIU_IMAGE_MALFORMED');
  assert.equal(e.status, 422);
  assert.match(e.message, msg);
}
