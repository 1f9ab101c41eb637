/**
 * The S3 store against a real S3 server (Ceph's radosgw with its dbstore backend, started per
 * file on loopback): the store contract, the pack cache, S3's failures (a server that stops
 * mid-upload or mid-read, wrong credentials, a missing bucket), and the whole vault on it.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { execFile } from 'node:child_process';
import { mkdir, readdir, stat, writeFile } from 'node:fs/promises';
import { promisify } from 'node:util';
import { join } from 'node:path';
import { DormantError } from '../domain/errors.js';
import { openVault } from './index.js';
import { S3Store, parseS3Url, type S3StoreOptions } from './s3-store.js';
import { diffTrees, removeDir, shmDir } from './testing/fixtures.js';
import { rgwMissing, startRgw, type TestRgw } from './testing/rgw.js';
import { storeContract } from './testing/store-contract.js';

const MiB = 1024 * 1024;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const missing = await rgwMissing();
if (missing !== undefined) process.stderr.write(`skipping the S3 vault tests: ${missing}\n`);

let rgw: TestRgw;
let root: string;
const stores: S3Store[] = [];
let n = 0;

function s3(o: Partial<S3StoreOptions> = {}): S3Store {
  const s = new S3Store({
    bucket: rgw.bucket,
    prefix: `p${++n}/vault`,
    endpoint: rgw.endpoint,
    credentials: { accessKeyId: rgw.accessKeyId, secretAccessKey: rgw.secretAccessKey },
    lockDir: join(root, `locks-${n}`),
    partSizeBytes: 5 * MiB,
    // Small pages: every list crosses pages.
    listPageSize: 2,
    ...o,
  });
  stores.push(s);
  return s;
}

/**
 * A store that has checked the server first, as the daemon's does. RGW's dbstore backend
 * (18.2, and 20.2 too) returns the first bytes of an object for any ranged GET and puts
 * multipart objects together wrongly; checkServer finds both and the store reads whole
 * objects and sends single PUTs instead, which is what the tests that compare bytes use.
 */
async function checked(o: Partial<S3StoreOptions> = {}): Promise<S3Store> {
  const s = s3(o);
  await s.checkServer();
  return s;
}

const run = (cmd: string, args: string[]) => promisify(execFile)(cmd, args);
const readFileSize = async (p: string): Promise<number> => (await stat(p)).size;
const code = (c: string) => (e: unknown) => e instanceof DormantError && e.code === c;

