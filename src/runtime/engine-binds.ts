/**
 * The host side of an imported sandbox's engine binds (runtime.ts EngineBind): one file or
 * folder each under the sandbox's own folder, root's, that runc binds in at create and that a
 * restore hands CRIU for the checkpoint's external mount of that destination. They sit outside
 * the writable layer on purpose: a source inside it could be swapped by the sandbox for a
 * symlink to a host file, which the next restore would bind in.
 */
import { chmod, lchown, lstat, mkdir, open } from 'node:fs/promises';
import { join } from 'node:path';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';
import type { EngineBind } from './runtime.js';
import type { UserNamespace } from './userns.js';

/** The source of `destination` in sandbox folder `dir`: `/etc/hostname` -> `binds/etc_hostname`. */
export function engineBindSource(dir: string, destination: string): string {
  return join(dir, 'binds', destination.replace(/^\/+/, '').replace(/\//g, '_'));
}

/** SandboxState.engineBinds of a sandbox in folder `dir` with these binds (none: nothing). */
export function engineBindsOf(
  dir: string,
  binds: readonly EngineBind[] | undefined,
): { engineBinds?: { destination: string; source: string }[] } {
  if (binds === undefined || binds.length === 0) return {};
  return {
    engineBinds: binds.map((b) => ({
      destination: b.destination,
      source: engineBindSource(dir, b.destination),
    })),
  };
}

/**
 * Makes each missing source (files 0644 and empty, folders 1777 as /dev/shm is); returns them.
 * With a user namespace `owner`, the sources are the sandbox's root's and their folder is
 * searchable by others (0711, still the host root's): CRIU's restored task opens them from
 * inside the namespace, and root inside writes /etc/resolv.conf and /etc/hosts.
 */
export async function ensureEngineBinds(
  dir: string,
  binds: readonly EngineBind[],
  owner?: UserNamespace,
): Promise<Record<string, string>> {
  const out: Record<string, string> = {};
  if (binds.length === 0) return out;
  const folder = join(dir, 'binds');
  await mkdir(folder, { recursive: true, mode: 0o700 });
  if (owner !== undefined) await chmod(folder, 0o711);
  for (const b of binds) {
    const source = engineBindSource(dir, b.destination);
    const st = await lstat(source).catch((e: unknown) => {
      if (errnoCode(e) === 'ENOENT') return undefined;
      throw e;
    });
    if (st === undefined) {
      if (b.dir) await mkdir(source, { mode: 0o1777 });
      else await (await open(source, 'wx', 0o644)).close();
    } else if (st.isDirectory() !== b.dir || st.isSymbolicLink())
      throw new DormantError(
        ErrorCode.RUNTIME_INVALID_STATE,
        `the source of engine bind ${b.destination} (${source}) is not a ${b.dir ? 'folder' : 'file'}`,
      );
    if (owner !== undefined && (st === undefined || (st.uid === 0 && st.gid === 0)))
      await lchown(source, owner.hostId, owner.hostId);
    out[b.destination] = source;
  }
  return out;
}
