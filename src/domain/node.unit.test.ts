import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { canWake, mostRoom, placeWake, proxyUrlProblem, type NodeInfo } from './node.js';

const GiB = 1024 ** 3;

function node(name: string, o: Partial<NodeInfo> = {}): NodeInfo {
  return {
    name,
    url: `http://${name}:7420`,
    state: 'active',
    capacity: { memoryBytes: 8 * GiB, cpus: 4, arch: 'x86_64', runtimes: ['runc'] },
    startedAt: 0,
    leaseUntil: 1,
    expired: false,
    sandboxes: {},
    awakeSandboxes: 0,
    memoryUsedBytes: 0,
    ...o,
  };
}

describe('placement of a waking sandbox', () => {
  test('its own node while that one takes sandboxes', () => {
    const nodes = [node('a'), node('b', { memoryUsedBytes: 6 * GiB }), node('c')];
    assert.equal(placeWake(nodes, 'b', 'a')?.name, 'b');
  });

  test('its node draining, lost or past its lease: the node the request reached', () => {
    for (const gone of [{ state: 'draining' as const }, { state: 'lost' as const }, { expired: true }]) {
      const nodes = [node('a'), node('b', gone), node('c')];
      assert.equal(placeWake(nodes, 'b', 'c')?.name, 'c', JSON.stringify(gone));
    }
  });

  test('neither takes sandboxes: the open node with the most memory free', () => {
    const nodes = [
      node('a', { state: 'draining' }),
      node('b', { memoryUsedBytes: 4 * GiB }),
      node('c', { memoryUsedBytes: 1 * GiB }),
      node('d', { expired: true }),
    ];
    assert.equal(placeWake(nodes, 'd', 'a')?.name, 'c');
    assert.equal(placeWake(nodes, undefined, 'a')?.name, 'c');
  });

  test('no node takes sandboxes: none', () => {
    assert.equal(
      placeWake([node('a', { state: 'draining' }), node('b', { expired: true })], 'a', 'a'),
      undefined,
    );
  });

  test('most room: free memory, then fewer awake sandboxes, then the name', () => {
    assert.equal(
      mostRoom([
        node('b', { awakeSandboxes: 3 }),
        node('a', { awakeSandboxes: 3 }),
        node('c', { awakeSandboxes: 4 }),
      ])?.name,
      'a',
    );
    assert.equal(
      mostRoom([
        node('x', { capacity: { memoryBytes: 16 * GiB, cpus: 1, arch: 'x86_64', runtimes: [] } }),
        node('y'),
      ])?.name,
      'x',
    );
  });

  test('only nodes that can restore it: its runtime, its architecture, its CPU flags, a CRIU as new', () => {
    const cap = (o: Partial<NodeInfo['capacity']>): Partial<NodeInfo> => ({
      capacity: {
        memoryBytes: 8 * GiB,
        cpus: 4,
        arch: 'x86_64',
        runtimes: ['runc'],
        criuVersion: '4.2',
        cpuFlags: ['avx2'],
        ...o,
      },
    });
    const needs = {
      runtime: 'runc',
      facts: { arch: 'x86_64', criuVersion: '4.2', cpuFlags: ['avx2', 'sse4_2'] },
    };
    const nodes = [
      node('arm', cap({ arch: 'aarch64', cpuFlags: ['avx2', 'sse4_2'] })),
      node('old', cap({ criuVersion: '3.17', cpuFlags: ['avx2', 'sse4_2'] })),
      node('nosse', cap({ cpuFlags: ['avx2'] })),
      node('gvisor', cap({ runtimes: ['runsc'], cpuFlags: ['avx2', 'sse4_2'] })),
      node('fits', cap({ cpuFlags: ['avx2', 'sse4_2'], memoryBytes: 1 * GiB })),
    ];
    assert.deepEqual(
      nodes.filter((n) => canWake(n, needs)).map((n) => n.name),
      ['fits'],
    );
    // Its own node and the one asked cannot: the one that can, though it has the least room.
    assert.equal(placeWake(nodes, 'arm', 'old', needs)?.name, 'fits');
    assert.equal(placeWake(nodes.slice(0, 4), 'arm', 'old', needs), undefined);
    // A node that told nothing of its CPU or CRIU is not held to them.
    assert.equal(canWake(node('quiet'), needs), true);
  });
});

test('a proxy on loopback behind an API other hosts reach is reported; on one host it is not', () => {
  assert.match(
    proxyUrlProblem('http://10.0.0.5:7420', 'http://127.0.0.1:7421') ?? '',
    /listens on loopback \(http:\/\/127\.0\.0\.1:7421\)/,
  );
  assert.equal(proxyUrlProblem('http://127.0.0.1:7420', 'http://127.0.0.1:7421'), undefined);
  assert.equal(proxyUrlProblem('http://10.0.0.5:7420', 'http://10.0.0.5:7421'), undefined);
  assert.equal(proxyUrlProblem('http://[::1]:7420', 'http://[::1]:7421'), undefined);
  assert.equal(proxyUrlProblem('http://10.0.0.5:7420', undefined), undefined);
});
