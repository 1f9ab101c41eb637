import { test } from 'node:test';
import assert from 'node:assert/strict';
import { formatBytes, formatDurationMs, parseDurationMs, parseSizeBytes } from './units.js';
import { compareVersions, versionAtLeast } from './version.js';

test('durations are parsed the human way', () => {
  assert.equal(parseDurationMs('15m'), 900_000);
  assert.equal(parseDurationMs('7d'), 604_800_000);
  assert.equal(parseDurationMs('1h30m'), 5_400_000);
  assert.equal(parseDurationMs('250ms'), 250);
  assert.equal(parseDurationMs('1.5s'), 1500);
  for (const bad of ['', '15', 'm15', '15 minutes', '1x', '-5m']) {
    assert.throws(() => parseDurationMs(bad), /invalid duration/, bad);
  }
});

test('durations are printed the human way', () => {
  assert.equal(formatDurationMs(850), '850ms');
  assert.equal(formatDurationMs(1500), '1.5s');
  assert.equal(formatDurationMs(900_000), '15m');
  assert.equal(formatDurationMs(5_400_000), '1h30m');
  assert.equal(formatDurationMs(8 * 86_400_000 + 3_600_000), '8d1h');
});

test('sizes use binary units', () => {
  assert.equal(parseSizeBytes('512M'), 512 * 1024 ** 2);
  assert.equal(parseSizeBytes('1G'), 1024 ** 3);
  assert.equal(parseSizeBytes('1.5GiB'), 1.5 * 1024 ** 3);
  assert.equal(parseSizeBytes('4096'), 4096);
  assert.throws(() => parseSizeBytes('12 parsecs'), /invalid size/);
  assert.equal(formatBytes(512), '512 B');
  assert.equal(formatBytes(1536), '1.50 KiB');
  assert.equal(formatBytes(512 * 1024 ** 2), '512 MiB');
});

test('versions compare numerically', () => {
  assert.ok(compareVersions('4.10', '4.2') > 0);
  assert.ok(versionAtLeast('4.2.1', '4.2'));
  assert.ok(!versionAtLeast('4.1.1', '4.2'));
  assert.ok(!versionAtLeast('3.17.1', '4.2'));
  assert.equal(compareVersions('1.1.5+ds1', '1.1.5'), 0);
});
