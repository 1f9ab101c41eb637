/**
 * Just enough HTTP/1.x for the wake proxy to relay a keep-alive connection byte for byte: where
 * each request and response head ends, the few header fields that route, authenticate and
 * frame a message, and where each body ends (Content-Length, chunked, or the connection's end).
 * Bodies are never copied or decoded, only measured. Anything ambiguous (both Content-Length
 * and Transfer-Encoding, differing lengths, folded lines, bad names) is refused, so the proxy
 * and the sandbox's server can never disagree about where a request ends. No I/O.
 */

/** A request or response head is refused past this size (the caller answers 431). */
export const MAX_HEAD_BYTES = 64 * 1024;

/** A head that cannot be parsed; `code` (the table's) says what the proxy answers. */
export class HttpParseError extends Error {
  constructor(
    message: string,
    readonly code:
      'BAD_REQUEST' | 'REQUEST_TIMEOUT' | 'REQUEST_HEAD_TOO_LARGE' | 'PROXY_UPSTREAM' = 'BAD_REQUEST',
  ) {
    super(message);
  }
}

export interface Header {
  /** Lower case. */
  name: string;
  value: string;
}

export interface RequestHead {
  method: string;
  target: string;
  /** 'HTTP/1.1' or 'HTTP/1.0'. */
  version: string;
  headers: Header[];
  host: string | undefined;
  body: BodyKind;
  /** The connection ends after this exchange (Connection: close, or HTTP/1.0 without keep-alive). */
  close: boolean;
  /** Upgrade requested (Upgrade and Connection: upgrade). */
  upgrade: boolean;
}

export interface ResponseHead {
  status: number;
  body: BodyKind;
  close: boolean;
}

export type BodyKind =
  | { kind: 'none' }
  | { kind: 'length'; length: number }
  | { kind: 'chunked' }
  /** Until the connection ends (responses only). */
  | { kind: 'close' };

const CRLFCRLF = Buffer.from('\r\n\r\n');
// Field values: visible characters, spaces, tabs and obs-text; no CR, LF or NUL.
const BAD_VALUE = /[\0\r\n]/;

/** Index just past the `\r\n\r\n` that ends a head starting at `from`, or -1. */
export function headEnd(buf: Buffer, from = 0): number {
  const i = buf.indexOf(CRLFCRLF, from);
  return i < 0 ? -1 : i + 4;
}

/** Characters of a token (RFC 9110 tchar), by code. */
const TCHAR = new Uint8Array(128);
for (const c of "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") {
  TCHAR[c.charCodeAt(0)] = 1;
}

function isToken(s: string): boolean {
  if (s.length === 0) return false;
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i);
    if (c >= 128 || TCHAR[c] === 0) return false;
  }
  return true;
}

/** The header fields of `text` from `start` (lines separated by CRLF, no blank line). */
function parseFields(text: string, start: number): Header[] {
  const out: Header[] = [];
  let i = start;
  while (i < text.length) {
    let eol = text.indexOf('\r\n', i);
    if (eol < 0) eol = text.length;
    const c = text.charCodeAt(i);
    if (c === 0x20 || c === 0x09) throw new HttpParseError('folded header line');
    const colon = text.indexOf(':', i);
    if (colon <= i || colon > eol) throw new HttpParseError('header line without a name');
    const name = text.slice(i, colon);
    if (!isToken(name)) throw new HttpParseError(`bad header name "${name.slice(0, 40)}"`);
    const value = text.slice(colon + 1, eol).trim();
    if (BAD_VALUE.test(value)) throw new HttpParseError(`bad value in header ${name}`);
    out.push({ name: name.toLowerCase(), value });
    i = eol + 2;
  }
  return out;
}

function hasToken(headers: Header[], name: string, token: string): boolean {
  for (const h of headers) {
    if (h.name !== name) continue;
    // The common case, one token (`keep-alive`), without a split.
    if (h.value.length === token.length && h.value.toLowerCase() === token) return true;
    if (!h.value.includes(',')) continue;
    for (const t of h.value.split(',')) if (t.trim().toLowerCase() === token) return true;
  }
  return false;
}

