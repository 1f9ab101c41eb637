import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { mkdir, open } from 'node:fs/promises';
import { join } from 'node:path';
import { openVault } from './index.js';
import { removeDir, shmDir } from './testing/fixtures.js';

const MiB = 1024 * 1024;
let root: string;

before(async () => {
  root = await shmDir('memory');
});
after(async () => {
  await removeDir(root);
});

describe('streaming', () => {
  test('storing and restoring a 768 MiB checkpoint never holds it in memory', async () => {
    const src = join(root, 'src');
    await mkdir(src);
    // Written in pieces, so this test's own memory stays small too.
    const h = await open(join(src, 'pages-1.img'), 'w');
    const piece = Buffer.alloc(4 * MiB);
    for (let i = 0; i < 192; i++) {
      randomBytes(MiB).copy(piece, 0);
      piece.fill(i & 0xff, MiB, 2 * MiB);
      await h.write(piece);
    }
    await h.close();
    const baseline = process.resourceUsage().maxRSS * 1024;
    const v = await openVault({ dir: join(root, 'vault'), masterKey: { key: randomBytes(32) } });
    const r = await v.putCheckpoint({ tenant: 't', sandboxId: 's', checkpointId: 'big', srcDir: src });
    assert.equal(r.logicalBytes, 768 * MiB);
    await v.restoreCheckpoint({ tenant: 't', checkpointId: 'big', destDir: join(root, 'out') });
    await v.close();
    const peak = process.resourceUsage().maxRSS * 1024;
    const grew = peak - baseline;
    process.stderr.write(`# peak RSS grew by ${(grew / MiB).toFixed(0)} MiB for a 768 MiB checkpoint\n`);
    assert.ok(grew < 256 * MiB, `peak RSS grew by ${(grew / MiB).toFixed(0)} MiB`);
  });
});
