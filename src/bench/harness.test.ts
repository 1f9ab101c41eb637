import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mergeReport } from './harness.js';

test('a rerun of one suite replaces its section and keeps the others and the hand-written notes', () => {
  const existing = [
    '# Benchmarks',
    '',
    '## A',
    '<!-- suite: a -->',
    'old a',
    '',
    '## Notes on A (by hand)',
    'kept',
    '',
    '## B',
    '<!-- suite: b -->',
    'old b',
    '',
  ].join('\n');
  const out = mergeReport(existing, new Map([['a', '## A\n<!-- suite: a -->\nnew a\n']]), ['a', 'b']);
  assert.match(out, /new a/);
  assert.doesNotMatch(out, /old a/);
  assert.match(out, /## Notes on A \(by hand\)\nkept/);
  assert.match(out, /old b/);
  assert.ok(
    out.indexOf('new a') < out.indexOf('Notes on A') && out.indexOf('Notes on A') < out.indexOf('old b'),
  );
});
