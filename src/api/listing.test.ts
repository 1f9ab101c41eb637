/** The pure parts of the sandbox listing and metadata: cursors, label filters and labels. */
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { decodeCursor, encodeCursor, parseLabelFilter } from './listing.js';
import { patchLabels, validateLabels } from '../domain/sandbox.js';
import { metricPoints } from '../control/meter.js';
import { isDormantError } from '../domain/errors.js';

const invalid = (fn: () => unknown, re: RegExp) =>
  assert.throws(fn, (e) => isDormantError(e, 'INVALID_ARGUMENT') && re.test(e.message));

describe('listing cursors and label filters', () => {
  test('a cursor round-trips, and one the API did not make is INVALID_ARGUMENT', () => {
    const c = { createdAt: 1_700_000_000_123, id: 'sb-abcdefghijklmnop' };
    assert.deepEqual(decodeCursor(encodeCursor(c)), c);
    assert.match(encodeCursor(c), /^[A-Za-z0-9_-]+$/, 'safe in a URL as it is');
    for (const bad of [
      '',
      'x',
      Buffer.from('[1]').toString('base64url'),
      Buffer.from('{"a":1}').toString('base64url'),
    ])
      invalid(() => decodeCursor(bad), /invalid cursor/);
  });

  test('label filters: k=v, k alone, and a bad key refused', () => {
    assert.deepEqual(parseLabelFilter('team=search'), ['team', 'search']);
    assert.deepEqual(parseLabelFilter('a.b/c=x=y'), ['a.b/c', 'x=y'], 'the value may hold =');
    assert.deepEqual(parseLabelFilter('team='), ['team', ''], 'an empty value');
    assert.deepEqual(parseLabelFilter('team'), ['team']);
    invalid(() => parseLabelFilter('=x'), /label key/);
    invalid(() => parseLabelFilter('-bad=x'), /label key/);
  });
});

describe('labels', () => {
  test('keys, value lengths and the count are checked', () => {
    assert.deepEqual(validateLabels({ 'app.kubernetes.io/name': 'x', A_1: '' }), {
      'app.kubernetes.io/name': 'x',
      A_1: '',
    });
    invalid(() => validateLabels({ 'has space': 'x' }), /label key/);
    invalid(() => validateLabels({ ['k'.repeat(64)]: 'x' }), /label key/);
    invalid(() => validateLabels({ k: 'v'.repeat(257) }), /longer than 256/);
    const many = Object.fromEntries(Array.from({ length: 65 }, (_, i) => [`k${i}`, 'v']));
    invalid(() => validateLabels(many), /too many labels/);
  });

  test('a patch sets, keeps and removes; the limit applies to the result', () => {
    assert.deepEqual(patchLabels({ a: '1', b: '2' }, { b: null, c: '3', a: '9' }), { a: '9', c: '3' });
    const full = Object.fromEntries(Array.from({ length: 64 }, (_, i) => [`k${i}`, 'v']));
    invalid(() => patchLabels(full, { extra: 'v' }), /too many labels/);
    assert.equal(Object.keys(patchLabels(full, { k0: null, extra: 'v' })).length, 64);
  });
});

describe('metric points', () => {
  test('CPU percent from the counter between samples; none across a counter reset or before the first', () => {
    const s = (at: number, usec: number, diskBytes?: number) => ({
      sandboxId: 'sb',
      at,
      memoryBytes: 5,
      cpuUsageUsec: usec,
      ...(diskBytes !== undefined ? { diskBytes } : {}),
    });
    const pts = metricPoints([s(1000, 0), s(2000, 500_000, 7), s(3000, 10), s(4000, 1_000_010)], 1500);
    assert.deepEqual(
      pts.map((p) => [p.at, p.cpuPercent, p.diskBytes]),
      [
        [2000, 50, 7],
        [3000, null, null],
        [4000, 100, null],
      ],
    );
  });
});
