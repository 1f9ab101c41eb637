import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { mkdir, open, readdir, stat, symlink, writeFile, chmod } from 'node:fs/promises';
import { join } from 'node:path';
import { isDormantError } from '../domain/errors.js';
import { openVault, type Vault } from './index.js';
import { LocalDirStore, type StoreReader } from './store.js';
import {
  criuDump,
  diffTrees,
  grepTree,
  killPid,
  removeDir,
  shmDir,
  startMixedPython,
} from './testing/fixtures.js';

const MiB = 1024 * 1024;
let root: string;
let vault: Vault;
const key = randomBytes(32);

before(async () => {
  root = await shmDir('rt');
  vault = await openVault({ dir: join(root, 'data', 'vault'), masterKey: { key } });
});
after(async () => {
  await vault.close();
  await removeDir(root);
});

let n = 0;
async function roundTrip(src: string, tenant = 'acme'): Promise<string> {
  const id = `ck-${++n}`;
  await vault.putCheckpoint({ tenant, sandboxId: 'sb-1', checkpointId: id, srcDir: src });
  const out = join(root, `out-${id}`);
  await vault.restoreCheckpoint({ tenant, checkpointId: id, destDir: out });
  assert.equal(await diffTrees(src, out), undefined, `round trip of ${src}`);
  return out;
}

