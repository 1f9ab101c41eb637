/**
 * A page server for `criu lazy-pages --page-server`: the restored process's memory comes
 * from wherever `source` reads it (the vault), not from a pages image on disk.
 *
 * The wire format (CRIU 4.x, little-endian), as the lazy-pages daemon speaks it:
 * - a request is 32 bytes: u32 command (low 16 bits; the high 16 carry PE_* flags), 4 bytes
 *   of padding, u64 page count, u64 virtual address, u64 destination (the task's pid in the
 *   images);
 * - PS_IOV_GET (7) asks for pages; the answer is the same header with command PS_IOV_ADD_F
 *   (6) and PE_PRESENT in the flags, followed by the pages. Answers go in request order;
 * - PS_IOV_FLUSH (0x1023) and PS_IOV_FLUSH_N_CLOSE (0x1024) are answered with an int32 0.
 *
 * A daemon whose connection drops fills the pages it still lacks with zeros, and the task runs
 * on wrong memory. So on any failure (a page that does not authenticate, a request for memory
 * the images do not hold) this server answers nothing more and keeps the connection open:
 * `failed` rejects, and the caller ends the task before it closes the server.
 */
import { once } from 'node:events';
import { open, readFile } from 'node:fs/promises';
import { createServer, type Server, type Socket } from 'node:net';
import { join } from 'node:path';
import { DormantError, ErrorCode, asError } from '../domain/errors.js';
import { PE_LAZY, pagemapInPagesFile } from './images/messages.js';
import { PAGE_SIZE, type ProcessImage } from './images/reader.js';

const HEADER_BYTES = 32;
const PS_IOV_ADD_F = 6;
const PS_IOV_GET = 7;
const PS_IOV_FLUSH = 0x1023;
const PS_IOV_FLUSH_N_CLOSE = 0x1024;
const PE_PRESENT = 4;
/** Capacity of a reused answer buffer: the most the daemon asks for at once. */
const ANSWER_BYTES = 4 << 20;
/** Answer buffers kept for reuse (the daemon asks one at a time; a few cover overlap). */
const FREE_ANSWERS = 4;
/** No request of the daemon comes near this (it asks for 4 MiB at most). */
const MAX_REQUEST_PAGES = 64 * 1024;

/** Whether `name` (a path in a dump folder) is one of CRIU's pages images, `pages-N.img`. */
export function isPagesImage(name: string): boolean {
  return /^pages-\d+\.img$/.test(name);
}

/** Where a process's pages are read from: a byte range of one of its pages images. */
export interface PageSource {
  /**
   * Reads into `out` at `at` when given (and returns it), else into a new buffer. `readAhead:
   * false` says the next read will not follow this one (a source that reads ahead need not).
   */
  read(
    file: string,
    offset: number,
    length: number,
    out?: Buffer,
    at?: number,
    opts?: { readAhead?: boolean },
  ): Promise<Buffer>;
}

/** A run of a process's memory in the images: where it lies in the pages file, if there. */
interface Run {
  start: number;
  end: number;
  /** Offset in the pages file; -1 when the run is not stored there (zero pages). */
  fileOffset: number;
  lazy: boolean;
}

interface ProcessPages {
  file: string;
  runs: Run[];
}

function runsOf(p: ProcessImage): ProcessPages | undefined {
  const pm = p.pagemap;
  if (pm === undefined) return undefined;
  const runs: Run[] = [];
  let off = 0;
  for (const e of pm.entries) {
    const start = Number(e.vaddr);
    const bytes = e.nrPages * PAGE_SIZE;
    const stored = pagemapInPagesFile(e);
    runs.push({
      start,
      end: start + bytes,
      fileOffset: stored ? off : -1,
      lazy: ((e.flags ?? 0) & PE_LAZY) !== 0,
    });
    if (stored) off += bytes;
  }
  runs.sort((a, b) => a.start - b.start);
  return { file: `pages-${String(pm.pagesId)}.img`, runs };
}

/**
 * Writes the pages images a lazy restore needs on disk into `dir`: each process's one as large
 * as the dump's, holding only the pages that are not lazy (vdso, file-backed private
 * mappings, ...) at their places; the lazy ones stay holes and come from the page server.
 * `pagesFiles` names every pages image of the dump: those no process's pagemap uses (shared
 * anonymous memory's, which CRIU restores from disk, never lazily) are copied whole. Returns
 * the bytes written.
 */
