import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import { formatBytes } from '../domain/units.js';
import { openVault, type Vault } from './index.js';
import { criuDump, diffTrees, killPid, removeDir, shmDir, startForkFamily } from './testing/fixtures.js';

let root: string;
let vault: Vault;

before(async () => {
  root = await shmDir('forks');
  vault = await openVault({ dir: join(root, 'vault'), masterKey: { key: randomBytes(32) } });
});
after(async () => {
  await vault.close();
  await removeDir(root);
});

describe('a base sandbox and ten forks (real CRIU images)', () => {
  test('store at no more than twice the base', async () => {
    const { forks, base } = await startForkFamily(root, 10, 48);
    const dirs: string[] = [];
    try {
      // Forks first: dumping the base would take its children with it.
      for (const [i, pid] of forks.entries()) {
        const d = join(root, `fork-${i}`);
        await criuDump(pid, d);
        dirs.push(d);
      }
      await criuDump(base, join(root, 'base'));
    } finally {
      for (const p of [...forks, base]) killPid(p);
    }
    const b = await vault.putCheckpoint({
      tenant: 't',
      sandboxId: 'base',
      checkpointId: 'base',
      srcDir: join(root, 'base'),
    });
    const baseStored = (await vault.stats()).total.storedBytes;
    let logical = b.logicalBytes;
    for (const [i, d] of dirs.entries()) {
      const r = await vault.putCheckpoint({
        tenant: 't',
        sandboxId: `fork-${i}`,
        checkpointId: `fork-${i}`,
        srcDir: d,
      });
      logical += r.logicalBytes;
    }
    const total = (await vault.stats()).total;
    const ratio = total.storedBytes / baseStored;
    process.stderr.write(
      `# base stored ${formatBytes(baseStored)}; base + 10 forks stored ${formatBytes(total.storedBytes)} ` +
        `(${ratio.toFixed(2)}x the base) for ${formatBytes(logical)} of images; dedup ${total.dedupRatio.toFixed(1)}x\n`,
    );
    assert.ok(ratio <= 2, `base + 10 forks take ${ratio.toFixed(2)}x the base`);
    // And each fork comes back exactly.
    for (const i of [0, 9]) {
      const out = join(root, `out-${i}`);
      await vault.restoreCheckpoint({ tenant: 't', checkpointId: `fork-${i}`, destDir: out });
      assert.equal(await diffTrees(dirs[i]!, out), undefined);
    }
  });
});
