/**
 * A node's backup: a consistent copy of its state (SQLite) and its vault (checkpoints, wrapped
 * keys, sealed secrets) in a folder another node can import, while the daemon runs.
 *
 * Consistency: gc is held off (the vault's shared lock) before the state is snapshotted and
 * until every vault file is copied, so every checkpoint the snapshot names still has all its
 * chunks, packs and manifests on disk when they are copied. Writers carry on meanwhile; what
 * they add after the snapshot is copied or not, and either way is unreferenced in the copy
 * (the importing node's gc sweeps it). Files a writer is still writing (`.tmp-`) are skipped.
 *
 * What is not in it: the master key (the importing node must be given the same one: it is
 * checked before anything is written), sandboxes' running processes (on the new node a
 * sandbox that was running goes back to its newest checkpoint, as after a reboot), and root
 * filesystems outside the data directory (they must exist at the same paths there).
 *
 * Layout of DIR: BACKUP.json (format, version, time, every file with its size and SHA-256),
 * state.db, vault/... . Import checks every file's hash before it writes anything.
 */
import Database from 'better-sqlite3';
import { createHash } from 'node:crypto';
import { createReadStream } from 'node:fs';
import { copyFile, mkdir, readFile, readdir, rename, rm, stat, writeFile } from 'node:fs/promises';
import { dirname, join, relative, sep } from 'node:path';
import { DormantError } from '../domain/errors.js';
import { DORMANT_VERSION } from '../domain/version.js';
import { openVault, type MasterKeySource } from '../vault/index.js';

export const BACKUP_FORMAT = 1;
const MANIFEST = 'BACKUP.json';
const TMP_MARK = '.tmp-';

export interface BackupManifest {
  format: number;
  dormantVersion: string;
  createdAt: number;
  files: { path: string; size: number; sha256: string }[];
}

export interface BackupReport {
  dir: string;
  files: number;
  bytes: number;
  durationMs: number;
}

async function sha256Of(file: string): Promise<string> {
  const h = createHash('sha256');
  for await (const chunk of createReadStream(file)) h.update(chunk as Buffer);
  return h.digest('hex');
}

/** Every regular file under `dir`, as paths relative to `base`, skipping in-progress writes. */
async function filesUnder(dir: string, base: string): Promise<string[]> {
  const out: string[] = [];
  for (const e of await readdir(dir, { withFileTypes: true })) {
    const p = join(dir, e.name);
    if (e.isDirectory()) out.push(...(await filesUnder(p, base)));
    else if (e.isFile() && !e.name.includes(TMP_MARK)) out.push(relative(base, p));
  }
  return out;
}

async function isEmptyDir(dir: string): Promise<boolean> {
  try {
    return (await readdir(dir)).length === 0;
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === 'ENOENT') return true;
    throw e;
  }
}

/** Writes a backup of the node whose data directory is `dataDir` into the new folder `dest`. */
export async function backupNode(opts: {
  dataDir: string;
  masterKey: MasterKeySource;
  dest: string;
}): Promise<BackupReport> {
  const started = performance.now();
  if (!(await isEmptyDir(opts.dest))) {
    throw new DormantError('INVALID_ARGUMENT', `backup: ${opts.dest} is not empty`, {
      hint: 'name a new or empty folder',
    });
  }
  const stateFile = join(opts.dataDir, 'state.db');
  try {
    await stat(stateFile);
  } catch {
    throw new DormantError('INVALID_ARGUMENT', `backup: no dormant state at ${stateFile}`, {
      hint: 'check --data-dir (or DORMANT_DATA_DIR)',
    });
  }
  await mkdir(opts.dest, { recursive: true, mode: 0o700 });
  const vaultDir = join(opts.dataDir, 'vault');
  const vault = await openVault({ dir: vaultDir, masterKey: opts.masterKey, create: false });
  const files: BackupManifest['files'] = [];
  try {
    await vault.whileGcHeldOff(async () => {
      // The state first (SQLite's online backup: a consistent snapshot while the daemon writes),
      // then the vault files it references, which gc cannot remove until this returns.
      const db = new Database(stateFile, { readonly: true, fileMustExist: true });
      try {
        await db.backup(join(opts.dest, 'state.db'));
      } finally {
        db.close();
      }
      for (const rel of await filesUnder(vaultDir, opts.dataDir)) {
        if (rel.split(sep)[1] === 'locks') continue;
        const to = join(opts.dest, rel);
        await mkdir(dirname(to), { recursive: true, mode: 0o700 });
        await copyFile(join(opts.dataDir, rel), to);
      }
    });
  } finally {
    await vault.close();
  }
  for (const rel of [...(await filesUnder(opts.dest, opts.dest))].sort()) {
    const p = join(opts.dest, rel);
    files.push({ path: rel.split(sep).join('/'), size: (await stat(p)).size, sha256: await sha256Of(p) });
  }
  const manifest: BackupManifest = {
    format: BACKUP_FORMAT,
    dormantVersion: DORMANT_VERSION,
    createdAt: Date.now(),
    files,
  };
  await writeFile(join(opts.dest, MANIFEST), `${JSON.stringify(manifest, null, 2)}\n`, { mode: 0o600 });
  return {
    dir: opts.dest,
    files: files.length,
    bytes: files.reduce((n, f) => n + f.size, 0),
    durationMs: Math.round(performance.now() - started),
  };
}

