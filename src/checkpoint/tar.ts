/**
 * A small tar (ustar + pax + GNU long names) reader and writer, written for hostile input
 * rather than taken from a library: the reader is a push parser that validates every header
 * (checksum, octal fields, sizes) and hands entries and their bytes to a visitor, so
 * callers decide what may be written where; the writer emits ustar with pax records for
 * long names, which checkpointctl and podman read.
 */
import { DormantError, ErrorCode } from '../domain/errors.js';

export type TarEntryType =
  'file' | 'dir' | 'symlink' | 'hardlink' | 'chardev' | 'blockdev' | 'fifo' | 'other';

export interface TarHeader {
  name: string;
  type: TarEntryType;
  /** The raw typeflag character, for messages. */
  typeflag: string;
  size: number;
  mode: number;
  mtimeSec: number;
  linkName: string;
}

export interface TarVisitor {
  /** Called at each entry's header; return a sink for its bytes, or undefined to skip them. */
  entry(h: TarHeader): ((chunk: Buffer) => void) | undefined;
  /** Called when an entry's bytes are all delivered. */
  entryEnd?(h: TarHeader): void;
}

export function invalidArchive(what: string, cause?: unknown): DormantError {
  return new DormantError(ErrorCode.CHECKPOINT_ARCHIVE_INVALID, `invalid checkpoint archive: ${what}`, {
    cause,
    hint: 'expected a podman, CRI-O or kubelet checkpoint archive (.tar, .tar.gz or .tar.zst)',
  });
}

const BLOCK = 512;
/** Pax and long-name records are metadata; a larger one is an attack, not a file name. */
const MAX_META_RECORD = 1024 * 1024;

function readOctal(b: Buffer, off: number, len: number, what: string): number {
  // GNU base-256 for large values: first byte has the high bit set.
  if ((b[off]! & 0x80) !== 0) {
    let v = 0;
    for (let i = 1; i < len; i++) v = v * 256 + b[off + i]!;
    if (!Number.isSafeInteger(v)) throw invalidArchive(`${what} out of range`);
    return v;
  }
  const s = b
    .subarray(off, off + len)
    .toString('latin1')
    .replace(/[\0 ]+$/g, '')
    .replace(/^[ ]+/, '');
  if (s === '') return 0;
  if (!/^[0-7]+$/.test(s)) throw invalidArchive(`${what} is not octal`);
  const v = parseInt(s, 8);
  if (!Number.isSafeInteger(v)) throw invalidArchive(`${what} out of range`);
  return v;
}

function readStr(b: Buffer, off: number, len: number): string {
  const s = b.subarray(off, off + len);
  const z = s.indexOf(0);
  return (z === -1 ? s : s.subarray(0, z)).toString('utf8');
}

function typeOf(flag: string): TarEntryType {
  switch (flag) {
    case '0':
    case '\0':
    case '7':
      return 'file';
    case '5':
      return 'dir';
    case '2':
      return 'symlink';
    case '1':
      return 'hardlink';
    case '3':
      return 'chardev';
    case '4':
      return 'blockdev';
    case '6':
      return 'fifo';
    default:
      return 'other';
  }
}

function parsePax(buf: Buffer): Map<string, string> {
  const out = new Map<string, string>();
  let pos = 0;
  while (pos < buf.length) {
    const sp = buf.indexOf(0x20, pos);
    if (sp === -1) throw invalidArchive('malformed pax record');
    const len = Number(buf.subarray(pos, sp).toString('latin1'));
    if (!Number.isInteger(len) || len <= sp - pos || pos + len > buf.length)
      throw invalidArchive('malformed pax record length');
    const rec = buf.subarray(sp + 1, pos + len - 1).toString('utf8');
    const eq = rec.indexOf('=');
    if (eq > 0) out.set(rec.slice(0, eq), rec.slice(eq + 1));
    pos += len;
  }
  return out;
}

/**
 * Push parser: feed it chunks with `push`, then call `end`. Throws CHECKPOINT_ARCHIVE_INVALID
 * on a bad header, and on `end` when the archive stops inside an entry.
 */
export class TarParser {
  private pending: Buffer[] = [];
  private pendingBytes = 0;
  private state: 'header' | 'body' | 'meta' | 'pad' | 'done' = 'header';
  private remaining = 0;
  private pad = 0;
  private current: TarHeader | undefined;
  private sink: ((chunk: Buffer) => void) | undefined;
  private metaKind: 'pax' | 'gnu-name' | 'gnu-link' | 'global' = 'pax';
  private metaBuf: Buffer[] = [];
  private nextPax = new Map<string, string>();
  private zeroBlocks = 0;
  entries = 0;
  /**
   * Bytes of the archive consumed so far. In `entry`, where the entry's bytes start: a caller
   * may read a member in place in an uncompressed archive instead of taking it from the stream.
   */
  position = 0;
  /** Bytes pushed after the two zero blocks that end the archive (padding, or a smuggled tail). */
  trailingBytes = 0;

