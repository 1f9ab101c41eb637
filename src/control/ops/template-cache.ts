/**
 * A template's checkpoint kept out of the vault between creates: its images as the vault gave
 * them (decrypted, each chunk authenticated), in the staging folder, so a create from a
 * template copies them in memory instead of fetching and decrypting them again (the longest
 * step of a template create, profiled in docs/BENCHMARKS.md).
 *
 * The plaintext is held as the vault's restores hold it: only in the staging folder (a tmpfs,
 * mode 0700, emptied when the daemon starts and removed when it stops, so nothing of it
 * outlives a crash on disk), bounded in size (least recently used first out), and dropped
 * when its template is removed. A template's checkpoint never changes (a new one is a new
 * template), so a copy is never stale.
 */

import { copyFile, mkdir, readdir, readlink, rename, stat, symlink } from 'node:fs/promises';
import { join } from 'node:path';
import type { TemplateRecord } from '../../state/templates.js';
import type { CheckpointRecord } from '../../state/store.js';
import type { LifecycleContext } from '../context.js';

/** What the cache holds at most, all templates together, unless configured. */
export const TEMPLATE_CACHE_BYTES = 1024 ** 3;

function bound(ctx: LifecycleContext): number {
  return ctx.opts.templateCacheBytes ?? TEMPLATE_CACHE_BYTES;
}
/** A checkpoint bigger than this share of the bound is not kept (it would push out the rest). */
const MAX_SHARE = 0.5;

interface Entry {
  dir: string;
  bytes: number;
  lastUsed: number;
  /** Copies out of it in flight: it is not evicted from under them. */
  readers: number;
}

interface Cache {
  entries: Map<string, Entry>;
  /** One fill per checkpoint at a time: concurrent creates wait for the same one. */
  filling: Map<string, Promise<Entry | undefined>>;
}

const caches = new WeakMap<LifecycleContext, Cache>();

function cacheOf(ctx: LifecycleContext): Cache {
  let c = caches.get(ctx);
  if (!c) caches.set(ctx, (c = { entries: new Map(), filling: new Map() }));
  return c;
}

function root(ctx: LifecycleContext): string {
  return ctx.staging('template-cache');
}

/**
 * Puts template `tpl`'s checkpoint images into `destDir` (which must not exist yet): copied
 * from the cache, which is filled from the vault on the first use. A checkpoint too big to
 * keep comes straight from the vault, as without the cache. False when the cache was missed
 * (the images came from the vault this time).
 */
export async function templateImages(
  ctx: LifecycleContext,
  tpl: TemplateRecord,
  destDir: string,
): Promise<boolean> {
  const c = cacheOf(ctx);
  let hit = true;
  let e = c.entries.get(tpl.checkpointId);
  if (!e) {
    hit = false;
    let fill = c.filling.get(tpl.checkpointId);
    if (!fill) {
      fill = fillEntry(ctx, tpl).finally(() => c.filling.delete(tpl.checkpointId));
      c.filling.set(tpl.checkpointId, fill);
    }
    e = await fill;
    // Another fill may have made room by evicting this one while this call waited.
    if (e !== undefined && c.entries.get(tpl.checkpointId) !== e) e = undefined;
  }
  if (!e) {
    await ctx.vault.restoreCheckpoint({ tenant: tpl.tenant, checkpointId: tpl.checkpointId, destDir });
    return false;
  }
  e.lastUsed = performance.now();
  e.readers++;
  try {
    await copyTree(e.dir, destDir);
  } finally {
    e.readers--;
  }
  return hit;
}

/**
 * Whether a template's checkpoint `ck` (its record) is small enough to keep: a bigger one restores as any
 * checkpoint does (its pages served from the vault, lazily), not through the cache.
 */
export function templateCacheKeeps(ctx: LifecycleContext, ck: CheckpointRecord | undefined): boolean {
  return ck?.logicalBytes !== undefined && ck.logicalBytes <= bound(ctx) * MAX_SHARE;
}

