import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFile, readdir, stat, writeFile } from 'node:fs/promises';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import { isMountPoint } from './rootfs.js';
import { prepareStaging, releaseStaging } from './staging.js';

/** The mount options of `path` from /proc/self/mountinfo (super options included). */
async function mountOptions(path: string): Promise<string | undefined> {
  const info = await readFile('/proc/self/mountinfo', 'utf8');
  const line = info.split('\n').find((l) => l.split(' ')[4] === path);
  return line?.split(' - ')[1];
}

test('staging is a private huge-page tmpfs, a crash leftover is emptied, release leaves nothing', async () => {
  const dir = `/dev/shm/dormant-staging-test-${randomBytes(4).toString('hex')}`;
  try {
    assert.equal(await prepareStaging(dir), 'tmpfs-huge');
    assert.equal(await isMountPoint(dir), true);
    const opts = (await mountOptions(dir)) ?? '';
    assert.match(opts, /^tmpfs /);
    assert.match(opts, /huge=within_size/);
    assert.equal((await stat(dir)).mode & 0o777, 0o700, 'only root reads the images in flight');

    // A daemon killed mid-hibernate leaves images behind; the next start wipes them.
    await writeFile(join(dir, 'pages-1.img'), randomBytes(3 << 20));
    assert.equal(await prepareStaging(dir), 'tmpfs-huge');
    assert.deepEqual(await readdir(dir), []);
    assert.equal(await isMountPoint(dir), true);
  } finally {
    await releaseStaging(dir);
  }
  assert.equal(await isMountPoint(dir), false);
  await assert.rejects(stat(dir), { code: 'ENOENT' });
});
