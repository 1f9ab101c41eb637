import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { mostRoom, placeWake, type NodeInfo } from './node.js';

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
        node('b', { sandboxes: { running: 3 } }),
        node('a', { sandboxes: { running: 3, hibernated: 9 } }),
        node('c', { sandboxes: { paused: 4 } }),
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
});