export async function writeEagerPages(
  processes: readonly ProcessImage[],
  dir: string,
  source: PageSource,
  pagesFiles: readonly { path: string; sizeBytes: number }[],
): Promise<number> {
  let written = 0;
  const done = new Set<string>();
  const put = async (
    file: string,
    pieces: Iterable<[offset: number, length: number]>,
    size: number,
  ): Promise<void> => {
    const h = await open(join(dir, file), 'wx', 0o600);
    try {
      for (const [offset, length] of pieces) {
        // Scattered pieces: what follows one is never asked for next.
        const b = await source.read(file, offset, length, undefined, 0, { readAhead: false });
        let at = 0;
        while (at < b.length) at += (await h.write(b, at, b.length - at, offset + at)).bytesWritten;
        b.fill(0);
        written += b.length;
      }
      await h.truncate(size);
    } finally {
      await h.close();
    }
  };
  for (const p of processes) {
    const pp = runsOf(p);
    if (pp === undefined || done.has(pp.file)) continue;
    done.add(pp.file);
    let size = 0;
    for (const r of pp.runs) if (r.fileOffset >= 0) size = Math.max(size, r.fileOffset + r.end - r.start);
    const eager = pp.runs.filter((r) => r.fileOffset >= 0 && !r.lazy);
    await put(
      pp.file,
      eager.map((r): [number, number] => [r.fileOffset, r.end - r.start]),
      size,
    );
  }
  const PIECE = 4 << 20;
  for (const f of pagesFiles) {
    if (done.has(f.path)) continue;
    done.add(f.path);
    const pieces: [number, number][] = [];
    for (let at = 0; at < f.sizeBytes; at += PIECE) pieces.push([at, Math.min(PIECE, f.sizeBytes - at)]);
    await put(f.path, pieces, f.sizeBytes);
  }
  return written;
}

/**
 * The uid owning the other end of a loopback TCP connection (from /proc/net/tcp), or
 * undefined when it cannot be told.
 */
async function peerUid(sock: Socket): Promise<number | undefined> {
  const hex = (port: number | undefined): string => (port ?? -1).toString(16).toUpperCase().padStart(4, '0');
  const theirs = `0100007F:${hex(sock.remotePort)}`;
  const ours = `0100007F:${hex(sock.localPort)}`;
  const table = await readFile('/proc/net/tcp', 'utf8').catch(() => '');
  for (const line of table.split('\n').slice(1)) {
    const f = line.trim().split(/\s+/);
    // sl local rem st tx:rx tr:when retrnsmt uid timeout inode
    if (f[1] === theirs && f[2] === ours) return Number(f[7]);
  }
  return undefined;
}

export interface PageServer {
  address: string;
  port: number;
  /** Rejects on the first failure; never resolves. */
  failed: Promise<never>;
  /** Page bytes sent so far. */
  servedBytes(): number;
  /** Ends every connection and stops listening. */
  close(): Promise<void>;
}

/**
 * Starts a page server on 127.0.0.1 (a free port) for the processes of one dump, reading
 * their pages from `source`.
 */
