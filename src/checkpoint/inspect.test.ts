/**
 * inspect against checkpointctl: a real python tree (TCP listener, established connection,
 * unix socket, pipe, file, child) is dumped with CRIU, packed as podman archives (.tar,
 * .tar.gz, .tar.zst), and dormant must show at least the processes, files and sockets
 * `checkpointctl inspect --ps-tree --files --sockets` shows for the same archive.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { readdir, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { run, which } from '../sys/exec.js';
import { inspectCheckpoint, type InspectFile, type InspectReport } from './inspect.js';
import { openCheckpointPath } from './source.js';
import { buildBusyboxRootfs } from '../runtime/testing/rootfs.js';
import { dump, podmanArchive, shm, startPython, TREE_PY } from './testing/fixtures.js';

interface CtlReport {
  process_tree: CtlNode;
  file_descriptors?: { pid: number; open_files: { type: string; fd: string; path: string }[] }[];
  sockets?: {
    pid: number;
    open_sockets: {
      protocol?: string;
      data: {
        type: string;
        state?: string;
        src?: string;
        src_port?: number;
        dst?: string;
        dst_port?: number;
        address?: string;
      };
    }[];
  }[];
}
interface CtlNode {
  pid: number;
  command: string;
  children?: CtlNode[];
}

function flat(n: CtlNode, out: { pid: number; command: string }[] = []): { pid: number; command: string }[] {
  out.push({ pid: n.pid, command: n.command });
  for (const c of n.children ?? []) flat(c, out);
  return out;
}

async function shmLeftovers(): Promise<string[]> {
  return (await readdir('/dev/shm')).filter((n) => n.startsWith('dormant-ck-'));
}

describe('checkpoint inspect', { timeout: 180_000 }, () => {
  let dir = '';
  let images = '';
  const archives: string[] = [];
  let ctl: string | undefined;

  before(async () => {
    ctl = await which('checkpointctl');
    dir = await shm('dormant-inspect-test-');
    images = join(dir, 'images');
    const pid = await startPython(TREE_PY, dir);
    await dump(pid, images);
    for (const c of ['none', 'gzip', 'zstd'] as const) {
      const ext = c === 'none' ? 'tar' : c === 'gzip' ? 'tar.gz' : 'tar.zst';
      archives.push(await podmanArchive(images, join(dir, `ck.${ext}`), c));
    }
  });
  after(async () => {
    await rm(dir, { recursive: true, force: true });
  });

  test('a folder of images: tree, commands, sockets, memory', async () => {
    const ck = await openCheckpointPath(images);
    const r = await inspectCheckpoint(ck);
    await ck.close();
    assert.equal(r.processes.length, 2);
    assert.equal(r.processTree.length, 1);
    assert.equal(r.processTree[0]!.children.length, 1);
    const root = r.processes[0]!;
    assert.match(root.comm, /python/);
    assert.ok(
      root.cmdline?.some((a) => a === '-c'),
      `argv read from memory: ${JSON.stringify(root.cmdline)}`,
    );
    assert.ok(root.sockets.some((s) => s.listening && s.protocol === 'tcp'));
    const est = root.sockets.filter((s) => s.state === 'ESTABLISHED');
    assert.equal(est.length, 2);
    assert.ok(est.every((s) => s.needsReconnect));
    assert.ok(root.sockets.some((s) => s.family === 'unix' && s.local.startsWith('@dormant-test-')));
    assert.ok(root.files.some((f) => f.path.endsWith('/data.txt')));
    assert.ok(root.files.some((f) => f.type === 'PIPE'));
    assert.ok(root.memory.storedBytes > 0 && root.memory.mappedBytes >= root.memory.storedBytes);
    assert.equal(r.metadata.engine, 'criu');
    assert.equal(r.metadata.arch, 'x86_64');
    assert.match(r.metadata.criuVersion ?? '', /^4\./);
  });

  for (const [i, ext] of ['tar', 'tar.gz', 'tar.zst'].entries()) {
    test(`.${ext}: at least what checkpointctl inspect shows`, async (t) => {
      const file = archives[i]!;
      const before = await shmLeftovers();
      const ck = await openCheckpointPath(file);
      let r: InspectReport;
      try {
        r = await inspectCheckpoint(ck);
      } finally {
        await ck.close();
      }
      assert.deepEqual(await shmLeftovers(), before, 'the staging folder is wiped');
      assert.equal(r.metadata.engine, 'podman');
      assert.equal(r.metadata.name, 'demo');
      assert.equal(r.metadata.runtime, 'runc');
      if (ctl === undefined) {
        t.skip('checkpointctl is not installed');
        return;
      }
      const out = await run(ctl, ['inspect', file, '--format', 'json', '--ps-tree', '--files', '--sockets'], {
        timeoutMs: 60_000,
      });
      const c = (JSON.parse(out.stdout) as CtlReport[])[0]!;
      const mine = new Map(r.processes.map((p) => [p.pid, p]));
      for (const p of flat(c.process_tree)) {
        assert.ok(mine.has(p.pid), `pid ${p.pid} shown by checkpointctl`);
        assert.equal(mine.get(p.pid)!.comm, p.command);
      }
      let nFiles = 0;
      for (const fdset of c.file_descriptors ?? []) {
        const p = mine.get(fdset.pid);
        assert.ok(p, `files of pid ${fdset.pid}`);
        for (const f of fdset.open_files) {
          nFiles++;
          const fd = /^\S+ (\d+)$/.exec(f.fd)?.[1] ?? f.fd;
          const m: InspectFile | undefined = p.files.find((x) => x.fd === fd);
          assert.ok(m, `pid ${fdset.pid} fd ${f.fd} (${f.path})`);
          if (f.type === 'REG' || f.type === 'PIPE' || f.fd === 'cwd' || f.fd === 'root')
            assert.equal(m.path, f.path);
        }
      }
      let nSockets = 0;
      for (const ss of c.sockets ?? []) {
        const p = mine.get(ss.pid)!;
        for (const s of ss.open_sockets) {
          nSockets++;
          if (s.data.type === 'UNIX') {
            const name = (s.data.address ?? '').replace(/^\0/, '@');
            assert.ok(
              p.sockets.some((x) => x.family === 'unix' && x.local === name),
              `unix socket ${name}`,
            );
          } else {
            const local = `${s.data.src}:${s.data.src_port}`;
            const state = s.data.state;
            const sock = p.sockets.find((x) => x.local === local && x.state === state);
            assert.ok(sock, `${s.data.type} ${local} ${state ?? ''}`);
            if (s.data.dst_port !== undefined)
              assert.equal(sock.remote, `${s.data.dst ?? ''}:${s.data.dst_port}`);
          }
        }
      }
      assert.ok(nFiles >= 20 && nSockets >= 8, `compared ${nFiles} files and ${nSockets} sockets`);
    });
  }

  test('podman itself: an archive from `podman container checkpoint --export` (needs podman)', async (t) => {
    const podman = await which('podman');
    if (podman === undefined) {
      t.skip('podman is not installed on this machine (scripts/setup.sh installs it)');
      return;
    }
    const name = `dormant-inspect-${process.pid}`;
    const image = `localhost/dormant-inspect-${process.pid}:latest`;
    const out = join(dir, 'podman.tar.zst');
    // An image of the test's own busybox root, never one pulled from a registry.
    const rootfs = join(dir, 'podman-rootfs');
    await buildBusyboxRootfs(rootfs);
    await run('tar', ['-C', rootfs, '-cf', `${rootfs}.tar`, '.'], { timeoutMs: 60_000 });
    await run(podman, ['import', `${rootfs}.tar`, image], { timeoutMs: 120_000 });
    // No network (nothing to reach), and the ulimits processes here may set (no CAP_SYS_RESOURCE).
    const args = ['--network', 'none', '--ulimit', 'nofile=1024:1024', '--ulimit', 'nproc=4096:4096'];
    await run(
      podman,
      [
        'run',
        '-d',
        '--name',
        name,
        '--runtime',
        'runc',
        ...args,
        image,
        'sh',
        '-c',
        'nc -lk -p 8080 & sleep 3600',
      ],
      {
        timeoutMs: 120_000,
      },
    );
    try {
      await run(podman, ['container', 'checkpoint', name, '--export', out, '--compress', 'zstd'], {
        timeoutMs: 120_000,
      });
      const ck = await openCheckpointPath(out);
      const r = await inspectCheckpoint(ck);
      await ck.close();
      assert.equal(r.metadata.engine, 'podman');
      const ctlOut = await run(ctl ?? 'checkpointctl', ['inspect', out, '--format', 'json', '--ps-tree'], {
        timeoutMs: 60_000,
      });
      const c = (JSON.parse(ctlOut.stdout) as CtlReport[])[0]!;
      for (const p of flat(c.process_tree))
        assert.ok(r.processes.some((x) => x.pid === p.pid && x.comm === p.command));
    } finally {
      await run(podman, ['rm', '-f', name], { timeoutMs: 60_000, okExitCodes: [0, 1, 125] });
      await run(podman, ['rmi', '-f', image], { timeoutMs: 60_000, okExitCodes: [0, 1, 125] });
    }
  });
});
