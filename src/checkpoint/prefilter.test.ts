/**
 * The scan prefilter finds exactly what the detectors find on the whole buffer when secrets sit
 * between random, zero and text bytes; and the filesystem diff of an import: written from a
 * real writable layer and applied again, with the hostile shapes refused.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { lstat, mkdir, mkdtemp, readFile, readlink, rm, symlink, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { findSecrets, findSecretsInBytes, textRegions } from './secrets.js';
import { applyDeletedFiles, applyRootfsDiff, rootfsDiffMembers } from './rootfs-diff.js';
import { TAR_END, tarHeader, tarPadding } from './tar.js';
import { run } from '../sys/exec.js';
import { scanCheckpoint } from './scan.js';
import { openCheckpointPath } from './source.js';
import { dump, kill, shm, startPython } from './testing/fixtures.js';

const SECRETS = [
  'AKIAQQQQQQQQ7EXAMPLE',
  'ghp_' + 'a1B2'.repeat(9),
  'sk-ant-api03-' + 'x9Y8'.repeat(10),
  'xoxb-1234567890-abcdefghij',
  'DB_PASSWORD=hunter2hunter2',
  'api_key: "Zq8v7Xw2Lk9Rt4Yp6Nm3Bc1"',
  'eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U',
  '-----BEGIN OPENSSH PRIVATE KEY-----',
];

test('the prefilter finds what the detectors find on the whole buffer', () => {
  const parts: Buffer[] = [];
  for (const [i, s] of SECRETS.entries()) {
    parts.push(randomBytes(5000 + i * 37));
    parts.push(Buffer.alloc(4096));
    parts.push(Buffer.from(`{"user": "agent", "ok": true}\n export ${s}\n`));
  }
  parts.push(randomBytes(3000));
  const buf = Buffer.concat(parts);
  const whole = findSecrets(buf.toString('latin1')).map((s) => `${s.kind}@${s.offset}:${s.value}`);
  const fast = findSecretsInBytes(buf).map((s) => `${s.kind}@${s.offset}:${s.value}`);
  assert.ok(whole.length >= SECRETS.length, whole.join('\n'));
  assert.deepEqual(fast, whole);
  // And the regions it hands the detectors are a small part of the buffer.
  const r = textRegions(buf);
  let text = 0;
  for (let i = 0; i < r.length; i += 2) text += r[i + 1]! - r[i]!;
  assert.ok(text < buf.length / 10, `${text} of ${buf.length} bytes looked at`);
});

test('textRegions reads a word at a time exactly as byte by byte', () => {
  // Runs of text with the edge bytes of every class (0x1f, 0x20, 0x7e, 0x7f, 0x80, 0xff, tab,
  // CR, LF, NUL) at every position of a word; a buffer at an odd offset is read byte by byte.
  let seed = 11;
  const rnd = (n: number) => {
    seed = (seed * 1103515245 + 12345) % 2 ** 31;
    return seed % n;
  };
  const edge = [0x1f, 0x20, 0x7e, 0x7f, 0x80, 0xff, 0x09, 0x0d, 0x0a, 0x00, 0x41];
  for (let round = 0; round < 300; round++) {
    const n = 64 + rnd(4000);
    const b = Buffer.alloc(n + 1);
    for (let i = 1; i <= n; i++) {
      const r = rnd(100);
      b[i] = r < 75 ? 0x20 + rnd(95) : r < 90 ? edge[rnd(edge.length)]! : rnd(256);
    }
    const odd = b.subarray(1);
    const aligned = Buffer.from(new Uint8Array(odd));
    assert.equal(aligned.byteOffset % 4, 0);
    assert.deepEqual(textRegions(aligned), textRegions(odd), `round ${round}`);
  }
});

test('over bytes, the detectors find exactly what they find over each region decoded whole', () => {
  // Text dense with anchors, near-misses and open-ended shapes (JWTs and webhooks longer than
  // any fixed window, a service-account "type" across blanks), between binary bytes.
  let seed = 7;
  const rnd = (n: number) => {
    seed = (seed * 1103515245 + 12345) % 2 ** 31;
    return seed % n;
  };
  const word = (n: number, set = 'abcXYZ019_-') =>
    Array.from({ length: n }, () => set[rnd(set.length)]).join('');
  const pieces = [
    () => `API_KEY=${word(8 + rnd(40))}`,
    () => `token: "${word(20 + rnd(30), 'aZ9xQ')}"`,
    () => `password = ${word(rnd(12))}`,
    () => `PASSWORD=${word(520 + rnd(20))}`,
    () => `secretary ${word(5)}`,
    () => `key${word(3)}`,
    () => `AKIA${word(16, 'ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789')}${rnd(2) ? 'x' : ' '}`,
    () => `eyJ${word(900 + rnd(600))}.eyJ${word(20)}.${word(30)}`,
    () => `eyJ${word(5)}`,
    () =>
      `https://hooks.slack.com/services/T${word(1200, 'ABC123')}/B${word(8, 'XYZ9')}/${word(24, 'abcXYZ09')}`,
    () => `"type"${' '.repeat(rnd(300))}:\t"service_account"`,
    () => `ghp_${word(36 + rnd(220), 'aB3')}`,
    () => `sk-ant-api03-${word(40 + rnd(90))} sk-${word(rnd(230))}`,
    () => `${word(3)}${rnd(10)}Q~${word(31 + rnd(5))}`,
    () => `xoxb-${word(rnd(260))} sk_live_${word(rnd(260), 'aZ0')}`,
    () => `-----BEGIN ${rnd(2) ? 'RSA ' : ''}PRIVATE KEY-----`,
    () => `{"user": "agent", "tool": "bash", "cwd": "/workspace"}`,
  ];
  const parts: Buffer[] = [];
  for (let i = 0; i < 3000; i++) {
    parts.push(Buffer.from(`${word(rnd(8), ' \n\t=:"')}${pieces[rnd(pieces.length)]!()}`, 'latin1'));
    if (rnd(20) === 0) parts.push(randomBytes(1 + rnd(40)));
  }
  const buf = Buffer.concat(parts);
  const regions = textRegions(buf);
  const reference: string[] = [];
  for (let r = 0; r < regions.length; r += 2) {
    for (const s of findSecrets(buf.toString('latin1', regions[r], regions[r + 1]))) {
      reference.push(`${s.kind}@${s.offset + regions[r]!}:${s.name ?? ''}:${s.value}`);
    }
  }
  const fast = findSecretsInBytes(buf).map((s) => `${s.kind}@${s.offset}:${s.name ?? ''}:${s.value}`);
  assert.ok(reference.length > 1000, `${reference.length} found`);
  assert.deepEqual(fast, reference);
});

test('textRegions: runs at the edges, short runs skipped, close runs merged', () => {
  const b = Buffer.concat([
    Buffer.from('0123456789ab'),
    Buffer.from([0, 1]),
    Buffer.from('short'),
    Buffer.alloc(40),
  ]);
  assert.deepEqual(textRegions(b), [0, 12]);
  const c = Buffer.concat([
    Buffer.alloc(30),
    Buffer.from('abcdefghijkl'),
    Buffer.from([0]),
    Buffer.from('mnopqrstuvwx'),
  ]);
  assert.deepEqual(textRegions(c), [30, 55]);
  assert.deepEqual(textRegions(Buffer.from('abcdefghij')), [0, 10]);
  assert.deepEqual(textRegions(Buffer.from('abcdefghi')), []);
});

test('a writable layer written as rootfs-diff.tar + deleted.files applies back the same', async () => {
  const dir = await mkdtemp('/tmp/dormant-rootfs-diff-');
  try {
    const upper = join(dir, 'upper');
    await mkdir(join(upper, 'srv', 'deep'), { recursive: true });
    await writeFile(join(upper, 'srv', 'note.txt'), 'changed\n');
    await writeFile(join(upper, 'srv', 'deep', 'big.bin'), randomBytes(300_000));
    await symlink('../srv/note.txt', join(upper, 'srv', 'link'));
    await writeFile(join(upper, `${'n'.repeat(120)}.txt`), 'long name');
    await run('mknod', [join(upper, 'srv', 'gone.txt'), 'c', '0', '0'], { timeoutMs: 10_000 });
    const members = await rootfsDiffMembers(upper, join(dir, 'rootfs-diff.tar'));
    assert.deepEqual(
      members.map((m) => m.name),
      ['rootfs-diff.tar', 'deleted.files'],
    );
    assert.deepEqual(JSON.parse(members[1]!.data!.toString()), ['/srv/gone.txt']);
    const back = join(dir, 'back');
    await mkdir(back);
    await applyRootfsDiff(join(dir, 'rootfs-diff.tar'), back);
    await applyDeletedFiles(members[1]!.data!.toString(), back);
    assert.equal(await readFile(join(back, 'srv', 'note.txt'), 'utf8'), 'changed\n');
    assert.deepEqual(
      await readFile(join(back, 'srv', 'deep', 'big.bin')),
      await readFile(join(upper, 'srv', 'deep', 'big.bin')),
    );
    assert.equal(await readlink(join(back, 'srv', 'link')), '../srv/note.txt');
    assert.equal(await readFile(join(back, `${'n'.repeat(120)}.txt`), 'utf8'), 'long name');
    const wh = await lstat(join(back, 'srv', 'gone.txt'));
    assert.ok(wh.isCharacterDevice() && wh.rdev === 0, 'the deletion is an overlay whiteout');
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});

test('a hostile rootfs diff is refused and writes nothing outside its folder', async () => {
  const dir = await mkdtemp('/tmp/dormant-rootfs-diff-');
  const file = (name: string, data: string): Buffer[] => {
    const b = Buffer.from(data);
    return [tarHeader({ name, size: b.length, type: 'file' }), b, tarPadding(b.length)];
  };
  try {
    const cases: [string, Buffer[], RegExp][] = [
      [
        'through-link',
        [tarHeader({ name: 'etc', size: 0, type: 'symlink', linkName: dir }), ...file('etc/x', 'x')],
        /through the link etc/,
      ],
      ['dotdot', file('../x', 'x'), /climbs out/],
      ['absolute', file(join(dir, 'x'), 'x'), /absolute path/],
      [
        'hardlink-out',
        [Buffer.from(tarHeader({ name: 'h', size: 0, type: 'symlink', linkName: '/etc/passwd' }))],
        /./,
      ],
      ['twice', [...file('a', '1'), ...file('a', '2')], /appears twice/],
    ];
    // A hard link to a file outside the archive: typeflag 1, written by hand.
    const hl = cases[3]![1][0]!;
    hl.write('1', 156, 'latin1');
    hl.write('        ', 148, 'latin1');
    let sum = 0;
    for (const x of hl) sum += x;
    hl.write(`${sum.toString(8).padStart(6, '0')}\0 `, 148, 'latin1');
    cases[3]![2] = /not a file of the archive|climbs out|absolute/;
    for (const [name, entries, why] of cases) {
      const tar = join(dir, `${name}.tar`);
      await writeFile(tar, Buffer.concat([...entries, TAR_END]));
      const target = join(dir, `${name}-out`);
      await mkdir(target);
      await assert.rejects(applyRootfsDiff(tar, target), (e: Error & { code?: string }) => {
        assert.equal(e.code, 'CHECKPOINT_ARCHIVE_INVALID', `${name}: ${e.message}`);
        assert.match(e.message, why, name);
        return true;
      });
      assert.equal(existsSync(join(dir, 'x')), false, `${name}: nothing written outside`);
    }
    await assert.rejects(applyDeletedFiles('["../../etc/passwd"]', join(dir, 'twice-out')), /climbs out/);
    await assert.rejects(applyDeletedFiles('{"a":1}', join(dir, 'twice-out')), /not a list/);
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});

test('a secret across a chunk boundary is found once, whatever the chunk size', async () => {
  const dir = await shm('dormant-seam-test-');
  // 40 copies, each 4 KiB further and one byte later: some straddle every page boundary.
  const code = `
import sys, time
key = bytes.fromhex(sys.argv[2])
buf = bytearray(4096 * 64)
for i in range(40):
    at = 4096 * (i + 1) - 20 + i
    buf[at:at + len(key)] = key
open(sys.argv[1], 'w').write('ok')
time.sleep(3600)
`;
  const secret = ['AKIA', 'Z'.repeat(12), '7SEAM'.slice(0, 4)].join('');
  const pid = await startPython(code.replace('sys.argv[2]', `'${Buffer.from(secret).toString('hex')}'`), dir);
  try {
    await dump(pid, join(dir, 'images'));
  } finally {
    kill(pid);
  }
  try {
    const ck = await openCheckpointPath(join(dir, 'images'));
    const count = async (chunkBytes?: number): Promise<number> => {
      const r = await scanCheckpoint(ck, { ...(chunkBytes !== undefined ? { chunkBytes } : {}) });
      return r.findings
        .filter((f) => f.kind === 'aws_access_key' && f.where === 'memory')
        .reduce((n, f) => n + f.occurrences, 0);
    };
    const whole = await count();
    assert.ok(whole >= 40, `${whole} copies found in 4 MiB chunks`);
    assert.equal(
      await count(4096),
      whole,
      'page-sized chunks find the same copies, straddling ones included',
    );
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});