describe('byte-exact round trips', () => {
  test('synthetic worst cases: zeros, random, sparse, empty files, empty folders, modes, symlinks', async () => {
    const src = join(root, 'synthetic');
    await mkdir(join(src, 'empty-dir'), { recursive: true });
    await mkdir(join(src, 'a', 'b', 'c'), { recursive: true });
    await writeFile(join(src, 'zeros.img'), Buffer.alloc(9 * MiB + 123));
    await writeFile(join(src, 'random.img'), randomBytes(5 * MiB + 7));
    await writeFile(join(src, 'empty'), '');
    await writeFile(join(src, 'a', 'b', 'c', 'tiny'), 'x');
    // Named like CRIU page images (chunked on page boundaries), but not whole pages.
    await writeFile(
      join(src, 'pages-1.img'),
      Buffer.concat([randomBytes(3 * MiB + 9), Buffer.alloc(PAGE * 2)]),
    );
    await writeFile(
      join(src, 'a', 'pages-2.img'),
      Buffer.concat([Buffer.alloc(PAGE * 4), randomBytes(PAGE - 1)]),
    );
    await writeFile(
      join(src, 'odd-tail'),
      Buffer.concat([randomBytes(PAGE + 5), Buffer.alloc(PAGE * 3 + 1)]),
    );
    // Sparse: 64 MiB apparent size, two islands of data, a hole at the end too.
    const h = await open(join(src, 'sparse.img'), 'w');
    await h.write(randomBytes(100_000), 0, 100_000, 10 * MiB);
    await h.write(Buffer.from('island'), 0, 6, 40 * MiB);
    await h.truncate(64 * MiB);
    await h.close();
    await chmod(join(src, 'random.img'), 0o600);
    await chmod(join(src, 'empty'), 0o755);
    await chmod(join(src, 'a', 'b'), 0o750);
    await symlink('a/b/c/tiny', join(src, 'link'));
    const out = await roundTrip(src);
    // Holes stay holes: the restored sparse file does not allocate its 64 MiB.
    const st = await stat(join(out, 'sparse.img'));
    assert.equal(st.size, 64 * MiB);
    assert.ok(st.blocks * 512 < 2 * MiB, `sparse file allocates ${st.blocks * 512} bytes`);
    const z = await stat(join(out, 'zeros.img'));
    assert.ok(z.blocks * 512 < 64 * 1024, `all-zero file allocates ${z.blocks * 512} bytes`);
  });

  test('many small files, chunks repeated within a file, and holes: byte-exact on workers and on the calling thread', async () => {
    const src = join(root, 'batches');
    await mkdir(join(src, 'small'), { recursive: true });
    // More files than a restore keeps open at once; some share their content.
    const shared = randomBytes(3000);
    for (let i = 0; i < 700; i++) {
      await writeFile(join(src, 'small', `f-${i}`), i % 7 === 0 ? shared : randomBytes(1 + (i % 5) * 1000));
    }
    // One random block again and again, between runs of zero pages and compressible text: the
    // repeats are decoded once per batch and copied, the zeros stay holes.
    const block = randomBytes(64 * 1024);
    const text = Buffer.from('{"tool":"bash","ok":true}\n'.repeat(40_000));
    const parts: Buffer[] = [];
    for (let i = 0; i < 60; i++)
      parts.push(block, i % 3 === 0 ? Buffer.alloc(PAGE * 16) : text.subarray(0, PAGE * 8));
    await writeFile(join(src, 'pages-3.img'), Buffer.concat(parts));
    const out = await roundTrip(src);
    const zeroBytes = 20 * PAGE * 16;
    const st = await stat(join(out, 'pages-3.img'));
    assert.ok(
      st.blocks * 512 <= st.size - zeroBytes + PAGE,
      `zero pages were written: ${st.blocks * 512} bytes`,
    );
    const inline = await openVault({
      dir: join(root, 'data', 'vault'),
      masterKey: { key },
      restoreWorkers: 0,
    });
    try {
      const out2 = join(root, 'out-batches-inline');
      await inline.restoreCheckpoint({ tenant: 'acme', checkpointId: `ck-${n}`, destDir: out2 });
      assert.equal(await diffTrees(src, out2), undefined, 'restore on the calling thread');
    } finally {
      await inline.close();
    }
  });

  test('a checkpoint spread over more packs than a restore keeps open restores byte-exact', async () => {
    const src = join(root, 'many-packs');
    await mkdir(src);
    await writeFile(join(src, 'pages-1.img'), randomBytes(20 * MiB));
    const dir = join(root, 'data', 'small-packs');
    const small = await openVault({ dir, masterKey: { key }, packTargetBytes: 64 * 1024 });
    try {
      await small.putCheckpoint({ tenant: 'acme', sandboxId: 'sb', checkpointId: 'ck', srcDir: src });
      const packs = await readdir(join(dir, 'data', 'acme', 'packs'));
      assert.ok(packs.length > 64, `${packs.length} packs`);
      const out = join(root, 'out-many-packs');
      await small.restoreCheckpoint({ tenant: 'acme', checkpointId: 'ck', destDir: out });
      assert.equal(await diffTrees(src, out), undefined);
    } finally {
      await small.close();
    }
  });

  test('a store that can fetch ahead is asked for the next packs before the restore opens them', async () => {
    const src = join(root, 'ahead');
    await mkdir(src);
    await writeFile(join(src, 'pages-1.img'), randomBytes(3 * MiB));
    await writeFile(join(src, 'pages-2.img'), randomBytes(MiB));
    const dir = join(root, 'data', 'ahead');
    /** What the restore asked of the store, in order: `open NAME` and `prefetch NAME`. */
    const asked: string[] = [];
    class Recording extends LocalDirStore {
      override openReader(name: string): Promise<StoreReader> {
        if (name.endsWith('.pack')) asked.push(`open ${name}`);
        return super.openReader(name);
      }
      prefetch(name: string): void {
        asked.push(`prefetch ${name}`);
      }
    }
    const v = await openVault({
      dir,
      masterKey: { key },
      store: new Recording(dir),
      packTargetBytes: 512 * 1024,
    });
    try {
      await v.putCheckpoint({ tenant: 'acme', sandboxId: 'sb', checkpointId: 'ck', srcDir: src });
      const packs = await readdir(join(dir, 'data', 'acme', 'packs'));
      assert.ok(packs.length >= 6, `${packs.length} packs`);
      const out = join(root, 'out-ahead');
      await v.restoreCheckpoint({ tenant: 'acme', checkpointId: 'ck', destDir: out });
      assert.equal(await diffTrees(src, out), undefined);
      const opened = asked.filter((a) => a.startsWith('open ')).map((a) => a.slice(5));
      assert.equal(new Set(opened).size, packs.length, 'every pack opened');
      // Every pack but the first was asked for ahead, two at most beyond the one being opened.
      for (const [i, name] of opened.entries()) {
        const at = asked.indexOf(`open ${name}`);
        const before = asked.slice(0, at);
        if (i > 0)
          assert.ok(
            before.includes(`prefetch ${name}`),
            `pack ${i} was not fetched ahead: ${asked.join(', ')}`,
          );
        const ahead = new Set(before.filter((a) => a.startsWith('prefetch ')).map((a) => a.slice(9)));
        const notYet = [...ahead].filter((p) => !before.includes(`open ${p}`) && p !== name);
        assert.ok(notYet.length <= 2, `more than two packs ahead of pack ${i}: ${notYet.join(', ')}`);
      }
    } finally {
      await v.close();
    }
  });

  test('an empty folder round-trips to an empty folder', async () => {
    const src = join(root, 'nothing');
    await mkdir(src);
    const out = await roundTrip(src);
    assert.deepEqual(await readdir(out), []);
  });

  test('real CRIU images of a python process, with a planted secret that never reaches the data dir', async () => {
    const work = join(root, 'criu');
    await mkdir(work);
    const secret = randomBytes(32);
    const pid = await startMixedPython(work, 48, secret.toString('hex'));
    const images = join(work, 'images');
    try {
      await criuDump(pid, images);
    } finally {
      killPid(pid);
    }
    const names = await readdir(images);
    assert.ok(
      names.some((x) => x.startsWith('pages-')),
      `criu wrote ${names.join(', ')}`,
    );
    assert.ok((await grepTree(images, secret)).length > 0, 'the secret is in the dumped memory');
    const out = await roundTrip(images);
    assert.ok((await grepTree(out, secret)).length > 0, 'and in the restored images');
    await removeDir(out);
    const hits = await grepTree(join(root, 'data'), secret);
    assert.deepEqual(hits, [], 'secret bytes found in the data dir');
    // Nor any 16-byte window of it (a partial leak would show there).
    for (let i = 0; i + 16 <= secret.length; i += 8) {
      assert.deepEqual(await grepTree(join(root, 'data'), secret.subarray(i, i + 16)), []);
    }
  });
});

