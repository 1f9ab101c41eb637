/** Where the database of record lives: SQLite under the data folder, or PostgreSQL by URL, its password never printed. */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { DormantError } from '../domain/errors.js';
import { configFileView, loadConfig } from './config.js';

function loadOk(env: Record<string, string>, flags: Record<string, unknown> = {}) {
  return loadConfig({ env: { ...env, DORMANT_CONFIG: '' }, flags }).config;
}

test('no state.url: SQLite in the data folder, as before', () => {
  assert.equal(loadOk({}).state, undefined);
});

test('PostgreSQL from the variable or --state (the flag wins), the password redacted when printed', () => {
  const c = loadOk({ DORMANT_STATE: 'postgres://dormant:s3cret-pw@10.0.0.5:5432/dormant' });
  assert.deepEqual(c.state, { url: 'postgres://dormant:s3cret-pw@10.0.0.5:5432/dormant' });
  const printed = JSON.stringify(configFileView(c));
  assert.ok(!printed.includes('s3cret-pw'), printed);
  assert.match(printed, /postgres:\/\/dormant@10\.0\.0\.5:5432\/dormant/);
  const f = loadOk({ DORMANT_STATE: 'postgres://a@h/x' }, { state: { url: 'postgresql://b@h2/y' } });
  assert.equal(f.state?.url, 'postgresql://b@h2/y');
});

test('a state URL that is not PostgreSQL is refused with the expected form', () => {
  assert.throws(
    () => loadOk({ DORMANT_STATE: 'mysql://h/db' }),
    (e: unknown) =>
      e instanceof DormantError &&
      e.code === 'INVALID_ARGUMENT' &&
      /DORMANT_STATE/.test(e.message) &&
      /postgres:\/\/USER/.test(e.message),
  );
});
