import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { mkdir, readdir, writeFile } from 'node:fs/promises';
import { fileURLToPath } from 'node:url';
import { dirname, join } from 'node:path';
import { openVault } from './index.js';
import { diffTrees, removeDir, shmDir } from './testing/fixtures.js';

const MiB = 1024 * 1024;
const child = join(dirname(fileURLToPath(import.meta.url)), 'testing', 'ingest-child.js');
let root: string;
let vaultDir: string;
let src: string;
const key = randomBytes(32);

function runChild(
  checkpointId: string,
  killAt?: string,
): Promise<{ code: number | null; signal: NodeJS.Signals | null }> {
  return new Promise((resolve, reject) => {
    const env = { ...process.env };
    if (killAt) env.DORMANT_VAULT_TEST_KILL_AT = killAt;
    else delete env.DORMANT_VAULT_TEST_KILL_AT;
    const p = spawn(process.execPath, [child, vaultDir, key.toString('hex'), src, checkpointId], {
      env,
      stdio: ['ignore', 'ignore', 'inherit'],
    });
    const timer = setTimeout(() => p.kill('SIGKILL'), 60_000);
    p.on('error', reject);
    p.on('exit', (code, signal) => {
      clearTimeout(timer);
      resolve({ code, signal });
    });
  });
}

async function countFiles(dir: string): Promise<number> {
  let n = 0;
  for (const e of await readdir(dir, { withFileTypes: true, recursive: true })) if (e.isFile()) n++;
  return n;
}

before(async () => {
  root = await shmDir('crash');
  vaultDir = join(root, 'vault');
  src = join(root, 'src');
  await mkdir(src);
  // 24 MiB of fresh data: three 8 MiB packs, so every step is reached more than once.
  await writeFile(join(src, 'pages-1.img'), randomBytes(24 * MiB));
  await writeFile(join(src, 'core-1.img'), Buffer.from('x'.repeat(10_000)));
  // One committed checkpoint that must survive every crash below.
  const r = await runChild('survivor');
  assert.equal(r.code, 0);
});
after(async () => {
  await removeDir(root);
});

describe('SIGKILL during ingest', () => {
  for (const step of ['pack-data-written', 'pack-committed', 'index-committed', 'before-manifest']) {
    test(`killed at ${step}: the vault verifies clean, the checkpoint does not exist, gc reclaims the orphans`, async () => {
      // A second copy of the same data would dedup to nothing; change it so new packs are written.
      await writeFile(join(src, 'pages-1.img'), randomBytes(24 * MiB));
      const r = await runChild(`ck-${step}`, step);
      assert.equal(r.signal, 'SIGKILL', `child exited with ${String(r.code)} instead of dying at ${step}`);
      const v = await openVault({ dir: vaultDir, masterKey: { key } });
      try {
        const before = await countFiles(join(vaultDir, 'data'));
        const report = await v.verify();
        assert.deepEqual(report.problems, [], 'verify after the crash');
        const leftovers = report.orphans.packs + report.orphans.temporaries;
        const list = await v.listCheckpoints({ tenant: 'crash' });
        const ids = list.map((c) => c.checkpointId);
        assert.ok(ids.includes('survivor'), 'the committed checkpoint is listed');
        assert.ok(!ids.includes(`ck-${step}`), 'the killed checkpoint must not exist');
        // The lock of the dead writer is stale: gc must not wait for it.
        const gc = await v.gc();
        if (step === 'pack-data-written') assert.ok(leftovers > 0, 'a partial pack was left');
        if (step !== 'pack-data-written') assert.ok(gc.packsDeleted > 0, `gc deleted no pack after ${step}`);
        assert.ok(gc.reclaimedBytes > 0 || leftovers === 0, 'gc reclaimed the orphans');
        const after = await countFiles(join(vaultDir, 'data'));
        assert.ok(after < before || leftovers === 0);
        const clean = await v.verify();
        assert.deepEqual(clean.problems, []);
        assert.deepEqual(clean.orphans, { packs: 0, indexes: 0, temporaries: 0 });
        const out = join(root, `out-${step}`);
        await v.restoreCheckpoint({ tenant: 'crash', checkpointId: 'survivor', destDir: out });
        await removeDir(out);
      } finally {
        await v.close();
      }
      // And the vault takes new writes after the crash.
      const again = await runChild(`ck-${step}`);
      assert.equal(again.code, 0);
      const v2 = await openVault({ dir: vaultDir, masterKey: { key } });
      try {
        const out = join(root, `again-${step}`);
        await v2.restoreCheckpoint({ tenant: 'crash', checkpointId: `ck-${step}`, destDir: out });
        assert.equal(await diffTrees(src, out), undefined);
        await removeDir(out);
      } finally {
        await v2.close();
      }
    });
  }
});
