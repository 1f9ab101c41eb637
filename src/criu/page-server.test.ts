/**
 * The page server's side of CRIU's lazy-pages protocol, spoken to by a client that sends what
 * `criu lazy-pages --page-server` sends (the real daemon is in api/lazy.test.ts): pages come
 * back in request order from the right place of the right pages file, zero runs as zeros; a
 * request it cannot answer truthfully gets no answer at all and the connection stays open
 * (a daemon that loses it would fill the pages with zeros), and `failed` says why.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { mkdtemp, readFile, rm, stat } from 'node:fs/promises';
import { connect, type Socket } from 'node:net';
import { join } from 'node:path';
import { PE_LAZY, PE_PRESENT } from './images/messages.js';
import type { ProcessImage } from './images/reader.js';
import { startPageServer, writeEagerPages, type PageSource } from './page-server.js';

const P = 4096;

function proc(
  pid: number,
  pagesId: number,
  entries: { vaddr: number; pages: number; flags: number }[],
): ProcessImage {
  return {
    pid,
    ppid: 0,
    pgid: pid,
    sid: pid,
    threads: [pid],
    comm: 'x',
    taskState: 1,
    fds: [],
    pagemap: {
      pagesId,
      entries: entries.map((e) => ({
        vaddr: BigInt(e.vaddr),
        nrPages: e.pages,
        inParent: false,
        flags: e.flags,
      })),
    },
  };
}

function source(files: Record<string, Buffer>, reads: string[] = []): PageSource {
  return {
    read: (file, offset, length, out, at = 0) => {
      reads.push(`${file}@${String(offset)}+${String(length)}`);
      const f = files[file];
      if (f === undefined || offset + length > f.length) return Promise.reject(new Error(`no ${file} range`));
      const dst = out ?? Buffer.alloc(length);
      f.copy(dst, out ? at : 0, offset, offset + length);
      return Promise.resolve(dst);
    },
  };
}

function get(pid: number, vaddr: number, pages: number): Buffer {
  const h = Buffer.alloc(32);
  h.writeUInt32LE(7 | (PE_LAZY << 16), 0);
  h.writeBigUInt64LE(BigInt(pages), 8);
  h.writeBigUInt64LE(BigInt(vaddr), 16);
  h.writeBigUInt64LE(BigInt(pid), 24);
  return h;
}

/** Collects what the server sends. */
function client(port: number): {
  sock: Socket;
  bytes: () => Buffer;
  closed: () => boolean;
  wait: (n: number) => Promise<Buffer>;
} {
  const sock = connect(port, '127.0.0.1');
  let got = Buffer.alloc(0);
  let closed = false;
  const waiters: (() => void)[] = [];
  sock.on('data', (d: Buffer) => {
    got = Buffer.concat([got, d]);
    for (const w of waiters.splice(0)) w();
  });
  sock.on('close', () => (closed = true));
  sock.on('error', () => undefined);
  return {
    sock,
    bytes: () => got,
    closed: () => closed,
    wait: async (n) => {
      while (got.length < n) await new Promise<void>((r) => waiters.push(r));
      return got;
    },
  };
}

// Task 10: [0x10000, 4 lazy pages) stored, [0x20000, 2 pages) zero (not stored), [0x30000,
// 1 page) stored and not lazy. Task 11 has a pages file of its own.
const mem10 = randomBytes(5 * P);
const mem11 = randomBytes(2 * P);
const procs = [
  proc(10, 1, [
    { vaddr: 0x10000, pages: 4, flags: PE_PRESENT | PE_LAZY },
    { vaddr: 0x20000, pages: 2, flags: 0 },
    { vaddr: 0x30000, pages: 1, flags: PE_PRESENT },
  ]),
  proc(11, 2, [{ vaddr: 0x7000, pages: 2, flags: PE_PRESENT | PE_LAZY }]),
];
const files = { 'pages-1.img': mem10, 'pages-2.img': mem11 };