  constructor(private readonly visitor: TarVisitor) {}

  private take(n: number): Buffer | undefined {
    if (this.pendingBytes < n) return undefined;
    const all = this.pending.length === 1 ? this.pending[0]! : Buffer.concat(this.pending);
    const out = all.subarray(0, n);
    const rest = all.subarray(n);
    this.pending = rest.length > 0 ? [rest] : [];
    this.pendingBytes = rest.length;
    this.position += n;
    return out;
  }

  push(chunk: Buffer): void {
    if (chunk.length === 0) return;
    if (this.state === 'done') {
      // Ignored (tar pads archives to whole records), but counted: the caller caps them.
      this.trailingBytes += chunk.length;
      return;
    }
    this.pending.push(chunk);
    this.pendingBytes += chunk.length;
    for (;;) {
      if (this.state === 'header') {
        const h = this.take(BLOCK);
        if (!h) return;
        this.onHeader(h);
        if ((this.state as string) === 'done') {
          this.trailingBytes += this.pendingBytes;
          this.pending = [];
          this.pendingBytes = 0;
          return;
        }
      } else if (this.state === 'body' || this.state === 'meta') {
        if (this.remaining === 0) {
          this.finishBody();
          continue;
        }
        if (this.pendingBytes === 0) return;
        const n = Math.min(this.remaining, this.pendingBytes);
        const part = this.take(n)!;
        this.remaining -= n;
        if (this.state === 'meta') this.metaBuf.push(Buffer.from(part));
        else this.sink?.(part);
      } else if (this.state === 'pad') {
        if (this.pendingBytes < this.pad) {
          this.pad -= this.pendingBytes;
          this.take(this.pendingBytes);
          return;
        }
        this.take(this.pad);
        this.pad = 0;
        this.state = 'header';
      } else {
        return;
      }
    }
  }

  /**
   * Bytes of the current entry's body that nobody takes (its visitor returned no sink) and that
   * are not pushed yet: a caller reading a file may read past them and call `skip` instead.
   */
  get skippable(): number {
    if (this.state !== 'body' || this.sink !== undefined || this.current === undefined) return 0;
    return this.pendingBytes === 0 ? this.remaining : 0;
  }

  /** Counts the `skippable` bytes as consumed; returns how many. */
  skip(): number {
    const n = this.skippable;
    this.remaining -= n;
    this.position += n;
    return n;
  }

  end(): void {
    if (this.state === 'done') return;
    if (this.state === 'header' && this.pendingBytes === 0 && this.entries > 0) return; // no end blocks: tolerated
    if (this.state === 'header' && this.pendingBytes === 0 && this.entries === 0 && this.zeroBlocks > 0)
      return;
    throw invalidArchive(
      this.current
        ? `truncated inside ${this.current.name} (${this.remaining} bytes missing)`
        : this.entries === 0
          ? 'empty or not a tar archive'
          : 'truncated archive',
    );
  }

  private onHeader(h: Buffer): void {
    if (h.every((b) => b === 0)) {
      this.zeroBlocks++;
      if (this.zeroBlocks >= 2) this.state = 'done';
      return;
    }
    this.zeroBlocks = 0;
    let sum = 0;
    for (let i = 0; i < BLOCK; i++) sum += i >= 148 && i < 156 ? 0x20 : h[i]!;
    const want = readOctal(h, 148, 8, 'header checksum');
    if (sum !== want)
      throw invalidArchive(
        `bad header checksum after ${this.entries} entries (not a tar archive, or damaged)`,
      );
    const flag = String.fromCharCode(h[156]!);
    const size = readOctal(h, 124, 12, 'entry size');
    const magic = h.subarray(257, 263).toString('latin1');
    let name = readStr(h, 0, 100);
    if (magic.startsWith('ustar')) {
      const prefix = readStr(h, 345, 155);
      if (prefix && magic === 'ustar\0') name = `${prefix}/${name}`;
    }
    if (flag === 'x' || flag === 'g' || flag === 'L' || flag === 'K') {
      if (size > MAX_META_RECORD) throw invalidArchive(`a ${size}-byte metadata record`);
      this.metaKind = flag === 'x' ? 'pax' : flag === 'g' ? 'global' : flag === 'L' ? 'gnu-name' : 'gnu-link';
      this.metaBuf = [];
      this.state = 'meta';
      this.remaining = size;
      this.pad = (BLOCK - (size % BLOCK)) % BLOCK;
      this.current = undefined;
      return;
    }
    const pax = this.nextPax;
    this.nextPax = new Map();
    const paxSize = pax.get('size');
    const realSize = paxSize !== undefined ? Number(paxSize) : size;
    if (!Number.isSafeInteger(realSize) || realSize < 0) throw invalidArchive(`bad size for ${name}`);
    const header: TarHeader = {
      name: pax.get('path') ?? name,
      type: typeOf(flag),
      typeflag: flag,
      size: realSize,
      mode: readOctal(h, 100, 8, 'mode'),
      mtimeSec: readOctal(h, 136, 12, 'mtime'),
      linkName: pax.get('linkpath') ?? readStr(h, 157, 100),
    };
    // Only regular files carry data; links, dirs and devices with a size are not trusted.
    const dataBytes = header.type === 'file' || header.type === 'other' ? realSize : 0;
    this.entries++;
    this.current = header;
    this.sink = this.visitor.entry(header);
    this.state = 'body';
    this.remaining = dataBytes;
    this.pad = (BLOCK - (dataBytes % BLOCK)) % BLOCK;
  }

