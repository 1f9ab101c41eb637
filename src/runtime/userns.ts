/**
 * A sandbox's user namespace: root inside is an unprivileged user of the host (uid/gid
 * `hostId`, and ids 1..size-1 follow), so whatever escapes the sandbox's other walls lands as a
 * nobody on the host, with no capability over the host's files, keyrings or devices.
 *
 * runc makes the user namespace (OCI `uidMappings`/`gidMappings`) and the network namespace
 * inside it, so that the sandbox's user namespace owns its network namespace: one made on the
 * host (`ip netns add`, as for sandboxes without a user namespace) belongs to the host's, and
 * then `runc exec` cannot join it and CRIU refuses to dump the sandbox. The runtime adopts the
 * namespace runc made after `runc create` (pins it as `ip netns` would, and wires its veth:
 * network.ts `adoptFrom`). A checkpoint dumps the namespace with the processes; at restore CRIU
 * makes a new user namespace (the dumped maps) and a network namespace inside it, which the
 * runtime adopts and wires in the same way. (CRIU cannot restore into a pinned network
 * namespace here: its root task is cloned into a new user namespace first, which does not own
 * the pinned one, and `--join-ns user:` is applied only after that.)
 *
 * The shared root filesystem stays owned by the host's root: the sandbox sees it through an
 * idmapped mount (native/idmap-mount.c) as the overlay's lower layer, and what it writes lands
 * in its writable layer with the mapped ids (root's files as `hostId`).
 */
import { spawn } from 'node:child_process';
import {
  access,
  chmod,
  chown,
  constants,
  mkdir,
  readFile,
  readdir,
  readlink,
  stat,
  writeFile,
} from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';
import { run } from '../sys/exec.js';
import { isMountPoint } from './rootfs.js';
import type { IdExtent } from '../criu/images/messages.js';

/** Host ids a sandbox's ids map to: 0..size-1 inside are hostId..hostId+size-1 outside. */
export interface UserNamespace {
  hostId: number;
  size: number;
}

/**
 * The default range: 65536 ids from 100000, the first block /etc/subuid hands out on most
 * distributions (so keep it out of /etc/subuid on a dormant node, or choose another). Below
 * 2^21, so numeric owners still fit a plain tar header in the writable layer's archive.
 */
export const DEFAULT_USER_NAMESPACE: UserNamespace = Object.freeze({ hostId: 100_000, size: 65_536 });

const TIMEOUT_MS = 15_000;

/** The range as CRIU records a user namespace's maps (what an imported checkpoint is held to). */
export function idMapsOf(u: UserNamespace): { uidMap: IdExtent[]; gidMap: IdExtent[] } {
  const extent = { first: 0, lowerFirst: u.hostId, count: u.size };
  return { uidMap: [{ ...extent }], gidMap: [{ ...extent }] };
}

/** Checks a range from the configuration: whole numbers, root inside never root outside. */
export function checkUserNamespace(u: UserNamespace): UserNamespace {
  if (
    !Number.isSafeInteger(u.hostId) ||
    !Number.isSafeInteger(u.size) ||
    u.hostId < 1 ||
    u.size < 1 ||
    u.hostId + u.size > 2 ** 32 - 1
  )
    throw new DormantError(
      ErrorCode.INVALID_ARGUMENT,
      `user namespace range ${u.hostId}+${u.size} is not valid: host ids from 1, below 2^32-1`,
      { status: 400 },
    );
  return Object.freeze({ hostId: u.hostId, size: u.size });
}

/** Where the dormant-idmap-mount helper may be: $DORMANT_IDMAP_HELPER, this checkout's build, setup's install. */
export async function locateIdmapHelper(env: NodeJS.ProcessEnv = process.env): Promise<string | undefined> {
  const here = dirname(fileURLToPath(import.meta.url));
  const candidates = env.DORMANT_IDMAP_HELPER
    ? [env.DORMANT_IDMAP_HELPER]
    : [
        join(here, '..', '..', 'build', 'native', 'dormant-idmap-mount'),
        '/opt/dormant/bin/dormant-idmap-mount',
      ];
  for (const p of candidates)
    if (
      await access(p, constants.X_OK)
        .then(() => true)
        .catch(() => false)
    )
      return p;
  return undefined;
}

async function nsLink(pid: number | 'self', kind: string): Promise<string | undefined> {
  return readlink(`/proc/${String(pid)}/ns/${kind}`).catch(() => undefined);
}

/**
 * Runs `fn` with the path of a user namespace that maps as `map` (`/proc/PID/ns/user`): a
 * process is started in a new one (`unshare --user`), its maps are written from here, and it is
 * ended after `fn`. An idmapped mount keeps its own reference to the namespace, so nothing needs
 * to pin it.
 */
async function withUserNamespace<T>(map: UserNamespace, fn: (nsPath: string) => Promise<T>): Promise<T> {
  const child = spawn('unshare', ['--user', '--', 'sleep', '60'], { stdio: 'ignore' });
  const exited = new Promise<void>((res) => child.once('exit', () => res()));
  child.once('error', () => undefined);
  try {
    const pid = child.pid;
    if (pid === undefined) throw new Error('unshare did not start');
    const own = await nsLink('self', 'user');
    // Until the child is in its own namespace (unshare, then exec sleep).
    for (let i = 0; ; i++) {
      const [u, exe] = await Promise.all([
        nsLink(pid, 'user'),
        readlink(`/proc/${String(pid)}/exe`).catch(() => ''),
      ]);
      if (u !== undefined && u !== own && exe.endsWith('/sleep')) break;
      if (i > 2000 || child.exitCode !== null) throw new Error('unshare --user did not make a namespace');
      await new Promise((r) => setTimeout(r, 2));
    }
    const line = `0 ${String(map.hostId)} ${String(map.size)}\n`;
    await writeFile(`/proc/${String(pid)}/uid_map`, line);
    await writeFile(`/proc/${String(pid)}/gid_map`, line);
    return await fn(`/proc/${String(pid)}/ns/user`);
  } finally {
    child.kill('SIGKILL');
    await exited;
  }
}

