/**
 * scan on real dumps: secrets of every kind planted in a python process's environment and
 * heap, in the filesystem diff and in spec.dump are all found, each with a redacted
 * preview that does not contain the secret; a clean process gives nothing; and for every
 * planted string dormant finds at least what `checkpointctl memparse --search` finds.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { readdir, rm, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { run, which } from '../sys/exec.js';
import { scanCheckpoint, type ScanReport } from './scan.js';
import { fingerprint, type SecretKind } from './secrets.js';
import { openCheckpointPath } from './source.js';
import { dump, podmanArchive, shm, startPython } from './testing/fixtures.js';

const ALNUM = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789';
function rnd(n: number, alphabet = ALNUM): string {
  const b = randomBytes(n);
  let s = '';
  for (let i = 0; i < n; i++) s += alphabet.charAt(b[i]! % alphabet.length);
  return s;
}
const UPPER = 'ABCDEFGHIJKLMNOPQRSTUVWXYZ234567';
const B64 = `${ALNUM}+/`;
const B64URL = `${ALNUM}-_`;

/** One fresh, well-formed (fake) secret of each kind, with the value the scanner should report. */
function plantedSecrets(): { kind: SecretKind; text: string; value: string }[] {
  const jwt = `eyJhbGciOiJIUzI1NiJ9.eyJ${rnd(40, B64URL)}.${rnd(43, B64URL)}`;
  const pem = `-----BEGIN RSA PRIVATE KEY-----`;
  const ssh = `-----BEGIN OPENSSH PRIVATE KEY-----`;
  const az = `AccountKey=${rnd(86, B64)}==`;
  const list: { kind: SecretKind; value: string; text?: string }[] = [
    { kind: 'aws_access_key', value: `AKIA${rnd(16, UPPER)}` },
    { kind: 'gcp_api_key', value: `AIza${rnd(35, B64URL)}` },
    {
      kind: 'azure_storage_key',
      value: az,
      text: `DefaultEndpointsProtocol=https;AccountName=x;${az};EndpointSuffix=core`,
    },
    { kind: 'github_token', value: `ghp_${rnd(36)}` },
    { kind: 'gitlab_token', value: `glpat-${rnd(20)}` },
    { kind: 'openai_api_key', value: `sk-proj-${rnd(48)}` },
    { kind: 'anthropic_api_key', value: `sk-ant-api03-${rnd(93, B64URL)}AA` },
    { kind: 'slack_token', value: `xoxb-${rnd(12, '0123456789')}-${rnd(24)}` },
    { kind: 'stripe_key', value: `sk_live_${rnd(24)}` },
    { kind: 'jwt', value: jwt },
    { kind: 'private_key', value: pem, text: `${pem}\nMIIEow${rnd(60, B64)}\n-----END RSA PRIVATE KEY-----` },
    {
      kind: 'ssh_private_key',
      value: ssh,
      text: `${ssh}\nb3BlbnNzaC1rZXk${rnd(60, B64)}\n-----END OPENSSH PRIVATE KEY-----`,
    },
    { kind: 'secret_assignment', value: `Tr0ub4dor-${rnd(8)}`, text: '' },
    { kind: 'high_entropy_assignment', value: `${rnd(10)}7x${rnd(12)}`, text: '' },
  ];
  return list.map((s) => {
    if (s.kind === 'secret_assignment')
      return { kind: s.kind, value: s.value, text: `DB_PASSWORD=${s.value}` };
    if (s.kind === 'high_entropy_assignment')
      return { kind: s.kind, value: s.value, text: `{"client_secret": "${s.value}"}` };
    return { kind: s.kind, value: s.value, text: s.text ?? s.value };
  });
}

/** Reads the planted texts from a file into the heap (bytearrays), then deletes the file. */
const HOLDER_PY = `
import os, sys, json, time
d = os.path.dirname(sys.argv[1])
p = os.path.join(d, 'plant.json')
keep = []
if os.path.exists(p):
    for t in json.load(open(p)):
        keep.append(bytearray(t.encode()))
    os.unlink(p)
junk = [bytearray(os.urandom(4096)) for _ in range(256)]
open(sys.argv[1], 'w').write(str(os.getpid()))
time.sleep(3600)
`;

