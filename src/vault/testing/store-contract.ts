/**
 * The contract every VaultStore adapter must pass: store.test.ts runs it on LocalDirStore,
 * s3-store.test.ts on S3Store against a real S3 server. Test-only.
 */
import { before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { DormantError } from '../../domain/errors.js';
import type { VaultStore } from '../store.js';

/**
 * The contract every VaultStore adapter must pass (an S3 adapter runs the same suite).
 * `make` returns a fresh, empty store.
 */
export function storeContract(name: string, make: () => Promise<VaultStore>): void {
  void describe(`VaultStore contract: ${name}`, () => {
    let store: VaultStore;
    before(async () => {
      store = await make();
    });

    const code = (c: string) => (e: unknown) => e instanceof DormantError && e.code === c;

    void test('a streamed object is invisible until commit, then whole', async () => {
      const w = await store.create('data/t/packs/a.pack');
      await w.write([Buffer.from('hello '), Buffer.from('world')]);
      assert.equal(w.sizeBytes, 11);
      await assert.rejects(store.read('data/t/packs/a.pack'), code('VAULT_NOT_FOUND'));
      await w.commit();
      assert.equal((await store.read('data/t/packs/a.pack')).toString(), 'hello world');
      const r = await store.openReader('data/t/packs/a.pack');
      assert.equal(r.sizeBytes, 11);
      assert.equal((await r.read(6, 5)).toString(), 'world');
      await assert.rejects(r.read(8, 10), code('VAULT_CORRUPT'));
      await r.close();
    });

    void test('an aborted object leaves nothing behind', async () => {
      const w = await store.create('data/t/packs/b.pack');
      await w.write([Buffer.from('partial')]);
      await w.abort();
      assert.deepEqual(
        (await store.list('data/t/packs')).map((e) => e.name),
        ['data/t/packs/a.pack'],
      );
    });

    void test('writeNew creates once and never replaces', async () => {
      assert.equal(await store.writeNew('keys/x.key', Buffer.from('first')), true);
      assert.equal(await store.writeNew('keys/x.key', Buffer.from('second')), false);
      assert.equal((await store.read('keys/x.key')).toString(), 'first');
      const racers = await Promise.all(
        [1, 2, 3, 4].map((i) => store.writeNew('keys/race', Buffer.from(String(i)))),
      );
      assert.equal(racers.filter(Boolean).length, 1);
    });

    void test('write replaces atomically; remove and shred are idempotent; removeAll empties a prefix', async () => {
      await store.write('data/t/index/i.idx', Buffer.from('v1'));
      await store.write('data/t/index/i.idx', Buffer.from('v2'));
      assert.equal((await store.read('data/t/index/i.idx')).toString(), 'v2');
      await store.remove('data/t/index/i.idx');
      await store.remove('data/t/index/i.idx');
      await store.shred('keys/x.key');
      await store.shred('keys/x.key');
      await assert.rejects(store.read('keys/x.key'), code('VAULT_NOT_FOUND'));
      await store.removeAll('data/t');
      assert.deepEqual(await store.list('data'), []);
      await store.write('data/t/packs/again.pack', Buffer.from('ok'));
      assert.equal((await store.read('data/t/packs/again.pack')).toString(), 'ok');
    });

    void test('a missing object is VAULT_NOT_FOUND to read, to open, and absent from lists', async () => {
      for (const op of [
        () => store.read('data/none/packs/x.pack'),
        () => store.openReader('data/none/packs/x.pack'),
      ]) {
        await assert.rejects(
          op(),
          (e: unknown) =>
            code('VAULT_NOT_FOUND')(e) && (e as DormantError).details?.object === 'data/none/packs/x.pack',
        );
      }
      assert.deepEqual(await store.list('data/none'), []);
    });

    void test('a streamed object of many writes and parts reads back byte for byte, in any range', async () => {
      const data = randomBytes(12 * 1024 * 1024 + 12345);
      const w = await store.create('data/big/packs/big.pack');
      // Uneven writes, some crossing a 5 MiB part boundary, several buffers per call.
      for (let at = 0, i = 0; at < data.length; i++) {
        const n = Math.min(data.length - at, [1, 700_000, 3 * 1024 * 1024, 4096][i % 4]!);
        await w.write([
          data.subarray(at, at + Math.floor(n / 2)),
          data.subarray(at + Math.floor(n / 2), at + n),
        ]);
        at += n;
      }
      assert.equal(w.sizeBytes, data.length);
      await w.commit();
      await w.abort(); // after a commit: nothing happens
      assert.ok((await store.read('data/big/packs/big.pack')).equals(data));
      const r = await store.openReader('data/big/packs/big.pack');
      assert.equal(r.sizeBytes, data.length);
      for (const [off, len] of [
        [0, 1],
        [5 * 1024 * 1024 - 3, 7],
        [data.length - 100, 100],
        [1234, 2 * 1024 * 1024],
        [77, 0],
      ] as const) {
        assert.ok((await r.read(off, len)).equals(data.subarray(off, off + len)), `range ${off}+${len}`);
      }
      const target = Buffer.alloc(4096 + 10);
      const got = await r.read(999, 4096, target);
      assert.equal(got.length, 4096);
      assert.ok(target.subarray(0, 4096).equals(data.subarray(999, 999 + 4096)));
      await assert.rejects(r.read(data.length - 10, 11), code('VAULT_CORRUPT'));
      await r.close();
      await store.remove('data/big/packs/big.pack');
    });

    void test('an aborted multi-part object leaves nothing behind', async () => {
      const w = await store.create('data/big/packs/gone.pack');
      await w.write([randomBytes(11 * 1024 * 1024)]);
      await w.abort();
      await assert.rejects(store.read('data/big/packs/gone.pack'), code('VAULT_NOT_FOUND'));
      assert.deepEqual(await store.list('data/big'), []);
    });

    void test('list is recursive, sorted, sized, and stays inside its folder', async () => {
      const names = ['data/l/a/1', 'data/l/a/2', 'data/l/b/c/3', 'data/l/z', 'data/l2/x', 'data/lz'];
      for (const [i, n] of names.entries()) await store.write(n, Buffer.alloc(i + 1, 1));
      for (const p of ['data/l', 'data/l/']) {
        const got = await store.list(p);
        assert.deepEqual(
          got.map((e) => e.name),
          ['data/l/a/1', 'data/l/a/2', 'data/l/b/c/3', 'data/l/z'],
        );
        assert.deepEqual(
          got.map((e) => e.sizeBytes),
          [1, 2, 3, 4],
        );
        assert.ok(got.every((e) => e.mtimeMs > Date.now() - 3_600_000));
      }
      await store.removeAll('data/l');
      assert.deepEqual(
        (await store.list('data')).map((e) => e.name).filter((n) => n.startsWith('data/l')),
        ['data/l2/x', 'data/lz'],
      );
      await store.removeAll('data/l2');
      await store.remove('data/lz');
    });

    void test('names that could escape the store are refused', async () => {
      for (const bad of ['../x', 'a/../../x', '/etc/passwd', 'a//b', '']) {
        await assert.rejects(store.read(bad), code('INVALID_ARGUMENT'), bad);
      }
    });
  });
}
