/**
 * The Connect protocol (connectrpc.com), JSON codec, as E2B's envd speaks it: what the E2B
 * SDK's `createConnectTransport({ useBinaryFormat: false })` sends and expects.
 *
 * - Unary: a POST of `application/json`, answered with JSON; an error is a non-200 status
 *   with `{ code, message }`, `code` one of Connect's snake_case names.
 * - Server streaming: a POST of `application/connect+json` whose body is one enveloped
 *   message; the answer is `application/connect+json`, a frame per message (a flag byte, a
 *   4-byte big-endian length, the JSON), and last an end-of-stream frame (flag 0x02) holding
 *   `{}` or `{ "error": { code, message } }`. Errors after the headers travel only there.
 */
import type { FastifyReply } from 'fastify';
import type { ServerResponse } from 'node:http';
import { DormantError, ErrorCode, errorInfo, type ErrorFamily } from '../../domain/errors.js';

/** Largest request message the front reads (a SendInput of stdin rides in one). */
export const MAX_MESSAGE_BYTES = 4 * 1024 * 1024;
/** Output a slow reader may leave unread before its stream is cut off. */
const MAX_UNREAD_BYTES = 64 * 1024 * 1024;
const END_STREAM = 0x02;

export type ConnectCode =
  | 'canceled'
  | 'unknown'
  | 'invalid_argument'
  | 'deadline_exceeded'
  | 'not_found'
  | 'already_exists'
  | 'permission_denied'
  | 'resource_exhausted'
  | 'failed_precondition'
  | 'aborted'
  | 'unimplemented'
  | 'internal'
  | 'unavailable'
  | 'unauthenticated';

/** The HTTP status a unary error carries (Connect's own table). */
const STATUS: Readonly<Record<ConnectCode, number>> = {
  canceled: 499,
  unknown: 500,
  invalid_argument: 400,
  deadline_exceeded: 504,
  not_found: 404,
  already_exists: 409,
  permission_denied: 403,
  resource_exhausted: 429,
  failed_precondition: 400,
  aborted: 409,
  unimplemented: 501,
  internal: 500,
  unavailable: 503,
  unauthenticated: 401,
};

/** An error with a Connect code, thrown by the envd services and answered as Connect says. */
export class ConnectError extends Error {
  constructor(
    readonly code: ConnectCode,
    message: string,
  ) {
    super(message);
    this.name = 'ConnectError';
  }
}

const BY_FAMILY: Readonly<Record<ErrorFamily, ConnectCode>> = {
  invalid: 'invalid_argument',
  unauthenticated: 'unauthenticated',
  forbidden: 'permission_denied',
  'not-found': 'not_found',
  conflict: 'failed_precondition',
  'too-large': 'resource_exhausted',
  unprocessable: 'invalid_argument',
  operation: 'internal',
  vault: 'internal',
  timeout: 'deadline_exceeded',
  unavailable: 'unavailable',
  internal: 'internal',
};

/** Codes whose E2B meaning differs from their family's. */
const BY_CODE: Readonly<Partial<Record<string, ConnectCode>>> = {
  [ErrorCode.FILE_EXISTS]: 'already_exists',
  // E2B's proxy answers a sandbox that is gone as unavailable (the SDK: "sandbox was killed").
  [ErrorCode.SANDBOX_NOT_FOUND]: 'unavailable',
};

/** Any error as a Connect one: a tenant never sees an internal error's text. */
export function asConnectError(e: unknown): ConnectError {
  if (e instanceof ConnectError) return e;
  if (e instanceof DormantError) {
    const code = BY_CODE[e.code] ?? BY_FAMILY[errorInfo(e.code).family];
    return new ConnectError(code, code === 'internal' ? `internal error (${e.code})` : e.message);
  }
  return new ConnectError('internal', 'internal error');
}

/** Answers a unary call's error. */
export function sendUnaryError(reply: FastifyReply, e: unknown): FastifyReply {
  const err = asConnectError(e);
  return reply
    .status(STATUS[err.code])
    .type('application/json')
    .send({ code: err.code, message: err.message });
}

/** One enveloped frame. */
function frame(flags: number, json: object): Buffer {
  const body = Buffer.from(JSON.stringify(json));
  const head = Buffer.alloc(5);
  head.writeUInt8(flags, 0);
  head.writeUInt32BE(body.length, 1);
  return Buffer.concat([head, body]);
}

/**
 * The one message of a server-streaming request's body (an envelope): a compressed
 * (flag 0x01) or oversized message is refused.
 */
export function unwrapEnvelope(body: Buffer): unknown {
  if (body.length < 5) throw new ConnectError('invalid_argument', 'the request is not an enveloped message');
  const flags = body.readUInt8(0);
  const len = body.readUInt32BE(1);
  if ((flags & 0x01) !== 0) throw new ConnectError('unimplemented', 'compressed messages are not supported');
  if (len !== body.length - 5)
    throw new ConnectError('invalid_argument', 'the envelope length does not match');
  return parseJson(body.subarray(5));
}

export function parseJson(body: Buffer): unknown {
  if (body.length === 0) return {};
  try {
    return JSON.parse(body.toString('utf8')) as unknown;
  } catch {
    throw new ConnectError('invalid_argument', 'the request is not valid JSON');
  }
}

/** A server stream in progress: messages, then exactly one end. */
export class ServerStream {
  private ended = false;
  readonly closed: Promise<void>;
  constructor(private readonly res: ServerResponse) {
    res.writeHead(200, { 'content-type': 'application/connect+json', 'cache-control': 'no-cache' });
    res.flushHeaders();
    this.closed = new Promise((resolve) => res.once('close', () => resolve()));
  }

  get open(): boolean {
    return !this.ended && !this.res.destroyed && !this.res.writableEnded;
  }

  /** Sends a message; a reader too far behind is cut off (a stalled client holds no memory). */
  send(message: object): void {
    if (!this.open) return;
    this.res.write(frame(0, message));
    if (this.res.writableLength > MAX_UNREAD_BYTES) this.res.destroy();
  }

  /** The end of the stream, with an error or without. */
  end(e?: unknown): void {
    if (!this.open) return;
    this.ended = true;
    if (e === undefined) this.res.end(frame(END_STREAM, {}));
    else {
      const err = asConnectError(e);
      this.res.end(frame(END_STREAM, { error: { code: err.code, message: err.message } }));
    }
  }
}
