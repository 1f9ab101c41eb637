import { test } from 'node:test';
import assert from 'node:assert/strict';
import { restoreProblems, type PlatformFacts } from './compat.js';

const node: PlatformFacts = {
  arch: 'x64',
  criuVersion: '4.2.1',
  cpuFlags: ['fpu', 'sse2', 'avx', 'avx2', 'hypervisor', 'aes'],
};

test('the same platform restores', () => {
  assert.deepEqual(restoreProblems(node, node), []);
});

test('a different architecture, an older CRIU and missing CPU features are each named', () => {
  assert.match(restoreProblems({ ...node, arch: 'arm64' }, node).join(), /made on arm64, this node is x64/);
  assert.match(
    restoreProblems({ ...node, criuVersion: '4.3' }, node).join(),
    /CRIU 4.3, this node has the older 4.2.1/,
  );
  assert.deepEqual(
    restoreProblems({ ...node, criuVersion: '4.1' }, node),
    [],
    'a newer CRIU reads older images',
  );
  const p = restoreProblems({ ...node, cpuFlags: [...node.cpuFlags, 'avx512f', 'vmx', 'sha_ni'] }, node);
  assert.equal(p.length, 1);
  assert.match(p[0]!, /lacks features .*: avx512f, sha_ni$/, 'vmx is not something user space relies on');
});

test('facts a checkpoint did not record are not held against it', () => {
  assert.deepEqual(restoreProblems({}, node), []);
});
