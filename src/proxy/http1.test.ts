/**
 * The proxy's HTTP/1.x framing: heads, body lengths, chunked bodies fed in any pieces, and the
 * ambiguous messages it must refuse so that it and the sandbox's server never disagree.
 */
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import {
  BodyTracker,
  ChunkedScanner,
  HttpParseError,
  headEnd,
  parseRequestHead,
  parseResponseHead,
} from './http1.js';

const head = (s: string): Buffer => Buffer.from(s, 'latin1');

describe('http1 framing', () => {
  test('reads a request head: target, host, framing, close and upgrade', () => {
    const r = parseRequestHead(
      head('POST /a?b=1 HTTP/1.1\r\nHost: x.test\r\nContent-Length: 5\r\nX-A:  v  \r\n\r\n'),
    );
    assert.equal(r.method, 'POST');
    assert.equal(r.target, '/a?b=1');
    assert.equal(r.host, 'x.test');
    assert.deepEqual(r.body, { kind: 'length', length: 5 });
    assert.equal(r.close, false);
    assert.deepEqual(r.headers.at(-1), { name: 'x-a', value: 'v' });
    const c = parseRequestHead(head('GET / HTTP/1.1\r\nhost: h\r\ntransfer-encoding: gzip, chunked\r\n\r\n'));
    assert.deepEqual(c.body, { kind: 'chunked' });
    assert.equal(parseRequestHead(head('GET / HTTP/1.0\r\nhost: h\r\n\r\n')).close, true);
    assert.equal(
      parseRequestHead(head('GET / HTTP/1.0\r\nhost: h\r\nconnection: keep-alive\r\n\r\n')).close,
      false,
    );
    const u = parseRequestHead(
      head('GET /ws HTTP/1.1\r\nhost: h\r\nConnection: keep-alive, Upgrade\r\nUpgrade: websocket\r\n\r\n'),
    );
    assert.equal(u.upgrade, true);
    assert.deepEqual(u.body, { kind: 'none' });
  });

  test('refuses ambiguous or malformed requests', () => {
    const bad = [
      'GET / HTTP/1.1\r\nhost: h\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n',
      'GET / HTTP/1.1\r\nhost: h\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\n',
      'GET / HTTP/1.1\r\nhost: h\r\ncontent-length: -1\r\n\r\n',
      'GET / HTTP/1.1\r\nhost: h\r\ntransfer-encoding: gzip\r\n\r\n',
      'GET / HTTP/1.1\r\nhost: h\r\nhost: i\r\n\r\n',
      'GET / HTTP/1.1\r\nhost: h\r\n folded\r\n\r\n',
      'GET / HTTP/1.1\r\nhost : h\r\n\r\n',
      'GET / HTTP/1.1\r\nhost: h\nx: y\r\n\r\n',
      'GET /a b HTTP/1.1\r\nhost: h\r\n\r\n',
      'GET / HTTP/2.0\r\nhost: h\r\n\r\n',
    ];
    for (const b of bad) assert.throws(() => parseRequestHead(head(b)), HttpParseError, JSON.stringify(b));
    // The same length twice is one length.
    assert.deepEqual(
      parseRequestHead(head('GET / HTTP/1.1\r\nhost: h\r\ncontent-length: 4, 4\r\n\r\n')).body,
      { kind: 'length', length: 4 },
    );
  });

  test('reads how a response ends, given the request method', () => {
    const r = (s: string, m = 'GET') => parseResponseHead(head(s), m);
    assert.deepEqual(r('HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n').body, { kind: 'length', length: 3 });
    assert.deepEqual(r('HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n', 'HEAD').body, { kind: 'none' });
    assert.deepEqual(r('HTTP/1.1 204 No Content\r\n\r\n').body, { kind: 'none' });
    assert.deepEqual(r('HTTP/1.1 304 Not Modified\r\ncontent-length: 9\r\n\r\n').body, { kind: 'none' });
    assert.deepEqual(r('HTTP/1.1 100 Continue\r\n\r\n').body, { kind: 'none' });
    assert.deepEqual(r('HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n').body, { kind: 'chunked' });
    const closing = r('HTTP/1.1 200 OK\r\nx: y\r\n\r\n');
    assert.deepEqual([closing.body, closing.close], [{ kind: 'close' }, true]);
    assert.equal(r('HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n').close, true);
    assert.equal(r('HTTP/1.1 200\r\ncontent-length: 0\r\n\r\n').status, 200);
    assert.throws(
      () => r('HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n'),
      HttpParseError,
    );
    assert.throws(() => r('HTTX/1.1 200 OK\r\n\r\n'), HttpParseError);
    // Names in any case, space before the colon, several tokens, lengths of other fields.
    const mixed = r(
      'HTTP/1.1 200 OK\r\nX-Content-Length: 7\r\nCONTENT-LENGTH : 12\r\nConnection: Keep-Alive, Close\r\n\r\n',
    );
    assert.deepEqual([mixed.body, mixed.close], [{ kind: 'length', length: 12 }, true]);
    assert.equal(r('HTTP/1.0 200 OK\r\ncontent-length: 1\r\nconnection: KEEP-ALIVE\r\n\r\n').close, false);
    assert.equal(r('HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\n').close, true);
    assert.deepEqual(r('HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n').body, { kind: 'close' });
  });

  test('finds the end of a chunked body fed a byte at a time, or all at once', () => {
    const body = Buffer.from(
      '5;ext=1\r\nhello\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nx-trailer: 1\r\n\r\nNEXT',
    );
    const whole = new ChunkedScanner().scan(body, 0);
    assert.equal(body.subarray(whole).toString(), 'NEXT');
    const s = new ChunkedScanner();
    let end = -1;
    for (let i = 0; i < body.length && end < 0; i++) {
      const r = s.scan(body.subarray(i, i + 1), 0);
      if (r >= 0) end = i + r;
    }
    assert.equal(end, whole);
    assert.equal(new ChunkedScanner().scan(Buffer.from('0\r\n\r\n'), 0), 5);
    for (const bad of ['x\r\n', '5\r\nhelloX\r\n', '5\nhello\r\n', '0\r\n\n']) {
      assert.throws(() => new ChunkedScanner().scan(Buffer.from(bad), 0), HttpParseError, bad);
    }
  });

  test('a Content-Length body ends after its bytes, across pieces', () => {
    const t = new BodyTracker({ kind: 'length', length: 6 });
    assert.equal(t.scan(Buffer.from('abcd'), 0), -1);
    assert.equal(t.scan(Buffer.from('efGET'), 0), 2);
    assert.equal(new BodyTracker({ kind: 'none' }).scan(Buffer.from('x'), 0), 0);
    assert.equal(new BodyTracker({ kind: 'close' }).scan(Buffer.from('x'), 0), -1);
    assert.equal(headEnd(Buffer.from('GET / HTTP/1.1\r\nh: v\r\n\r\nbody')), 24);
    assert.equal(headEnd(Buffer.from('GET / HTTP/1.1\r\nh: v\r\n')), -1);
  });
});
