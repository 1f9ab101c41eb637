/**
 * Two nodes sharing one vault: each has its own data folder (its own `<data-dir>/vault` with
 * its lock files), both use the same bucket prefix on a real S3 server (Ceph RGW), the same
 * master key and the same PostgreSQL database, whose advisory locks (state/pg-locks.ts)
 * arbitrate between them: key creation, and writers against gc.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { randomBytes } from 'node:crypto';
import pg from 'pg';
import { mkdir, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import type { S3VaultConfig } from '../daemon/config.js';
import { s3VaultStore, vaultLocksFor } from '../daemon/vault-store.js';
import { DormantError } from '../domain/errors.js';
import { openVaultLocks } from '../state/pg-locks.js';
import { pgMissing, startPostgres, type TestPostgres } from '../state/testing/postgres.js';
import { TenantSecrets, openVault, type Vault, type VaultLocks } from './index.js';
import { S3Store } from './s3-store.js';
import { diffTrees, removeDir, shmDir } from './testing/fixtures.js';
import { rgwMissing, startRgw, type TestRgw } from './testing/rgw.js';

const missing = (await pgMissing()) ?? (await rgwMissing());
if (missing !== undefined) process.stderr.write(`skipping the vault fleet lock tests: ${missing}\n`);

const code = (c: string) => (e: unknown) => e instanceof DormantError && e.code === c;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

let pgs: TestPostgres;
let rgw: TestRgw;
let root: string;
let url: string;
let n = 0;

interface Node {
  store: S3Store;
  vault: Vault;
  secrets: TenantSecrets;
  close(): Promise<void>;
}

/** A node on `prefix`: its own data folder, the shared bucket, `locks` (or its lock files). */
async function node(
  name: string,
  prefix: string,
  key: Buffer,
  locks: VaultLocks | undefined,
  lockTimeoutMs?: number,
): Promise<Node> {
  const dir = join(root, name, 'vault');
  const store = new S3Store({
    bucket: rgw.bucket,
    prefix,
    endpoint: rgw.endpoint,
    credentials: { accessKeyId: rgw.accessKeyId, secretAccessKey: rgw.secretAccessKey },
    lockDir: join(dir, 'locks'),
    ...(locks ? { locks } : {}),
  });
  // RGW's dbstore gets ranged GETs and multipart wrong: the store reads and writes whole objects.
  await store.checkServer();
  const vault = await openVault({
    dir,
    masterKey: { key },
    store,
    onWarning: () => undefined,
    sealWorkers: 0,
    ...(locks ? { locks } : {}),
    ...(lockTimeoutMs !== undefined ? { lockTimeoutMs } : {}),
  });
  const secrets = await TenantSecrets.open({ store, masterKey: { key } });
  return {
    store,
    vault,
    secrets,
    close: async () => {
      secrets.close();
      await vault.close();
      store.destroy();
    },
  };
}

/** Two nodes on a fresh prefix, each with its own locks on the one database. */
async function twoNodes(lockTimeoutMs?: number): Promise<{
  a: Node;
  b: Node;
  locksA: VaultLocks;
  locksB: VaultLocks;
  /** One more node on the prefix, with locks of its own (closed with the others; close the node first). */
  third: (lockTimeoutMs?: number) => Promise<Node>;
  close: () => Promise<void>;
}> {
  const prefix = `fleet${++n}/vault`;
  const key = randomBytes(32);
  const locksA = await openVaultLocks(url);
  const locksB = await openVaultLocks(url);
  const more: VaultLocks[] = [];
  // Opened at once on an empty prefix: FORMAT and master.check are created by both.
  const [a, b] = await Promise.all([
    node(`a${n}`, prefix, key, locksA, lockTimeoutMs),
    node(`b${n}`, prefix, key, locksB, lockTimeoutMs),
  ]);
  const m = n;
  return {
    a,
    b,
    locksA,
    locksB,
    third: async (timeoutMs) => {
      const locks = await openVaultLocks(url);
      more.push(locks);
      return node(`c${m}`, prefix, key, locks, timeoutMs);
    },
    close: async () => {
      for (const l of more) await l.close();
      await a.close();
      await b.close();
      await locksA.close();
      await locksB.close();
    },
  };
}

