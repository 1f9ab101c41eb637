import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { access, chmod, mkdir, readFile, readdir, rm, stat, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { DormantError, isDormantError } from '../domain/errors.js';
import { openVault } from './index.js';
import { chunkId, deriveTenantKeys } from './crypto.js';
import { diffTrees, grepTree, removeDir, shmDir } from './testing/fixtures.js';

const MiB = 1024 * 1024;
let root: string;
let src: string;

before(async () => {
  root = await shmDir('keys');
  src = join(root, 'src');
  await mkdir(src);
  await writeFile(
    join(src, 'pages-1.img'),
    Buffer.concat([randomBytes(MiB), Buffer.from('abc'.repeat(100_000))]),
  );
});
after(async () => {
  await removeDir(root);
});

function code(c: string): (e: unknown) => boolean {
  return (e) => {
    assert.ok(e instanceof DormantError, String(e));
    assert.equal(e.code, c, e.message);
    return true;
  };
}

describe('master key', () => {
  test('a missing key file is generated with mode 0600 and a warning, then reused', async () => {
    const dir = join(root, 'gen');
    const keyFile = join(dir, 'master.key');
    const warnings: string[] = [];
    const v = await openVault({
      dir: join(dir, 'vault'),
      masterKey: { file: keyFile },
      onWarning: (m) => warnings.push(m),
    });
    await v.putCheckpoint({ tenant: 't', sandboxId: 's', checkpointId: 'c', srcDir: src });
    await v.close();
    assert.equal((await stat(keyFile)).mode & 0o777, 0o600);
    assert.match(warnings.join('\n'), /generated a new master key/);
    assert.match(await readFile(keyFile, 'utf8'), /^[0-9a-f]{64}\n$/);
    const v2 = await openVault({
      dir: join(dir, 'vault'),
      masterKey: { file: keyFile },
      onWarning: (m) => warnings.push(m),
    });
    await v2.restoreCheckpoint({ tenant: 't', checkpointId: 'c', destDir: join(dir, 'out') });
    await v2.close();
    assert.equal(await diffTrees(src, join(dir, 'out')), undefined);
    assert.equal(warnings.length, 1, 'no second warning');
    // A vault with data never gets a fresh key: that key could not open it.
    await assert.rejects(
      openVault({ dir: join(dir, 'vault'), masterKey: { file: join(dir, 'other.key') } }),
      code('VAULT_KEY_MISSING'),
    );
    // A loose file mode is called out.
    await chmod(keyFile, 0o644);
    const w2: string[] = [];
    await (
      await openVault({ dir: join(dir, 'vault'), masterKey: { file: keyFile }, onWarning: (m) => w2.push(m) })
    ).close();
    assert.match(w2.join('\n'), /readable by group or others/);
  });

  test('the key can come from a command (a KMS hook); a wrong key is refused plainly', async () => {
    const dir = join(root, 'cmd');
    const key = randomBytes(32);
    const masterKey = { command: '/bin/sh', args: ['-c', `echo ${key.toString('base64')}`] };
    const v = await openVault({ dir, masterKey });
    await v.putCheckpoint({ tenant: 't', sandboxId: 's', checkpointId: 'c', srcDir: src });
    await v.close();
    const v2 = await openVault({ dir, masterKey: { key } });
    await v2.restoreCheckpoint({ tenant: 't', checkpointId: 'c', destDir: join(root, 'cmd-out') });
    await v2.close();
    await assert.rejects(openVault({ dir, masterKey: { key: randomBytes(32) } }), code('VAULT_KEY_WRONG'));
    await assert.rejects(openVault({ dir, masterKey: { command: '/bin/false' } }), code('VAULT_KEY_MISSING'));
    await assert.rejects(
      openVault({ dir, masterKey: { command: '/bin/echo', args: ['not-a-key'] } }),
      code('VAULT_KEY_MISSING'),
    );
  });

  test('a vault written by a newer dormant is refused untouched; an unmarked one is marked', async () => {
    const dir = join(root, 'format');
    const key = randomBytes(32);
    const v = await openVault({ dir, masterKey: { key } });
    await v.putCheckpoint({ tenant: 't', sandboxId: 's', checkpointId: 'c', srcDir: src });
    await v.close();
    assert.deepEqual(JSON.parse(await readFile(join(dir, 'FORMAT'), 'utf8')), { format: 1 });
    await writeFile(join(dir, 'FORMAT'), '{"format":99}\n');
    const before = await readdir(dir, { recursive: true });
    await assert.rejects(openVault({ dir, masterKey: { key } }), (e: unknown) => {
      assert.ok(isDormantError(e, 'VAULT_FORMAT_NEWER'), String(e));
      assert.match((e as Error).message, /format 99, newer than this dormant's 1/);
      return true;
    });
    assert.deepEqual(await readdir(dir, { recursive: true }), before, 'nothing written');
    assert.equal(await readFile(join(dir, 'FORMAT'), 'utf8'), '{"format":99}\n');
    // A vault from before the marker (none): read as it is, and marked.
    await rm(join(dir, 'FORMAT'));
    const v2 = await openVault({ dir, masterKey: { key } });
    await v2.restoreCheckpoint({ tenant: 't', checkpointId: 'c', destDir: join(root, 'format-out') });
    await v2.close();
    assert.deepEqual(JSON.parse(await readFile(join(dir, 'FORMAT'), 'utf8')), { format: 1 });
  });
});

describe('crypto-shredding', () => {
  test('destroying a tenant key makes its checkpoints unrecoverable and removes the key material', async () => {
    const dir = join(root, 'shred');
    const key = randomBytes(32);
    const v = await openVault({ dir, masterKey: { key } });
    await v.putCheckpoint({ tenant: 'gone', sandboxId: 's1', checkpointId: 'c1', srcDir: src });
    await v.putCheckpoint({ tenant: 'kept', sandboxId: 's1', checkpointId: 'c1', srcDir: src });
    const wrapped = await readFile(join(dir, 'keys', 'tenants', 'gone.key'));
    const sbWrapped = await readFile(join(dir, 'keys', 'sandboxes', 'gone', 's1.key'));
    await v.destroyTenantKey({ tenant: 'gone' });
    await v.close();

    // Another process (a fresh vault) cannot get it back either.
    const v2 = await openVault({ dir, masterKey: { key } });
    await assert.rejects(
      v2.restoreCheckpoint({ tenant: 'gone', checkpointId: 'c1', destDir: join(root, 'shred-out') }),
      code('TENANT_KEY_DESTROYED'),
    );
    await assert.rejects(
      v2.putCheckpoint({ tenant: 'gone', sandboxId: 's1', checkpointId: 'c2', srcDir: src }),
      code('TENANT_KEY_DESTROYED'),
    );
    // The wrapped keys (the only copies) are nowhere on disk any more.
    assert.deepEqual(await grepTree(dir, wrapped.subarray(8, 40)), []);
    assert.deepEqual(await grepTree(dir, sbWrapped.subarray(8, 40)), []);
    await assert.rejects(access(join(dir, 'keys', 'tenants', 'gone.key')));
    // Verify reports the tenant as shredded, not as damage; gc deletes its ciphertext.
    const report = await v2.verify();
    assert.deepEqual(report.problems, []);
    assert.deepEqual(report.shreddedTenants, ['gone']);
    const gc = await v2.gc();
    assert.equal(gc.tenantsShredded, 1);
    assert.deepEqual(await readdir(join(dir, 'data')), ['kept']);
    // The other tenant is untouched.
    await v2.restoreCheckpoint({ tenant: 'kept', checkpointId: 'c1', destDir: join(root, 'kept-out') });
    assert.equal(await diffTrees(src, join(root, 'kept-out')), undefined);
    await v2.close();
  });

  test('destroying a sandbox key removes its checkpoints; gc then drops the chunks only it used', async () => {
    const dir = join(root, 'shred-sb');
    const key = randomBytes(32);
    const only = join(root, 'only-b');
    await mkdir(only);
    await writeFile(join(only, 'pages-1.img'), randomBytes(2 * MiB));
    const v = await openVault({ dir, masterKey: { key } });
    await v.putCheckpoint({ tenant: 't', sandboxId: 'a', checkpointId: 'a1', srcDir: src });
    await v.putCheckpoint({ tenant: 't', sandboxId: 'b', checkpointId: 'b1', srcDir: src });
    await v.putCheckpoint({ tenant: 't', sandboxId: 'b', checkpointId: 'b2', srcDir: only });
    const before = (await v.stats()).total.storedBytes;
    const r = await v.destroySandboxKey({ tenant: 't', sandboxId: 'b' });
    assert.equal(r.checkpointsDeleted, 2);
    await assert.rejects(
      v.restoreCheckpoint({ tenant: 't', checkpointId: 'b1', destDir: join(root, 'b1-out') }),
      (e) => isDormantError(e, 'CHECKPOINT_NOT_FOUND') || isDormantError(e, 'SANDBOX_KEY_DESTROYED'),
    );
    const gc = await v.gc();
    assert.ok(gc.reclaimedBytes >= 2 * MiB, `reclaimed ${gc.reclaimedBytes}`);
    assert.ok((await v.stats()).total.storedBytes < before - 2 * MiB);
    // Shared chunks stay for the sandbox that still uses them.
    await v.restoreCheckpoint({ tenant: 't', checkpointId: 'a1', destDir: join(root, 'a1-out') });
    assert.equal(await diffTrees(src, join(root, 'a1-out')), undefined);
    assert.ok((await v.verify()).ok);
    await v.close();
  });

  test('chunk ids are keyed per tenant: same content, unrelated ids', () => {
    const data = randomBytes(16 * 1024);
    const a = chunkId(deriveTenantKeys(randomBytes(32)).idKey, data);
    const b = chunkId(deriveTenantKeys(randomBytes(32)).idKey, data);
    assert.notDeepEqual(a, b);
  });
});

describe('gc and writers', () => {
  test('gc started during a write waits for it; a write started during gc waits; nothing is lost', async () => {
    const dir = join(root, 'concurrent');
    const big = join(root, 'big');
    await mkdir(big);
    await writeFile(join(big, 'pages-1.img'), randomBytes(24 * MiB));
    const v = await openVault({ dir, masterKey: { key: randomBytes(32) }, packTargetBytes: 4 * MiB });
    await v.putCheckpoint({ tenant: 't', sandboxId: 's', checkpointId: 'old', srcDir: src });
    await v.deleteCheckpoint({ tenant: 't', checkpointId: 'old' });
    const order: string[] = [];
    // The write reuses nothing of 'old'; gc must not delete the packs it is writing.
    const put = v
      .putCheckpoint({ tenant: 't', sandboxId: 's', checkpointId: 'new', srcDir: big })
      .then(() => order.push('put'));
    await new Promise((r) => setTimeout(r, 30));
    const gc = v.gc().then((g) => {
      order.push('gc');
      return g;
    });
    const put2 = (async () => {
      await new Promise((r) => setTimeout(r, 60));
      await v.putCheckpoint({ tenant: 't', sandboxId: 's', checkpointId: 'again', srcDir: src });
      order.push('put2');
    })();
    const [, g] = await Promise.all([put, gc, put2]);
    assert.equal(order[0], 'put', `order ${order.join(',')}`);
    assert.ok(g.packsDeleted >= 1, 'gc swept the deleted checkpoint');
    const report = await v.verify();
    assert.deepEqual(report.problems, []);
    await v.restoreCheckpoint({ tenant: 't', checkpointId: 'new', destDir: join(root, 'new-out') });
    assert.equal(await diffTrees(big, join(root, 'new-out')), undefined);
    await v.restoreCheckpoint({ tenant: 't', checkpointId: 'again', destDir: join(root, 'again-out') });
    assert.equal(await diffTrees(src, join(root, 'again-out')), undefined);
    await v.close();
  });
});
