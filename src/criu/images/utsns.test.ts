import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, readFile, readdir, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { IMG_COMMON_MAGIC, parseImage } from './image-file.js';
import { decodeFields } from './proto.js';
import { UTSNS_MAGIC, imageHostnames, setImagesHostname } from './utsns.js';
import { bytes, encodeFields } from './write.js';

/** A utsns image as CRIU writes it: the common and the UTS magic, one length-prefixed entry. */
function utsnsImage(nodename: string, domainname: string, magic = UTSNS_MAGIC): Buffer {
  const entry = encodeFields([bytes(1, nodename), bytes(2, domainname)]);
  const head = Buffer.alloc(12);
  head.writeUInt32LE(IMG_COMMON_MAGIC, 0);
  head.writeUInt32LE(magic, 4);
  head.writeUInt32LE(entry.length, 8);
  return Buffer.concat([head, entry]);
}

test('the nodename of every UTS image is rewritten; the domain name and other images stay', async () => {
  const dir = await mkdtemp(join(tmpdir(), 'dormant-utsns-'));
  try {
    await writeFile(join(dir, 'utsns-12.img'), utsnsImage('template-source', '(none)'));
    await writeFile(join(dir, 'core-1.img'), 'not touched');
    assert.equal(await setImagesHostname(dir, 'sb-new-and-longer-name'), 1);
    assert.deepEqual(await imageHostnames(dir), ['sb-new-and-longer-name']);
    const img = parseImage(await readFile(join(dir, 'utsns-12.img')), 'utsns', UTSNS_MAGIC);
    const fields = decodeFields(img.entries[0]!);
    assert.deepEqual(
      fields.map((f) => [f.no, Buffer.from(f.value as Uint8Array).toString()]),
      [
        [1, 'sb-new-and-longer-name'],
        [2, '(none)'],
      ],
    );
    assert.equal(await readFile(join(dir, 'core-1.img'), 'utf8'), 'not touched');
    assert.deepEqual((await readdir(dir)).sort(), ['core-1.img', 'utsns-12.img'], 'no temporary left');
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});

test('none: nothing to rewrite; not a UTS image: refused as malformed, left as it was', async () => {
  const dir = await mkdtemp(join(tmpdir(), 'dormant-utsns-'));
  try {
    assert.equal(await setImagesHostname(dir, 'x'), 0);
    const wrong = utsnsImage('a', 'b', 0x12345678);
    await writeFile(join(dir, 'utsns-1.img'), wrong);
    await assert.rejects(setImagesHostname(dir, 'x'), { code: 'CRIU_IMAGE_MALFORMED' });
    assert.deepEqual(await readFile(join(dir, 'utsns-1.img')), wrong);
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});
