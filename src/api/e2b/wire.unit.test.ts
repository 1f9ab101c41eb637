/**
 * The E2B front's parts that need no sandbox: Connect's envelopes and error codes, the
 * multipart reader's bounds, template resolution, keys, and the configuration of the front.
 */
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Readable } from 'node:stream';
import { DormantError, ErrorCode } from '../../domain/errors.js';
import { configFileView, loadConfig } from '../../daemon/config.js';
import { ConnectError, asConnectError, unwrapEnvelope } from './connect.js';
import { E2B_KEY_PATTERN, newE2bKey } from './front.js';
import { readMultipart } from './multipart.js';
import { IDLE_COMMAND, resolveTemplate } from './templates.js';

function envelope(flags: number, json: string, lengthDelta = 0): Buffer {
  const body = Buffer.from(json);
  const head = Buffer.alloc(5);
  head.writeUInt8(flags, 0);
  head.writeUInt32BE(body.length + lengthDelta, 1);
  return Buffer.concat([head, body]);
}

const code = (f: () => unknown): string => {
  try {
    f();
  } catch (e) {
    return e instanceof ConnectError ? e.code : String(e);
  }
  return 'no error';
};

describe('E2B front: wire formats', () => {
  test('Connect envelopes: one message, uncompressed, its length exact', () => {
    assert.deepEqual(unwrapEnvelope(envelope(0, '{"path":"/tmp"}')), { path: '/tmp' });
    assert.equal(
      code(() => unwrapEnvelope(envelope(1, '{}'))),
      'unimplemented',
    );
    assert.equal(
      code(() => unwrapEnvelope(envelope(0, '{}', 7))),
      'invalid_argument',
    );
    assert.equal(
      code(() => unwrapEnvelope(envelope(0, '{nope'))),
      'invalid_argument',
    );
    assert.equal(
      code(() => unwrapEnvelope(Buffer.from([0, 0]))),
      'invalid_argument',
    );
  });

  test("dormant's errors as Connect codes; an internal one says nothing of itself", () => {
    assert.equal(asConnectError(new DormantError(ErrorCode.FILE_NOT_FOUND, 'x')).code, 'not_found');
    assert.equal(asConnectError(new DormantError(ErrorCode.FILE_EXISTS, 'x')).code, 'already_exists');
    assert.equal(asConnectError(new DormantError(ErrorCode.SANDBOX_NOT_FOUND, 'x')).code, 'unavailable');
    assert.equal(asConnectError(new DormantError(ErrorCode.UNAUTHORIZED, 'x')).code, 'unauthenticated');
    const internal = asConnectError(new Error('/var/lib/dormant/secret path'));
    assert.deepEqual([internal.code, internal.message], ['internal', 'internal error']);
  });

  test('multipart: files by their filename, bounded', async () => {
    const b = 'XyZ';
    const body = [
      `--${b}\r\nContent-Disposition: form-data; name="file"; filename="/tmp/a.txt"\r\n\r\nalpha\r\n`,
      `--${b}\r\nContent-Disposition: form-data; name="file"; filename="/tmp/b.bin"\r\nContent-Type: application/octet-stream\r\n\r\n\r\n--not-it\r\n`,
      `--${b}--\r\n`,
    ].join('');
    const parts = await readMultipart(
      Readable.from([Buffer.from(body)]),
      `multipart/form-data; boundary=${b}`,
      1024,
    );
    assert.deepEqual(
      parts.map((p) => [p.filename, p.data.toString()]),
      [
        ['/tmp/a.txt', 'alpha'],
        ['/tmp/b.bin', '\r\n--not-it'],
      ],
    );
    await assert.rejects(
      readMultipart(Readable.from([Buffer.from(body)]), `multipart/form-data; boundary=${b}`, 100),
      (e: unknown) => e instanceof DormantError && e.code === ErrorCode.REQUEST_TOO_LARGE,
    );
    await assert.rejects(
      readMultipart(Readable.from([Buffer.from(body)]), 'multipart/form-data', 1024),
      ConnectError,
    );
  });

  test('templates: the configured map; an unknown id is not found, with the hint', () => {
    assert.deepEqual(resolveTemplate({ base: { rootfs: '/r' } }, 'base'), {
      rootfs: '/r',
      command: IDLE_COMMAND,
    });
    assert.throws(
      () => resolveTemplate({ base: { rootfs: '/r' } }, 'toString'),
      (e: unknown) =>
        e instanceof DormantError && e.code === ErrorCode.NOT_FOUND && /e2b\.templates/.test(e.hint ?? ''),
    );
  });

  test("keys have E2B's format", () => {
    const k = newE2bKey();
    assert.match(k, E2B_KEY_PATTERN);
    assert.notEqual(k, newE2bKey());
  });

  test('the front is off by default; on with e2b.listen; templates from the file', async () => {
    const dir = await mkdtemp(join(tmpdir(), 'dormant-e2b-config-'));
    try {
      assert.equal(loadConfig({ env: {}, file: await file(dir, {}) }).config.e2b.listen, undefined);
      const { config } = loadConfig({
        env: { DORMANT_E2B_LISTEN: '127.0.0.1:3001' },
        file: await file(dir, {
          e2b: { templates: { base: { image: '/srv/img', memory: '1G', command: ['sleep', 'infinity'] } } },
        }),
      });
      assert.equal(config.e2b.listen, '127.0.0.1:3001');
      assert.deepEqual(config.e2b.templates.base, {
        image: '/srv/img',
        memoryBytes: 1024 ** 3,
        command: ['sleep', 'infinity'],
      });
      // The printed configuration is a valid file again.
      const again = loadConfig({ env: {}, file: await file(dir, configFileView(config)) }).config;
      assert.deepEqual(again.e2b, config.e2b);
      assert.throws(
        () => loadConfig({ env: {}, file: `${dir}/bad.json` }),
        /rootfs or image|e2b/,
        'a template with neither is refused',
      );
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});

let n = 0;
async function file(dir: string, content: object): Promise<string> {
  const p = join(dir, `c${n++}.json`);
  await writeFile(p, JSON.stringify(content));
  await writeFile(join(dir, 'bad.json'), JSON.stringify({ e2b: { templates: { base: {} } } }));
  return p;
}