export async function startPageServer(o: {
  processes: readonly ProcessImage[];
  source: PageSource;
  /** For messages: what is being restored ("checkpoint ck-1"). */
  what: string;
  /**
   * Called with each accepted (root's) connection before anything is read from it; a
   * rejection fails the server. dormant's resume hands the socket to a keeper here.
   */
  onConnection?: (sock: Socket) => Promise<void> | void;
}): Promise<PageServer> {
  const byPid = new Map<number, ProcessPages>();
  for (const p of o.processes) {
    const pp = runsOf(p);
    if (pp !== undefined) byPid.set(p.pid, pp);
  }
  let served = 0;
  let failure: Error | undefined;
  let fail!: (e: Error) => void;
  const failed = new Promise<never>((_, reject) => {
    fail = (e) => {
      if (failure !== undefined) return;
      failure = e;
      reject(e);
    };
  });
  failed.catch(() => undefined);
  const sockets = new Set<Socket>();
  // Answers are written from a few reused buffers: a fresh 1 MiB buffer per request is fresh
  // memory each time, and its first touch (~14 us a page on these VMs) cost more than serving.
  const free: Buffer[] = [];
  const take = (len: number): Buffer => {
    if (len > ANSWER_BYTES) return Buffer.allocUnsafe(len);
    return (free.pop() ?? Buffer.allocUnsafe(ANSWER_BYTES)).subarray(0, len);
  };
  const give = (b: Buffer): void => {
    b.fill(0);
    if (b.buffer.byteLength === ANSWER_BYTES && b.byteOffset === 0 && free.length < FREE_ANSWERS)
      free.push(Buffer.from(b.buffer, 0, ANSWER_BYTES));
  };

  const pages = async (pid: number, vaddr: number, nrPages: number): Promise<Buffer> => {
    const pp = byPid.get(pid);
    if (pp === undefined)
      throw new DormantError(
        ErrorCode.RUNTIME_RESTORE_FAILED,
        `${o.what}: lazy pages asked for task ${String(pid)}, which the images do not hold`,
      );
    const len = nrPages * PAGE_SIZE;
    // Every byte is written below: pages from the source, zeros for runs it does not store.
    const out = take(len);
    let pos = vaddr;
    const end = vaddr + len;
    // The first run that ends past `pos`.
    let lo = 0;
    let hi = pp.runs.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (pp.runs[mid]!.end <= pos) lo = mid + 1;
      else hi = mid;
    }
    try {
      for (let i = lo; pos < end; i++) {
        const r = pp.runs[i];
        if (r === undefined || r.start > pos)
          throw new DormantError(
            ErrorCode.RUNTIME_RESTORE_FAILED,
            `${o.what}: lazy pages asked for memory at 0x${pos.toString(16)} of task ${String(pid)}, which its pagemap does not hold`,
          );
        const n = Math.min(end, r.end) - pos;
        if (r.fileOffset >= 0) {
          const b = await o.source.read(pp.file, r.fileOffset + (pos - r.start), n, out, pos - vaddr);
          // A source that ignores `out` returns the pages in a buffer of their own.
          if (b !== out) b.copy(out, pos - vaddr, 0, n);
        } else out.fill(0, pos - vaddr, pos - vaddr + n);
        pos += n;
      }
    } catch (e) {
      // What was decoded of this answer is not left lying in memory.
      give(out);
      throw e;
    }
    return out;
  };

  const serve = (sock: Socket): void => {
    sockets.add(sock);
    // Memory is served only to root (CRIU runs as root): any local user can reach a loopback
    // port, and these pages are a process's secrets. Nothing is read from a socket before.
    sock.pause();
    void peerUid(sock).then(async (uid) => {
      if (uid !== 0) {
        sock.destroy();
        return;
      }
      try {
        await o.onConnection?.(sock);
      } catch (e) {
        // Nothing is served without it; the connection stays open, unanswered.
        fail(asError(e));
        return;
      }
      sock.resume();
    });
    sock.setNoDelay(true);
    let pending: Buffer = Buffer.alloc(0);
    let chain: Promise<void> = Promise.resolve();
    // Resolves when the socket takes more (or is gone).
    const drained = (): Promise<void> =>
      new Promise((res) => {
        const done = (): void => {
          sock.off('drain', done);
          sock.off('close', done);
          res();
        };
        sock.on('drain', done);
        sock.on('close', done);
      });
    const write = async (b: Buffer): Promise<void> => {
      if (!sock.write(b)) await drained();
    };
    const handle = async (h: Buffer): Promise<void> => {
      if (failure !== undefined) return;
      const word = h.readUInt32LE(0);
      const cmd = word & 0xffff;
      if (cmd === PS_IOV_FLUSH || cmd === PS_IOV_FLUSH_N_CLOSE) {
        const r = Buffer.alloc(4);
        await write(r);
        return;
      }
      if (cmd !== PS_IOV_GET)
        throw new DormantError(
          ErrorCode.RUNTIME_RESTORE_FAILED,
          `${o.what}: lazy pages sent page server command ${String(cmd)}, which this server does not know`,
        );
      const nr = h.readBigUInt64LE(8);
      const vaddr = h.readBigUInt64LE(16);
      const pid = h.readBigUInt64LE(24);
      if (
        nr === 0n ||
        nr > BigInt(MAX_REQUEST_PAGES) ||
        vaddr > BigInt(Number.MAX_SAFE_INTEGER) ||
        pid > 0x7fffffffn
      )
        throw new DormantError(
          ErrorCode.RUNTIME_RESTORE_FAILED,
          `${o.what}: lazy pages sent a request for ${nr.toString()} pages at 0x${vaddr.toString(16)} of task ${pid.toString()}, which this server refuses`,
        );
      const data = await pages(Number(pid), Number(vaddr), Number(nr));
      const reply = Buffer.alloc(HEADER_BYTES);
      reply.writeUInt32LE((PS_IOV_ADD_F | (PE_PRESENT << 16)) >>> 0, 0);
      reply.writeBigUInt64LE(nr, 8);
      reply.writeBigUInt64LE(vaddr, 16);
      reply.writeBigUInt64LE(pid, 24);
      if (failure !== undefined) {
        give(data);
        return;
      }
      sock.cork();
      sock.write(reply);
      // The plaintext is wiped once the kernel has it, and its buffer used again.
      const ok = sock.write(data, () => give(data));
      sock.uncork();
      served += data.length;
      if (!ok) await drained();
    };
    sock.on('data', (d: Buffer) => {
      pending = pending.length === 0 ? d : Buffer.concat([pending, d]);
      while (pending.length >= HEADER_BYTES) {
        const h = Buffer.from(pending.subarray(0, HEADER_BYTES));
        pending = pending.subarray(HEADER_BYTES);
        chain = chain
          .then(() => handle(h))
          .catch((e: unknown) => {
            fail(e instanceof Error ? e : new Error(String(e)));
          });
      }
    });
    sock.on('error', () => undefined);
    sock.on('close', () => sockets.delete(sock));
  };

  const server: Server = createServer(serve);
  server.listen(0, '127.0.0.1');
  await once(server, 'listening');
  const addr = server.address();
  if (addr === null || typeof addr === 'string') throw new Error('page server: no port');
  return {
    address: '127.0.0.1',
    port: addr.port,
    failed,
    servedBytes: () => served,
    close: async () => {
      for (const s of sockets) s.destroy();
      await new Promise<void>((res) => server.close(() => res()));
    },
  };
}
