/**
 * Key hierarchy: a master key (from a file, an external command, or given in memory) wraps
 * one random data key per tenant; a tenant's key wraps one random key per sandbox. Chunks and
 * pack indexes are sealed with keys derived from the tenant key (so a tenant's sandboxes
 * deduplicate against each other); manifests are sealed with the sandbox key. Destroying a
 * key object makes what it protects unrecoverable: crypto-shredding.
 */
import { chmod, mkdir, open, readFile, stat } from 'node:fs/promises';
import { randomBytes } from 'node:crypto';
import { dirname } from 'node:path';
import { DormantError, ErrorCode, errnoCode } from '../domain/errors.js';
import { run } from '../sys/exec.js';
import { KEY_BYTES, deriveKey, open as openSealed, seal } from './crypto.js';
import type { VaultStore } from './store.js';

/** Where the master key comes from. */
export type MasterKeySource =
  /**
   * A file holding 32 bytes as 64 hex digits (or base64). With `create` (the default) a
   * missing file is generated (mode 0600) when the vault is new, with a warning that the key
   * belongs in a secrets manager in production.
   */
  | { file: string; create?: boolean }
  /** An external command (a KMS hook) that prints the key, hex or base64, on stdout. */
  | { command: string; args?: readonly string[]; timeoutMs?: number }
  /** The key itself (embedding, tests). */
  | { key: Uint8Array };

export function parseKeyText(text: string, where: string): Buffer {
  const t = text.trim();
  let key: Buffer | undefined;
  if (/^[0-9a-fA-F]{64}$/.test(t)) key = Buffer.from(t, 'hex');
  else if (/^[A-Za-z0-9+/]{43}=?$/.test(t)) key = Buffer.from(t, 'base64');
  if (key?.length !== KEY_BYTES) {
    throw new DormantError(
      ErrorCode.VAULT_KEY_MISSING,
      `master key from ${where} is not 32 bytes written as 64 hex digits or base64`,
      { hint: 'generate one with: head -c 32 /dev/urandom | xxd -p -c 64' },
    );
  }
  return key;
}

/**
 * Loads the master key. `vaultIsNew` says whether a missing key file may be generated: a
 * vault that already holds data is never given a fresh (and so wrong) key.
 */
export async function loadMasterKey(
  src: MasterKeySource,
  opts: { vaultIsNew: boolean; warn: (msg: string) => void; signal?: AbortSignal },
): Promise<Buffer> {
  if ('key' in src) {
    if (src.key.length !== KEY_BYTES) {
      throw new DormantError(ErrorCode.VAULT_KEY_MISSING, `master key must be ${KEY_BYTES} bytes`);
    }
    return Buffer.from(src.key);
  }
  if ('command' in src) {
    const res = await run(src.command, src.args ?? [], {
      timeoutMs: src.timeoutMs ?? 30_000,
      maxOutputBytes: 64 * 1024,
      ...(opts.signal ? { signal: opts.signal } : {}),
    }).catch((e: unknown) => {
      throw new DormantError(ErrorCode.VAULT_KEY_MISSING, `master key command ${src.command} failed`, {
        cause: e,
        hint: 'the key command must print the 32-byte key (hex or base64) and exit 0',
      });
    });
    return parseKeyText(res.stdout, `command ${src.command}`);
  }
  try {
    const text = await readFile(src.file, 'utf8');
    const st = await stat(src.file);
    if ((st.mode & 0o077) !== 0) {
      opts.warn(
        `master key file ${src.file} is readable by group or others (mode ${(st.mode & 0o777).toString(8)}); chmod 600 it`,
      );
    }
    return parseKeyText(text, src.file);
  } catch (e) {
    if (errnoCode(e) !== 'ENOENT') {
      if (e instanceof DormantError) throw e;
      throw new DormantError(ErrorCode.VAULT_KEY_MISSING, `cannot read master key file ${src.file}`, {
        cause: e,
      });
    }
  }
  if (src.create === false || !opts.vaultIsNew) {
    throw new DormantError(ErrorCode.VAULT_KEY_MISSING, `master key file ${src.file} does not exist`, {
      hint: opts.vaultIsNew
        ? 'create it (head -c 32 /dev/urandom | xxd -p -c 64 > FILE; chmod 600 FILE) or point DORMANT_MASTER_KEY_FILE at it'
        : 'this vault already holds data sealed under a master key: restore that key file; a new key cannot open it',
    });
  }
  const key = randomBytes(KEY_BYTES);
  await mkdir(dirname(src.file), { recursive: true, mode: 0o700 });
  // 'wx': never overwrite a key another process created a moment ago.
  const h = await open(src.file, 'wx', 0o600).catch(async (e: unknown) => {
    if (errnoCode(e) === 'EEXIST') return undefined;
    throw new DormantError(ErrorCode.VAULT_IO, `cannot create master key file ${src.file}`, { cause: e });
  });
  if (h === undefined) return loadMasterKey({ file: src.file, create: false }, opts);
  try {
    await h.writeFile(`${key.toString('hex')}\n`);
    await h.sync();
  } finally {
    await h.close();
  }
  await chmod(src.file, 0o600);
  opts.warn(
    `generated a new master key at ${src.file}; in production keep it in a secrets manager and pass it with a key command (or DORMANT_MASTER_KEY_FILE on a separate volume): losing it loses every checkpoint`,
  );
  return key;
}