/** The template's images fetched into the cache, or undefined when they are too big to keep. */
async function fillEntry(ctx: LifecycleContext, tpl: TemplateRecord): Promise<Entry | undefined> {
  const ck = await ctx.store.getCheckpoint(tpl.checkpointId);
  const limit = bound(ctx) * MAX_SHARE;
  if (ck === undefined || !templateCacheKeeps(ctx, ck)) return undefined;
  const dir = join(root(ctx), tpl.checkpointId);
  const partial = `${dir}.partial`;
  await mkdir(root(ctx), { recursive: true, mode: 0o700 });
  // A fill that failed half way left its folder: started again from nothing.
  await ctx.wipe(partial);
  try {
    await ctx.vault.restoreCheckpoint({
      tenant: tpl.tenant,
      checkpointId: tpl.checkpointId,
      destDir: partial,
    });
    // What an imported checkpoint's restore checks, checked before the images are kept (each
    // restore from a copy checks again).
    await ctx.checkImported(partial, ck);
    const bytes = await treeBytes(partial);
    if (bytes > limit) {
      await ctx.wipe(partial);
      return undefined;
    }
    await makeRoom(ctx, bytes);
    await rename(partial, dir);
    const e: Entry = { dir, bytes, lastUsed: performance.now(), readers: 0 };
    cacheOf(ctx).entries.set(tpl.checkpointId, e);
    return e;
  } catch (err) {
    await ctx.wipe(partial).catch((x: unknown) => ctx.warnCleanup(tpl.id, 'template cache', x));
    throw err;
  }
}

/** Evicts least recently used entries no copy reads until `bytes` more fit under the bound. */
async function makeRoom(ctx: LifecycleContext, bytes: number): Promise<void> {
  const c = cacheOf(ctx);
  let held = [...c.entries.values()].reduce((n, e) => n + e.bytes, 0);
  const byAge = [...c.entries].sort((a, b) => a[1].lastUsed - b[1].lastUsed);
  for (const [ckId, e] of byAge) {
    if (held + bytes <= bound(ctx)) return;
    if (e.readers > 0) continue;
    c.entries.delete(ckId);
    held -= e.bytes;
    await ctx.wipe(e.dir);
  }
}

/** Drops template `tpl`'s images from the cache (the template is removed). */
export async function forgetTemplateImages(ctx: LifecycleContext, checkpointId: string): Promise<void> {
  const c = cacheOf(ctx);
  // A fill in flight finishes first, so that it cannot put the images back afterwards.
  await c.filling.get(checkpointId)?.catch(() => undefined);
  const e = c.entries.get(checkpointId);
  c.entries.delete(checkpointId);
  if (e) await ctx.wipe(e.dir);
}

/** The bytes the cache holds now (tests, metrics). */
export function templateCacheBytes(ctx: LifecycleContext): number {
  return [...cacheOf(ctx).entries.values()].reduce((n, e) => n + e.bytes, 0);
}

async function treeBytes(dir: string): Promise<number> {
  let n = 0;
  for (const d of await readdir(dir, { withFileTypes: true, recursive: true }))
    if (d.isFile()) n += (await stat(join(d.parentPath, d.name))).size;
  return n;
}

/**
 * A copy, not links: a restore rewrites images in place (the hostname, their owner under a
 * user namespace), which must not reach the cache or another create's copy.
 */
async function copyTree(from: string, to: string): Promise<void> {
  await mkdir(to, { mode: 0o700 });
  await Promise.all(
    (await readdir(from, { withFileTypes: true })).map(async (d) => {
      if (d.isDirectory()) await copyTree(join(from, d.name), join(to, d.name));
      else if (d.isFile()) await copyFile(join(from, d.name), join(to, d.name));
      else if (d.isSymbolicLink()) await symlink(await readlink(join(from, d.name)), join(to, d.name));
    }),
  );
}
