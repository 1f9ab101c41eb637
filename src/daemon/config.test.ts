/**
 * The daemon's configuration without a daemon (no root): the file's keys and units, relative
 * paths, precedence (flags > environment > file > defaults), errors that name the file and key
 * (or the variable, or the flag), the printed view (a valid file, secrets redacted), and
 * docs/CONFIG.md naming every key, variable and flag.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, readFile, readdir, rm, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { DormantError } from '../domain/errors.js';
import { DEFAULT_POLICY } from '../domain/sandbox.js';
import {
  SETTINGS,
  configFileView,
  defaultConfig,
  flagAttribute,
  flagLayerRaw,
  loadConfig,
} from './config.js';
import { DEFAULTS, DEFAULT_LISTEN } from './defaults.js';
import { optionsFromConfig } from './daemon.js';

const ROOT = fileURLToPath(new URL('../../', import.meta.url));

describe('daemon configuration', () => {
  let dir: string;
  const file = async (name: string, value: unknown): Promise<string> => {
    const p = join(dir, name);
    await writeFile(p, typeof value === 'string' ? value : JSON.stringify(value));
    return p;
  };
  /** The INVALID_ARGUMENT message of what `fn` throws. */
  const refusal = (fn: () => unknown): string => {
    try {
      fn();
    } catch (e) {
      assert.ok(e instanceof DormantError, String(e));
      assert.equal(e.code, 'INVALID_ARGUMENT');
      return e.message;
    }
    assert.fail('accepted');
  };

  before(async () => {
    dir = await mkdtemp('/tmp/dormant-config-');
  });
  after(async () => {
    await rm(dir, { recursive: true, force: true });
  });

  test('an empty file gives the defaults', async () => {
    const { config, file: read } = loadConfig({ file: await file('empty.json', {}), env: {} });
    assert.equal(read, join(dir, 'empty.json'));
    assert.deepEqual(config, defaultConfig({ dataDir: DEFAULTS.dataDir }));
    assert.equal(config.listen, DEFAULT_LISTEN);
    assert.equal(config.listen, '127.0.0.1:7420');
    assert.equal(config.proxy.listen, '127.0.0.1:7421', "the proxy on the API's port + 1");
    assert.deepEqual(config.masterKey, { file: '/var/lib/dormant/master.key' });
    assert.deepEqual(config.policy.defaults, DEFAULT_POLICY);
    assert.equal(config.importLimits.maxEntries, 100_000);
  });

  test('the file: units, per-tenant policy, relative paths from its folder, the key command over the file', async () => {
    const p = await file('full.json', {
      listen: '0.0.0.0:9000',
      dataDir: 'state',
      masterKeyFile: '/keys/k',
      masterKeyCommand: 'vault read -field=key secret/dormant',
      debug: ['timings'],
      proxy: { domain: 'sandboxes.example.com', wakeTimeout: '45s', tcp: 'all' },
      policy: {
        interval: '1s',
        defaults: { pauseAfter: '5m' },
        tenants: { acme: { hibernateAfter: '2m', lifetime: '1d' } },
      },
      sandbox: {
        allowedSourceRoots: ['images', '/srv/rootfs'],
        diskQuota: '20G',
        seccompProfile: 'seccomp.json',
      },
      checkpoint: { keep: 3, timeout: '5m', templateCache: '256M' },
      restore: { lazy: false, pagesFromVaultAbove: 0, timeout: 90_000 },
      importLimits: { maxBytes: '8G', maxEntries: 5000 },
      api: { bodyLimit: '1M' },
      meter: { prices: { currency: 'EUR', nodeCostPerHour: 1.5, nodeMemory: '64G' } },
    });
    const { config: c } = loadConfig({ file: p, env: {} });
    assert.equal(c.listen, '0.0.0.0:9000');
    assert.equal(c.proxy.listen, '0.0.0.0:9001');
    assert.equal(c.dataDir, join(dir, 'state'));
    assert.deepEqual(c.masterKey, { command: 'vault read -field=key secret/dormant' });
    assert.equal(c.proxy.wakeTimeoutMs, 45_000);
    assert.equal(c.proxy.tcp, 'all');
    assert.equal(c.policy.intervalMs, 1000);
    assert.deepEqual(
      c.policy.defaults,
      { ...DEFAULT_POLICY, pauseAfterMs: 300_000 },
      'over the built-in ones',
    );
    assert.deepEqual(c.policy.tenants, { acme: { hibernateAfterMs: 120_000, lifetimeMs: 86_400_000 } });
    assert.deepEqual(c.sandbox.allowedSourceRoots, [join(dir, 'images'), '/srv/rootfs']);
    assert.equal(c.sandbox.seccompProfile, join(dir, 'seccomp.json'));
    assert.equal(c.sandbox.diskBytes, 20 * 1024 ** 3);
    assert.deepEqual(c.checkpoint, { keep: 3, timeoutMs: 300_000, templateCacheBytes: 256 * 1024 ** 2 });
    assert.deepEqual(c.restore, {
      lazy: false,
      pagesFromVault: true,
      pagesFromVaultAboveBytes: 0,
      timeoutMs: 90_000,
    });
    assert.deepEqual(c.importLimits, {
      maxBytes: 8 * 1024 ** 3,
      maxMemberBytes: DEFAULTS.importLimits.maxMemberBytes,
      maxEntries: 5000,
    });
    assert.equal(c.api.bodyLimitBytes, 1024 ** 2);
    assert.deepEqual(c.meter.prices, {
      currency: 'EUR',
      nodeCostPerHour: 1.5,
      nodeMemoryBytes: 64 * 1024 ** 3,
    });

    // Into the daemon's options, in one place.
    const o = optionsFromConfig(c);
    assert.deepEqual(o.masterKey, {
      command: '/bin/sh',
      args: ['-c', 'vault read -field=key secret/dormant'],
    });
    assert.ok(o.policy !== false && o.policy !== undefined);
    assert.deepEqual(o.policy.defaults, { node: c.policy.defaults, tenants: c.policy.tenants });
    assert.equal(o.restoreTimeoutMs, 90_000);
    assert.equal(o.keepCheckpoints, 3);
    assert.equal(typeof o.onTimings, 'function', 'debug: timings prints them');
    assert.deepEqual(o.importLimits, c.importLimits);
  });

  test('precedence: flags over the environment over the file over the defaults', async () => {
    const p = await file('layers.json', {
      listen: '127.0.0.1:1000',
      dataDir: '/file/data',
      proxy: { domain: 'file.example', wakeTimeout: '10s' },
      sandbox: { diskQuota: '1G' },
    });
    const env = {
      DORMANT_LISTEN: '127.0.0.1:2000',
      DORMANT_DATA_DIR: '/env/data',
      DORMANT_PROXY_WAKE_TIMEOUT: '20s',
      DORMANT_PROXY: 'off',
      DORMANT_ALLOWED_SOURCE_ROOTS: '/a:/b',
    };
    const flags = flagLayerRaw({ listen: '127.0.0.1:3000', keepCheckpoints: '4' }, (a) =>
      ['listen', 'keepCheckpoints'].includes(a),
    );
    const { config: c } = loadConfig({ file: p, env, flags });
    assert.equal(c.listen, '127.0.0.1:3000', 'flag');
    assert.equal(c.dataDir, '/env/data', 'environment over file');
    assert.equal(c.proxy.wakeTimeoutMs, 20_000, 'environment over file');
    assert.equal(c.proxy.enabled, false);
    assert.equal(c.proxy.domain, 'file.example', 'file over defaults');
    assert.equal(c.sandbox.diskBytes, 1024 ** 3);
    assert.deepEqual(c.sandbox.allowedSourceRoots, ['/a', '/b']);
    assert.equal(c.checkpoint.keep, 4);
    assert.equal(c.restore.timeoutMs, DEFAULTS.restore.timeoutMs, 'defaults');
    assert.deepEqual(c.masterKey, { file: '/env/data/master.key' }, 'next to the data directory in force');

    // DORMANT_CONFIG names the file when --config does not.
    assert.equal(loadConfig({ env: { DORMANT_CONFIG: p } }).config.dataDir, '/file/data');
  });

  test("flags: commander's values, only those given on the command line", () => {
    const values = {
      proxy: false,
      policy: true,
      lazyRestore: false,
      stageLazyPages: true,
      log: true,
      allowRoot: ['/srv/x'],
      disk: '2G',
      restoreTimeout: '3m',
      importMaxEntries: '10',
    };
    const given = new Set(Object.keys(values));
    given.delete('policy'); // commander's default for --no-policy, not the user's
    const raw = flagLayerRaw(values, (a) => given.has(a));
    assert.deepEqual(raw, {
      log: true,
      proxy: { enabled: false },
      sandbox: { allowedSourceRoots: ['/srv/x'], diskQuota: '2G' },
      restore: { lazy: false, pagesFromVault: false, timeout: '3m' },
      importLimits: { maxEntries: 10 },
    });
    assert.equal(flagAttribute('--no-lazy-restore'), 'lazyRestore');
    assert.equal(flagAttribute('--import-max-member-bytes <size>'), 'importMaxMemberBytes');
  });

  test('errors name the file and the key, every one of them', async () => {
    const p = await file('bad.json', {
      listen: 'localhost',
      proxy: { wakeTimeout: '30', bogus: true },
      policy: { tenants: { acme: { hibernateAfter: 'soon' } } },
      checkpoint: { keep: 0 },
      extra: 1,
    });
    const m = refusal(() => loadConfig({ file: p, env: {} }));
    assert.match(m, new RegExp(`${p}: listen: expected HOST:PORT`));
    assert.match(m, new RegExp(`${p}: proxy.wakeTimeout: invalid duration "30"`));
    assert.match(m, new RegExp(`${p}: proxy.bogus: unknown key`));
    assert.match(m, new RegExp(`${p}: policy.tenants.acme.hibernateAfter: invalid duration "soon"`));
    assert.match(m, new RegExp(`${p}: checkpoint.keep: `));
    assert.match(m, new RegExp(`${p}: extra: unknown key`));

    assert.match(
      refusal(() => loadConfig({ file: join(dir, 'nope.json'), env: {} })),
      /nope\.json: no such file/,
    );
    const notJson = await file('notjson.json', '{ listen: 1 ');
    assert.match(
      refusal(() => loadConfig({ file: notJson, env: {} })),
      /notjson\.json: not JSON/,
    );
  });

  test('errors name the variable or the flag', async () => {
    const p = await file('ok.json', {});
    const m = refusal(() =>
      loadConfig({ file: p, env: { DORMANT_DISK_QUOTA: 'lots', DORMANT_PROXY: 'maybe' } }),
    );
    assert.match(m, /DORMANT_DISK_QUOTA \(sandbox\.diskQuota\): invalid size "lots"/);
    assert.match(m, /DORMANT_PROXY \(proxy\.enabled\): expected true or false/);
    assert.match(
      refusal(() => loadConfig({ file: p, env: {}, flags: { restore: { timeout: 'forever' } } })),
      /--restore-timeout \(restore\.timeout\): invalid duration "forever"/,
    );
  });

  test('the printed configuration is a valid file that loads to the same, with the key command redacted', async () => {
    const p = await file('round.json', {
      dataDir: '/d',
      masterKeyFile: '/k',
      policy: { tenants: { acme: { pauseAfter: '90s' } } },
      restore: { pagesFromVaultAbove: 1000 },
      api: { execBodyLimit: '1536K' },
    });
    const { config } = loadConfig({ file: p, env: {} });
    const view = configFileView(config);
    const again = loadConfig({ file: await file('view.json', view), env: {} }).config;
    assert.deepEqual(again, config);

    const withCommand = loadConfig({ file: p, env: { DORMANT_MASTER_KEY_COMMAND: 'echo s3cret' } }).config;
    const printed = JSON.stringify(configFileView(withCommand));
    assert.ok(!printed.includes('s3cret'));
    assert.match(printed, /"masterKeyCommand":"<redacted>"/);
  });

  test('docs/CONFIG.md names every key, variable and flag', async () => {
    const doc = await readFile(join(ROOT, 'docs', 'CONFIG.md'), 'utf8');
    for (const s of SETTINGS) {
      assert.ok(doc.includes(`\`${s.key}\``), `key ${s.key}`);
      if (s.env) assert.ok(doc.includes(`\`${s.env}\``), `variable ${s.env}`);
      if (s.flag) assert.ok(doc.includes(`\`${s.flag.split(' ')[0]!}`), `flag ${s.flag}`);
    }
    for (const key of ['policy.defaults', 'policy.tenants', 'meter.prices'])
      assert.ok(doc.includes(`\`${key}`), key);
  });

  test('127.0.0.1:7420 is written once in src/ (tests aside)', async () => {
    const hits: string[] = [];
    const walk = async (d: string): Promise<void> => {
      for (const e of await readdir(d, { withFileTypes: true })) {
        const p = join(d, e.name);
        if (e.isDirectory()) await walk(p);
        else if (
          p.endsWith('.ts') &&
          !p.endsWith('.test.ts') &&
          (await readFile(p, 'utf8')).includes('127.0.0.1:7420')
        )
          hits.push(p.slice(ROOT.length));
      }
    };
    await walk(join(ROOT, 'src'));
    assert.deepEqual(hits, ['src/sdk/client.ts']);
  });
});