  private finishBody(): void {
    if (this.state === 'meta') {
      const buf = Buffer.concat(this.metaBuf);
      if (this.metaKind === 'pax') this.nextPax = parsePax(buf);
      else if (this.metaKind === 'gnu-name') this.nextPax.set('path', readStr(buf, 0, buf.length));
      else if (this.metaKind === 'gnu-link') this.nextPax.set('linkpath', readStr(buf, 0, buf.length));
    } else if (this.current) {
      this.visitor.entryEnd?.(this.current);
    }
    this.current = undefined;
    this.sink = undefined;
    this.state = this.pad > 0 ? 'pad' : 'header';
  }
}

/** Writing: one 512-byte ustar header (plus a pax record when a name does not fit). */
function octal(n: number, len: number): string {
  return `${n.toString(8).padStart(len - 1, '0')}\0`;
}

function rawHeader(
  name: string,
  size: number,
  flag: string,
  mode: number,
  mtimeSec: number,
  linkName = '',
): Buffer {
  const h = Buffer.alloc(BLOCK);
  h.write(name, 0, 100, 'utf8');
  h.write(linkName, 157, 100, 'utf8');
  h.write(octal(mode & 0o7777, 8), 100, 'latin1');
  h.write(octal(0, 8), 108, 'latin1');
  h.write(octal(0, 8), 116, 'latin1');
  h.write(octal(size, 12), 124, 'latin1');
  h.write(octal(mtimeSec, 12), 136, 'latin1');
  h.write('        ', 148, 'latin1');
  h.write(flag, 156, 'latin1');
  h.write('ustar\0', 257, 'latin1');
  h.write('00', 263, 'latin1');
  let sum = 0;
  for (let i = 0; i < BLOCK; i++) sum += h[i]!;
  h.write(`${sum.toString(8).padStart(6, '0')}\0 `, 148, 'latin1');
  return h;
}

/** Header block(s) for an entry: a pax record first when the name is long or non-ASCII. */
export function tarHeader(o: {
  name: string;
  size: number;
  type: 'file' | 'dir' | 'symlink';
  mode?: number;
  mtimeSec?: number;
  /** The target of a symlink. */
  linkName?: string;
}): Buffer {
  const flag = o.type === 'dir' ? '5' : o.type === 'symlink' ? '2' : '0';
  const mode = o.mode ?? (o.type === 'file' ? 0o644 : o.type === 'dir' ? 0o755 : 0o777);
  const mtime = o.mtimeSec ?? Math.floor(Date.now() / 1000);
  const link = o.linkName ?? '';
  const short = (v: string): boolean => Buffer.byteLength(v) < 100 && /^[\x20-\x7e]*$/.test(v);
  if (short(o.name) && short(link)) return rawHeader(o.name, o.size, flag, mode, mtime, link);
  const record = (key: string, value: string): string => {
    const body = `${key}=${value}\n`;
    let len = Buffer.byteLength(body) + 3;
    while (Buffer.byteLength(`${len} ${body}`) !== len) len = Buffer.byteLength(`${len} ${body}`);
    return `${len} ${body}`;
  };
  const rec = Buffer.from(
    `${short(o.name) ? '' : record('path', o.name)}${short(link) ? '' : record('linkpath', link)}`,
  );
  return Buffer.concat([
    rawHeader('PaxHeader', rec.length, 'x', 0o644, mtime),
    rec,
    Buffer.alloc((BLOCK - (rec.length % BLOCK)) % BLOCK),
    rawHeader(o.name.slice(0, 99), o.size, flag, mode, mtime, short(link) ? link : ''),
  ]);
}

/** Zero bytes that pad an entry of `size` bytes to a block. */
export function tarPadding(size: number): Buffer {
  return Buffer.alloc((BLOCK - (size % BLOCK)) % BLOCK);
}

/** The two zero blocks that end an archive. */
export const TAR_END = Buffer.alloc(BLOCK * 2);
