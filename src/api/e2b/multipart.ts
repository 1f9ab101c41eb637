/**
 * multipart/form-data, as the E2B SDK uploads files to envd's `POST /files` (a `file` field
 * per file, its path as the part's filename). The body is read whole up to a bound: an upload
 * larger than that is refused (the SDK sends streams as application/octet-stream, which the
 * front streams through without holding it).
 */
import { DormantError, ErrorCode } from '../../domain/errors.js';
import { ConnectError } from './connect.js';

export interface FilePart {
  filename: string;
  data: Buffer;
}

/** At most this many parts per upload. */
const MAX_PARTS = 1000;

/** The parts of `body` that carry a file (a filename). */
export async function readMultipart(
  body: NodeJS.ReadableStream,
  contentType: string,
  maxBytes: number,
): Promise<FilePart[]> {
  const m = /boundary=(?:"([^"]{1,70})"|([^\s;]{1,70}))/i.exec(contentType);
  if (!m) throw new ConnectError('invalid_argument', 'multipart upload without a boundary');
  const boundary = Buffer.from(`--${m[1] ?? m[2]!}`);
  const chunks: Buffer[] = [];
  let size = 0;
  for await (const c of body as AsyncIterable<Buffer>) {
    size += c.length;
    if (size > maxBytes)
      throw new DormantError(
        ErrorCode.REQUEST_TOO_LARGE,
        `a multipart upload is limited to ${maxBytes} bytes`,
        { hint: 'send large files as a stream (application/octet-stream)' },
      );
    chunks.push(c);
  }
  const all = Buffer.concat(chunks);
  const parts: FilePart[] = [];
  let at = all.indexOf(boundary);
  while (at >= 0) {
    const start = at + boundary.length;
    // `--` after a boundary closes the body.
    if (all.subarray(start, start + 2).toString() === '--') break;
    const headEnd = all.indexOf('\r\n\r\n', start);
    if (headEnd < 0) break;
    const next = all.indexOf(Buffer.concat([Buffer.from('\r\n'), boundary]), headEnd + 4);
    if (next < 0) throw new ConnectError('invalid_argument', 'multipart upload cut short');
    const head = all.subarray(start, headEnd).toString('utf8');
    const name = /filename\*?="((?:[^"\\]|\\.)*)"/i.exec(head);
    if (name)
      parts.push({ filename: name[1]!.replace(/\\(.)/g, '$1'), data: all.subarray(headEnd + 4, next) });
    if (parts.length > MAX_PARTS)
      throw new ConnectError('invalid_argument', `at most ${MAX_PARTS} files per upload`);
    at = next + 2;
  }
  if (parts.length === 0) throw new ConnectError('invalid_argument', 'the upload holds no file');
  return parts;
}
