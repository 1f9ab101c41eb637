/**
 * The API's contract has one source: the committed generated files (src/sdk/contract.gen.ts,
 * the error table of docs/API.md) are what `npm run gen` would write now; the SDK's copy of
 * the error table and the OpenAPI document's error codes equal the daemon's table; the SDK's
 * classes follow the table's families; and the one event-stream reader reads what the server
 * writes, however it is cut into chunks.
 */
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { ERRORS } from '../domain/errors.js';
import { SANDBOX_STATES as DOMAIN_STATES } from '../domain/sandbox.js';
import { openApiDocument } from '../api/openapi.js';
import { API_ERRORS, SANDBOX_STATES } from './contract.gen.js';
import {
  AuthenticationError,
  ConflictError,
  ConnectionError,
  DormantApiError,
  ForbiddenError,
  InvalidArgumentError,
  NotFoundError,
  SandboxOperationError,
  TimeoutError,
  VaultError,
  errorClassFor,
} from './errors.js';
import { readEventStream, type ServerSentEvent } from './sse.js';

const ROOT = join(dirname(fileURLToPath(import.meta.url)), '..', '..');

describe('the API contract', () => {
  test('the generated files are what npm run gen writes now', async () => {
    const gen = (await import(pathToFileURL(join(ROOT, 'scripts', 'gen-sdk-types.mjs')).href)) as {
      generate(): Promise<Record<string, string>>;
    };
    const want = await gen.generate();
    assert.ok(Object.keys(want).length >= 2);
    for (const [path, text] of Object.entries(want))
      assert.ok(readFileSync(join(ROOT, path), 'utf8') === text, `${path} is stale: run npm run gen`);
  });

  test("the SDK's error table and the OpenAPI error codes are the daemon's table", () => {
    assert.deepEqual(API_ERRORS, ERRORS);
    const doc = openApiDocument('test') as {
      components: {
        schemas: { Error: { properties: { error: { properties: { code: { enum: string[] } } } } } };
      };
    };
    assert.deepEqual(doc.components.schemas.Error.properties.error.properties.code.enum, Object.keys(ERRORS));
    assert.deepEqual(SANDBOX_STATES, DOMAIN_STATES);
  });

  test('the SDK has a class per family, and classes unknown codes by status', () => {
    const byFamily: Record<string, typeof DormantApiError> = {
      invalid: InvalidArgumentError,
      unauthenticated: AuthenticationError,
      forbidden: ForbiddenError,
      'not-found': NotFoundError,
      conflict: ConflictError,
      operation: SandboxOperationError,
      vault: VaultError,
    };
    for (const [code, e] of Object.entries(ERRORS))
      assert.equal(errorClassFor(code, e.status), byFamily[e.family] ?? DormantApiError, code);
    assert.equal(errorClassFor('DAEMON_UNREACHABLE', 0), ConnectionError);
    assert.equal(errorClassFor('TIMEOUT', 0), TimeoutError);
    assert.equal(errorClassFor('SOME_NEWER_CODE', 404), NotFoundError);
    assert.equal(errorClassFor('SOME_NEWER_CODE', 409), ConflictError);
    assert.equal(errorClassFor('HTTP_502', 502), DormantApiError);
  });
});

describe('the event-stream reader', () => {
  const streamOf = (chunks: string[]): ReadableStream<Uint8Array> => {
    const bytes = chunks.map((c) => new TextEncoder().encode(c));
    return new ReadableStream({
      pull(ctl) {
        const next = bytes.shift();
        if (next === undefined) ctl.close();
        else ctl.enqueue(next);
      },
    });
  };
  const all = async (chunks: string[]): Promise<ServerSentEvent[]> => {
    const out: ServerSentEvent[] = [];
    for await (const ev of readEventStream(streamOf(chunks))) out.push(ev);
    return out;
  };
  const text =
    ': dormant events\n\n' +
    'id: 7\nevent: transition\ndata: {"id":7,"to":"running"}\n\n' +
    ': ping\n\n' +
    'data: first line\ndata:second line\n\n' +
    'id: 9\r\nevent: transition\r\ndata: {"to":"hibernated","reason":"a ü"}\r\n\r\n';
  const want: ServerSentEvent[] = [
    { id: '7', event: 'transition', data: '{"id":7,"to":"running"}' },
    { id: undefined, event: 'message', data: 'first line\nsecond line' },
    { id: '9', event: 'transition', data: '{"to":"hibernated","reason":"a ü"}' },
  ];

  test('reads events, ids and multi-line data, skipping comments', async () => {
    assert.deepEqual(await all([text]), want);
  });

  test('the same, cut at every byte (inside a CRLF and a UTF-8 character too)', async () => {
    const bytes = new TextEncoder().encode(text);
    for (let cut = 1; cut < bytes.length; cut++) {
      const s = new ReadableStream<Uint8Array>({
        start(ctl) {
          ctl.enqueue(bytes.slice(0, cut));
          ctl.enqueue(bytes.slice(cut));
          ctl.close();
        },
      });
      const got: ServerSentEvent[] = [];
      for await (const ev of readEventStream(s)) got.push(ev);
      assert.deepEqual(got, want, `cut at ${cut}`);
    }
  });

  test('a consumer that stops early cancels the stream', async () => {
    let cancelled = false;
    const s = new ReadableStream<Uint8Array>({
      start(ctl) {
        ctl.enqueue(new TextEncoder().encode('data: 1\n\ndata: 2\n\n'));
      },
      cancel() {
        cancelled = true;
      },
    });
    for await (const ev of readEventStream(s)) {
      assert.equal(ev.data, '1');
      break;
    }
    assert.ok(cancelled);
  });
});
