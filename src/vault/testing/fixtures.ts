/**
 * Test fixtures for the vault: memory-backed temp folders, folder comparison, raw-byte grep,
 * and real CRIU dumps of python processes. Test-only (the layer check skips testing/).
 */
import { spawn } from 'node:child_process';
import { lstat, mkdir, mkdtemp, open, readdir, readFile, readlink, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { run } from '../../sys/exec.js';

/** A private temp folder on /dev/shm (memory-backed: test plaintext never reaches a disk). */
export async function shmDir(prefix: string): Promise<string> {
  await mkdir('/dev/shm', { recursive: true });
  return mkdtemp(join('/dev/shm', `dormant-vault-${prefix}-`));
}

/** Flips bits of the byte at `pos` of `path` (XOR `mask`): the same call again undoes it. */
export async function flipByte(path: string, pos: number, mask = 0x40): Promise<void> {
  const h = await open(path, 'r+');
  try {
    const b = Buffer.alloc(1);
    await h.read(b, 0, 1, pos);
    b[0] = b[0]! ^ mask;
    await h.write(b, 0, 1, pos);
  } finally {
    await h.close();
  }
}

export async function removeDir(dir: string): Promise<void> {
  await rm(dir, { recursive: true, force: true });
}

export interface TreeEntry {
  type: 'file' | 'dir' | 'symlink';
  mode: number;
  size: number;
  /** Allocated bytes (st_blocks * 512): shows whether holes stayed holes. */
  allocated: number;
  target?: string;
}

export async function describeTree(root: string): Promise<Map<string, TreeEntry>> {
  const out = new Map<string, TreeEntry>();
  const walk = async (dir: string, rel: string): Promise<void> => {
    for (const n of (await readdir(dir)).sort()) {
      const p = join(dir, n);
      const r = rel ? `${rel}/${n}` : n;
      const st = await lstat(p);
      const base = { mode: st.mode & 0o7777, size: st.size, allocated: st.blocks * 512 };
      if (st.isDirectory()) {
        out.set(r, { type: 'dir', ...base, size: 0, allocated: 0 });
        await walk(p, r);
      } else if (st.isSymbolicLink()) {
        out.set(r, { type: 'symlink', ...base, mode: 0, allocated: 0, target: await readlink(p) });
      } else {
        out.set(r, { type: 'file', ...base });
      }
    }
  };
  await walk(root, '');
  return out;
}

/** Returns the first difference between two folders (paths, types, modes, sizes, bytes), or undefined. */
export async function diffTrees(a: string, b: string): Promise<string | undefined> {
  const ta = await describeTree(a);
  const tb = await describeTree(b);
  const names = new Set([...ta.keys(), ...tb.keys()]);
  for (const n of [...names].sort()) {
    const x = ta.get(n);
    const y = tb.get(n);
    if (!x || !y) return `${n}: only in ${x ? a : b}`;
    if (x.type !== y.type) return `${n}: ${x.type} vs ${y.type}`;
    if (x.mode !== y.mode) return `${n}: mode ${x.mode.toString(8)} vs ${y.mode.toString(8)}`;
    if (x.size !== y.size) return `${n}: size ${x.size} vs ${y.size}`;
    if (x.target !== y.target) return `${n}: link ${x.target ?? ''} vs ${y.target ?? ''}`;
    if (x.type === 'file') {
      const [da, db] = await Promise.all([readFile(join(a, n)), readFile(join(b, n))]);
      if (!da.equals(db)) return `${n}: contents differ`;
    }
  }
  return undefined;
}

/** Every file under `root` whose raw bytes contain `needle`. */
export async function grepTree(root: string, needle: Buffer): Promise<string[]> {
  const hits: string[] = [];
  for (const [rel, e] of await describeTree(root)) {
    if (e.type !== 'file') continue;
    if ((await readFile(join(root, rel))).includes(needle)) hits.push(rel);
  }
  return hits;
}

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

async function waitForFile(path: string, timeoutMs: number): Promise<string> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    try {
      const t = await readFile(path, 'utf8');
      if (t !== '') return t;
    } catch {
      // Not there yet.
    }
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${path}`);
    await sleep(20);
  }
}

export function killPid(pid: number): void {
  try {
    process.kill(pid, 'SIGKILL');
  } catch {
    // Already gone (criu dump kills what it dumped).
  }
}

/**
 * Starts `python3 -c code` detached; the script gets the ready-file path as argv[1] and must
 * write its pid-or-anything there when set up. Returns the pid.
 */
export async function startPython(
  code: string,
  workDir: string,
  args: string[] = [],
  timeoutMs = 60_000,
): Promise<number> {
  const ready = join(workDir, `ready-${Date.now()}-${Math.random().toString(16).slice(2)}`);
  const child = spawn('/usr/bin/python3', ['-c', code, ready, ...args], { detached: true, stdio: 'ignore' });
  child.unref();
  const pid = child.pid;
  if (pid === undefined) throw new Error('python3 did not start');
  try {
    await waitForFile(ready, timeoutMs);
  } catch (e) {
    killPid(pid);
    throw e;
  }
  await rm(ready, { force: true });
  return pid;
}

/** Dumps `pid` with CRIU into `dir` (created). The process is gone afterwards. */
export async function criuDump(pid: number, dir: string, timeoutMs = 120_000): Promise<void> {
  await mkdir(dir, { recursive: true });
  try {
    await run('criu', ['dump', '-t', String(pid), '-D', dir, '--shell-job', '-o', 'dump.log'], { timeoutMs });
  } finally {
    killPid(pid);
  }
  // dump.log names paths and pids, not memory; it stays so the folder is what dormant gets.
}

/**
 * A python process holding `mb` MiB of mixed memory (random, text, zeros) and `secret` (hex)
 * in its heap. Returns its pid once the memory is populated.
 */
export async function startMixedPython(workDir: string, mb: number, secretHex = ''): Promise<number> {
  const code = `
import os, sys, time
mb = int(sys.argv[2]); secret = bytes.fromhex(sys.argv[3]) if len(sys.argv) > 3 else b''
q = mb * 1024 * 1024 // 4
rnd = bytearray(os.urandom(q))
txt = bytearray((b'{"user": "agent", "tool": "bash", "cwd": "/workspace", "ok": true}\\n' * (q // 64 + 1))[:q])
zer = bytearray(q)
mix = bytearray(q)
for i in range(0, q, 4096): mix[i:i+64] = os.urandom(64)
keep = [bytearray(secret) for _ in range(4)]
open(sys.argv[1], 'w').write(str(os.getpid()))
time.sleep(3600)
`;
  return startPython(code, workDir, [String(mb), secretHex]);
}

/**
 * A python base process with `n` forks: each fork changes one byte per MiB of the shared data
 * and allocates 256 KiB of its own. Returns pids (forks first, then the base), in dump order.
 */
export async function startForkFamily(
  workDir: string,
  n: number,
  mb: number,
): Promise<{ forks: number[]; base: number }> {
  const code = `
import os, sys, time
d = sys.argv[1]; n = int(sys.argv[2]); mb = int(sys.argv[3])
half = mb * 1024 * 1024 // 2
base = bytearray(os.urandom(half)) + bytearray((b'page of text %d ' % 7) * (half // 15 + 1))[:half]
for i in range(n):
    if os.fork() == 0:
        mine = bytearray(os.urandom(256 * 1024))
        for j in range(0, len(base), 1024 * 1024): base[j] = (base[j] + i + 1) % 256
        open(d + '.kid-%d' % i, 'w').write(str(os.getpid()))
        time.sleep(3600); os._exit(0)
open(d, 'w').write(str(os.getpid()))
time.sleep(3600)
`;
  const ready = join(workDir, 'family');
  const child = spawn('/usr/bin/python3', ['-c', code, ready, String(n), String(mb)], {
    detached: true,
    stdio: 'ignore',
  });
  child.unref();
  const base = Number(await waitForFile(ready, 60_000));
  const forks: number[] = [];
  for (let i = 0; i < n; i++) forks.push(Number(await waitForFile(`${ready}.kid-${i}`, 60_000)));
  return { forks, base };
}