/**
 * Mounts `source` at `target` read-only, idmapped as `map` (root's files appear as the
 * sandbox's root's), unless something is mounted there already.
 */
export async function mountIdmapped(
  helper: string | undefined,
  map: UserNamespace,
  source: string,
  target: string,
  signal?: AbortSignal,
): Promise<void> {
  if (await isMountPoint(target)) return;
  if (helper === undefined)
    throw new DormantError(
      ErrorCode.RUNTIME_ROOTFS_FAILED,
      'the dormant-idmap-mount helper is not built: sandboxes with a user namespace need it',
      { hint: 'npm run build builds it (it needs gcc); DORMANT_IDMAP_HELPER names another' },
    );
  await mkdir(target, { recursive: true, mode: 0o700 });
  try {
    await withUserNamespace(map, (ns) =>
      run(helper, [ns, source, target], {
        timeoutMs: TIMEOUT_MS,
        ...(signal !== undefined ? { signal } : {}),
      }),
    );
  } catch (e) {
    throw new DormantError(
      ErrorCode.RUNTIME_ROOTFS_FAILED,
      `could not mount the root filesystem idmapped for the sandbox's user namespace: ${(e as Error).message}`,
      {
        cause: e,
        hint: 'idmapped mounts need Linux >= 5.12, unshare (util-linux), user.max_user_namespaces > 0 and a filesystem that supports them (ext4, xfs, btrfs, tmpfs >= 6.3)',
      },
    );
  }
}

/**
 * The writable layer's top folder owned by the sandbox's root: overlayfs shows the upper
 * folder's owner and mode for `/`. Only a folder still owned by the host's root (a new layer)
 * is changed; what is below keeps the owners its files were written with.
 */
export async function ownLayerRoot(upper: string, map: UserNamespace): Promise<void> {
  const st = await stat(upper);
  if (st.uid === 0 && st.gid === 0) await chown(upper, map.hostId, map.hostId);
}

/**
 * Every folder from `/` down to `path` searchable by others (o+x): runc mounts the sandbox's
 * root filesystem from inside its user namespace, as an unprivileged host user, who must be
 * able to walk to it. Folders at or below `ours` (the runtime's state folder) that miss o+x are
 * given it (alone: none becomes listable or writable); one above it that misses it is refused
 * with what to do, as it is the operator's to change.
 */
export async function walkableTo(path: string, ours: string): Promise<void> {
  const chain: string[] = [];
  for (let p = path; p !== '/'; p = dirname(p)) chain.push(p);
  for (const p of chain.reverse()) {
    const st = await stat(p);
    if ((st.mode & 0o001) !== 0) continue;
    if (!(p === ours || p.startsWith(`${ours}/`)))
      throw new DormantError(
        ErrorCode.RUNTIME_ROOTFS_FAILED,
        `${p} is not searchable by others: a sandbox's user namespace could not reach its root filesystem`,
        {
          hint: 'give the folders above the data folder mode o+x (0711 is enough), or run sandboxes without user namespaces (dormant serve --no-user-namespace)',
        },
      );
    await chmod(p, (st.mode & 0o7777) | 0o001);
  }
}

/**
 * The images folder and its files owned by the sandbox's root, for CRIU's restored root task,
 * which reads some of them itself (utsns, timens, tty-info) from inside its new user
 * namespace. The folder is also searchable and the files readable by others (0711, 0644): the
 * task opens some (timens) before CRIU has written its uid_map, as the overflow uid. Nothing
 * else reaches them: the folders above stay the host root's, 0700.
 */
export async function ownImages(imagesDir: string, map: UserNamespace): Promise<void> {
  await chown(imagesDir, map.hostId, map.hostId);
  await chmod(imagesDir, 0o711);
  for (const e of await readdir(imagesDir, { withFileTypes: true }))
    if (e.isFile()) {
      await chown(join(imagesDir, e.name), map.hostId, map.hostId);
      await chmod(join(imagesDir, e.name), 0o644);
    }
}

/**
 * Why a lazy restore cannot work for a sandbox in a user namespace here, or undefined: CRIU
 * opens the userfaultfd in the restored root task, inside the sandbox's user namespace, which
 * the kernel allows only with vm.unprivileged_userfaultfd = 1 (CRIU does not use
 * /dev/userfaultfd). The daemon then resumes eagerly. (The sandbox itself cannot use
 * userfaultfd either way: the seccomp profile refuses it.)
 */
export async function lazyRestoreInUserNamespace(): Promise<string | undefined> {
  const v = await readFile('/proc/sys/vm/unprivileged_userfaultfd', 'utf8').catch(() => '0');
  return v.trim() === '1'
    ? undefined
    : 'sandboxes have user namespaces and vm.unprivileged_userfaultfd is 0 (CRIU opens userfaultfd inside the namespace)';
}

/**
 * Whether CRIU images were dumped from processes in a user namespace of their own: CRIU writes
 * one `userns-<id>.img` per user namespace below the root one.
 */
export async function imagesHaveUserNamespace(imagesDir: string): Promise<boolean> {
  try {
    return (await readdir(imagesDir)).some((n) => /^userns-\d+\.img$/.test(n));
  } catch (e) {
    if (errnoCode(e) === 'ENOENT') return false;
    throw e;
  }
}