/** Settles to true once `p` has settled; read it without waiting. */
function watch(p: Promise<unknown>): { settled: boolean } {
  const w = { settled: false };
  void p.then(
    () => (w.settled = true),
    () => (w.settled = true),
  );
  return w;
}

/** Counts the calls made on `store` from now on (every method of the storage port). */
function countCalls(store: S3Store): { count: number } {
  const c = { count: 0 };
  for (const m of [
    'read',
    'openReader',
    'write',
    'create',
    'writeNew',
    'list',
    'remove',
    'removeAll',
    'shred',
  ] as const) {
    const orig = store[m].bind(store) as (...args: unknown[]) => Promise<unknown>;
    Object.defineProperty(store, m, {
      value: (...args: unknown[]) => {
        c.count++;
        return orig(...args);
      },
    });
  }
  return c;
}

/** A promise and the function that resolves it: a gate a holder waits at. */
function gate(): { wait: Promise<void>; open: () => void } {
  let open!: () => void;
  const wait = new Promise<void>((r) => (open = r));
  return { wait, open };
}

/** A child process holding `kind` of the writer/gc lock of `location` until killed. */
async function holderChild(
  kind: 'shared' | 'exclusive',
  location: string,
): Promise<{ kill(): Promise<void> }> {
  const child = spawn(
    process.execPath,
    [
      '--input-type=module',
      '-e',
      `const { openVaultLocks } = await import(${JSON.stringify(new URL('../state/pg-locks.js', import.meta.url).href)});
       const locks = await openVaultLocks(process.env.URL);
       await locks.writersAndGc(process.env.LOC).${kind}({ timeoutMs: 10000 });
       process.stdout.write('held\\n');
       setInterval(() => {}, 1000);`,
    ],
    { env: { ...process.env, URL: url, LOC: location }, stdio: ['ignore', 'pipe', 'inherit'] },
  );
  const [line] = (await once(child.stdout, 'data')) as [Buffer];
  assert.equal(line.toString().trim(), 'held');
  return {
    kill: async () => {
      child.kill('SIGKILL');
      if (child.exitCode === null && child.signalCode === null) await once(child, 'exit');
    },
  };
}