test('pages come back in request order, from the right file and offset; FLUSH is answered with 0', async () => {
  const reads: string[] = [];
  const srv = await startPageServer({ processes: procs, source: source(files, reads), what: 'test' });
  try {
    const c = client(srv.port);
    // Pipelined, as the daemon does.
    c.sock.write(
      Buffer.concat([get(10, 0x11000, 2), get(11, 0x7000, 2), get(10, 0x20000, 2), get(10, 0x30000, 1)]),
    );
    const head = 32;
    const want = [
      { pid: 10, vaddr: 0x11000, data: mem10.subarray(P, 3 * P) },
      { pid: 11, vaddr: 0x7000, data: mem11 },
      { pid: 10, vaddr: 0x20000, data: Buffer.alloc(2 * P) },
      { pid: 10, vaddr: 0x30000, data: mem10.subarray(4 * P, 5 * P) },
    ];
    const total = want.reduce((n, w) => n + head + w.data.length, 0);
    const got = await c.wait(total);
    let at = 0;
    for (const w of want) {
      assert.equal(got.readUInt32LE(at) & 0xffff, 6, 'PS_IOV_ADD_F');
      assert.equal(got.readUInt32LE(at) >>> 16, PE_PRESENT);
      assert.equal(got.readBigUInt64LE(at + 8), BigInt(w.data.length / P));
      assert.equal(got.readBigUInt64LE(at + 16), BigInt(w.vaddr));
      assert.equal(got.readBigUInt64LE(at + 24), BigInt(w.pid));
      assert.ok(
        got.subarray(at + head, at + head + w.data.length).equals(w.data),
        `pages of ${String(w.pid)}@${w.vaddr.toString(16)}`,
      );
      at += head + w.data.length;
    }
    // The zero run is not read from anywhere.
    assert.deepEqual(reads, ['pages-1.img@4096+8192', 'pages-2.img@0+8192', 'pages-1.img@16384+4096']);
    const flush = Buffer.alloc(32);
    flush.writeUInt32LE(0x1023, 0);
    c.sock.write(flush);
    const after = await c.wait(total + 4);
    assert.equal(after.readInt32LE(total), 0);
    assert.equal(srv.servedBytes(), total - 4 * head);
    c.sock.destroy();
  } finally {
    await srv.close();
  }
});

test('answers stay whole while the client reads slowly: a reused buffer is written again only once the kernel has its bytes', async () => {
  // 64 MiB of one task, asked for 1 MiB at a time, all at once, and read only after a pause:
  // the answers queue in the socket, so a buffer reused too early would show in them.
  const big = randomBytes(64 << 20);
  const pages = big.length / P;
  const bigProcs = [proc(20, 7, [{ vaddr: 0x100000, pages, flags: PE_PRESENT | PE_LAZY }])];
  const srv = await startPageServer({
    processes: bigProcs,
    source: source({ 'pages-7.img': big }),
    what: 'test',
  });
  try {
    const sock = connect(srv.port, '127.0.0.1');
    sock.pause();
    const per = 256;
    const reqs: Buffer[] = [];
    for (let i = 0; i < pages; i += per) reqs.push(get(20, 0x100000 + i * P, per));
    sock.write(Buffer.concat(reqs));
    await new Promise((r) => setTimeout(r, 300));
    const want = reqs.length * 32 + big.length;
    const chunks: Buffer[] = [];
    let n = 0;
    await new Promise<void>((resolve) => {
      sock.on('data', (d: Buffer) => {
        chunks.push(d);
        n += d.length;
        if (n >= want) resolve();
      });
      sock.resume();
    });
    const got = Buffer.concat(chunks);
    for (let k = 0, at = 0; k < reqs.length; k++) {
      assert.equal(got.readBigUInt64LE(at + 16), BigInt(0x100000 + k * per * P));
      at += 32;
      assert.ok(
        got.subarray(at, at + per * P).equals(big.subarray(k * per * P, (k + 1) * per * P)),
        `answer ${String(k)}`,
      );
      at += per * P;
    }
    sock.destroy();
  } finally {
    await srv.close();
  }
});

for (const [name, req, why] of [
  ['a task the images do not hold', get(99, 0x10000, 1), /task 99/],
  ['memory outside the pagemap', get(10, 0x40000, 1), /0x40000 of task 10/],
  ['a range that runs past its run into unmapped memory', get(10, 0x13000, 2), /0x14000 of task 10/],
  ['zero pages', get(10, 0x10000, 0), /0 pages/],
] as const) {
  test(`a request for ${name} gets no answer, the connection stays open, and failed says why`, async () => {
    const srv = await startPageServer({ processes: procs, source: source(files), what: 'checkpoint ck-1' });
    try {
      const c = client(srv.port);
      // A good request behind the bad one must not be answered either: answers go in order.
      c.sock.write(Buffer.concat([req, get(10, 0x10000, 1)]));
      await assert.rejects(
        srv.failed,
        (e: Error) => why.test(e.message) && /checkpoint ck-1/.test(e.message),
      );
      await new Promise((r) => setTimeout(r, 100));
      assert.equal(c.bytes().length, 0, 'nothing sent');
      assert.equal(c.closed(), false, 'the connection is kept');
      c.sock.destroy();
    } finally {
      await srv.close();
    }
  });
}

