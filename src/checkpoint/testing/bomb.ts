/**
 * Test-only: decompression bombs, made by streaming zeros through the compressor, so a 4 GiB
 * member costs the test a few seconds and 1 MiB of memory, never 4 GiB of disk or memory.
 */
import { createWriteStream } from 'node:fs';
import { Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { createGzip } from 'node:zlib';
import { CompressStream } from 'zstd-napi';
import { TAR_END, tarHeader, tarPadding } from '../tar.js';

/** A tar archive of `members` (name and size) whose bytes are all zeros, compressed. */
export async function writeZeroBomb(
  path: string,
  members: { name: string; sizeBytes: number }[],
  compression: 'zstd' | 'gzip',
): Promise<void> {
  const zeros = Buffer.alloc(1024 * 1024);
  function* tar(): Generator<Buffer> {
    for (const m of members) {
      yield tarHeader({ name: m.name, size: m.sizeBytes, type: 'file' });
      for (let left = m.sizeBytes; left > 0; left -= zeros.length)
        yield left >= zeros.length ? zeros : zeros.subarray(0, left);
      yield tarPadding(m.sizeBytes);
    }
    yield TAR_END;
  }
  await pipeline(
    Readable.from(tar(), { objectMode: false }),
    compression === 'zstd' ? new CompressStream() : createGzip({ level: 1 }),
    createWriteStream(path, { flags: 'wx', mode: 0o600 }),
  );
}
