import { test } from 'node:test';
import assert from 'node:assert/strict';
import { DormantError } from './errors.js';
import { egressText, parseCidr, parseEgressPolicy } from './egress.js';

function code(fn: () => unknown): string | undefined {
  try {
    fn();
  } catch (e) {
    return e instanceof DormantError ? e.code : 'not a DormantError';
  }
  return undefined;
}

test('internet and none stand alone', () => {
  assert.deepEqual(parseEgressPolicy('internet'), { mode: 'internet' });
  assert.deepEqual(parseEgressPolicy(' none '), { mode: 'none' });
  assert.equal(
    code(() => parseEgressPolicy('none,198.18.0.0/15')),
    'EGRESS_POLICY_INVALID',
  );
  assert.equal(
    code(() => parseEgressPolicy('')),
    'EGRESS_POLICY_INVALID',
  );
  assert.equal(
    code(() => parseEgressPolicy(',')),
    'EGRESS_POLICY_INVALID',
  );
});

test('a list keeps CIDRs (normalized, deduplicated) and host names (lowercased)', () => {
  assert.deepEqual(
    parseEgressPolicy('198.18.0.0/15,Api.Example.com,198.18.7.9/15, 1.2.3.4,api.example.com.'),
    {
      mode: 'list',
      cidrs: ['198.18.0.0/15', '1.2.3.4/32'],
      hosts: ['api.example.com'],
    },
  );
  assert.deepEqual(parseEgressPolicy(['10.1.2.3/8', 'pypi.org']), {
    mode: 'list',
    cidrs: ['10.0.0.0/8'],
    hosts: ['pypi.org'],
  });
  assert.equal(egressText(parseEgressPolicy('198.18.0.0/15,pypi.org')), '198.18.0.0/15,pypi.org');
});

test('malformed entries are refused with a code naming the entry', () => {
  for (const bad of [
    '198.18.0.0/33',
    '256.1.1.1',
    '1.2.3/8',
    '01.2.3.4',
    '1.2.3.4/',
    'localhost',
    '-bad.example.com',
    'a..b',
    '2001:db8::/32',
    'exa mple.com',
    '1.2.3.4; rm -rf /',
  ]) {
    let err: unknown;
    try {
      parseEgressPolicy(bad);
    } catch (e) {
      err = e;
    }
    assert.ok(err instanceof DormantError, bad);
    assert.equal(err.code, 'EGRESS_POLICY_INVALID', bad);
    assert.equal(err.status, 400);
  }
  assert.equal(
    code(() => parseEgressPolicy(Array.from({ length: 65 }, (_, i) => `198.18.0.${i}`).join(','))),
    'EGRESS_POLICY_INVALID',
  );
});

test('parseCidr normalizes to the network', () => {
  assert.equal(parseCidr('192.168.1.77/24'), '192.168.1.0/24');
  assert.equal(parseCidr('0.0.0.0/0'), '0.0.0.0/0');
  assert.equal(parseCidr('8.8.8.8'), '8.8.8.8/32');
  assert.equal(parseCidr('1.2.3.4/40'), undefined);
});
