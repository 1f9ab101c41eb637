/**
 * The container's filesystem changes in a checkpoint archive, as podman and CRI-O carry them:
 * `rootfs-diff.tar` (files, folders and symlinks that were added or changed) and
 * `deleted.files` (a JSON list of paths the container removed).
 *
 * Writing walks a sandbox's writable layer (overlayfs upper dir): overlay whiteouts (character
 * devices 0/0) become `deleted.files` entries, hard links are written as plain files.
 *
 * Applying writes into a new sandbox's (empty) writable layer, and the tar is hostile input:
 * names are checked like every archive member (no absolute paths, no `..`), nothing is
 * written through a symlink the archive itself made (a link is created, never followed),
 * hard links may only point at files already unpacked, and device nodes and fifos are
 * refused. Deleted paths become overlay whiteouts under the same rules.
 */
import {
  closeSync,
  constants,
  linkSync,
  lstatSync,
  mkdirSync,
  openSync,
  symlinkSync,
  writeSync,
} from 'node:fs';
import { lstat, open, readdir, readlink, rm } from 'node:fs/promises';
import { join, posix } from 'node:path';
import { errnoCode } from '../domain/errors.js';
import { run } from '../sys/exec.js';
import { safeMemberName, walkArchive, type ArchiveLimits } from './archive.js';
import type { ArchiveMember } from './export.js';
import { invalidArchive, tarHeader, tarPadding, TAR_END, type TarHeader } from './tar.js';

/** One entry of the diff, in the order it goes into the tar (parents before children). */
interface DiffEntry {
  rel: string;
  kind: 'dir' | 'file' | 'symlink';
  mode: number;
  mtimeSec: number;
  size: number;
  linkName?: string;
}

/** Walks `upperDir`: what changed (files, folders, symlinks) and what was deleted (whiteouts). */
export async function diffOfUpper(upperDir: string): Promise<{ entries: DiffEntry[]; deleted: string[] }> {
  const entries: DiffEntry[] = [];
  const deleted: string[] = [];
  const walk = async (rel: string): Promise<void> => {
    const names = (await readdir(join(upperDir, rel))).sort();
    for (const n of names) {
      const r = rel === '' ? n : `${rel}/${n}`;
      const p = join(upperDir, r);
      const st = await lstat(p);
      const base = { rel: r, mode: st.mode & 0o7777, mtimeSec: Math.floor(st.mtimeMs / 1000) };
      if (st.isDirectory()) {
        entries.push({ ...base, kind: 'dir', size: 0 });
        await walk(r);
      } else if (st.isFile()) entries.push({ ...base, kind: 'file', size: st.size });
      else if (st.isSymbolicLink())
        entries.push({ ...base, kind: 'symlink', size: 0, linkName: await readlink(p) });
      else if (st.isCharacterDevice() && st.rdev === 0) deleted.push(`/${r}`);
      // Sockets, fifos and real device nodes in a sandbox's writable layer are not carried.
    }
  };
  await walk('');
  return { entries, deleted };
}

/**
 * Archive members for a sandbox's filesystem diff: `rootfs-diff.tar` (built as a tar in
 * memory would not do for large layers, so it is written to `tarFile`) and, when the
 * sandbox deleted anything, `deleted.files`.
 */
export async function rootfsDiffMembers(upperDir: string, tarFile: string): Promise<ArchiveMember[]> {
  const { entries, deleted } = await diffOfUpper(upperDir);
  const out = await open(tarFile, 'wx', 0o600);
  try {
    for (const e of entries) {
      const name = e.kind === 'dir' ? `${e.rel}/` : e.rel;
      if (e.kind !== 'file') {
        await out.write(
          tarHeader({
            name,
            size: 0,
            type: e.kind,
            mode: e.mode,
            mtimeSec: e.mtimeSec,
            ...(e.linkName !== undefined ? { linkName: e.linkName } : {}),
          }),
        );
        continue;
      }
      await out.write(tarHeader({ name, size: e.size, type: 'file', mode: e.mode, mtimeSec: e.mtimeSec }));
      const src = await open(join(upperDir, e.rel), constants.O_RDONLY | constants.O_NOFOLLOW);
      try {
        const buf = Buffer.alloc(1024 * 1024);
        let left = e.size;
        while (left > 0) {
          const { bytesRead } = await src.read(buf, 0, Math.min(buf.length, left));
          // A file that shrank under us is padded with zeros: the header already promised its size.
          if (bytesRead === 0) {
            await out.write(Buffer.alloc(left));
            break;
          }
          await out.write(buf.subarray(0, bytesRead));
          left -= bytesRead;
        }
      } finally {
        await src.close();
      }
      await out.write(tarPadding(e.size));
    }
    await out.write(TAR_END);
    await out.sync();
  } catch (e) {
    await out.close();
    await rm(tarFile, { force: true });
    throw e;
  }
  await out.close();
  const members: ArchiveMember[] = [{ name: 'rootfs-diff.tar', file: tarFile }];
  if (deleted.length > 0) members.push({ name: 'deleted.files', data: Buffer.from(JSON.stringify(deleted)) });
  return members;
}

/** True when some folder on the way to `rel` is a link this unpacking made (or is not a folder). */
function underLink(rel: string, links: Set<string>): string | undefined {
  const parts = rel.split('/');
  for (let i = 1; i < parts.length; i++) {
    const prefix = parts.slice(0, i).join('/');
    if (links.has(prefix)) return prefix;
  }
  return undefined;
}

