import { after, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { openVault } from './index.js';

const dirs: string[] = [];
after(async () => {
  for (const d of dirs) await rm(d, { recursive: true, force: true });
});

test("a shared chunk's bytes are split among the checkpoints that reference it", async () => {
  const root = await mkdtemp(join(tmpdir(), 'dormant-attr-'));
  dirs.push(root);
  const vault = await openVault({ dir: join(root, 'vault'), masterKey: { key: randomBytes(32) } });
  try {
    const shared = randomBytes(4 * 1024 * 1024);
    const a = join(root, 'a');
    const b = join(root, 'b');
    await mkdir(a);
    await mkdir(b);
    await writeFile(join(a, 'pages.img'), shared);
    // b: the same pages, then 1 MiB of its own in a second file.
    await writeFile(join(b, 'pages.img'), shared);
    await writeFile(join(b, 'own.img'), randomBytes(1024 * 1024));
    const pa = await vault.putCheckpoint({ tenant: 't', sandboxId: 'sb-a', checkpointId: 'ck-a', srcDir: a });
    const pb = await vault.putCheckpoint({ tenant: 't', sandboxId: 'sb-b', checkpointId: 'ck-b', srcDir: b });
    assert.ok(pb.newBytes < 1.2 * 1024 * 1024, 'b added only its own megabyte');

    const attr = await vault.attribution();
    const ka = attr.find((x) => x.checkpointId === 'ck-a')!;
    const kb = attr.find((x) => x.checkpointId === 'ck-b')!;
    assert.equal(ka.sandboxId, 'sb-a');
    // a paid for all the shared pages when it was written alone; now it pays half.
    assert.ok(
      Math.abs(ka.storedBytes - pa.storedBytes / 2) < 0.05 * pa.storedBytes,
      `${ka.storedBytes} ~ ${pa.storedBytes / 2}`,
    );
    assert.ok(Math.abs(kb.storedBytes - (pa.storedBytes / 2 + pb.storedBytes)) < 0.05 * pa.storedBytes);
    const stats = await vault.stats();
    const t = stats.tenants.find((x) => x.tenant === 't')!;
    const sum = ka.storedBytes + kb.storedBytes;
    assert.ok(
      sum >= t.chunkStoredBytes && sum <= t.storedBytes,
      `attributed ${sum} between chunks ${t.chunkStoredBytes} and all ${t.storedBytes}`,
    );

    // Deleting a: b now pays for every chunk it uses.
    await vault.deleteCheckpoint({ tenant: 't', checkpointId: 'ck-a' });
    const after2 = await vault.attribution();
    assert.deepEqual(
      after2.map((x) => x.checkpointId),
      ['ck-b'],
    );
    assert.ok(after2[0]!.storedBytes > kb.storedBytes);
  } finally {
    await vault.close();
  }
});
