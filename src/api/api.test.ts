/**
 * The HTTP API through the real daemon (loopback, SQLite, vault, runc, CRIU): every route,
 * validation errors, tokens and their revocation, two tenants that cannot see each other
 * (404, never 403), server-sent events of transitions, /metrics and the OpenAPI document.
 * Answers are checked against the response schemas the OpenAPI document is built from.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { join } from 'node:path';
import { z } from 'zod';
import type { Daemon } from '../daemon/daemon.js';
import { call, openEvents, type Answer } from './testing/http.js';
import { startTestDaemon, tearDown, testFolder } from './testing/daemon.js';
import {
  CheckpointSchema,
  documentedRoutes,
  ErrorSchema,
  ExecResultSchema,
  SandboxSchema,
  TokenSchema,
  TransitionSchema,
} from './openapi.js';

const errorOf = (r: Answer) => ErrorSchema.parse(r.body).error;
const sandboxOf = (r: Answer) => SandboxSchema.parse(r.body);
const NewToken = TokenSchema.extend({ token: z.string() });
const Sandboxes = z.object({ sandboxes: z.array(SandboxSchema) });
const Checkpoints = z.object({ checkpoints: z.array(CheckpointSchema) });
const Tokens = z.object({ tokens: z.array(TokenSchema) });
const Health = z.object({ ok: z.boolean() });
const Doc = z.object({ openapi: z.string(), paths: z.record(z.string(), z.record(z.string(), z.unknown())) });

describe('the HTTP API', () => {
  let dir: string;
  let rootfs: string;
  let daemon: Daemon;
  let admin: string;
  let alice: string;
  let bob: string;
  let aliceTokenId: string;
  let sbId: string;
  const api = (token: string | undefined, method: string, path: string, body?: unknown) =>
    call(daemon.url, token, method, path, body);

  before(async () => {
    ({ dir, rootfs } = await testFolder('api'));
    ({ daemon } = await startTestDaemon({
      dataDir: join(dir, 'data'),
      readonlyBinds: [],
      // The tenants here make sandboxes of a rootfs in this folder (serve --allow-root).
      allowedSourceRoots: [rootfs],
      policy: false,
    }));
    admin = daemon.adminToken;
  });

  after(() => tearDown(dir, daemon));

  test('health and the OpenAPI document need no token; the document lists every route', async () => {
    const h = await api(undefined, 'GET', '/v1/health');
    assert.equal(h.status, 200);
    assert.equal(Health.parse(h.body).ok, true);
    const doc = await api(undefined, 'GET', '/v1/openapi.json');
    assert.equal(doc.status, 200);
    const { openapi, paths } = Doc.parse(doc.body);
    assert.equal(openapi, '3.1.0');
    for (const p of [
      '/v1/sandboxes',
      '/v1/sandboxes/{id}',
      '/v1/sandboxes/{id}/hibernate',
      '/v1/sandboxes/{id}/exec',
      '/v1/events',
      '/v1/tokens',
      '/v1/tokens/{id}',
      '/metrics',
    ])
      assert.ok(paths[p], `documented: ${p}`);
    // Generated from the schema that validates: the create body's fields are there.
    const create = z
      .object({
        requestBody: z.object({
          content: z.object({
            'application/json': z.object({
              schema: z.object({ properties: z.record(z.string(), z.unknown()) }),
            }),
          }),
        }),
      })
      .parse(paths['/v1/sandboxes']!.post);
    assert.ok(create.requestBody.content['application/json'].schema.properties.memory);
    // Every route the server answers is documented (the dashboard's static files aside)...
    const undocumented = daemon.app.servedRoutes.filter(
      (r) => !documentedRoutes().includes(r) && !/^GET \/($|index\.html|dashboard\/)/.test(r),
    );
    assert.deepEqual(undocumented, [], 'routes missing from openapi.ts ROUTES');
    assert.ok(
      daemon.app.servedRoutes.length >= 25,
      `the route list is complete: ${daemon.app.servedRoutes.length}`,
    );
    // ...and every documented route exists on the server.
    for (const [p, methods] of Object.entries(paths))
      for (const m of Object.keys(methods))
        assert.ok(
          daemon.app.hasRoute({
            method: m.toUpperCase(),
            url: p.replace(/\{(\w+)\}/g, ':$1'),
          }),
          `${m} ${p} is served`,
        );
  });

  test('requests without a valid token are 401 with a hint', async () => {
    for (const [token, msg] of [
      [undefined, /no API token/],
      ['dmt_nope', /unknown API token/],
    ] as const) {
      const r = await api(token, 'GET', '/v1/sandboxes');
      assert.equal(r.status, 401);
      assert.equal(errorOf(r).code, 'UNAUTHORIZED');
      assert.match(errorOf(r).message, msg);
      assert.ok(errorOf(r).hint);
    }
    const malformed = await fetch(`${daemon.url}/v1/sandboxes`, { headers: { authorization: 'Basic x' } });
    assert.equal(malformed.status, 401);
  });

  test('tokens: an admin mints them per tenant; stored hashed; others may not', async () => {
    const a = await api(admin, 'POST', '/v1/tokens', { tenant: 'alice' });
    assert.equal(a.status, 201);
    const minted = NewToken.parse(a.body);
    assert.match(minted.token, /^dmt_/);
    assert.equal(minted.tenant, 'alice');
    assert.equal(minted.admin, false);
    alice = minted.token;
    aliceTokenId = minted.id;
    bob = NewToken.parse((await api(admin, 'POST', '/v1/tokens', { tenant: 'bob' })).body).token;

    const list = await api(admin, 'GET', '/v1/tokens');
    assert.equal(list.status, 200);
    assert.deepEqual(
      Tokens.parse(list.body).tokens.map((t) => t.tenant),
      ['default', 'alice', 'bob'],
    );
    assert.ok(!list.text.includes(alice), 'the token itself is never shown again');
    assert.ok(
      !(await daemon.store.listTokens()).some((t) => t.hash === alice || t.hash.includes(alice.slice(4))),
      'only a hash is stored',
    );

    const forbidden = await api(alice, 'POST', '/v1/tokens', { tenant: 'alice' });
    assert.equal(forbidden.status, 403);
    assert.equal(errorOf(forbidden).code, 'FORBIDDEN');
    assert.equal((await api(alice, 'GET', '/v1/tokens')).status, 403);

    const bad = await api(admin, 'POST', '/v1/tokens', { tenant: 'Not A Tenant' });
    assert.equal(bad.status, 400);
    assert.equal(errorOf(bad).code, 'INVALID_ARGUMENT');
    assert.match(errorOf(bad).message, /tenant/);
  });

  test('validation errors are 400 INVALID_ARGUMENT naming the field', async () => {
    const cases: [string, string, unknown, RegExp][] = [
      ['POST', '/v1/sandboxes', { rootfs, command: ['true'], memory: 'lots' }, /memory/],
      ['POST', '/v1/sandboxes', { rootfs, command: ['true'], colour: 'blue' }, /colour|unrecognized/i],
      ['POST', '/v1/sandboxes', { rootfs, command: 'true' }, /command/],
      ['POST', '/v1/sandboxes', { rootfs, command: ['true'], ports: [70000] }, /ports/],
      ['POST', '/v1/sandboxes', '{not json', /json/i],
      ['GET', '/v1/events?since=minus-one', undefined, /since/],
      ['DELETE', '/v1/tokens/xyz', undefined, /id/],
      ['GET', '/v1/cost?by=nope', undefined, /by/],
    ];
    for (const [method, path, body, re] of cases) {
      const r = await api(admin, method, path, body);
      assert.equal(r.status, 400, `${method} ${path} ${JSON.stringify(body)}: ${r.text}`);
      assert.equal(errorOf(r).code, 'INVALID_ARGUMENT');
      assert.match(errorOf(r).message, re);
    }
    const unknownRoute = await api(admin, 'GET', '/v1/nothing-here');
    assert.equal(unknownRoute.status, 404);
    assert.equal(errorOf(unknownRoute).code, 'NOT_FOUND');
  });

  test('a sandbox: every route, and events of each transition to its own tenant only', async () => {
    const aliceEvents = await openEvents(daemon.url, alice);
    const bobEvents = await openEvents(daemon.url, bob);
    const adminEvents = await openEvents(daemon.url, admin);
    try {
      assert.equal(aliceEvents.status, 200);
      const c = await api(alice, 'POST', '/v1/sandboxes', {
        name: 'api-test',
        rootfs,
        command: ['sh', '-c', 'echo started; while true; do sleep 1; done'],
        memory: '64M',
        idle: '1h',
      });
      assert.equal(c.status, 201, c.text);
      const created = sandboxOf(c);
      sbId = created.id;
      assert.equal(created.tenant, 'alice');
      assert.equal(created.state, 'running');

      const list = await api(alice, 'GET', '/v1/sandboxes');
      assert.deepEqual(
        Sandboxes.parse(list.body).sandboxes.map((s) => s.id),
        [sbId],
      );
      sandboxOf(await api(alice, 'GET', `/v1/sandboxes/${sbId}`));
      assert.equal(sandboxOf(await api(alice, 'GET', '/v1/sandboxes/api-test')).id, sbId, 'by name too');

      const ex = await api(alice, 'POST', `/v1/sandboxes/${sbId}/exec`, {
        command: ['sh', '-c', 'echo hi; exit 4'],
      });
      assert.equal(ex.status, 200);
      const out = ExecResultSchema.parse(ex.body);
      assert.deepEqual([out.stdout, out.exitCode], ['hi\n', 4]);
      const emptyExec = await api(alice, 'POST', `/v1/sandboxes/${sbId}/exec`, { command: [] });
      assert.equal(emptyExec.status, 400);
      const badResume = await api(alice, 'POST', `/v1/sandboxes/${sbId}/resume`, { from: 5 });
      assert.equal(badResume.status, 400);
      assert.match(errorOf(badResume).message, /from/);

      const ka = await api(alice, 'POST', `/v1/sandboxes/${sbId}/keepalive`, { for: '10m' });
      assert.equal(ka.status, 200);
      assert.ok(Date.parse(sandboxOf(ka).lastActiveAt) > Date.now() + 9 * 60_000);

      assert.equal(sandboxOf(await api(alice, 'POST', `/v1/sandboxes/${sbId}/pause`)).state, 'paused');
      const h = await api(alice, 'POST', `/v1/sandboxes/${sbId}/hibernate`);
      assert.equal(h.status, 200, h.text);
      assert.equal(sandboxOf(h).state, 'hibernated');
      assert.equal(sandboxOf(h).memoryBytes, 0);
      assert.equal(sandboxOf(await api(alice, 'POST', `/v1/sandboxes/${sbId}/resume`)).state, 'running');

      const cks = await api(alice, 'GET', `/v1/checkpoints?sandbox=${sbId}`);
      assert.equal(cks.status, 200);
      const [ck, ...more] = Checkpoints.parse(cks.body).checkpoints;
      assert.ok(ck);
      assert.equal(more.length, 0);
      assert.equal(
        CheckpointSchema.parse((await api(alice, 'GET', `/v1/checkpoints/${ck.id}`)).body).id,
        ck.id,
      );

      const f = await api(alice, 'POST', `/v1/sandboxes/${sbId}/fork`, { name: 'api-fork' });
      assert.equal(f.status, 201, f.text);
      const fork = sandboxOf(f);
      assert.equal(fork.tenant, 'alice');
      assert.equal(sandboxOf(await api(alice, 'POST', `/v1/sandboxes/${fork.id}/archive`)).state, 'archived');
      assert.equal((await api(alice, 'DELETE', `/v1/sandboxes/${fork.id}`)).status, 204);

      const logs = await api(alice, 'GET', `/v1/sandboxes/${sbId}/logs`);
      assert.equal(logs.status, 200);
      assert.match(logs.text, /started/);

      await aliceEvents.waitFor((es) => es.some((e) => e.data.includes('"to":"archived"')));
      const mine = aliceEvents.events
        .map((e) => ({ id: e.id, event: e.event, t: TransitionSchema.parse(JSON.parse(e.data)) }))
        .filter((e) => e.t.sandboxId === sbId);
      for (const e of mine) {
        assert.equal(e.event, 'transition');
        assert.equal(e.id, String(e.t.id), 'the SSE id is the transition id (Last-Event-ID resumes there)');
      }
      assert.deepEqual(
        mine.map((e) => `${e.t.from ?? ''}>${e.t.to}`),
        [
          '>creating',
          'creating>running',
          'running>paused',
          'paused>hibernating',
          'hibernating>hibernated',
          'hibernated>resuming',
          'resuming>running',
        ],
      );
      assert.ok(mine.every((e) => e.t.reason !== '' && Date.parse(e.t.at) > 0));
      await adminEvents.waitFor((es) => es.some((e) => e.data.includes('"to":"archived"')));
      assert.equal(bobEvents.events.length, 0, "bob sees none of alice's transitions");

      // Last-Event-ID replays what came after it.
      const replay = await openEvents(daemon.url, alice, `?since=${mine[4]!.t.id}`);
      try {
        await replay.waitFor((es) => es.some((e) => e.data.includes('"to":"running"')));
        assert.equal(
          TransitionSchema.parse(JSON.parse(replay.events[0]!.data)).id,
          mine[5]!.t.id,
          'starts right after the given id',
        );
      } finally {
        replay.close();
      }
    } finally {
      aliceEvents.close();
      bobEvents.close();
      adminEvents.close();
    }
  });

  test("another tenant's sandboxes and checkpoints answer 404, exactly like missing ones", async () => {
    const ck = Checkpoints.parse((await api(alice, 'GET', '/v1/checkpoints')).body).checkpoints[0]!.id;
    assert.deepEqual(Sandboxes.parse((await api(bob, 'GET', '/v1/sandboxes')).body).sandboxes, []);
    assert.deepEqual(Checkpoints.parse((await api(bob, 'GET', '/v1/checkpoints')).body).checkpoints, []);
    const cost = z
      .object({ sandboxes: z.array(z.object({ sandboxId: z.string() })) })
      .parse((await api(bob, 'GET', '/v1/cost?by=sandbox')).body);
    assert.deepEqual(cost.sandboxes, [], "alice's sandboxes are not in bob's costs");
    const probes: [string, string, unknown, string][] = [
      ['GET', `/v1/sandboxes/${sbId}`, undefined, 'SANDBOX_NOT_FOUND'],
      ['GET', '/v1/sandboxes/api-test', undefined, 'SANDBOX_NOT_FOUND'],
      ['POST', `/v1/sandboxes/${sbId}/hibernate`, undefined, 'SANDBOX_NOT_FOUND'],
      ['POST', `/v1/sandboxes/${sbId}/exec`, { command: ['true'] }, 'SANDBOX_NOT_FOUND'],
      ['POST', `/v1/sandboxes/${sbId}/fork`, {}, 'SANDBOX_NOT_FOUND'],
      ['GET', `/v1/sandboxes/${sbId}/logs`, undefined, 'SANDBOX_NOT_FOUND'],
      ['GET', `/v1/checkpoints?sandbox=${sbId}`, undefined, 'SANDBOX_NOT_FOUND'],
      ['GET', `/v1/checkpoints/${ck}`, undefined, 'CHECKPOINT_NOT_FOUND'],
      ['GET', `/v1/checkpoints/${ck}/inspect`, undefined, 'CHECKPOINT_NOT_FOUND'],
    ];
    for (const [method, path, body, code] of probes) {
      const theirs = await api(bob, method, path, body);
      assert.equal(theirs.status, 404, `${method} ${path}: ${theirs.text}`);
      assert.equal(errorOf(theirs).code, code);
      const missing = await api(
        bob,
        method,
        path.replace(sbId, 'sb-0000000000000000').replace(ck, 'ck-0000'),
        body,
      );
      assert.equal(missing.status, 404);
      assert.equal(errorOf(missing).code, code, 'the same answer as for an id that does not exist');
    }
    // A delete is idempotent: another tenant's sandbox answers 204 like a missing one, untouched.
    assert.equal((await api(bob, 'DELETE', `/v1/sandboxes/${sbId}`)).status, 204);
    assert.equal((await api(bob, 'DELETE', '/v1/sandboxes/sb-0000000000000000')).status, 204);
    assert.equal(sandboxOf(await api(alice, 'GET', `/v1/sandboxes/${sbId}`)).state, 'running', 'untouched');
    assert.equal(
      (await api(admin, 'GET', `/v1/sandboxes/${sbId}`)).status,
      200,
      'an admin sees every tenant',
    );
  });

  test('illegal transitions are 409 ILLEGAL_TRANSITION with a hint', async () => {
    // exec wakes a paused sandbox now (the toolbox does); resuming a running one from a
    // checkpoint is the illegal transition here.
    await api(alice, 'POST', `/v1/sandboxes/${sbId}/pause`);
    assert.equal((await api(alice, 'POST', `/v1/sandboxes/${sbId}/exec`, { command: ['true'] })).status, 200);
    const cks = await api(alice, 'GET', `/v1/checkpoints?sandbox=${sbId}`);
    const ck = (cks.body as { checkpoints: { id: string }[] }).checkpoints[0]!.id;
    const r = await api(alice, 'POST', `/v1/sandboxes/${sbId}/resume`, { from: ck });
    assert.equal(r.status, 409);
    assert.equal(errorOf(r).code, 'ILLEGAL_TRANSITION');
    assert.ok(errorOf(r).hint);
  });

  test('/metrics: Prometheus text for an admin, 403 for a tenant', async () => {
    assert.equal((await api(alice, 'GET', '/metrics')).status, 403);
    const m = await api(admin, 'GET', '/metrics');
    assert.equal(m.status, 200);
    assert.match(m.type, /text\/plain/);
    assert.match(m.text, /^dormant_sandboxes\{state="running"\} 1$/m);
    assert.match(m.text, /^dormant_sandboxes\{state="hibernated"\} 0$/m);
    assert.match(m.text, /^dormant_transitions_total\{from="hibernating",to="hibernated"\} 1$/m);
    assert.match(m.text, /^dormant_hibernate_duration_seconds_count 1$/m);
    assert.match(m.text, /^dormant_resume_duration_seconds_count 1$/m);
    assert.match(m.text, /^dormant_sandbox_memory_bytes [1-9]\d*$/m);
    assert.match(
      m.text,
      /^dormant_http_requests_total\{method="POST",route="\/v1\/sandboxes\/:id\/hibernate",status="200"\} 1$/m,
    );
  });

  test('the dashboard is served at / without a token, with a strict content policy', async () => {
    const r = await fetch(`${daemon.url}/`);
    assert.equal(r.status, 200);
    assert.match(r.headers.get('content-type') ?? '', /text\/html/);
    assert.match(r.headers.get('content-security-policy') ?? '', /default-src 'self'/);
    assert.match(await r.text(), /dormant/);
    assert.equal((await fetch(`${daemon.url}/dashboard/app.js`)).status, 200);
    assert.equal((await fetch(`${daemon.url}/dashboard/..%2fstate.db`)).status, 404);
  });

  test('a revoked token is refused at once; the last admin token cannot be revoked', async () => {
    const r = await api(admin, 'DELETE', `/v1/tokens/${aliceTokenId}`);
    assert.equal(r.status, 200);
    assert.ok(TokenSchema.parse(r.body).revokedAt);
    const refused = await api(alice, 'GET', '/v1/sandboxes');
    assert.equal(refused.status, 401);
    assert.match(errorOf(refused).message, /revoked/);
    assert.equal((await api(admin, 'DELETE', `/v1/tokens/${aliceTokenId}`)).status, 200, 'idempotent');
    const missing = await api(admin, 'DELETE', '/v1/tokens/00000000');
    assert.equal(missing.status, 404);
    assert.equal(errorOf(missing).code, 'TOKEN_NOT_FOUND');
    const adminId = Tokens.parse((await api(admin, 'GET', '/v1/tokens')).body).tokens.find(
      (t) => t.admin,
    )!.id;
    const last = await api(admin, 'DELETE', `/v1/tokens/${adminId}`);
    assert.equal(last.status, 409);
    assert.equal(errorOf(last).code, 'LAST_ADMIN_TOKEN');
  });
});