const PAGE = 4096;

describe('tenants', () => {
  test('identical content deduplicates within a tenant and not across tenants', async () => {
    const src = join(root, 'shared-content');
    await mkdir(src);
    await writeFile(join(src, 'pages-1.img'), randomBytes(3 * MiB));
    const a1 = await vault.putCheckpoint({ tenant: 'red', sandboxId: 's1', checkpointId: 'r1', srcDir: src });
    const a2 = await vault.putCheckpoint({ tenant: 'red', sandboxId: 's2', checkpointId: 'r2', srcDir: src });
    const b1 = await vault.putCheckpoint({
      tenant: 'blue',
      sandboxId: 's1',
      checkpointId: 'b1',
      srcDir: src,
    });
    assert.equal(a1.newBytes, 3 * MiB);
    assert.equal(a2.newBytes, 0, 'second copy in the same tenant stores nothing new');
    assert.equal(b1.newBytes, 3 * MiB, 'another tenant stores its own copy');
    const stats = await vault.stats();
    const red = stats.tenants.find((t) => t.tenant === 'red')!;
    const blue = stats.tenants.find((t) => t.tenant === 'blue')!;
    assert.equal(red.uniqueBytes, 3 * MiB);
    assert.ok(red.dedupRatio > 1.99, `red dedup ${red.dedupRatio}`);
    assert.equal(blue.uniqueBytes, 3 * MiB);
    // A tenant cannot read another tenant's checkpoints, even by id.
    await assert.rejects(
      vault.restoreCheckpoint({ tenant: 'blue', checkpointId: 'r1', destDir: join(root, 'nope') }),
      (e) => isDormantError(e, 'CHECKPOINT_NOT_FOUND'),
    );
  });

  test('checkpoint ids are not reused and listings show what was stored', async () => {
    const src = join(root, 'shared-content');
    await assert.rejects(
      vault.putCheckpoint({ tenant: 'red', sandboxId: 's1', checkpointId: 'r1', srcDir: src }),
      (e) => isDormantError(e, 'CHECKPOINT_EXISTS'),
    );
    const list = await vault.listCheckpoints({ tenant: 'red' });
    assert.deepEqual(
      list.map((c) => [c.checkpointId, c.sandboxId, c.logicalBytes]),
      [
        ['r1', 's1', 3 * MiB],
        ['r2', 's2', 3 * MiB],
      ],
    );
    await assert.rejects(
      vault.putCheckpoint({ tenant: '../etc', sandboxId: 's1', checkpointId: 'x', srcDir: src }),
      (e) => isDormantError(e, 'INVALID_ARGUMENT'),
    );
  });

  test('verify is clean, and gc after a delete reclaims the unshared data only', async () => {
    const report = await vault.verify();
    assert.deepEqual(report.problems, []);
    assert.ok(report.ok);
    await vault.deleteCheckpoint({ tenant: 'blue', checkpointId: 'b1' });
    await vault.deleteCheckpoint({ tenant: 'red', checkpointId: 'r1' });
    const gc = await vault.gc();
    assert.ok(gc.reclaimedBytes >= 3 * MiB, `reclaimed ${gc.reclaimedBytes}`);
    const out = join(root, 'after-gc');
    await vault.restoreCheckpoint({ tenant: 'red', checkpointId: 'r2', destDir: out });
    assert.equal(await diffTrees(join(root, 'shared-content'), out), undefined);
    assert.ok((await vault.verify()).ok);
  });
});

describe('cancellation', () => {
  test('an aborted put stores nothing and an aborted restore leaves nothing behind', async () => {
    const src = join(root, 'abort-src');
    await mkdir(src);
    await writeFile(join(src, 'pages-1.img'), randomBytes(12 * MiB));
    const ac = new AbortController();
    ac.abort(new Error('sandbox woke up'));
    await assert.rejects(
      vault.putCheckpoint({
        tenant: 'acme',
        sandboxId: 'sb',
        checkpointId: 'aborted',
        srcDir: src,
        signal: ac.signal,
      }),
      (e) => isDormantError(e, 'COMMAND_ABORTED'),
    );
    assert.ok(!(await vault.listCheckpoints({ tenant: 'acme' })).some((c) => c.checkpointId === 'aborted'));
    assert.deepEqual((await vault.verify()).problems, []);
    await vault.putCheckpoint({ tenant: 'acme', sandboxId: 'sb', checkpointId: 'kept', srcDir: src });
    const out = join(root, 'abort-out');
    await assert.rejects(
      vault.restoreCheckpoint({ tenant: 'acme', checkpointId: 'kept', destDir: out, signal: ac.signal }),
      (e) => isDormantError(e, 'COMMAND_ABORTED'),
    );
    await assert.rejects(stat(out), 'the partial restore was removed');
  });
});