/** Reads and checks a backup's manifest: the format, and paths that stay inside the folder. */
async function readManifest(src: string): Promise<BackupManifest> {
  let m: BackupManifest;
  try {
    m = JSON.parse(await readFile(join(src, MANIFEST), 'utf8')) as BackupManifest;
  } catch (e) {
    throw new DormantError('INVALID_ARGUMENT', `backup: ${join(src, MANIFEST)} is missing or not JSON`, {
      cause: e,
      hint: 'name a folder `dormant vault backup` wrote',
    });
  }
  if (m.format !== BACKUP_FORMAT || !Array.isArray(m.files)) {
    throw new DormantError(
      'INVALID_ARGUMENT',
      `backup: format ${String(m.format)} is not one this version reads (${BACKUP_FORMAT})`,
      { hint: 'import it with the dormant version that made it, or a newer one' },
    );
  }
  for (const f of m.files) {
    const ok =
      typeof f.path === 'string' &&
      (f.path === 'state.db' || f.path.startsWith('vault/')) &&
      !f.path.split('/').some((part) => part === '..' || part === '' || part === '.');
    if (!ok)
      throw new DormantError('INVALID_ARGUMENT', `backup: the manifest names a path outside it: ${f.path}`);
  }
  if (!m.files.some((f) => f.path === 'state.db')) {
    throw new DormantError('INVALID_ARGUMENT', 'backup: it holds no state.db');
  }
  return m;
}

/**
 * Imports the backup in `src` into the data directory `dataDir`, which must hold no state and
 * no vault. Every file's hash is checked, then the master key against the backup's vault,
 * before anything is written there.
 */
export async function restoreNode(opts: {
  src: string;
  dataDir: string;
  masterKey: MasterKeySource;
}): Promise<BackupReport> {
  const started = performance.now();
  const m = await readManifest(opts.src);
  try {
    await stat(join(opts.dataDir, 'state.db'));
    throw new DormantError('INVALID_ARGUMENT', `import: ${opts.dataDir} already has a state.db`, {
      hint: 'import into a fresh data directory; this one belongs to a node',
    });
  } catch (e) {
    if (e instanceof DormantError) throw e;
  }
  if (!(await isEmptyDir(join(opts.dataDir, 'vault')))) {
    throw new DormantError('INVALID_ARGUMENT', `import: ${opts.dataDir}/vault is not empty`, {
      hint: 'import into a fresh data directory; this one belongs to a node',
    });
  }
  for (const f of m.files) {
    const p = join(opts.src, f.path);
    const size = await stat(p).then(
      (s) => s.size,
      () => -1,
    );
    if (size !== f.size || (await sha256Of(p)) !== f.sha256) {
      throw new DormantError(
        'INVALID_ARGUMENT',
        `import: ${f.path} is missing or damaged (size or hash differs)`,
        {
          hint: 'copy the backup again from its source',
        },
      );
    }
  }
  // The master key must open the backup's vault: found now, not at the first resume.
  const check = await openVault({ dir: join(opts.src, 'vault'), masterKey: opts.masterKey, create: false });
  await check.close();

  await mkdir(opts.dataDir, { recursive: true, mode: 0o700 });
  const staging = join(opts.dataDir, `.import${TMP_MARK}${process.pid}`);
  await rm(staging, { recursive: true, force: true });
  try {
    for (const f of m.files) {
      const to = join(staging, f.path);
      await mkdir(dirname(to), { recursive: true, mode: 0o700 });
      await copyFile(join(opts.src, f.path), to);
    }
    // The vault first, the state last: a node never starts on a state whose vault is missing.
    await rm(join(opts.dataDir, 'vault'), { recursive: true, force: true });
    await rename(join(staging, 'vault'), join(opts.dataDir, 'vault'));
    await rename(join(staging, 'state.db'), join(opts.dataDir, 'state.db'));
  } finally {
    await rm(staging, { recursive: true, force: true });
  }
  return {
    dir: opts.dataDir,
    files: m.files.length,
    bytes: m.files.reduce((n, f) => n + f.size, 0),
    durationMs: Math.round(performance.now() - started),
  };
}
