/**
 * narrowToProfile on a real CRIU core image given every capability and no no_new_privs: the
 * engine defaults a sandbox goes without are cut, no_new_privs is set, and the rest stays for
 * the profile check to refuse. clearRootMode on a real files.img: only the root folder's mode goes.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { Magic } from '../criu/images/image-file.js';
import { decodeCore, decodeFileEntry } from '../criu/images/messages.js';
import { readImageEntries } from '../criu/images/reader.js';
import { allCapsNoNewPrivs } from '../criu/images/testing/tamper.js';
import { SANDBOX_CAPABILITIES } from '../runtime/oci.js';
import { clearRootMode, narrowToProfile } from './narrow.js';
import { CAPABILITY_NAMES, sandboxProfile } from './profile-check.js';

// dist/checkpoint -> src/criu/images/testdata
const CORPUS = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'src', 'criu', 'images', 'testdata');

const capsOf = (words: number[]): string[] =>
  CAPABILITY_NAMES.filter((_, i) => ((words[i >> 5] ?? 0) & (1 << (i & 31))) !== 0);

test('the engine defaults are cut from every set and no_new_privs is set; other capabilities stay', async () => {
  const dir = await mkdtemp(join(tmpdir(), 'dormant-narrow-'));
  try {
    await writeFile(join(dir, 'core-1.img'), allCapsNoNewPrivs(await readFile(join(CORPUS, 'core-1.img'))));
    const r = await narrowToProfile(dir, sandboxProfile({ capabilities: SANDBOX_CAPABILITIES }));
    assert.deepEqual(r, { capabilities: ['CAP_MKNOD', 'CAP_NET_RAW', 'CAP_SETFCAP'], noNewPrivs: true });
    const [raw] = (await readImageEntries(dir, 'core-1.img', Magic.CORE))!;
    const creds = decodeCore(raw!).threadCore!.creds!;
    for (const set of [creds.capEff, creds.capPrm, creds.capBnd]) {
      const caps = capsOf(set);
      assert.ok(
        !caps.includes('CAP_SETFCAP') && !caps.includes('CAP_MKNOD') && !caps.includes('CAP_NET_RAW'),
      );
      assert.ok(
        caps.includes('CAP_SYS_ADMIN'),
        'what is not an engine default stays, for the check to refuse',
      );
    }
    assert.equal(creds.noNewPrivs, 1);
    // Done again, nothing is left to cut.
    assert.deepEqual(await narrowToProfile(dir, sandboxProfile({ capabilities: SANDBOX_CAPABILITIES })), {
      capabilities: [],
      noNewPrivs: false,
    });
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});

test("clearRootMode takes the mode off the root folder's entries only; again, it changes nothing", async () => {
  const dir = await mkdtemp(join(tmpdir(), 'dormant-rootmode-'));
  try {
    for (const f of ['files.img', 'mountpoints-13.img'])
      await writeFile(join(dir, f), await readFile(join(CORPUS, f)));
    const regs = async () =>
      (await readImageEntries(dir, 'files.img', Magic.FILES))!.flatMap((raw) => {
        const reg = decodeFileEntry(raw).reg;
        return reg ? [{ name: reg.name, mode: reg.mode }] : [];
      });
    const was = await regs();
    assert.deepEqual(
      was.filter((r) => r.name === '/').map((r) => r.mode),
      [0o40755, 0o40755],
    );
    assert.equal(await clearRootMode(dir), 2);
    const now = await regs();
    assert.deepEqual(
      now.filter((r) => r.name === '/').map((r) => r.mode),
      [undefined, undefined],
    );
    assert.deepEqual(
      now.filter((r) => r.name !== '/'),
      was.filter((r) => r.name !== '/'),
      'every other file keeps its mode',
    );
    assert.equal(await clearRootMode(dir), 0);
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});