/**
 * Unpacks a rootfs-diff.tar into `upperDir` (a new sandbox's writable layer). Returns the
 * number of entries written. Throws CHECKPOINT_ARCHIVE_INVALID on anything unsafe; the caller
 * removes the half-written layer with the sandbox.
 */
export async function applyRootfsDiff(
  tarFile: string,
  upperDir: string,
  limits: ArchiveLimits = {},
): Promise<{ entries: number }> {
  const links = new Set<string>();
  const files = new Set<string>();
  const dirs = new Set<string>(['']);
  let written = 0;
  const ensureDir = (rel: string): void => {
    if (dirs.has(rel)) return;
    if (links.has(rel)) throw invalidArchive(`rootfs-diff.tar: ${rel} is a link, not a folder`);
    ensureDir(posix.dirname(rel) === '.' ? '' : posix.dirname(rel));
    try {
      mkdirSync(join(upperDir, rel), { mode: 0o755 });
    } catch (e) {
      if (errnoCode(e) !== 'EEXIST') throw e;
      if (!lstatSync(join(upperDir, rel)).isDirectory())
        throw invalidArchive(`rootfs-diff.tar: ${rel} is both a file and a folder`);
    }
    dirs.add(rel);
  };
  let fd: number | undefined;
  const visitor = {
    entry(h: TarHeader): ((chunk: Buffer) => void) | undefined {
      const rel = safeMemberName(h.name);
      if (rel === '') return undefined;
      const via = underLink(rel, links);
      if (via !== undefined)
        throw invalidArchive(
          `rootfs-diff.tar: ${JSON.stringify(h.name)} would be written through the link ${via}`,
        );
      const parent = posix.dirname(rel) === '.' ? '' : posix.dirname(rel);
      ensureDir(parent);
      const path = join(upperDir, rel);
      written++;
      switch (h.type) {
        case 'dir':
          ensureDir(rel);
          return undefined;
        case 'symlink':
          if (h.linkName.includes('\0')) throw invalidArchive(`rootfs-diff.tar: link ${rel} with a NUL byte`);
          try {
            // Its target is resolved inside the sandbox, never here: the link is made, not followed.
            symlinkSync(h.linkName, path);
          } catch (e) {
            if (errnoCode(e) === 'EEXIST') throw invalidArchive(`rootfs-diff.tar: ${rel} appears twice`);
            throw e;
          }
          links.add(rel);
          return undefined;
        case 'hardlink': {
          const target = safeMemberName(h.linkName);
          if (!files.has(target))
            throw invalidArchive(
              `rootfs-diff.tar: hard link ${rel} points at ${JSON.stringify(h.linkName)}, which is not a file of the archive`,
            );
          try {
            linkSync(join(upperDir, target), path);
          } catch (e) {
            if (errnoCode(e) === 'EEXIST') throw invalidArchive(`rootfs-diff.tar: ${rel} appears twice`);
            throw e;
          }
          return undefined;
        }
        case 'file': {
          try {
            fd = openSync(
              path,
              constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL | constants.O_NOFOLLOW,
              h.mode & 0o7777,
            );
          } catch (e) {
            if (errnoCode(e) === 'EEXIST') throw invalidArchive(`rootfs-diff.tar: ${rel} appears twice`);
            throw e;
          }
          files.add(rel);
          const myFd = fd;
          return (chunk: Buffer) => {
            let off = 0;
            while (off < chunk.length) off += writeSync(myFd, chunk, off);
          };
        }
        default:
          throw invalidArchive(
            `rootfs-diff.tar: ${JSON.stringify(h.name)} is a ${h.type} (type ${JSON.stringify(h.typeflag)}); only files, folders and links are restored`,
          );
      }
    },
    entryEnd(): void {
      if (fd !== undefined) {
        closeSync(fd);
        fd = undefined;
      }
    },
  };
  try {
    await walkArchive(tarFile, visitor, limits);
  } finally {
    if (fd !== undefined) closeSync(fd);
  }
  // Folders were made 0755 so their contents could be written; modes are the archive's now.
  return { entries: written };
}

/**
 * Parses deleted.files (a JSON list of absolute or relative paths) and turns each path into an
 * overlay whiteout in `upperDir`, so the base image's file is hidden from the sandbox.
 */
export async function applyDeletedFiles(text: string, upperDir: string): Promise<{ deleted: number }> {
  let list: unknown;
  try {
    list = JSON.parse(text);
  } catch (e) {
    throw invalidArchive('deleted.files is not valid JSON', e);
  }
  if (!Array.isArray(list) || !list.every((x): x is string => typeof x === 'string'))
    throw invalidArchive('deleted.files is not a list of paths');
  let n = 0;
  for (const raw of list) {
    const rel = safeMemberName(raw.replace(/^\/+/, ''));
    if (rel === '') continue;
    // Nothing on the way may be a link (the diff may have made one): walk it with lstat.
    const parts = rel.split('/');
    let cur = upperDir;
    for (const p of parts.slice(0, -1)) {
      cur = join(cur, p);
      try {
        const st = await lstat(cur);
        if (!st.isDirectory())
          throw invalidArchive(`deleted.files: ${raw} lies under ${p}, which is not a folder`);
      } catch (e) {
        if (errnoCode(e) !== 'ENOENT') throw e;
        mkdirSync(cur, { mode: 0o755 });
      }
    }
    const path = join(upperDir, rel);
    try {
      await lstat(path);
      continue; // The diff brought a new file there: it wins over the deletion.
    } catch (e) {
      if (errnoCode(e) !== 'ENOENT') throw e;
    }
    await run('mknod', ['-m', '000', path, 'c', '0', '0'], { timeoutMs: 10_000 });
    n++;
  }
  return { deleted: n };
}
