/**
 * The template image cache over a stand-in vault (a folder per checkpoint written on fetch):
 * the first create fetches, the next ones copy from memory without the vault; copies are
 * independent of the cache; the bound holds (least recently used out, too big never kept); a
 * failed fetch leaves nothing; a removed template's images go. No root.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdir, mkdtemp, readFile, readdir, rm, stat, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { TemplateRecord } from '../../state/templates.js';
import type { LifecycleContext } from '../context.js';
import { forgetTemplateImages, templateCacheBytes, templateImages } from './template-cache.js';

describe('template image cache', () => {
  let dir: string;
  let staging: string;
  let n = 0;
  const fetched: string[] = [];
  /** Each checkpoint's pages size; the vault fails for ids in `broken`. */
  const sizes = new Map<string, number>();
  const broken = new Set<string>();
  let ctx: LifecycleContext;

  const tpl = (ck: string): TemplateRecord =>
    ({ id: `tp-${ck}`, tenant: 't', checkpointId: ck }) as TemplateRecord;
  const dest = (): string => join(dir, `dest-${String(++n)}`);

  before(async () => {
    dir = await mkdtemp(join(tmpdir(), 'dormant-template-cache-'));
    staging = join(dir, 'staging');
    await mkdir(staging, { mode: 0o700 });
    ctx = {
      opts: { templateCacheBytes: 1000 },
      staging: (name: string) => join(staging, name),
      wipe: (d: string) => rm(d, { recursive: true, force: true }),
      warnCleanup: () => undefined,
      checkImported: () => Promise.resolve(),
      store: { getCheckpoint: (id: string) => ({ id, logicalBytes: sizes.get(id) }) },
      vault: {
        restoreCheckpoint: async (o: { checkpointId: string; destDir: string }) => {
          fetched.push(o.checkpointId);
          await mkdir(join(o.destDir, 'fs'), { recursive: true });
          await writeFile(join(o.destDir, 'inventory.img'), o.checkpointId);
          if (broken.has(o.checkpointId)) throw new Error('pack damaged');
          await writeFile(join(o.destDir, 'fs', 'pages-1.img'), Buffer.alloc(sizes.get(o.checkpointId)!, 7));
        },
      },
    } as unknown as LifecycleContext;
  });

  after(() => rm(dir, { recursive: true, force: true }));

  test('fetched once, then copied without the vault; a copy changed leaves the cache as it was', async () => {
    sizes.set('ck-a', 300);
    const d1 = dest();
    assert.equal(await templateImages(ctx, tpl('ck-a'), d1), false, 'the first use misses');
    const d2 = dest();
    assert.equal(await templateImages(ctx, tpl('ck-a'), d2), true);
    assert.deepEqual(fetched, ['ck-a'], 'the vault was read once');
    for (const d of [d1, d2]) {
      assert.equal(await readFile(join(d, 'inventory.img'), 'utf8'), 'ck-a');
      assert.equal((await stat(join(d, 'fs', 'pages-1.img'))).size, 300);
    }
    await writeFile(join(d2, 'inventory.img'), 'renamed');
    const d3 = dest();
    await templateImages(ctx, tpl('ck-a'), d3);
    assert.equal(await readFile(join(d3, 'inventory.img'), 'utf8'), 'ck-a');
    assert.equal((await stat(join(staging, 'template-cache'))).mode & 0o777, 0o700);
    assert.equal(templateCacheBytes(ctx), 304, 'its pages and inventory');
  });

  test('the bound: the least recently used goes first; one over half the bound is never kept', async () => {
    sizes.set('ck-b', 400);
    sizes.set('ck-c', 400);
    await templateImages(ctx, tpl('ck-b'), dest());
    await templateImages(ctx, tpl('ck-a'), dest());
    fetched.length = 0;
    // a, b and c do not fit in 1000 bytes: b (used before a) goes.
    await templateImages(ctx, tpl('ck-c'), dest());
    assert.deepEqual((await readdir(join(staging, 'template-cache'))).sort(), ['ck-a', 'ck-c']);
    await templateImages(ctx, tpl('ck-a'), dest());
    assert.deepEqual(fetched, ['ck-c']);

    sizes.set('ck-big', 600);
    const d = dest();
    assert.equal(await templateImages(ctx, tpl('ck-big'), d), false);
    assert.equal((await stat(join(d, 'fs', 'pages-1.img'))).size, 600, 'straight from the vault');
    await templateImages(ctx, tpl('ck-big'), dest());
    assert.deepEqual(fetched, ['ck-c', 'ck-big', 'ck-big'], 'fetched each time');
    assert.ok(templateCacheBytes(ctx) <= 1000);
  });

  test('a failed fetch leaves nothing in the cache and fails the create; a removed template’s images go', async () => {
    sizes.set('ck-bad', 100);
    broken.add('ck-bad');
    await assert.rejects(templateImages(ctx, tpl('ck-bad'), dest()), /pack damaged/);
    assert.deepEqual((await readdir(join(staging, 'template-cache'))).sort(), ['ck-a', 'ck-c']);
    await forgetTemplateImages(ctx, 'ck-a');
    assert.deepEqual(await readdir(join(staging, 'template-cache')), ['ck-c']);
    fetched.length = 0;
    await templateImages(ctx, tpl('ck-a'), dest());
    assert.deepEqual(fetched, ['ck-a'], 'fetched again after it was dropped');
  });
});
