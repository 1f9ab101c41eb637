/**
 * Privileges container engines give by default that a sandbox does without, taken out of an
 * imported checkpoint's images before the profile check judges them. podman 4 keeps
 * CAP_SETFCAP and leaves no_new_privs clear; docker adds CAP_MKNOD and CAP_NET_RAW. CRIU
 * restores the creds the images hold, so the images are what must change: each thread's
 * capability sets lose these, and no_new_privs is set as runc sets it for a sandbox. Only
 * ever narrower: anything else beyond the profile is still refused by profile-check.ts. And
 * the one mark an export takes out for podman's restore (clearTcpCloseMark).
 */
import { readFile, readdir, rename, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { Magic } from '../criu/images/image-file.js';
import { readVarint, type Field } from '../criu/images/proto.js';
import { imageBudget, readImageEntries } from '../criu/images/reader.js';
import { editSub, rewriteImage, rewriteMessage, uint } from '../criu/images/write.js';
import { CAPABILITY_NAMES, type SandboxProfile } from './profile-check.js';
import { decodeFileEntry, decodeInventory, decodeMount } from '../criu/images/messages.js';

/** Engine defaults a sandbox drops (restoring without them is what a sandbox would be). */
export const ENGINE_DEFAULT_CAPS: readonly string[] = Object.freeze([
  'CAP_SETFCAP',
  'CAP_MKNOD',
  'CAP_NET_RAW',
]);

// creds_entry (CRIU's creds.proto): cap_inh 9, cap_prm 10, cap_eff 11, cap_bnd 12, cap_amb 19,
// no_new_privs 18; it sits in core_entry.thread_core (5) -> thread_core_entry.creds (10).
const CAP_FIELDS = [9, 10, 11, 12, 19];
const NO_NEW_PRIVS = 18;

/** The capability words of a repeated uint32 field, packed or not. */
function words(fields: Field[], no: number): number[] {
  const out: number[] = [];
  for (const f of fields) {
    if (f.no !== no) continue;
    if (f.wire === 0) out.push(Number(BigInt.asUintN(32, f.value)));
    else if (f.wire === 2)
      for (let pos = 0; pos < f.value.length;) {
        const [v, p] = readVarint(f.value, pos);
        out.push(Number(BigInt.asUintN(32, v)));
        pos = p;
      }
  }
  return out;
}

/** What `narrowImports` changed, for the import's event. */
export interface Narrowed {
  capabilities: string[];
  noNewPrivs: boolean;
}

/**
 * Cuts the engine-default privileges `profile` does not grant out of every core-N.img in
 * `dir` (in place). Returns what it cut; nothing is written when nothing needs cutting.
 */
export async function narrowToProfile(dir: string, profile: SandboxProfile): Promise<Narrowed> {
  const drop = ENGINE_DEFAULT_CAPS.filter((c) => !profile.capabilities.includes(c)).map((c) =>
    CAPABILITY_NAMES.indexOf(c),
  );
  const dropped = new Set<string>();
  let nnp = false;
  let changed = false;
  const creds = (fields: Field[]): Field[] => {
    const out = fields.filter(
      (f) => !CAP_FIELDS.includes(f.no) && !(profile.noNewPrivsRequired && f.no === NO_NEW_PRIVS),
    );
    for (const no of CAP_FIELDS) {
      const w = words(fields, no);
      for (const cap of drop) {
        const i = cap >> 5;
        const bit = 1 << (cap & 31);
        if (w[i] !== undefined && (w[i] & bit) !== 0) {
          w[i] = (w[i] & ~bit) >>> 0;
          dropped.add(CAPABILITY_NAMES[cap]!);
          changed = true;
        }
      }
      out.push(...w.map((v) => uint(no, v)));
    }
    if (profile.noNewPrivsRequired) {
      const was = fields.find((f) => f.no === NO_NEW_PRIVS);
      if (was === undefined || was.wire !== 0 || was.value === 0n) nnp = changed = true;
      out.push(uint(NO_NEW_PRIVS, 1));
    }
    return out;
  };
  const budget = imageBudget();
  for (const name of await readdir(dir)) {
    if (!/^core-\d+\.img$/.test(name)) continue;
    // Read through the bounded reader first: a malformed image fails here, not in the rewrite.
    const entries = await readImageEntries(dir, name, Magic.CORE, budget);
    if (entries === undefined) continue;
    changed = false;
    const next = rewriteImage(await readFile(join(dir, name)), (e) =>
      rewriteMessage(e, editSub(5, editSub(10, creds))),
    );
    if (!changed) continue;
    const tmp = join(dir, `.${name}.narrowed`);
    await writeFile(tmp, next, { mode: 0o600 });
    await rename(tmp, join(dir, name));
  }
  return { capabilities: [...dropped].sort(), noNewPrivs: nnp };
}

/** TCP states (linux/tcp_states.h) a socket restores as without established-connection state. */
const TCP_CLOSE = 7;
const TCP_LISTEN = 10;

/**
 * Makes a dump that dormant took with CRIU's tcp-close (criu.conf, runtime/oci.ts) restorable by
 * a runtime that cannot pass that option (podman 4's restore has no --tcp-close): its inventory's
 * tcp_close mark is cleared when no TCP socket in it holds a connection (only listening or
 * unconnected ones), where the mark changes nothing. Returns whether the dump is now free of it;
 * false leaves it marked (such a runtime then refuses it, saying so).
 */
export async function clearTcpCloseMark(dir: string): Promise<boolean> {
  const budget = imageBudget();
  const inv = await readImageEntries(dir, 'inventory.img', Magic.INVENTORY, budget);
  if (inv?.[0] === undefined || !decodeInventory(inv[0]).tcpClose) return true;
  for (const raw of (await readImageEntries(dir, 'files.img', Magic.FILES, budget)) ?? []) {
    const sk = decodeFileEntry(raw).inet;
    if (sk !== undefined && sk.proto === IPPROTO_TCP && sk.state !== TCP_LISTEN && sk.state !== TCP_CLOSE)
      return false;
  }
  const next = rewriteImage(await readFile(join(dir, 'inventory.img')), (e) =>
    rewriteMessage(e, (fields) => fields.filter((f) => f.no !== INVENTORY_TCP_CLOSE)),
  );
  const tmp = join(dir, '.inventory.img.cleared');
  await writeFile(tmp, next, { mode: 0o600 });
  await rename(tmp, join(dir, 'inventory.img'));
  return true;
}

const IPPROTO_TCP = 6;
// inventory_entry.tcp_close (CRIU's inventory.proto).
const INVENTORY_TCP_CLOSE = 10;

// reg_file_entry.mode (CRIU's regfile.proto); the entry is file_entry.reg (3).
const REG_MODE = 10;

/**
 * Takes the recorded mode off the root folder's entries in files.img (each process's root and
 * any cwd of `/`), so that a runtime whose root folder has another mode restores the dump:
 * CRIU checks an opened file's mode against the image only when the image records one. A
 * sandbox's root is its writable layer's folder (0700); podman's is its image's (0555 for most).
 * Returns how many entries it changed.
 */
export async function clearRootMode(dir: string): Promise<number> {
  const budget = imageBudget();
  const rootIds = new Set<number>();
  for (const name of await readdir(dir))
    if (/^mountpoints-\d+\.img$/.test(name))
      for (const raw of (await readImageEntries(dir, name, Magic.MNTS, budget)) ?? []) {
        const m = decodeMount(raw);
        if (m.mountpoint === '/') rootIds.add(m.mntId);
      }
  const files = await readImageEntries(dir, 'files.img', Magic.FILES, budget);
  if (files === undefined) return 0;
  let changed = 0;
  const next = rewriteImage(await readFile(join(dir, 'files.img')), (e) => {
    const reg = decodeFileEntry(e).reg;
    if (reg?.name !== '/' || reg.mode === undefined) return e;
    // `/` of another mount (a cwd at the top of /dev) keeps its mode; an entry naming no mount
    // is on the root one.
    if (reg.mntId !== undefined && rootIds.size > 0 && !rootIds.has(reg.mntId)) return e;
    changed++;
    return rewriteMessage(
      e,
      editSub(3, (fields) => fields.filter((f) => f.no !== REG_MODE)),
    );
  });
  if (changed === 0) return 0;
  const tmp = join(dir, '.files.img.rootmode');
  await writeFile(tmp, next, { mode: 0o600 });
  await rename(tmp, join(dir, 'files.img'));
  return changed;
}