const KEY_MAGIC = Buffer.from('DRMKEY01');
const CHECK_TEXT = Buffer.from('dormant vault master key check v1');

export const MASTER_CHECK = 'keys/master.check';

/** Proves the master key is the one the vault was created with (a wrong key says so plainly). */
export async function checkMasterKey(store: VaultStore, master: Buffer, vaultIsNew: boolean): Promise<void> {
  const k = deriveKey(master, 'master-check');
  if (vaultIsNew) {
    await store.writeNew(MASTER_CHECK, seal(k, Buffer.from(MASTER_CHECK), CHECK_TEXT));
  }
  const sealed = await store.read(MASTER_CHECK);
  const plain = openSealed(k, Buffer.from(MASTER_CHECK), sealed);
  if (!plain?.equals(CHECK_TEXT)) {
    throw new DormantError(
      ErrorCode.VAULT_KEY_WRONG,
      `the master key does not open the vault at ${store.location}`,
      { hint: 'use the master key this vault was created with (DORMANT_MASTER_KEY_FILE or the key command)' },
    );
  }
}

export function tenantKeyName(tenant: string): string {
  return `keys/tenants/${tenant}.key`;
}
export function tenantTombstoneName(tenant: string): string {
  return `keys/tenants/${tenant}.destroyed`;
}
export function sandboxKeyName(tenant: string, sandboxId: string): string {
  return `keys/sandboxes/${tenant}/${sandboxId}.key`;
}
export function sandboxTombstoneName(tenant: string, sandboxId: string): string {
  return `keys/sandboxes/${tenant}/${sandboxId}.destroyed`;
}

async function exists(store: VaultStore, name: string): Promise<boolean> {
  try {
    await store.read(name);
    return true;
  } catch (e) {
    if (e instanceof DormantError && e.code === ErrorCode.VAULT_NOT_FOUND) return false;
    throw e;
  }
}

/**
 * Loads (or with `create`, first creates) a wrapped key object. Creation is exclusive, so two
 * writers racing on a new tenant end up with the same key.
 */
export async function loadWrappedKey(
  store: VaultStore,
  opts: {
    name: string;
    tombstone: string;
    wrapKey: Buffer;
    label: string;
    create: boolean;
    destroyedCode: 'TENANT_KEY_DESTROYED' | 'SANDBOX_KEY_DESTROYED';
  },
): Promise<Buffer | undefined> {
  const aad = Buffer.from(opts.name);
  for (let attempt = 0; attempt < 2; attempt++) {
    if (await exists(store, opts.tombstone)) {
      throw new DormantError(
        opts.destroyedCode,
        `the key of ${opts.label} was destroyed; its checkpoints are unrecoverable`,
        { hint: 'crypto-shredding cannot be undone; new checkpoints need a new tenant or sandbox id' },
      );
    }
    let blob: Buffer | undefined;
    try {
      blob = await store.read(opts.name);
    } catch (e) {
      if (!(e instanceof DormantError && e.code === ErrorCode.VAULT_NOT_FOUND)) throw e;
    }
    if (blob !== undefined) {
      const key = blob.subarray(0, KEY_MAGIC.length).equals(KEY_MAGIC)
        ? openSealed(opts.wrapKey, aad, blob.subarray(KEY_MAGIC.length))
        : undefined;
      if (key?.length !== KEY_BYTES) {
        throw new DormantError(
          ErrorCode.VAULT_CORRUPT,
          `key object ${opts.name} of ${opts.label} fails authentication`,
          {
            details: { object: opts.name },
            hint: 'the key object was modified or the wrong master key is in use',
          },
        );
      }
      return key;
    }
    if (!opts.create) return undefined;
    const key = randomBytes(KEY_BYTES);
    const wrapped = Buffer.concat([KEY_MAGIC, seal(opts.wrapKey, aad, key)]);
    if (await store.writeNew(opts.name, wrapped)) return key;
    // Lost the race to another writer: use the key it created.
  }
  throw new DormantError(ErrorCode.VAULT_IO, `could not create key object ${opts.name}`);
}

export async function isDestroyed(store: VaultStore, tombstone: string): Promise<boolean> {
  return exists(store, tombstone);
}

/**
 * The key Vault.open derives from the master key to wrap tenant keys (keep the two in step:
 * vault.ts derives it inline with the same label).
 */
export function tenantWrapKeyOf(master: Uint8Array): Buffer {
  return deriveKey(master, 'tenant-key-wrap');
}