describe('checkpoint scan', { timeout: 240_000 }, () => {
  let dir = '';
  const key = randomBytes(32);
  const planted = plantedSecrets();
  const envSecret = { kind: 'openai_api_key' as SecretKind, value: `sk-proj-${rnd(48)}` };
  const envAws = `AKIA${rnd(16, UPPER)}`;
  const fileSecret = `ghp_${rnd(36)}`;
  const specSecret = `glpat-${rnd(20)}`;
  let dirty = '';
  let clean = '';
  let dirtyTar = '';
  let dirtyPid = 0;

  before(async () => {
    dir = await shm('dormant-scan-test-');
    await writeFile(join(dir, 'plant.json'), JSON.stringify(planted.map((p) => p.text)));
    dirtyPid = await startPython(HOLDER_PY, dir, {
      OPENAI_API_KEY: envSecret.value,
      AWS_ACCESS_KEY_ID: envAws,
    });
    await dump(dirtyPid, join(dir, 'dirty'));
    const cleanPid = await startPython(HOLDER_PY, dir);
    await dump(cleanPid, join(dir, 'clean'));
    dirty = await podmanArchive(join(dir, 'dirty'), join(dir, 'dirty.tar.zst'), 'zstd', {
      env: ['PATH=/bin', `GITLAB_TOKEN=${specSecret}`],
      rootfs: {
        'home/agent/.config/gh/hosts.yml': `github.com:\n  oauth_token: ${fileSecret}\n`,
        'etc/motd': 'hello\n',
      },
    });
    clean = await podmanArchive(join(dir, 'clean'), join(dir, 'clean.tar'), 'none');
    dirtyTar = await podmanArchive(join(dir, 'dirty'), join(dir, 'dirty.tar'), 'none', {
      env: ['PATH=/bin', `GITLAB_TOKEN=${specSecret}`],
      rootfs: {
        'home/agent/.config/gh/hosts.yml': `github.com:\n  oauth_token: ${fileSecret}\n`,
        'etc/motd': 'hello\n',
      },
    });
  });
  after(async () => {
    await rm(dir, { recursive: true, force: true });
  });

  async function scan(file: string): Promise<ScanReport> {
    const ck = await openCheckpointPath(file);
    try {
      return await scanCheckpoint(ck, { fingerprintKey: key });
    } finally {
      await ck.close();
    }
  }

  test('every planted kind is found in memory, environment, files and metadata; no preview leaks', async () => {
    const r = await scan(dirty);
    const mem = r.findings.filter((f) => f.where === 'memory');
    for (const p of planted) {
      const fp = fingerprint(key, p.value);
      const hit = mem.find((f) => f.fingerprint === fp);
      assert.ok(hit, `${p.kind} planted in the heap was not found`);
      assert.equal(hit.kind, p.kind);
      assert.equal(hit.process?.pid, dirtyPid);
      assert.match(hit.address ?? '', /^0x[0-9a-f]+$/);
      assert.ok(hit.mapping !== undefined && hit.mapping !== '');
    }
    const env = mem.find((f) => f.fingerprint === fingerprint(key, envSecret.value));
    assert.ok(env, 'OPENAI_API_KEY from the environment');
    assert.ok(mem.some((f) => f.fingerprint === fingerprint(key, envAws) && f.kind === 'aws_access_key'));
    const fsHit = r.findings.find((f) => f.where === 'filesystem');
    assert.equal(fsHit?.path, '/home/agent/.config/gh/hosts.yml');
    assert.equal(fsHit.fingerprint, fingerprint(key, fileSecret));
    const meta = r.findings.find((f) => f.where === 'metadata' && f.path === 'spec.dump');
    assert.equal(meta?.kind, 'gitlab_token');
    assert.equal(meta.name, 'GITLAB_TOKEN');
    const everything = JSON.stringify(r);
    for (const s of [...planted.map((p) => p.value), envSecret.value, envAws, fileSecret, specSecret]) {
      if (s.startsWith('-----BEGIN')) continue; // the PEM header is the finding, not the key
      assert.ok(!everything.includes(s), `the report must not carry the secret (${s.slice(0, 6)}...)`);
    }
    assert.ok(r.scanned.memoryBytes > 1_000_000);
  });

  test('the same report with and without worker threads, whatever the chunk size', async () => {
    const ck = await openCheckpointPath(dirty);
    try {
      for (const chunkBytes of [4096, 64 * 1024, undefined]) {
        const opts = { fingerprintKey: key, ...(chunkBytes !== undefined ? { chunkBytes } : {}) };
        const inline = await scanCheckpoint(ck, { ...opts, workers: 0 });
        const pooled = await scanCheckpoint(ck, { ...opts, workers: 2 });
        assert.ok(inline.findings.length > planted.length);
        assert.deepEqual(pooled.findings, inline.findings, `chunkBytes ${chunkBytes}`);
        assert.deepEqual(pooled.scanned, inline.scanned);
      }
    } finally {
      await ck.close();
    }
  });

  test('pages read in place in an uncompressed archive: the same report, no pages in staging', async () => {
    const unpacked = await scan(dirty);
    const ck = await openCheckpointPath(dirtyTar, { pagesInPlace: true });
    try {
      assert.ok(ck.pagesInPlace !== undefined && ck.pagesInPlace.members.size > 0, 'pages left in place');
      const staged = await readdir(ck.imagesDir);
      assert.ok(staged.includes('pstree.img'));
      assert.deepEqual(
        staged.filter((n) => n.startsWith('pages-')),
        [],
      );
      for (const workers of [0, 2]) {
        const r = await scanCheckpoint(ck, { fingerprintKey: key, workers });
        assert.deepEqual(r.findings, unpacked.findings, `workers ${workers}`);
        assert.deepEqual(r.scanned, unpacked.scanned);
      }
    } finally {
      await ck.close();
    }
    // A compressed archive has no place to read from: it is unpacked whole, as before.
    const z = await openCheckpointPath(dirty, { pagesInPlace: true });
    try {
      assert.equal(z.pagesInPlace, undefined);
    } finally {
      await z.close();
    }
  });

  test('a clean process gives nothing', async () => {
    const r = await scan(clean);
    assert.deepEqual(
      r.findings.map((f) => `${f.kind} ${f.where} ${f.mapping ?? f.path ?? ''} ${f.preview}`),
      [],
    );
  });

  test('at least what checkpointctl memparse --search finds, for each planted string', async (t) => {
    const ctl = await which('checkpointctl');
    if (ctl === undefined) {
      t.skip('checkpointctl is not installed');
      return;
    }
    const r = await scan(dirty);
    let ctlHits = 0;
    for (const p of [...planted, envSecret]) {
      const out = await run(ctl, ['memparse', dirty, '--pid', String(dirtyPid), '--search', p.value], {
        timeoutMs: 60_000,
        okExitCodes: [0, 1],
      });
      const found = !/No matches/.test(out.stdout + out.stderr) && out.exitCode === 0;
      if (!found) continue;
      ctlHits++;
      assert.ok(
        r.findings.some((f) => f.process?.pid === dirtyPid && f.fingerprint === fingerprint(key, p.value)),
        `checkpointctl found ${p.kind}; dormant must too`,
      );
    }
    t.diagnostic(
      `checkpointctl memparse found ${ctlHits} of ${planted.length + 1} planted strings; dormant found all`,
    );
  });

  test('no staging folder is left in /dev/shm', async () => {
    const before = (await readdir('/dev/shm')).filter((n) => n.startsWith('dormant-ck-'));
    await scan(dirty);
    const afterScan = (await readdir('/dev/shm')).filter((n) => n.startsWith('dormant-ck-'));
    assert.deepEqual(afterScan, before);
  });
});
