/**
 * The hostname in a checkpoint's UTS namespace image (utsns-ID.img: CRIU's utsns_entry,
 * nodename = 1, domainname = 2). CRIU restores the namespace exactly as dumped, so a sandbox
 * restored from another's checkpoint (a fork, a template) would answer to the other's name
 * until told otherwise; written into the image before the restore, the name is the sandbox's
 * own from the first instruction its processes run.
 */
import { readFile, readdir, rename, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { decodeFields, malformed } from './proto.js';
import { parseImage } from './image-file.js';
import { bytes, rewriteImage, rewriteMessage } from './write.js';

/** CRIU's UTSNS_MAGIC (criu/include/magic.h). */
export const UTSNS_MAGIC = 0x54473203;
const NODENAME = 1;
/** A UTS namespace image holds one small entry; anything bigger is not one. */
const MAX_UTSNS_BYTES = 4096;

/** The nodename of each UTS namespace image in `dir` (tests, and what a restore will show). */
export async function imageHostnames(dir: string): Promise<string[]> {
  const out: string[] = [];
  for (const f of (await readdir(dir)).filter(isUtsnsImage).sort()) {
    const img = parseImage(await readFile(join(dir, f)), f, UTSNS_MAGIC, 1);
    for (const e of img.entries)
      for (const field of decodeFields(e))
        if (field.no === NODENAME && field.wire === 2) out.push(Buffer.from(field.value).toString());
  }
  return out;
}

const isUtsnsImage = (name: string): boolean => /^utsns-\d+\.img$/.test(name);

/**
 * Sets the nodename of every UTS namespace image in `dir` to `hostname`; returns how many
 * images it rewrote (0: the checkpoint has no UTS namespace of its own).
 */
export async function setImagesHostname(dir: string, hostname: string): Promise<number> {
  // No folder: nothing to rename; the restore that follows says the images are missing.
  const names = await readdir(dir).catch((e: unknown) => {
    if ((e as NodeJS.ErrnoException).code === 'ENOENT') return [];
    throw e;
  });
  const files = names.filter(isUtsnsImage);
  for (const f of files) {
    const path = join(dir, f);
    const raw = await readFile(path);
    if (raw.length > MAX_UTSNS_BYTES)
      throw malformed(`${f}: ${raw.length} bytes is too big for a UTS namespace image`);
    // Checked (magic, entry lengths) before the rewrite trusts its lengths.
    parseImage(raw, f, UTSNS_MAGIC, 1);
    const out = rewriteImage(raw, (entry) =>
      rewriteMessage(entry, (fields) =>
        fields.map((field) =>
          field.no === NODENAME && field.wire === 2 ? bytes(NODENAME, hostname) : field,
        ),
      ),
    );
    // Whole or not at all: a restore never reads half an image.
    await writeFile(`${path}.tmp`, out, { mode: 0o600 });
    await rename(`${path}.tmp`, path);
  }
  return files.length;
}