test('a page the source cannot read (a damaged record) stops the server without an answer', async () => {
  const bad: PageSource = { read: () => Promise.reject(new Error('chunk 1234 fails authentication')) };
  const srv = await startPageServer({ processes: procs, source: bad, what: 'test' });
  try {
    const c = client(srv.port);
    c.sock.write(get(10, 0x10000, 1));
    await assert.rejects(srv.failed, /fails authentication/);
    await new Promise((r) => setTimeout(r, 100));
    assert.equal(c.bytes().length, 0);
    assert.equal(c.closed(), false);
    c.sock.destroy();
  } finally {
    await srv.close();
  }
});

test('writeEagerPages writes only the pages that are not lazy, the rest stays holes of the right size; shared memory is copied whole', async () => {
  const dir = await mkdtemp('/tmp/dormant-pagesrv-');
  try {
    const reads: string[] = [];
    // pages-3.img: no process's pagemap names it (shared anonymous memory's, restored from disk).
    const shmem = randomBytes(6 * P);
    const all = { ...files, 'pages-3.img': shmem };
    const list = Object.entries(all).map(([path, b]) => ({ path, sizeBytes: b.length }));
    const n = await writeEagerPages(procs, dir, source(all, reads), list);
    assert.equal(n, P + shmem.length, 'one page is not lazy, and all of shared memory');
    assert.deepEqual(reads, ['pages-1.img@16384+4096', `pages-3.img@0+${String(6 * P)}`]);
    assert.ok((await readFile(join(dir, 'pages-3.img'))).equals(shmem), 'shared memory is there, whole');
    const img = await readFile(join(dir, 'pages-1.img'));
    assert.equal(img.length, 5 * P, 'as large as the dump');
    assert.ok(img.subarray(4 * P).equals(mem10.subarray(4 * P)), 'the eager page at its place');
    assert.ok(img.subarray(0, 4 * P).equals(Buffer.alloc(4 * P)), 'lazy pages are zeros');
    assert.ok((await stat(join(dir, 'pages-1.img'))).blocks * 512 <= 2 * P, 'and holes, not written zeros');
    assert.equal((await readFile(join(dir, 'pages-2.img'))).length, 2 * P);
    assert.ok((await stat(join(dir, 'pages-2.img'))).blocks === 0, 'all lazy: all hole');
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});

test('a connection from a user other than root gets nothing and is closed', async () => {
  const srv = await startPageServer({ processes: procs, source: source(files), what: 'test' });
  try {
    // A local user (nobody) asks for task 10's pages on the loopback port.
    const script = `
      const s = require('net').connect(${String(srv.port)}, '127.0.0.1');
      let got = 0;
      s.on('connect', () => s.write(Buffer.from('${get(10, 0x10000, 1).toString('hex')}', 'hex')));
      s.on('data', (d) => (got += d.length));
      s.on('error', () => {});
      s.on('close', () => { console.log('closed ' + got); process.exit(0); });
      setTimeout(() => { console.log('open ' + got); process.exit(0); }, 3000);`;
    const out = await new Promise<string>((resolve, reject) => {
      const c = spawn(process.execPath, ['-e', script], {
        uid: 65534,
        gid: 65534,
        stdio: ['ignore', 'pipe', 'inherit'],
      });
      let o = '';
      c.stdout.on('data', (d: Buffer) => (o += d.toString()));
      c.on('error', reject);
      c.on('exit', () => resolve(o.trim()));
    });
    assert.equal(out, 'closed 0', 'no byte of memory, and the connection closed');
    assert.equal(srv.servedBytes(), 0);
    // Root (the lazy-pages daemon) is still served.
    const c = client(srv.port);
    c.sock.write(get(10, 0x10000, 1));
    const got = await c.wait(32 + P);
    assert.ok(got.subarray(32).equals(mem10.subarray(0, P)));
    c.sock.destroy();
  } finally {
    await srv.close();
  }
});
