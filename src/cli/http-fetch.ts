/**
 * `fetch` for the CLI over node:http. Node's own fetch (undici) costs a CLI run more than the
 * rest of its start-up on the first request: measured here, `node` plus one fetch to a daemon
 * on loopback took 2.8x `node -e ''`, against 0.9x with http.request (docs/BENCHMARKS.md "CLI
 * start-up"). A command makes one or a few requests, so that first one is what a user waits
 * for. The daemon the CLI talks to speaks plain HTTP/1.1 (https where DORMANT_URL says so).
 *
 * What the SDK and the commands use is supported: a method, headers, a body (a string, bytes,
 * a Blob, a web ReadableStream or an async iterable, streamed as read), an AbortSignal, and a
 * Response whose body streams as it arrives (progress events, logs, file downloads).
 */
import http from 'node:http';
import https from 'node:https';
import { Readable } from 'node:stream';

/** Statuses whose Response may have no body (the Response constructor rejects one). */
const NULL_BODY = new Set([101, 103, 204, 205, 304]);

/** The request's body as a byte stream, or bytes; undefined without one. */
function bodyOf(body: RequestInit['body']): Readable | string | Uint8Array | undefined {
  if (body === undefined || body === null) return undefined;
  if (typeof body === 'string' || body instanceof Uint8Array) return body;
  if (body instanceof ReadableStream) return Readable.fromWeb(body);
  if (body instanceof Blob) return Readable.fromWeb(body.stream());
  if (typeof body === 'object' && Symbol.asyncIterator in body) {
    return Readable.from(body as AsyncIterable<Uint8Array>, { objectMode: false });
  }
  throw new TypeError(`dormant CLI fetch: unsupported body type ${Object.prototype.toString.call(body)}`);
}

function headersOf(init: RequestInit['headers']): Record<string, string> {
  const out: Record<string, string> = {};
  new Headers(init).forEach((v, k) => (out[k] = v));
  return out;
}

/** A TypeError with the system error as its cause: what Node's fetch rejects with, which the SDK reads. */
function failed(cause: unknown): TypeError {
  return new TypeError('fetch failed', { cause });
}

export function httpFetch(input: string | URL | Request, init: RequestInit = {}): Promise<Response> {
  if (input instanceof Request) throw new TypeError('dormant CLI fetch: pass a URL and options');
  const url = new URL(input);
  const signal = init.signal ?? undefined;
  return new Promise<Response>((resolve, reject) => {
    // An abort rejects with the signal's reason, as Node's fetch does (an Error in practice).
    if (signal?.aborted) {
      reject(signal.reason as Error);
      return;
    }
    const body = bodyOf(init.body);
    const given = headersOf(init.headers);
    const req = (url.protocol === 'https:' ? https : http).request(url, {
      method: init.method ?? 'GET',
      headers: {
        ...given,
        ...(typeof body === 'string' ? { 'content-length': String(Buffer.byteLength(body)) } : {}),
        ...(body instanceof Uint8Array ? { 'content-length': String(body.byteLength) } : {}),
        // A Blob's size and type, as fetch sends them (the caller's headers win).
        ...(init.body instanceof Blob
          ? {
              'content-length': String(init.body.size),
              ...(init.body.type !== '' && given['content-type'] === undefined
                ? { 'content-type': init.body.type }
                : {}),
            }
          : {}),
      },
    });
    // After the headers, an abort errors the body stream as Node's fetch does; before them, it
    // rejects the promise.
    const onAbort = (): void => {
      req.destroy(signal!.reason as Error);
      reject(signal!.reason as Error);
    };
    signal?.addEventListener('abort', onAbort, { once: true });
    req.once('error', (e) => {
      signal?.removeEventListener('abort', onAbort);
      reject(signal?.aborted ? (signal.reason as Error) : failed(e));
    });
    req.once('response', (res) => {
      const headers = new Headers();
      for (let i = 0; i < res.rawHeaders.length; i += 2)
        headers.append(res.rawHeaders[i]!, res.rawHeaders[i + 1]!);
      const status = res.statusCode ?? 0;
      const streamed = NULL_BODY.has(status) || init.method === 'HEAD' ? null : Readable.toWeb(res);
      if (streamed === null) res.resume();
      res.once('close', () => signal?.removeEventListener('abort', onAbort));
      resolve(
        new Response(streamed as ReadableStream<Uint8Array> | null, {
          status,
          statusText: res.statusMessage ?? '',
          headers,
        }),
      );
    });
    if (body instanceof Readable) {
      body.once('error', (e) => req.destroy(e));
      body.pipe(req);
    } else {
      req.end(body);
    }
  });
}
