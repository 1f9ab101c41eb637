/** Registry references, the plain-HTTP rule and the reading of skopeo's failures (no registry needed). */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { isDormantError } from '../domain/errors.js';
import {
  formatRegistryRef,
  isRegistryRef,
  ociArch,
  parseRegistryRef,
  plainHttpAllowed,
  registryError,
} from './registry.js';

const D = `sha256:${'ab'.repeat(32)}`;

test('references: host, name, tag or digest; latest when neither', () => {
  assert.deepEqual(parseRegistryRef('registry.example.com/team/agent:1.4'), {
    host: 'registry.example.com',
    repository: 'team/agent',
    tag: '1.4',
  });
  assert.deepEqual(parseRegistryRef('127.0.0.1:5000/busybox'), {
    host: '127.0.0.1:5000',
    repository: 'busybox',
    tag: 'latest',
  });
  assert.deepEqual(parseRegistryRef(`localhost/a/b@${D}`), {
    host: 'localhost',
    repository: 'a/b',
    digest: D,
  });
  assert.deepEqual(parseRegistryRef(`[::1]:5000/x:y@${D}`), {
    host: '[::1]:5000',
    repository: 'x',
    tag: 'y',
    digest: D,
  });
  for (const t of ['registry.example.com/team/agent:1.4', `localhost/a/b@${D}`])
    assert.equal(formatRegistryRef(parseRegistryRef(t)), t);
  assert.equal(isRegistryRef('/srv/images/agent:1'), false);
  assert.equal(isRegistryRef('docker.io/library/busybox'), true);
});

test('malformed references are IMAGE_REF_INVALID, naming what is wrong', () => {
  const cases: [string, RegExp][] = [
    ['busybox', /no registry host/],
    ['busybox:latest', /no registry host/],
    ['library/busybox', /not a registry host/],
    ['registry.example.com/', /lowercase/],
    ['registry.example.com/Team/agent', /lowercase/],
    ['registry.example.com/team//agent', /lowercase/],
    ['registry.example.com/team/agent:', /not a tag/],
    ['registry.example.com/team/agent:-x', /not a tag/],
    ['registry.example.com/team/agent@sha256:12', /digest/],
    ['registry.example.com/team/agent@md5:00', /digest/],
    ['bad_host.example.com/a', /not a registry host/],
    [`registry.example.com/${'a'.repeat(1100)}`, /longer than/],
  ];
  for (const [text, why] of cases) {
    assert.throws(
      () => parseRegistryRef(text),
      (e: unknown) => isDormantError(e) && e.code === 'IMAGE_REF_INVALID' && why.test(e.message),
      text,
    );
  }
});

test('plain HTTP: loopback registries and the listed ones only', () => {
  for (const h of ['127.0.0.1:5000', '127.1.2.3', 'localhost:5000', '[::1]:5000'])
    assert.equal(plainHttpAllowed(h, []), true, h);
  for (const h of ['registry.example.com', '10.0.0.5:5000', '128.0.0.1', 'localhost.example.com'])
    assert.equal(plainHttpAllowed(h, []), false, h);
  assert.equal(plainHttpAllowed('registry.lan:5000', ['registry.lan:5000']), true);
  assert.equal(
    plainHttpAllowed('registry.lan:5000', ['registry.lan']),
    true,
    'a host without port: any port',
  );
  assert.equal(plainHttpAllowed('registry.lan:5000', ['registry.lan:6000']), false);
  assert.equal(ociArch('x64'), 'amd64');
  assert.equal(ociArch('arm64'), 'arm64');
});

test("skopeo's failures map to the registry codes", () => {
  const fatal = (m: string) => `time="x" level=fatal msg="${m}"`;
  const cases: [string, string][] = [
    [fatal('reading manifest v9 in h/x: manifest unknown: manifest unknown'), 'IMAGE_NOT_FOUND'],
    [fatal('reading manifest v1 in h/x: unauthorized: authentication required'), 'REGISTRY_UNAUTHORIZED'],
    [fatal('authenticating creds for "h": invalid username/password'), 'REGISTRY_UNAUTHORIZED'],
    [
      fatal('writing blob: happened during read: Digest did not match, expected sha256:a, got sha256:b'),
      'IMAGE_DIGEST_MISMATCH',
    ],
    [
      fatal('pinging container registry h: Get "http://h/v2/": dial tcp h: connect: connection refused'),
      'REGISTRY_UNAVAILABLE',
    ],
    [
      fatal(
        'pinging container registry h: Get "https://h/v2/": http: server gave HTTP response to HTTPS client',
      ),
      'REGISTRY_UNAVAILABLE',
    ],
  ];
  for (const [out, code] of cases) assert.equal(registryError('h/x:v1', out).code, code, out);
  const insecure = registryError('h/x:v1', cases[5]![0]);
  assert.match(insecure.hint ?? '', /images\.insecureRegistries/);
});
