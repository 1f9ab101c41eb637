/** The S3 vault's settings: file, variables and the --vault flag, checked as a whole, the secret never printed. */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { DormantError } from '../domain/errors.js';
import { configFileView, loadConfig } from './config.js';

function loadOk(env: Record<string, string>, flags: Record<string, unknown> = {}) {
  return loadConfig({ env: { ...env, DORMANT_CONFIG: '' }, flags }).config;
}

const invalid = (re: RegExp) => (e: unknown) =>
  e instanceof DormantError && e.code === 'INVALID_ARGUMENT' && re.test(e.message);

test('no vault.url: the local vault, as before', () => {
  assert.equal(loadOk({}).vault, undefined);
});

test('an S3 vault from the variables, the secret redacted when printed', () => {
  const c = loadOk({
    DORMANT_VAULT: 's3://ckpts/node-1',
    DORMANT_VAULT_ENDPOINT: 'http://127.0.0.1:7480',
    DORMANT_VAULT_ACCESS_KEY_ID: 'AK',
    DORMANT_VAULT_SECRET_ACCESS_KEY: 'very-secret',
    DORMANT_VAULT_CACHE_SIZE: '512M',
  });
  assert.deepEqual(c.vault, {
    url: 's3://ckpts/node-1',
    endpoint: 'http://127.0.0.1:7480',
    accessKeyId: 'AK',
    secretAccessKey: { value: 'very-secret' },
    cacheBytes: 512 * 1024 * 1024,
    partSizeBytes: 8 * 1024 * 1024,
  });
  const printed = JSON.stringify(configFileView(c));
  assert.ok(!printed.includes('very-secret'));
  assert.match(printed, /"secretAccessKey":"<redacted>"/);
});

test('--vault sets the URL over the variable', () => {
  const c = loadOk({ DORMANT_VAULT: 's3://from-env' }, { vault: { url: 's3://from-flag/p' } });
  assert.equal(c.vault?.url, 's3://from-flag/p');
});

test('bad or half-given vault settings are refused with what to fix', () => {
  assert.throws(() => loadOk({ DORMANT_VAULT: 'https://bucket' }), invalid(/DORMANT_VAULT.*s3:\/\/BUCKET/));
  assert.throws(() => loadOk({ DORMANT_VAULT: 's3://Bad_Bucket' }), invalid(/s3:\/\/BUCKET/));
  assert.throws(
    () => loadOk({ DORMANT_VAULT: 's3://b-1', DORMANT_VAULT_ACCESS_KEY_ID: 'AK' }),
    invalid(/accessKeyId and a secret/),
  );
  assert.throws(
    () =>
      loadOk({
        DORMANT_VAULT: 's3://b-1',
        DORMANT_VAULT_ACCESS_KEY_ID: 'AK',
        DORMANT_VAULT_SECRET_ACCESS_KEY: 'x',
        DORMANT_VAULT_SECRET_ACCESS_KEY_COMMAND: 'echo x',
      }),
    invalid(/not both/),
  );
  assert.throws(() => loadOk({ DORMANT_VAULT_ENDPOINT: 'http://h:1' }), invalid(/no vault\.url/));
  assert.throws(
    () => loadOk({ DORMANT_VAULT: 's3://b-1', DORMANT_VAULT_PART_SIZE: '1M' }),
    invalid(/5M to 5G/),
  );
  assert.throws(
    () => loadOk({ DORMANT_VAULT: 's3://b-1', DORMANT_VAULT_ENDPOINT: 'ftp://x' }),
    invalid(/http/),
  );
});