/** What a sealed secret value starts with; anything else is a value from before sealing. */
export const SEALED_VALUE_PREFIX = 'dormant-sealed-v1:';

const TENANT_RE = /^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/;

/**
 * Seals a sandbox's small secrets (its `--env` values) for the database of record, under a key
 * derived (HKDF, label `sandbox-env`) from the tenant's key in the vault: destroying the tenant
 * key (crypto-shredding) makes them unreadable too. Each value is AES-256-GCM with associated
 * data naming the tenant, the sandbox and the variable, so a value cannot be moved to another
 * variable, sandbox or tenant. Names stay in clear (they show which variables a sandbox has).
 * Keys are loaded for each call, not cached: a destroyed tenant key stops working at once.
 */
export class TenantSecrets {
  private constructor(
    private readonly store: VaultStore,
    private readonly wrap: Buffer,
  ) {}

  /** Loads the master key from `masterKey` (the vault's, already checked) and proves it again. */
  static async open(o: { store: VaultStore; masterKey: MasterKeySource }): Promise<TenantSecrets> {
    const src = 'file' in o.masterKey ? { file: o.masterKey.file, create: false } : o.masterKey;
    // The vault was opened first (it generated the key file if it was new): never create here.
    const master = await loadMasterKey(src, { vaultIsNew: false, warn: () => undefined });
    const wrap = tenantWrapKeyOf(master);
    master.fill(0);
    await checkMasterKey(o.store, wrap, false);
    return new TenantSecrets(o.store, wrap);
  }

  private async key(tenant: string): Promise<Buffer> {
    if (!TENANT_RE.test(tenant))
      throw new DormantError(ErrorCode.INVALID_ARGUMENT, `invalid tenant "${tenant.slice(0, 80)}"`);
    const tk = await loadWrappedKey(this.store, {
      name: tenantKeyName(tenant),
      tombstone: tenantTombstoneName(tenant),
      wrapKey: this.wrap,
      label: `tenant ${tenant}`,
      create: true,
      destroyedCode: ErrorCode.TENANT_KEY_DESTROYED,
    });
    const k = deriveKey(tk!, 'sandbox-env');
    tk!.fill(0);
    return k;
  }

  private static aad(tenant: string, sandboxId: string, name: string): Buffer {
    return Buffer.from(`dormant sandbox env v1\n${tenant}\n${sandboxId}\n${name}`);
  }

  /**
   * The key of the toolbox agents' tokens (control/ops/toolbox.ts): derived from the master
   * key through HKDF with a label of its own, so it is stable across daemon restarts (a
   * hibernated sandbox's agent still knows its token) and tells nothing of the keys beside it.
   */
  agentTokenKey(): Buffer {
    return deriveKey(this.wrap, 'toolbox agent token');
  }

  /** `env` with every value sealed (names unchanged). */
  async seal(
    tenant: string,
    sandboxId: string,
    env: Readonly<Record<string, string>>,
  ): Promise<Record<string, string>> {
    const names = Object.keys(env);
    if (names.length === 0) return {};
    const k = await this.key(tenant);
    try {
      const out: Record<string, string> = {};
      for (const n of names) {
        const blob = seal(k, TenantSecrets.aad(tenant, sandboxId, n), Buffer.from(env[n]!, 'utf8'));
        out[n] = SEALED_VALUE_PREFIX + blob.toString('base64');
      }
      return out;
    } finally {
      k.fill(0);
    }
  }

  /** `env` with every value opened; a value that is not sealed, or fails authentication, throws. */
  async open(
    tenant: string,
    sandboxId: string,
    env: Readonly<Record<string, string>>,
  ): Promise<Record<string, string>> {
    const names = Object.keys(env);
    if (names.length === 0) return {};
    const k = await this.key(tenant);
    try {
      const out: Record<string, string> = {};
      for (const n of names) {
        const v = env[n]!;
        const plain = v.startsWith(SEALED_VALUE_PREFIX)
          ? openSealed(
              k,
              TenantSecrets.aad(tenant, sandboxId, n),
              Buffer.from(v.slice(SEALED_VALUE_PREFIX.length), 'base64'),
            )
          : undefined;
        if (plain === undefined)
          throw new DormantError(
            ErrorCode.VAULT_CORRUPT,
            `the sealed value of environment variable ${n} of sandbox ${sandboxId} does not open`,
            {
              hint: 'the database row was modified, or the vault (its tenant key) is not the one it was sealed with',
            },
          );
        out[n] = plain.toString('utf8');
        plain.fill(0);
      }
      return out;
    } finally {
      k.fill(0);
    }
  }

  /** True when every value of `env` is sealed. */
  static isSealed(env: Readonly<Record<string, string>>): boolean {
    return Object.values(env).every((v) => v.startsWith(SEALED_VALUE_PREFIX));
  }

  /** Overwrites the wrapping key in memory. */
  close(): void {
    this.wrap.fill(0);
  }
}
