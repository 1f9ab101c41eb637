/**
 * Fuzzing the image reader with a kept corpus (testdata/: the metadata images of a real
 * CRIU 4.2 dump of a python process; no page contents). Every mutation (bit flips, byte
 * overwrites, truncation, inflated lengths) must either decode or fail with
 * CRIU_IMAGE_MALFORMED: never another exception, never a hang, never a huge allocation.
 * A seeded generator makes failures reproducible: the seed is in the test name.
 */
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { cp, mkdtemp, readdir, readFile, rm, writeFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { DormantError } from '../../domain/errors.js';
import { parseImage, Magic } from './image-file.js';
import {
  decodeCore,
  decodeFdinfo,
  decodeFileEntry,
  decodeFs,
  decodeIdsEntry,
  decodeInventory,
  decodeMm,
  decodeMount,
  decodePagemapEntry,
  decodePstree,
  decodeSeccomp,
  decodeUserns,
} from './messages.js';
import { readCriuImages } from './reader.js';
import { readProfileImages } from '../../checkpoint/profile-check-io.js';
import { encodeFields, sub, uint } from './testing/tamper.js';
import { rng } from '../../sys/testing/rng.js';

// dist/criu/images -> src/criu/images/testdata
const CORPUS = join(
  dirname(fileURLToPath(import.meta.url)),
  '..',
  '..',
  '..',
  'src',
  'criu',
  'images',
  'testdata',
);

const DECODERS: Record<string, [number, (b: Uint8Array) => unknown]> = {
  'inventory.img': [Magic.INVENTORY, decodeInventory],
  'pstree.img': [Magic.PSTREE, decodePstree],
  'core-1.img': [Magic.CORE, decodeCore],
  'mm-1.img': [Magic.MM, decodeMm],
  'pagemap-1.img': [Magic.PAGEMAP, decodePagemapEntry],
  'files.img': [Magic.FILES, decodeFileEntry],
  'fdinfo-2.img': [Magic.FDINFO, decodeFdinfo],
  'ids-1.img': [Magic.IDS, decodeIdsEntry],
  'fs-1.img': [Magic.FS, decodeFs],
  // From a dump of a dormant sandbox (runc 1.1, CRIU 4.2); userns-20.img written by tamper.ts.
  'mountpoints-13.img': [Magic.MNTS, decodeMount],
  'seccomp.img': [Magic.SECCOMP, decodeSeccomp],
  'userns-20.img': [Magic.USERNS, decodeUserns],
};

function mutate(src: Buffer, r: () => number): Buffer {
  const b = Buffer.from(src);
  const kind = Math.floor(r() * 4);
  if (kind === 0) {
    for (let i = 0; i < 1 + Math.floor(r() * 8); i++)
      b[Math.floor(r() * b.length)]! ^= 1 << Math.floor(r() * 8);
    return b;
  }
  if (kind === 1) return b.subarray(0, Math.floor(r() * b.length));
  if (kind === 2) {
    // An entry length (or any 4 bytes) made huge.
    const at = 4 + Math.floor(r() * Math.max(1, b.length - 8));
    if (at + 4 <= b.length) b.writeUInt32LE(Math.floor(r() * 0xffffffff), at);
    return b;
  }
  for (let i = 0; i < 4; i++) b[Math.floor(r() * b.length)] = Math.floor(r() * 256);
  return b;
}

function decodeAll(name: string, buf: Buffer): void {
  const [magic, dec] = DECODERS[name]!;
  const img = parseImage(buf, name, magic);
  img.entries.forEach((e, i) => {
    if (name === 'pagemap-1.img' && i === 0) return; // the head
    dec(e);
  });
}

const SEED = Number(process.env.DORMANT_FUZZ_SEED ?? 20261202);
const ROUNDS = Number(process.env.DORMANT_FUZZ_ROUNDS ?? 400);

describe('CRIU image reader fuzz', () => {
  test('the corpus decodes cleanly', async () => {
    for (const name of Object.keys(DECODERS)) decodeAll(name, await readFile(join(CORPUS, name)));
  });

  test(`${ROUNDS} mutations per image (seed ${SEED}) decode or fail with CRIU_IMAGE_MALFORMED`, async () => {
    const r = rng(SEED);
    let failures = 0;
    for (const name of Object.keys(DECODERS)) {
      const src = await readFile(join(CORPUS, name));
      for (let i = 0; i < ROUNDS; i++) {
        const m = mutate(src, r);
        try {
          decodeAll(name, m);
        } catch (e) {
          failures++;
          assert.ok(e instanceof DormantError, `${name} round ${i}: ${String(e)}`);
          assert.equal(e.code, 'CRIU_IMAGE_MALFORMED');
        }
      }
    }
    assert.ok(failures > 0, 'the mutations did hit the checks');
  });

  test('a whole folder with one damaged image fails with CRIU_IMAGE_MALFORMED or reads', async () => {
    const dir = await mkdtemp('/dev/shm/dormant-fuzz-');
    try {
      const r = rng(SEED + 1);
      const names = (await readdir(CORPUS)).filter((n) => n.endsWith('.img'));
      for (let i = 0; i < 60; i++) {
        await rm(dir, { recursive: true, force: true });
        await cp(CORPUS, dir, { recursive: true });
        const victim = names[Math.floor(r() * names.length)]!;
        await writeFile(join(dir, victim), mutate(await readFile(join(CORPUS, victim)), r));
        for (const read of [readCriuImages, readProfileImages]) {
          try {
            await read(dir);
          } catch (e) {
            assert.ok(e instanceof DormantError, `${victim}: ${String(e)}`);
            assert.equal(e.code, 'CRIU_IMAGE_MALFORMED');
          }
        }
      }
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  test('credentials are read as CRIU reads them: uint32s truncated, a repeated embedded message refused', () => {
    const creds = [
      ...[1, 2, 3, 4, 5, 6, 7, 8].map((no) => uint(no, 0)),
      uint(13, 0),
      uint(11, 2n ** 32n + 1n),
    ];
    const thread = (c: ReturnType<typeof sub>[]) =>
      encodeFields([uint(1, 1), sub(5, [uint(1, 0), uint(2, 0), ...c])]);
    // protobuf-c keeps the low 32 bits of a uint32's varint.
    assert.deepEqual(decodeCore(thread([sub(10, creds)])).threadCore?.creds?.capEff, [1]);
    // protobuf-c would merge two creds (their capability lists concatenated): refused instead.
    assert.throws(
      () => decodeCore(thread([sub(10, creds), sub(10, creds)])),
      (e: unknown) => e instanceof DormantError && e.code === 'CRIU_IMAGE_MALFORMED',
    );
  });
});
