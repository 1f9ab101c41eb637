import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { DormantError } from '../domain/errors.js';
import { LocalDirStore, type VaultStore } from './store.js';
import { removeDir, shmDir } from './testing/fixtures.js';

/**
 * The contract every VaultStore adapter must pass (an S3 adapter runs the same suite).
 * `make` returns a fresh, empty store.
 */
export function storeContract(name: string, make: () => Promise<VaultStore>): void {
  describe(`VaultStore contract: ${name}`, () => {
    let store: VaultStore;
    before(async () => {
      store = await make();
    });

    const code = (c: string) => (e: unknown) => e instanceof DormantError && e.code === c;

    test('a streamed object is invisible until commit, then whole', async () => {
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

    test('an aborted object leaves nothing behind', async () => {
      const w = await store.create('data/t/packs/b.pack');
      await w.write([Buffer.from('partial')]);
      await w.abort();
      assert.deepEqual(
        (await store.list('data/t/packs')).map((e) => e.name),
        ['data/t/packs/a.pack'],
      );
    });

    test('writeNew creates once and never replaces', async () => {
      assert.equal(await store.writeNew('keys/x.key', Buffer.from('first')), true);
      assert.equal(await store.writeNew('keys/x.key', Buffer.from('second')), false);
      assert.equal((await store.read('keys/x.key')).toString(), 'first');
      const racers = await Promise.all(
        [1, 2, 3, 4].map((i) => store.writeNew('keys/race', Buffer.from(String(i)))),
      );
      assert.equal(racers.filter(Boolean).length, 1);
    });

    test('write replaces atomically; remove and shred are idempotent; removeAll empties a prefix', async () => {
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

    test('names that could escape the store are refused', async () => {
      for (const bad of ['../x', 'a/../../x', '/etc/passwd', 'a//b', '']) {
        await assert.rejects(store.read(bad), code('INVALID_ARGUMENT'), bad);
      }
    });
  });
}

let dir: string;
before(async () => {
  dir = await shmDir('store');
});
after(async () => {
  await removeDir(dir);
});
storeContract('LocalDirStore', async () => new LocalDirStore(dir));