describe(
  'the vault on two nodes sharing a bucket prefix and a PostgreSQL database',
  { skip: missing },
  () => {
    before(async () => {
      root = await shmDir('fleet');
      [pgs, rgw] = await Promise.all([startPostgres(), startRgw()]);
      url = await pgs.createDatabase('fleet');
    });
    after(async () => {
      await pgs?.stop();
      await rgw?.stop();
      if (root) await removeDir(root);
    });

    test('both nodes create the same tenant key at the same moment, 20 times: both always end up with the same key', async () => {
      const { a, b, close } = await twoNodes();
      try {
        const lost: string[] = [];
        for (let round = 0; round < 20; round++) {
          const tenant = `t${round}`;
          // Each call loads (and here first creates) the tenant key afresh from the bucket.
          const [byA, byB] = await Promise.all([
            a.secrets.seal(tenant, 'sb-a', { V: `from a ${round}` }),
            b.secrets.seal(tenant, 'sb-b', { V: `from b ${round}` }),
          ]);
          // Sealed with a key the bucket no longer holds: opens nowhere.
          const opened = await Promise.all([
            b.secrets.open(tenant, 'sb-a', byA).then(
              (v) => v.V,
              () => undefined,
            ),
            a.secrets.open(tenant, 'sb-b', byB).then(
              (v) => v.V,
              () => undefined,
            ),
          ]);
          if (opened[0] !== `from a ${round}` || opened[1] !== `from b ${round}`) lost.push(tenant);
        }
        assert.deepEqual(lost, [], 'tenants whose data one node sealed with a key that was overwritten');

        // The store's create-if-absent itself: exactly one node creates each object.
        for (let round = 0; round < 20; round++) {
          const name = `keys/tenants/raw${round}.key`;
          const da = randomBytes(64);
          const db = randomBytes(64);
          const [wa, wb] = await Promise.all([a.store.writeNew(name, da), b.store.writeNew(name, db)]);
          assert.equal(Number(wa) + Number(wb), 1, `round ${round}: one create of ${name}`);
          assert.deepEqual(await a.store.read(name), wa ? da : db);
        }

        // Whole checkpoints, a fresh tenant each: what one node stored the other restores.
        for (let round = 0; round < 3; round++) {
          const tenant = `ck${round}`;
          const srcs = [join(root, `src-a-${round}`), join(root, `src-b-${round}`)];
          for (const s of srcs) {
            await mkdir(s, { recursive: true });
            await writeFile(join(s, 'core.img'), randomBytes(50_000));
          }
          await Promise.all([
            a.vault.putCheckpoint({ tenant, sandboxId: 'sb-a', checkpointId: 'ck-a', srcDir: srcs[0]! }),
            b.vault.putCheckpoint({ tenant, sandboxId: 'sb-b', checkpointId: 'ck-b', srcDir: srcs[1]! }),
          ]);
          const dests = [join(root, `dst-b-${round}`), join(root, `dst-a-${round}`)];
          await b.vault.restoreCheckpoint({ tenant, checkpointId: 'ck-a', destDir: dests[0]! });
          await a.vault.restoreCheckpoint({ tenant, checkpointId: 'ck-b', destDir: dests[1]! });
          assert.equal(await diffTrees(srcs[0]!, dests[0]!), undefined);
          assert.equal(await diffTrees(srcs[1]!, dests[1]!), undefined);
        }
      } finally {
        await close();
      }
    });

    test("a create waits for another node's create of the same object, and gives up after its bound naming it", async () => {
      const prefix = `fleet${++n}/vault`;
      const locksA = await openVaultLocks(url);
      const locksB = await openVaultLocks(url, { createWaitMs: 300 });
      const held = gate();
      try {
        const location = `s3://${rgw.bucket}/${prefix}`;
        const first = locksA.whileCreating(location, 'keys/tenants/x.key', () => held.wait);
        await sleep(100);
        const started = Date.now();
        await assert.rejects(
          locksB.whileCreating(location, 'keys/tenants/x.key', async () => 'ran'),
          (e: unknown) =>
            code('VAULT_BUSY')(e) &&
            (e as Error).message.includes(`${location}/keys/tenants/x.key`) &&
            /another dormant node/.test((e as DormantError).hint ?? ''),
        );
        assert.ok(Date.now() - started < 5_000);
        // Another object, or the same name in another vault, does not wait.
        assert.equal(await locksB.whileCreating(location, 'keys/tenants/y.key', async () => 'ran'), 'ran');
        assert.equal(
          await locksB.whileCreating(`${location}2`, 'keys/tenants/x.key', async () => 'ran'),
          'ran',
        );
        held.open();
        await first;
        assert.equal(await locksB.whileCreating(location, 'keys/tenants/x.key', async () => 'ran'), 'ran');
      } finally {
        held.open();
        await locksA.close();
        await locksB.close();
      }
    });

    test("gc on one node waits for the other node's writers (and keeps new ones out); a writer waits for the other's gc", async () => {
      const { a, b, locksA, third, close } = await twoNodes();
      // A third node whose writers and gc give up after 300 ms (VaultOptions.lockTimeoutMs).
      const c = await third(300);
      try {
        // Node B holds a writer's lock (a restore, a put, a backup: all the same lock).
        const writer = gate();
        const b1 = b.vault.whileGcHeldOff(() => writer.wait);
        await sleep(100);
        await assert.rejects(
          c.vault.gc(),
          (e: unknown) => code('VAULT_BUSY')(e) && /checkpoints are being written/.test((e as Error).message),
        );
        // Node A does nothing but its gc: every call on its store from here is the gc's.
        const gcCalls = countCalls(a.store);
        const gc = a.vault.gc();
        const gcDone = watch(gc);
        await sleep(300);
        // A second writer on node B, after A's gc asked: waits for that gc, though B already writes.
        let gcCallsWhenB2Ran: number | undefined;
        const b2 = b.vault.whileGcHeldOff(async () => {
          gcCallsWhenB2Ran = gcCalls.count;
        });
        await sleep(500);
        assert.equal(gcDone.settled, false, "A's gc waits for B's running writer");
        assert.equal(gcCalls.count, 0, "A's gc has not touched the bucket while B's writer runs");
        assert.equal(gcCallsWhenB2Ran, undefined, "B's new writer waits for A's waiting gc");
        writer.open();
        await b1;
        await gc;
        await b2;
        assert.ok(gcCalls.count > 0);
        assert.equal(gcCallsWhenB2Ran, gcCalls.count, "B's new writer ran after the last of A's gc's calls");

        // A's gc holds the vault (the lock gc takes): B's put waits, C's gives up after its bound.
        const release = await locksA.writersAndGc(a.store.location).exclusive({ timeoutMs: 5_000 });
        const src = join(root, `gc-src-${n}`);
        await mkdir(src, { recursive: true });
        await writeFile(join(src, 'core.img'), randomBytes(10_000));
        const put = b.vault.putCheckpoint({
          tenant: 'acme',
          sandboxId: 'sb',
          checkpointId: 'ck-1',
          srcDir: src,
        });
        const putDone = watch(put);
        await assert.rejects(
          c.vault.putCheckpoint({ tenant: 'acme', sandboxId: 'sb', checkpointId: 'ck-2', srcDir: src }),
          (e: unknown) =>
            code('VAULT_BUSY')(e) && /a garbage collection is running/.test((e as Error).message),
        );
        await sleep(300);
        assert.equal(putDone.settled, false, "B's put waits for A's gc");
        await release();
        await put;
        const restored = join(root, `gc-dst-${n}`);
        await a.vault.restoreCheckpoint({ tenant: 'acme', checkpointId: 'ck-1', destDir: restored });
        assert.equal(await diffTrees(src, restored), undefined);
      } finally {
        await c.close();
        await close();
      }
    });

    test('a holder that dies (SIGKILL) frees the lock: gc after a killed writer, writers after a killed gc', async () => {
      const location = `s3://${rgw.bucket}/fleet${++n}/vault`;
      const locks = await openVaultLocks(url);
      try {
        const lock = locks.writersAndGc(location);
        const gcHolder = await holderChild('exclusive', location);
        try {
          await assert.rejects(
            lock.shared({ timeoutMs: 300 }),
            (e: unknown) =>
              code('VAULT_BUSY')(e) && /a garbage collection is running/.test((e as Error).message),
          );
        } finally {
          await gcHolder.kill();
        }
        // The server ends a dead client's session when its socket closes: at once, not after a lease.
        const release = await lock.shared({ timeoutMs: 5_000 });
        await release();

        const writerHolder = await holderChild('shared', location);
        try {
          await assert.rejects(
            lock.exclusive({ timeoutMs: 300 }),
            (e: unknown) =>
              code('VAULT_BUSY')(e) && /checkpoints are being written/.test((e as Error).message),
          );
        } finally {
          await writerHolder.kill();
        }
        const releaseGc = await lock.exclusive({ timeoutMs: 5_000 });
        await releaseGc();
      } finally {
        await locks.close();
      }
    });

    test("a writers' connection the server ends is reported and its lock taken again: gc elsewhere still waits", async () => {
      const location = `s3://${rgw.bucket}/fleet${++n}/vault`;
      const lost: string[] = [];
      const locks = await openVaultLocks(url, { onLost: (m) => lost.push(m) });
      const other = await openVaultLocks(url);
      const admin = new pg.Client({ connectionString: url });
      await admin.connect();
      try {
        const release = await locks.writersAndGc(location).shared({ timeoutMs: 1_000 });
        const ended = await admin.query<{ n: number }>(
          `SELECT count(pg_terminate_backend(pid))::int AS n FROM pg_stat_activity
            WHERE application_name = 'dormant vault writers' AND pid <> pg_backend_pid()`,
        );
        assert.equal(ended.rows[0]?.n, 1);
        for (let i = 0; i < 100 && lost.length === 0; i++) await sleep(20);
        assert.match(lost[0] ?? '', /ended while 1 write\(s\) ran; taking it again/);
        // Taken again on a new connection: another node's gc waits for the write as before.
        for (let i = 0; i < 100; i++) {
          const r = await admin.query<{ n: number }>(
            `SELECT count(*)::int AS n FROM pg_locks
              WHERE locktype = 'advisory' AND classid = $1 AND objsubid = 2 AND mode = 'ShareLock' AND granted`,
            [0x76617577], // the writers' key class in state/pg-locks.ts
          );
          if (r.rows[0]?.n === 1) break;
          await sleep(20);
        }
        await assert.rejects(
          other.writersAndGc(location).exclusive({ timeoutMs: 300 }),
          (e: unknown) => code('VAULT_BUSY')(e) && /checkpoints are being written/.test((e as Error).message),
        );
        await release();
        const gc = await other.writersAndGc(location).exclusive({ timeoutMs: 1_000 });
        await gc();
        assert.equal(lost.length, 1, lost.join('; '));
      } finally {
        await admin.end();
        await locks.close();
        await other.close();
      }
    });

    test("the daemon's and the vault commands' locks (vaultLocksFor): PostgreSQL's for an S3 vault with PostgreSQL state, else the lock files", async () => {
      const warn = (m: string): void => assert.fail(`unexpected warning: ${m}`);
      const cfg: S3VaultConfig = {
        url: `s3://${rgw.bucket}/fleet${++n}/vault`,
        endpoint: rgw.endpoint,
        accessKeyId: rgw.accessKeyId,
        secretAccessKey: { value: rgw.secretAccessKey },
        cacheBytes: 0,
        partSizeBytes: 8 * 1024 * 1024,
      };
      assert.equal(await vaultLocksFor(undefined, cfg, warn), undefined);
      assert.equal(await vaultLocksFor({ url }, undefined, warn), undefined);
      const locks = await vaultLocksFor({ url }, cfg, warn);
      assert.ok(locks);
      const other = await openVaultLocks(url);
      const store = await s3VaultStore(cfg, join(root, `d${n}`, 'vault'), () => undefined, locks);
      const held = gate();
      try {
        // Another node is creating FORMAT: this node's create of it waits, then finds it there.
        const hold = other.whileCreating(store.location, 'FORMAT', async () => {
          await held.wait;
          await store.write('FORMAT', Buffer.from('theirs'));
        });
        await sleep(100);
        const mine = store.writeNew('FORMAT', Buffer.from('mine'));
        const mineDone = watch(mine);
        await sleep(300);
        assert.equal(mineDone.settled, false, "the store's writeNew waits for the other node's create");
        held.open();
        await hold;
        assert.equal(await mine, false);
        assert.equal((await store.read('FORMAT')).toString(), 'theirs');
      } finally {
        held.open();
        store.destroy();
        await locks.close();
        await other.close();
      }
    });

    test('an unreachable database: STATE_UNAVAILABLE naming it without its password', async () => {
      await assert.rejects(
        openVaultLocks('postgres://u:s3cret@127.0.0.1:1/x', { connectTimeoutMs: 2_000 }),
        (e: unknown) =>
          code('STATE_UNAVAILABLE')(e) &&
          (e as Error).message.includes('127.0.0.1:1') &&
          !(e as Error).message.includes('s3cret'),
      );
    });
  },
);