describe('S3 vault on radosgw', { skip: missing }, () => {
  before(async () => {
    root = await shmDir('s3');
    rgw = await startRgw();
  });
  after(async () => {
    for (const s of stores) s.destroy();
    await rgw?.stop();
    if (root) await removeDir(root);
  });

  storeContract('S3Store', () => checked());
  // A bucket of its own: sharing one with the suite above, this suite's 12 MiB object read
  // back wrong on RGW's dbstore every run (alone, the same suite passed; not understood).
  storeContract('S3Store with a pack cache', async () => {
    await rgw.makeBucket('dormant-cached');
    return checked({
      bucket: 'dormant-cached',
      cache: { dir: join(root, `cache-${n + 1}`), maxBytes: 64 * MiB },
    });
  });

  test('vault URLs: bucket and prefix, or a clear error', () => {
    assert.deepEqual(parseS3Url('s3://my-bucket'), { bucket: 'my-bucket', prefix: '' });
    assert.deepEqual(parseS3Url('s3://my-bucket/a/b/'), { bucket: 'my-bucket', prefix: 'a/b' });
    for (const bad of ['http://x/y', 's3://', 's3://B', 's3://ok-bucket/a/../b', 's3://ok-bucket/a b']) {
      assert.throws(() => parseS3Url(bad), code('INVALID_ARGUMENT'), bad);
    }
  });

  test('the pack cache keeps what this node wrote, bounded, and reads it without S3', async () => {
    const cacheDir = join(root, 'cache-bounded');
    const store = await checked({ cache: { dir: cacheDir, maxBytes: 24 * MiB } });
    const packs = [0, 1, 2, 3].map(() => randomBytes(5 * MiB + 1));
    for (const [i, p] of packs.entries()) await store.write(`data/t/packs/${i}.pack`, p);
    await store.write('data/t/index/0.idx', Buffer.from('not cached'));
    // 4 x 5 MiB fits in 24 MiB; a fifth pushes the least recently used (pack 0) out.
    assert.equal((await readdir(cacheDir)).length, 4);
    await store.write('data/t/packs/4.pack', randomBytes(5 * MiB));
    const cached = (await readdir(cacheDir)).sort();
    assert.deepEqual(cached, [
      'data+t+packs+1.pack',
      'data+t+packs+2.pack',
      'data+t+packs+3.pack',
      'data+t+packs+4.pack',
    ]);
    // Served from the cache while the server is down.
    await rgw.halt();
    try {
      const r = await store.openReader('data/t/packs/2.pack');
      assert.ok((await r.read(MiB, MiB)).equals(packs[2]!.subarray(MiB, 2 * MiB)));
      await r.close();
    } finally {
      await rgw.start();
    }
    // A pack read from S3 (pack 0, evicted) comes back into the cache.
    const r0 = await store.openReader('data/t/packs/0.pack');
    assert.ok((await r0.read(0, 5 * MiB + 1)).equals(packs[0]!));
    await r0.close();
    assert.ok((await readdir(cacheDir)).includes('data+t+packs+0.pack'));
    await store.remove('data/t/packs/0.pack');
    assert.ok(!(await readdir(cacheDir)).includes('data+t+packs+0.pack'));
    await store.removeAll('data');
  });

  test('multipart uploads: parts complete into one object of the right size; abort leaves nothing', async () => {
    const store = s3({ partSizeBytes: 5 * MiB, partsInFlight: 2 });
    const upload = async (): Promise<void> => {
      const w = await store.create('data/t/packs/multi.pack');
      for (let i = 0; i < 6; i++) await w.write([randomBytes(2 * MiB + 1)]);
      await w.commit();
    };
    // This server's multipart support is the flawed one the store works around (docs/VAULT.md):
    // once in many CI runs it lost a part uploaded beside another (InvalidPart at the
    // complete). One more upload then; a writer that completes wrongly still fails below.
    await upload().catch(async (e: unknown) => {
      if (!/InvalidPart/.test(String(e))) throw e;
      await upload();
    });
    const listed = await store.list('data/t/packs');
    assert.deepEqual(
      listed.map((e) => [e.name, e.sizeBytes]),
      [['data/t/packs/multi.pack', 6 * (2 * MiB + 1)]],
    );
    const r = await store.openReader('data/t/packs/multi.pack');
    assert.equal(r.sizeBytes, 6 * (2 * MiB + 1));
    await r.close();
    const a = await store.create('data/t/packs/aborted.pack');
    await a.write([randomBytes(11 * MiB)]);
    await a.abort();
    await assert.rejects(store.read('data/t/packs/aborted.pack'), code('VAULT_NOT_FOUND'));
    await store.removeAll('data');
    assert.deepEqual(await store.list(''), []);
  });

  test('writers reuse their body buffers only once sent: objects written from reused buffers while others upload read back whole', async () => {
    // One PUT per object, as on this server, with the caller's expected size: each writer's
    // body is a pooled buffer that goes back only when its PUT has settled. As in ingest, the
    // next object is written while the last one commits.
    const store = await checked();
    const expected = 3 * MiB;
    const objects = new Map<string, Buffer>();
    const commits: Promise<void>[] = [];
    const scratch = Buffer.alloc(256 * 1024);
    for (let i = 0; i < 10; i++) {
      const name = `data/t/packs/w${i}.pack`;
      // Every fourth one is 2 MiB larger than expected: its buffer grows.
      const data = randomBytes(i % 4 === 3 ? expected + 2 * MiB + 1 : expected - i);
      objects.set(name, data);
      const w = await store.create(name, expected);
      for (let at = 0; at < data.length; at += scratch.length) {
        const n = data.copy(scratch, 0, at, at + scratch.length);
        await w.write([scratch.subarray(0, n)]);
        // The caller reuses its buffer once a write resolves.
        scratch.fill(0xee);
      }
      commits.push(w.commit());
    }
    await Promise.all(commits);
    // Sent buffers came back for the next writers.
    assert.ok(store.bodies.idleBytes > 0);
    for (const [name, data] of objects) assert.ok((await store.read(name)).equals(data), name);
    await store.removeAll('data');
    store.destroy();
    assert.equal(store.bodies.idleBytes, 0);
  });

  test('a server that stops mid-upload: commit fails clearly and nothing half-written is visible', async () => {
    const store = s3({ maxAttempts: 2, partSizeBytes: 5 * MiB });
    const w = await store.create('data/t/packs/half.pack');
    await w.write([randomBytes(6 * MiB)]);
    await rgw.halt();
    try {
      await assert.rejects(
        (async () => {
          await w.write([randomBytes(6 * MiB)]);
          await w.commit();
        })(),
        (e: unknown) => code('VAULT_IO')(e) && /half\.pack/.test((e as Error).message),
      );
      await w.abort();
    } finally {
      await rgw.start();
    }
    await assert.rejects(store.read('data/t/packs/half.pack'), code('VAULT_NOT_FOUND'));
    assert.deepEqual(await store.list('data'), []);
  });

  test('checkServer finds what the server gets wrong and the store works around it', async () => {
    const store = s3();
    const found = await store.checkServer();
    assert.equal(found.warnings.length, Number(!found.rangedReads) + Number(!found.multipart));
    assert.deepEqual(await store.list(''), [], 'the probe object is gone');
    const data = randomBytes(12 * MiB);
    await store.write('data/t/packs/w.pack', data);
    const r = await store.openReader('data/t/packs/w.pack');
    assert.ok((await r.read(7 * MiB + 3, 100)).equals(data.subarray(7 * MiB + 3, 7 * MiB + 103)));
    await r.close();
    await store.removeAll('data');
  });

  test('a read while the server restarts is retried and succeeds', async () => {
    const store = await checked({ maxAttempts: 10 });
    const data = randomBytes(3 * MiB);
    await store.write('data/t/packs/r.pack', data);
    await rgw.halt();
    const reading = (async () => {
      const r = await store.openReader('data/t/packs/r.pack');
      const b = await r.read(MiB, MiB);
      await r.close();
      return b;
    })();
    // The server comes back while the read is retrying; a failed start fails the test itself.
    await Promise.all([reading, sleep(300).then(() => rgw.start())]);
    assert.ok((await reading).equals(data.subarray(MiB, 2 * MiB)));
    await store.removeAll('data');
  });

  test('wrong credentials and a missing bucket are VAULT_IO with a hint that says so', async () => {
    const bad = s3({ credentials: { accessKeyId: rgw.accessKeyId, secretAccessKey: 'wrong' } });
    await assert.rejects(
      bad.write('x', Buffer.from('x')),
      (e: unknown) => code('VAULT_IO')(e) && /credentials/.test((e as DormantError).hint ?? ''),
    );
    const nob = s3({ bucket: 'no-such-bucket' });
    await assert.rejects(
      nob.list(''),
      (e: unknown) => code('VAULT_IO')(e) && /create the bucket/.test((e as DormantError).hint ?? ''),
    );
  });

  test('a node that never had the packs: a restore fetches each pack once into its cache, the next ones ahead; a full cache disk loses nothing', async () => {
    const prefix = `p${++n}/cold`;
    const key = randomBytes(32);
    const src = join(root, 'cold-src');
    await mkdir(src, { recursive: true });
    await writeFile(join(src, 'pages-1.img'), randomBytes(18 * MiB));
    await writeFile(join(src, 'core.img'), randomBytes(200_000));
    // The node that hibernated: small packs, so the checkpoint spans several.
    const writer = await checked({ prefix, cache: { dir: join(root, 'cold-cache-w'), maxBytes: 256 * MiB } });
    const w = await openVault({
      dir: join(root, 'cold-w'),
      masterKey: { key },
      store: writer,
      packTargetBytes: 4 * MiB,
    });
    await w.putCheckpoint({ tenant: 'acme', sandboxId: 'sb', checkpointId: 'ck', srcDir: src });
    await w.close();
    const packs = (await writer.list('data/acme/packs')).map((e) => e.name).sort();
    assert.ok(packs.length >= 4, `${packs.length} packs`);

    /** GETs of packs by name, counted on the store's own client. */
    const gets = (store: S3Store): Map<string, number> => {
      const m = new Map<string, number>();
      store.client.middlewareStack.add(
        (next, context) => async (args) => {
          const k = (args.input as { Key?: string }).Key ?? '';
          if ((context as { commandName?: string }).commandName === 'GetObjectCommand' && k.endsWith('.pack'))
            m.set(k, (m.get(k) ?? 0) + 1);
          return next(args);
        },
        { step: 'initialize', name: 'testCountGets' },
      );
      return m;
    };

    // Another node: an empty cache. Every pack comes from the bucket once, and stays.
    const cacheDir = join(root, 'cold-cache-r');
    const reader = await checked({ prefix, cache: { dir: cacheDir, maxBytes: 256 * MiB } });
    const got = gets(reader);
    const r = await openVault({
      dir: join(root, 'cold-r'),
      masterKey: { key },
      store: reader,
      create: false,
    });
    const out = join(root, 'cold-out');
    await r.restoreCheckpoint({ tenant: 'acme', checkpointId: 'ck', destDir: out });
    assert.equal(await diffTrees(src, out), undefined);
    await removeDir(out);
    assert.deepEqual([...got.keys()].map((k) => k.slice(prefix.length + 1)).sort(), packs);
    assert.ok(
      [...got.values()].every((c) => c === 1),
      JSON.stringify([...got]),
    );
    assert.equal((await readdir(cacheDir)).length, packs.length);
    await r.close();

    // A prefetch alone fills the cache: the pack is then read with the server down.
    const third = await checked({ prefix, cache: { dir: join(root, 'cold-cache-p'), maxBytes: 256 * MiB } });
    third.prefetch(packs[0]!);
    for (
      let i = 0;
      i < 200 &&
      !(await readdir(join(root, 'cold-cache-p')).catch(() => [])).some((f) => f.endsWith('.pack'));
      i++
    )
      await sleep(25);
    await rgw.halt();
    try {
      const pr = await third.openReader(packs[0]!);
      assert.equal(
        pr.sizeBytes,
        await readFileSize(join(root, 'cold-cache-w', packs[0]!.replaceAll('/', '+'))),
      );
      await pr.close();
    } finally {
      await rgw.start();
    }

    // A cache on a disk too small for a pack: those fills fail, the restore reads those packs
    // from the bucket instead and is whole; the cache is left without temporaries.
    const tiny = join(root, 'cold-cache-tiny');
    await mkdir(tiny);
    await run('mount', ['-t', 'tmpfs', '-o', 'size=1m', 'tmpfs', tiny]);
    try {
      const small = await checked({ prefix, cache: { dir: tiny, maxBytes: 256 * MiB } });
      const v = await openVault({
        dir: join(root, 'cold-s'),
        masterKey: { key },
        store: small,
        create: false,
      });
      await v.restoreCheckpoint({ tenant: 'acme', checkpointId: 'ck', destDir: out });
      assert.equal(await diffTrees(src, out), undefined);
      await removeDir(out);
      await v.close();
      const left = await readdir(tiny);
      assert.ok(!left.some((f) => f.includes('.tmp-')), left.join(' '));
      assert.ok(left.length < packs.length, left.join(' '));
    } finally {
      await run('umount', [tiny]);
    }
    await writer.removeAll('data');
  });

  test('the vault on S3: a checkpoint folder round trip, dedup across puts, delete and gc', async () => {
    const store = await checked({ cache: { dir: join(root, 'vault-cache'), maxBytes: 256 * MiB } });
    const key = randomBytes(32);
    const vault = await openVault({
      dir: join(root, 'vault-local'),
      masterKey: { key },
      store,
      packTargetBytes: 8 * MiB,
    });
    try {
      const src = join(root, 'ck-src');
      await mkdir(join(src, 'sub'), { recursive: true });
      const pages = Buffer.concat([randomBytes(20 * MiB), Buffer.alloc(4 * MiB), randomBytes(MiB)]);
      await writeFile(join(src, 'pages-1.img'), pages);
      await writeFile(join(src, 'sub', 'core.img'), randomBytes(300_000));
      await writeFile(join(src, 'empty'), '');
      const first = await vault.putCheckpoint({
        tenant: 'acme',
        sandboxId: 'sb',
        checkpointId: 'ck-1',
        srcDir: src,
      });
      assert.ok(first.storedBytes > 20 * MiB);
      // Packs, indexes and manifests are objects under the prefix; locks are local.
      const objects = (await store.list('')).map((e) => e.name);
      assert.ok(
        objects.some((o) => /^data\/acme\/packs\/[0-9a-f]{32}\.pack$/.test(o)),
        objects.join(' '),
      );
      assert.ok(objects.includes('data/acme/manifests/ck-1.mf'));
      assert.ok(objects.includes('keys/tenants/acme.key'));
      // A second put of nearly the same folder stores only what changed.
      pages.write('changed', 5 * MiB);
      await writeFile(join(src, 'pages-1.img'), pages);
      const second = await vault.putCheckpoint({
        tenant: 'acme',
        sandboxId: 'sb',
        checkpointId: 'ck-2',
        srcDir: src,
      });
      assert.ok(second.newBytes < MiB, `second put stored ${second.newBytes} new bytes`);
      for (const id of ['ck-1', 'ck-2']) {
        const out = join(root, `out-${id}`);
        await vault.restoreCheckpoint({ tenant: 'acme', checkpointId: id, destDir: out });
        if (id === 'ck-2') assert.equal(await diffTrees(src, out), undefined);
        await removeDir(out);
      }
      // Random reads straight from S3.
      const reader = await vault.openCheckpoint({ tenant: 'acme', checkpointId: 'ck-2' });
      assert.ok(
        (await reader.read('pages-1.img', 5 * MiB - 3, 20)).equals(pages.subarray(5 * MiB - 3, 5 * MiB + 17)),
      );
      await reader.close();
      await vault.deleteCheckpoint({ tenant: 'acme', checkpointId: 'ck-1' });
      const before = (await store.list('data/acme/packs')).length;
      const gc = await vault.gc();
      assert.ok(gc.packsRepacked + gc.packsDeleted > 0, JSON.stringify(gc));
      assert.ok((await store.list('data/acme/packs')).length <= before);
      const report = await vault.verify();
      assert.equal(report.ok, true, JSON.stringify(report.problems));
      const out = join(root, 'out-after-gc');
      await vault.restoreCheckpoint({ tenant: 'acme', checkpointId: 'ck-2', destDir: out });
      assert.equal(await diffTrees(src, out), undefined);
    } finally {
      await vault.close();
    }
    // Opened again (a restart) with the same key: the vault is there; with another, refused.
    const again = await openVault({
      dir: join(root, 'vault-local'),
      masterKey: { key },
      store,
      create: false,
    });
    assert.deepEqual(
      (await again.listCheckpoints({ tenant: 'acme' })).map((c) => c.checkpointId),
      ['ck-2'],
    );
    await again.close();
    await assert.rejects(
      openVault({ dir: join(root, 'vault-local'), masterKey: { key: randomBytes(32) }, store }),
      code('VAULT_KEY_WRONG'),
    );
  });
});