/** Content-Length / Transfer-Encoding framing of a message; undefined when it has neither. */
function framing(headers: Header[]): BodyKind | undefined {
  let length: number | undefined;
  let te: string[] | undefined;
  for (const h of headers) {
    if (h.name === 'content-length') {
      for (const v of h.value.includes(',') ? h.value.split(',') : [h.value]) {
        const t = v.trim();
        if (!/^\d{1,15}$/.test(t)) throw new HttpParseError(`bad Content-Length "${t.slice(0, 20)}"`);
        const n = Number(t);
        if (length !== undefined && length !== n) throw new HttpParseError('conflicting Content-Length');
        length = n;
      }
    } else if (h.name === 'transfer-encoding') {
      te = [...(te ?? []), ...h.value.split(',').map((x) => x.trim().toLowerCase())];
    }
  }
  if (te !== undefined) {
    if (length !== undefined) throw new HttpParseError('both Content-Length and Transfer-Encoding');
    if (te.at(-1) !== 'chunked') return { kind: 'close' };
    return { kind: 'chunked' };
  }
  if (length !== undefined) return length === 0 ? { kind: 'none' } : { kind: 'length', length };
  return undefined;
}

/** Parses a request head, `buf` holding exactly the head (through its blank line). */
export function parseRequestHead(buf: Buffer): RequestHead {
  const text = buf.toString('latin1', 0, buf.length - 4);
  let eol = text.indexOf('\r\n');
  if (eol < 0) eol = text.length;
  const m = /^([!#$%&'*+\-.^_`|~0-9A-Za-z]+) ([^\0-\x20\x7f]+) (HTTP\/1\.[01])$/.exec(text.slice(0, eol));
  if (!m) throw new HttpParseError('malformed request line');
  const headers = parseFields(text, eol + 2);
  let host: string | undefined;
  for (const h of headers) {
    if (h.name !== 'host') continue;
    if (host !== undefined) throw new HttpParseError('more than one Host header');
    host = h.value;
  }
  const version = m[3]!;
  const f = framing(headers);
  if (f?.kind === 'close') throw new HttpParseError('request Transfer-Encoding must end in chunked');
  const close =
    hasToken(headers, 'connection', 'close') ||
    (version === 'HTTP/1.0' && !hasToken(headers, 'connection', 'keep-alive'));
  return {
    method: m[1]!,
    target: m[2]!,
    version,
    headers,
    host,
    body: f ?? { kind: 'none' },
    close,
    upgrade: headers.some((h) => h.name === 'upgrade') && hasToken(headers, 'connection', 'upgrade'),
  };
}

/** The header names a response is read for, by their length. */
const FRAMING_NAMES = new Map([
  [14, 'content-length'],
  [17, 'transfer-encoding'],
  [10, 'connection'],
]);

/**
 * The fields of `text` (a response head without its blank line) that frame its body, one pass
 * over the lines: a line is looked at only when its name (up to the colon, less spaces or tabs
 * before it) has the length of one of them. Nothing else is lowered or copied.
 */
function framingFields(text: string): Header[] {
  const out: Header[] = [];
  let i = text.indexOf('\r\n');
  while (i >= 0) {
    const start = i + 2;
    let eol = text.indexOf('\r\n', start);
    const end = eol < 0 ? text.length : eol;
    const colon = text.indexOf(':', start);
    if (colon > start && colon < end) {
      let n = colon;
      while (n > start && (text.charCodeAt(n - 1) === 0x20 || text.charCodeAt(n - 1) === 0x09)) n--;
      const want = FRAMING_NAMES.get(n - start);
      if (want !== undefined && text.slice(start, n).toLowerCase() === want) {
        out.push({
          name: want,
          value: text
            .slice(colon + 1, end)
            .trim()
            .toLowerCase(),
        });
      }
    }
    if (eol < 0) break;
    i = eol;
    eol = -1;
  }
  return out;
}

/**
 * Parses a response head to a request of `method`, `buf` holding exactly the head. Reads only
 * the status and the fields that frame the body: the response goes to the client as it came.
 */
export function parseResponseHead(buf: Buffer, method: string): ResponseHead {
  const text = buf.toString('latin1', 0, buf.length - 4);
  const m = /^HTTP\/1\.([01]) (\d{3})(?:[ \r]|$)/.exec(text);
  if (!m) throw new HttpParseError('malformed status line', 'PROXY_UPSTREAM');
  const status = Number(m[2]);
  const fields = framingFields(text);
  const close =
    hasToken(fields, 'connection', 'close') ||
    (m[1] === '0' && !hasToken(fields, 'connection', 'keep-alive'));
  if (method === 'HEAD' || status < 200 || status === 204 || status === 304) {
    return { status, body: { kind: 'none' }, close };
  }
  let f: BodyKind | undefined;
  try {
    f = framing(fields);
  } catch (e) {
    throw new HttpParseError((e as Error).message, 'PROXY_UPSTREAM');
  }
  const body = f ?? { kind: 'close' };
  return { status, body, close: close || body.kind === 'close' };
}

/** States of the chunked scanner. */
const C = {
  Size: 0,
  Ext: 1,
  SizeLf: 2,
  Data: 3,
  DataCr: 4,
  DataLf: 5,
  TrailerStart: 6,
  Trailer: 7,
  TrailerLf: 8,
  FinalLf: 9,
} as const;

/**
 * Follows a chunked body through the bytes it is given, in any pieces, and says where it ends
 * (after the last chunk and its trailers). Strict: sizes are hex with CRLF line ends.
 */
export class ChunkedScanner {
  private state: number = C.Size;
  private size = 0;
  private digits = 0;
  private remaining = 0;
  private lineBytes = 0;

  /** Index in `buf` just past the end of the body, or -1 when all of buf[from..] belongs to it. */
  scan(buf: Buffer, from: number): number {
    let i = from;
    const n = buf.length;
    while (i < n) {
      const c = buf[i]!;
      switch (this.state) {
        case C.Size: {
          const d = hexValue(c);
          if (d >= 0) {
            if (++this.digits > 12) throw new HttpParseError('chunk size too large');
            this.size = this.size * 16 + d;
          } else if (this.digits === 0) {
            throw new HttpParseError('bad chunk size');
          } else if (c === 0x3b /* ; */ || c === 0x20 || c === 0x09) {
            this.state = C.Ext;
          } else if (c === 0x0d) {
            this.state = C.SizeLf;
          } else {
            throw new HttpParseError('bad chunk size');
          }
          i++;
          break;
        }
        case C.Ext:
          if (c === 0x0d) this.state = C.SizeLf;
          else if (c === 0x0a) throw new HttpParseError('bare LF in chunk extension');
          if (++this.lineBytes > 4096) throw new HttpParseError('chunk extension too long');
          i++;
          break;
        case C.SizeLf:
          if (c !== 0x0a) throw new HttpParseError('chunk size line must end in CRLF');
          i++;
          this.lineBytes = 0;
          this.digits = 0;
          if (this.size === 0) {
            this.state = C.TrailerStart;
          } else {
            this.remaining = this.size;
            this.size = 0;
            this.state = C.Data;
          }
          break;
        case C.Data: {
          const take = Math.min(this.remaining, n - i);
          this.remaining -= take;
          i += take;
          if (this.remaining === 0) this.state = C.DataCr;
          break;
        }
        case C.DataCr:
          if (c !== 0x0d) throw new HttpParseError('chunk data must end in CRLF');
          this.state = C.DataLf;
          i++;
          break;
        case C.DataLf:
          if (c !== 0x0a) throw new HttpParseError('chunk data must end in CRLF');
          this.state = C.Size;
          i++;
          break;
        case C.TrailerStart:
          if (c === 0x0a) throw new HttpParseError('bare LF in trailers');
          if (c === 0x0d) {
            this.state = C.FinalLf;
          } else {
            this.state = C.Trailer;
            this.lineBytes = 1;
          }
          i++;
          break;
        case C.Trailer:
          if (c === 0x0d) this.state = C.TrailerLf;
          else if (c === 0x0a) throw new HttpParseError('bare LF in trailers');
          else if (++this.lineBytes > 8192) throw new HttpParseError('trailer too long');
          i++;
          break;
        case C.TrailerLf:
          if (c !== 0x0a) throw new HttpParseError('trailer line must end in CRLF');
          this.state = C.TrailerStart;
          i++;
          break;
        case C.FinalLf:
          if (c !== 0x0a) throw new HttpParseError('chunked body must end in CRLF');
          return i + 1;
      }
    }
    return -1;
  }
}

function hexValue(c: number): number {
  if (c >= 0x30 && c <= 0x39) return c - 0x30;
  if (c >= 0x61 && c <= 0x66) return c - 0x57;
  if (c >= 0x41 && c <= 0x46) return c - 0x37;
  return -1;
}

/** Where a body ends, fed its bytes in pieces. */
export class BodyTracker {
  private remaining: number;
  private readonly chunked: ChunkedScanner | undefined;
  constructor(readonly kind: BodyKind) {
    this.remaining = kind.kind === 'length' ? kind.length : 0;
    this.chunked = kind.kind === 'chunked' ? new ChunkedScanner() : undefined;
  }

  /** Index just past the body's end in buf (from `from`), or -1 when all of it is body. */
  scan(buf: Buffer, from: number): number {
    switch (this.kind.kind) {
      case 'none':
        return from;
      case 'close':
        return -1;
      case 'length': {
        const take = Math.min(this.remaining, buf.length - from);
        this.remaining -= take;
        return this.remaining === 0 ? from + take : -1;
      }
      case 'chunked':
        return this.chunked!.scan(buf, from);
    }
  }
}
