/**
 * The scan on worker threads: a secret split across a chunk boundary, its two halves read by
 * two different workers, is still found (the seam); the detectors never run on the scan's
 * own thread; and no worker thread outlives its scan, whether it ends, is aborted or fails.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { rm } from 'node:fs/promises';
import { join } from 'node:path';
import { threadId } from 'node:worker_threads';
import { scanCheckpoint, type ScanOptions } from './scan.js';
import { liveScanWorkers } from './scan-pool.js';
import { openCheckpointPath, type OpenedCheckpoint } from './source.js';
import { dump, kill, shm, startPython } from './testing/fixtures.js';

/** OS threads of this process now. */
function osThreads(): number {
  return Number(/^Threads:\s+(\d+)$/m.exec(readFileSync('/proc/self/status', 'utf8'))![1]);
}

describe('checkpoint scan on worker threads', { timeout: 120_000 }, () => {
  let dir = '';
  let ck: OpenedCheckpoint;
  // 40 copies, each across a page boundary, 3 to 17 bytes before it.
  const secret = ['AKIA', 'W'.repeat(12), '7SPL'].join('');
  const copies = 40;

  before(async () => {
    dir = await shm('dormant-scan-workers-test-');
    const code = `
import ctypes, sys, time
key = bytes.fromhex('${Buffer.from(secret).toString('hex')}')
buf = bytearray(4096 * 64)
addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
first = 4096 - addr % 4096
for i in range(${copies}):
    at = first + 4096 * i - 3 - i % 15
    # 20 variants, each a finding of its own, seen twice: the findings' order and the place
    # each names (its first) follow the order the chunks were read in.
    buf[at:at + len(key)] = key[:-2] + b'%02d' % (i % 20)
pad = bytearray(8 * 1024 * 1024)
open(sys.argv[1], 'w').write('ok')
time.sleep(3600)
`;
    const pid = await startPython(code, dir);
    try {
      await dump(pid, join(dir, 'images'));
    } finally {
      kill(pid);
    }
    ck = await openCheckpointPath(join(dir, 'images'));
  });
  after(async () => {
    await ck?.close();
    await rm(dir, { recursive: true, force: true });
  });

  async function count(opts: ScanOptions): Promise<number> {
    const r = await scanCheckpoint(ck, { fingerprintKey: Buffer.alloc(32, 3), ...opts });
    return r.findings
      .filter((f) => f.kind === 'aws_access_key' && f.where === 'memory')
      .reduce((n, f) => n + f.occurrences, 0);
  }

  test('a secret split across a chunk boundary read by two workers is found', async () => {
    const threads: number[] = [];
    const found = await count({ workers: 2, chunkBytes: 4096, onChunk: (c) => threads.push(c.thread) });
    // Every copy straddles a page boundary: with page-sized chunks each is split in two. (The
    // one more is python's own `key`.)
    assert.equal(found, copies + 1, 'each split copy found once');
    assert.equal(new Set(threads).size, 2, 'two workers scanned the chunks');
    assert.ok(!threads.includes(threadId), 'no chunk was scanned on the scan thread');
    for (let i = 1; i < threads.length; i++)
      assert.notEqual(threads[i], threads[i - 1], `chunks ${i - 1} and ${i} went to different workers`);
    assert.equal(await count({ workers: 0 }), copies + 1, 'the same without workers, in 4 MiB chunks');
  });

  test('the same findings, places and occurrences with and without workers', async () => {
    const key = Buffer.alloc(32, 9);
    for (const chunkBytes of [4096, 12288, undefined]) {
      const opts = { fingerprintKey: key, ...(chunkBytes !== undefined ? { chunkBytes } : {}) };
      const inline = await scanCheckpoint(ck, { ...opts, workers: 0 });
      const pooled = await scanCheckpoint(ck, { ...opts, workers: 2 });
      assert.ok(inline.findings.length >= 20);
      assert.deepEqual(pooled.findings, inline.findings, `chunkBytes ${chunkBytes}`);
      assert.deepEqual(pooled.scanned, inline.scanned);
    }
  });

  test('no worker thread outlives its scan: done, aborted or failed', async () => {
    await count({ workers: 2 }); // the fs thread pool is up from here on
    const base = osThreads();
    await count({ workers: 3, chunkBytes: 4096 });
    assert.equal(liveScanWorkers(), 0, 'after a scan');
    assert.equal(osThreads(), base, 'OS threads after a scan');

    const ac = new AbortController();
    await assert.rejects(
      count({ workers: 2, chunkBytes: 4096, signal: ac.signal, onChunk: () => ac.abort() }),
      (e: Error) => e.name === 'AbortError',
    );
    assert.equal(liveScanWorkers(), 0, 'after an aborted scan');
    assert.equal(osThreads(), base, 'OS threads after an aborted scan');

    // The scan fails while chunks are out on the workers.
    await assert.rejects(
      scanCheckpoint(ck, {
        workers: 2,
        onChunk: () => {
          throw new Error('the scan must stop here');
        },
      }),
      /must stop here/,
    );
    assert.equal(liveScanWorkers(), 0, 'after a failed scan');
    assert.equal(osThreads(), base, 'OS threads after a failed scan');
  });
});
