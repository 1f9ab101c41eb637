/**
 * The HTTP API under /v1. Every route authenticates, validates its input with the schemas in
 * schemas.ts, and answers errors as `{ error: { code, message, hint } }` with a stable code.
 * Another tenant's sandbox answers 404, exactly like one that does not exist.
 */
import { installForwarding, registerFleetRoutes, type FleetHooks } from './fleet.js';
import { egressText } from '../domain/egress.js';
import { DEFAULT_GPU_POLICY } from '../domain/gpu.js';
import Fastify, {
  LogController,
  type FastifyBaseLogger,
  type FastifyInstance,
  type FastifyReply,
  type FastifyRequest,
} from 'fastify';
import { createReadStream } from 'node:fs';
import { stat } from 'node:fs/promises';
import { randomBytes } from 'node:crypto';
import { logContext, type Logger } from '../sys/log.js';
import { Readable } from 'node:stream';
import { DormantError, ErrorCode, asError, errorInfo, isDormantError } from '../domain/errors.js';
import { patchLabels, type Sandbox, type Transition } from '../domain/sandbox.js';
import type { SandboxController } from '../control/sandboxes.js';
import type { CheckpointRecord, StateStore } from '../state/store.js';
import { authenticate, type Principal } from './auth.js';
import { registerCheckpointRoutes } from './routes-checkpoints.js';
import { registerToolboxRoutes } from './routes-toolbox.js';
import { registerTemplateRoutes } from './routes-templates.js';
import type { VaultReader } from '../checkpoint/source.js';
import {
  CheckpointsQuery,
  CreateSandboxBody,
  EventsQuery,
  ExecBody,
  ExportQuery,
  ImportBody,
  ImportUploadQuery,
  ForkBody,
  IdParams,
  KeepaliveBody,
  ListSandboxesQuery,
  LogsQuery,
  MetricsQuery,
  ResumeBody,
  UpdateSandboxBody,
  type CheckpointView,
  type ExecResultView,
  type SandboxListView,
  type SandboxView,
  type TransitionView,
} from './schemas.js';
import { decodeCursor, encodeCursor, parseLabelFilter } from './listing.js';
import { metricPoints, MAX_METRIC_POINTS } from '../control/meter.js';
import { parse, sourceAndLimits } from './validate.js';
import { registerTokenRoutes } from './routes-tokens.js';
import { registerMetrics } from './metrics.js';
import { registerOpenApi } from './openapi.js';
import { isDashboardPath, registerDashboard } from './dashboard.js';

export interface ServerOptions {
  controller: SandboxController;
  store: StateStore;
  /** The vault, for GET /v1/checkpoints/{id}/inspect and /scan. */
  checkpointVault?: VaultReader;
  /** A line for each request in the log. Default false. */
  logger?: boolean;
  /** The daemon's log (src/sys/log.ts); Fastify's own lines go there too. Default: none. */
  log?: Logger;
  version?: string;
  /**
   * The daemon's own folders (data, staging): scrubbed from every error a tenant sees, a last
   * guard behind the messages that are written without host paths in the first place.
   */
  hostPaths?: readonly string[];
  /** Largest archive a client may upload to /v1/checkpoints/import. Default 16 GiB. */
  maxUploadBytes?: number;
  /** Largest JSON body of every route but exec. Default 4 MiB. */
  bodyLimitBytes?: number;
  /** Largest body of an exec (its stdin rides in it). Default 32 MiB. */
  execBodyLimitBytes?: number;
  /** This node in a fleet: requests for other nodes' sandboxes are forwarded (api/fleet.ts). */
  fleet?: FleetHooks;
}

/** Uploads bigger than this are refused unless the daemon says otherwise. */
export const DEFAULT_MAX_UPLOAD_BYTES = 16 * 1024 ** 3;
// A body is parsed whole, and a 31 MiB body of tiny arrays cost ~0.5 GiB of parse memory and
// 10 s of CPU: 4 MiB of JSON for every route but exec (whose stdin may be 16 MiB).
export const DEFAULT_BODY_LIMIT_BYTES = 4 * 1024 * 1024;
export const DEFAULT_EXEC_BODY_LIMIT_BYTES = 32 * 1024 * 1024;

/** `text` with each of `paths` (and anything below it) replaced by `<host>`. */
export function scrubHostPaths(text: string, paths: readonly string[]): string {
  let out = text;
  for (const p of [...paths].sort((a, b) => b.length - a.length)) {
    if (p.length < 2) continue;
    out = out.split(p).join('<host>');
  }
  return out.replace(/<host>[^\s'",;:)]*/g, '<host>');
}

const iso = (ms: number): string => new Date(ms).toISOString();

const isReadable = (b: unknown): b is Readable => b instanceof Readable;

/** The sandbox as the API shows it (SandboxSchema in schemas.ts). */
export function sandboxView(s: Sandbox): SandboxView {
  return {
    id: s.id,
    name: s.name,
    tenant: s.tenant,
    state: s.state,
    ports: s.spec.ports,
    address: s.address ?? null,
    memoryBytes: s.memoryBytes,
    memoryLimitBytes: s.spec.memoryBytes,
    diskLimitBytes: s.spec.diskBytes ?? null,
    cpus: s.spec.cpus,
    command: s.spec.command,
    source: s.spec.source,
    createdAt: iso(s.createdAt),
    stateSince: iso(s.stateSince),
    lastActiveAt: iso(s.lastActiveAt),
    checkpointId: s.checkpointId ?? null,
    lastError: s.lastError ?? null,
    policy: s.spec.policy,
    gpus: s.gpus ?? null,
    gpuPolicy: s.gpuPolicy ?? DEFAULT_GPU_POLICY,
    labels: s.spec.labels ?? {},
    egress: s.spec.egress !== undefined ? egressText(s.spec.egress) : null,
    runtime: s.spec.runtime ?? 'runc',
    node: s.node ?? null,
  };
}

export function checkpointView(c: CheckpointRecord): CheckpointView {
  return {
    id: c.id,
    sandboxId: c.sandboxId,
    tenant: c.tenant,
    kind: c.kind,
    createdAt: iso(c.createdAt),
    logicalBytes: c.logicalBytes,
    storedBytes: c.storedBytes,
    meta: c.meta,
  };
}

export function transitionView(t: Transition): TransitionView {
  return {
    id: t.id,
    sandboxId: t.sandboxId,
    tenant: t.tenant,
    from: t.from,
    to: t.to,
    at: iso(t.at),
    reason: t.reason,
  };
}

declare module 'fastify' {
  interface FastifyRequest {
    principal: Principal;
  }
}

export function buildServer(opts: ServerOptions): FastifyInstance {
  const { controller, store } = opts;
  // maxParamLength past any valid id, so an overlong one reaches IdParams and gets our 400
  // instead of the router's own 414 body.
  // Typed as Fastify's base logger, so the app's type is the one every route module takes.
  const loggerInstance: FastifyBaseLogger | undefined = opts.log;
  const app = Fastify({
    ...(loggerInstance ? { loggerInstance } : { logger: false }),
    logController: new LogController({ disableRequestLogging: !(opts.logger ?? false) }),
    // Ids of our own (a client's header is not trusted into the log): short, and unique enough
    // to find one request's lines among a day's.
    genReqId: () => randomBytes(6).toString('hex'),
    bodyLimit: opts.bodyLimitBytes ?? DEFAULT_BODY_LIMIT_BYTES,
    routerOptions: { maxParamLength: 16_384 },
  });
  const execBodyLimit = opts.execBodyLimitBytes ?? DEFAULT_EXEC_BODY_LIMIT_BYTES;
  app.decorateRequest('principal', { getter: () => ({ tenant: '', admin: false }) });

  const hostPaths = opts.hostPaths ?? [];
  app.setErrorHandler((err: unknown, req, reply) => {
    // A tenant never sees the daemon's folders or command lines; an admin sees everything.
    const tenant = !req.principal.admin;
    if (err instanceof DormantError) {
      const body = err.toJSON();
      if (tenant) {
        body.message = scrubHostPaths(body.message, hostPaths);
        if (body.hint !== undefined) body.hint = scrubHostPaths(body.hint, hostPaths);
      }
      // The status is the code's, from the table: no throw site picks one.
      void reply.status(errorInfo(err.code).status).send({ error: body });
      return;
    }
    const e = asError(err) as Error & { statusCode?: number; code?: string };
    if (typeof e.statusCode === 'number' && e.statusCode >= 400 && e.statusCode < 500) {
      // fastify's own: malformed JSON, body too large, unsupported media type.
      const code = fastifyCode(e.statusCode);
      void reply
        .status(errorInfo(code).status)
        .send({ error: { code, message: e.message, hint: errorInfo(code).hint } });
      return;
    }
    app.log.error(err);
    void reply.status(errorInfo(ErrorCode.INTERNAL).status).send({
      error: {
        code: ErrorCode.INTERNAL,
        // Internal errors carry whatever the system said (paths, commands): admins only.
        message: tenant ? `internal error (request ${req.id})` : e.message,
        hint: errorInfo(ErrorCode.INTERNAL).hint,
      },
    });
  });
  app.setNotFoundHandler((req, reply) => {
    const err = new DormantError(
      ErrorCode.NOT_FOUND,
      `no route ${req.method} ${req.url.split('?')[0] ?? ''}`,
    );
    void reply.status(err.status).send({ error: err.toJSON() });
  });

  // First of all hooks: the rest of the request, down to the runtime, runs with its id in
  // the log's context, and the client gets the id to quote.
  app.addHook('onRequest', (req, reply, done) => {
    void reply.header('x-request-id', req.id);
    logContext.run({ reqId: req.id }, done);
  });

  const unauthenticated = new Set(['/v1/health', '/v1/openapi.json']);
  app.addHook('onRequest', async (req) => {
    const path = req.url.split('?')[0] ?? '';
    if (unauthenticated.has(path) || isDashboardPath(path)) return;
    const p = authenticate(req.headers.authorization, await store.listTokens());
    Object.defineProperty(req, 'principal', { value: p });
  });

  /** The tenant filter for a request: undefined lets an admin see every tenant. */
  const scope = (req: FastifyRequest): string | undefined =>
    req.principal.admin ? undefined : req.principal.tenant;

  /** The sandbox id of a route's :id, which may also be the sandbox's name. 404 if not visible. */
  const sandboxId = async (req: FastifyRequest): Promise<string> =>
    (await controller.get(parse(IdParams, req.params, 'path').id, scope(req))).id;

  if (opts.fleet) installForwarding(app, { fleet: opts.fleet, controller, scope });
  registerFleetRoutes(app, opts.fleet);

  app.get('/v1/health', async () => ({ ok: true, version: opts.version ?? '0.1.0' }));
  registerMetrics(app, { store, controller });
  registerOpenApi(app, opts.version ?? '0.1.0');
  registerTokenRoutes(app, { store });
  registerDashboard(app);

  const view = async (s: Sandbox) => sandboxView(await controller.withUsage(s));

  app.get('/v1/sandboxes', async (req) => {
    const q = parse(ListSandboxesQuery, req.query, 'query');
    const own = scope(req);
    const labels = (q.label ?? []).map(parseLabelFilter);
    // A tenant's own scope always applies: its ?tenant= can narrow it (to nothing), never widen it.
    const tenant = own ?? q.tenant;
    const found =
      own !== undefined && q.tenant !== undefined && q.tenant !== own
        ? []
        : await store.querySandboxes({
            ...(tenant !== undefined ? { tenant } : {}),
            ...(q.state !== undefined ? { states: q.state } : {}),
            ...(q.name !== undefined ? { name: q.name } : {}),
            labels,
            ...(q.cursor !== undefined ? { after: decodeCursor(q.cursor) } : {}),
            // One more than a page: whether it is there says whether a next page is.
            limit: q.limit + 1,
          });
    const page = found.slice(0, q.limit);
    const out: SandboxListView = { sandboxes: await Promise.all(page.map(view)) };
    const last = page.at(-1);
    if (found.length > q.limit && last) out.nextCursor = encodeCursor(last);
    return out;
  });

  app.post('/v1/sandboxes', async (req, reply) => {
    const b = parse(CreateSandboxBody, req.body, 'request body');
    const s = await controller.create({
      tenant: req.principal.tenant,
      admin: req.principal.admin,
      command: b.command,
      ...(b.name !== undefined ? { name: b.name } : {}),
      ...sourceAndLimits(b),
      ...(b.onResume !== undefined ? { onResume: b.onResume } : {}),
      ...(b.gpus !== undefined ? { gpus: b.gpus } : {}),
      ...(b.gpuPolicy !== undefined ? { gpuPolicy: b.gpuPolicy } : {}),
      ...(b.labels !== undefined ? { labels: b.labels } : {}),
      ...(b.template !== undefined ? { template: b.template } : {}),
      ...(b.egress !== undefined ? { egress: b.egress } : {}),
      ...(b.runtime !== undefined ? { runtime: b.runtime } : {}),
      policy: {
        ...(b.idle !== undefined ? { hibernateAfterMs: b.idle } : {}),
        ...(b.pauseAfter !== undefined ? { pauseAfterMs: b.pauseAfter } : {}),
        ...(b.archiveAfter !== undefined ? { archiveAfterMs: b.archiveAfter } : {}),
        ...(b.lifetime !== undefined ? { lifetimeMs: b.lifetime } : {}),
      },
    });
    return reply.status(201).send(await view(s));
  });

  app.get('/v1/sandboxes/:id', async (req) => {
    const id = await sandboxId(req);
    return view(await controller.get(id, scope(req)));
  });

  app.patch('/v1/sandboxes/:id', async (req) => {
    const id = await sandboxId(req);
    const b = parse(UpdateSandboxBody, req.body ?? {}, 'request body');
    const policy = {
      ...(b.idle !== undefined ? { hibernateAfterMs: b.idle } : {}),
      ...(b.pauseAfter !== undefined ? { pauseAfterMs: b.pauseAfter } : {}),
      ...(b.archiveAfter !== undefined ? { archiveAfterMs: b.archiveAfter } : {}),
      ...(b.lifetime !== undefined ? { lifetimeMs: b.lifetime } : {}),
    };
    // The labels checked first (patchLabels throws on a bad one), then the egress, the part
    // that can fail late (a bad policy): a refused request changes nothing.
    if (b.labels !== undefined)
      patchLabels((await controller.get(id, scope(req))).spec.labels ?? {}, b.labels);
    if (b.egress !== undefined) await controller.updateEgress(id, scope(req), b.egress);
    return view(
      await controller.update(id, scope(req), {
        ...(b.labels !== undefined ? { labels: b.labels } : {}),
        policy,
      }),
    );
  });

  // Idempotent: a sandbox already gone (or never there, as far as the caller can see) is what
  // the caller asked for, so a retried or doubled delete succeeds too.
  app.delete('/v1/sandboxes/:id', async (req, reply) => {
    try {
      await controller.remove(await sandboxId(req), scope(req));
    } catch (e) {
      if (!isDormantError(e, 'SANDBOX_NOT_FOUND')) throw e;
    }
    return reply.status(204).send();
  });

  app.get('/v1/sandboxes/:id/metrics', async (req) => {
    const id = await sandboxId(req);
    const q = parse(MetricsQuery, req.query, 'query');
    const since = q.since ?? Date.now() - 3_600_000;
    return {
      samples: metricPoints(await store.sandboxSamples(id, { since, limit: MAX_METRIC_POINTS }), since),
    };
  });

  for (const op of ['pause', 'hibernate', 'archive'] as const) {
    app.post(`/v1/sandboxes/:id/${op}`, async (req) => {
      const id = await sandboxId(req);
      return view(await controller[op](id, scope(req)));
    });
  }

  app.post('/v1/sandboxes/:id/resume', async (req) => {
    const id = await sandboxId(req);
    const b = parse(ResumeBody, req.body ?? undefined, 'request body');
    return view(
      await controller.resume(id, scope(req), 'resume', b?.from !== undefined ? { from: b.from } : {}),
    );
  });

  app.post('/v1/sandboxes/:id/fork', async (req, reply) => {
    const id = await sandboxId(req);
    const b = parse(ForkBody, req.body ?? undefined, 'request body');
    const s = await controller.fork(id, scope(req), {
      ...(b?.name !== undefined ? { name: b.name } : {}),
      ...(b?.labels !== undefined ? { labels: b.labels } : {}),
    });
    return reply.status(201).send(await view(s));
  });

  app.post('/v1/sandboxes/:id/exec', { bodyLimit: execBodyLimit }, async (req, reply) => {
    const id = await sandboxId(req);
    const b = parse(ExecBody, req.body, 'request body');
    if (b.stdin !== undefined && b.stdinBase64 !== undefined) {
      throw new DormantError(ErrorCode.INVALID_ARGUMENT, 'give stdin or stdinBase64, not both');
    }
    // The caller gone before the end: the command is killed, as its answer has no reader.
    const gone = new AbortController();
    reply.raw.once('close', () => reply.raw.writableFinished || gone.abort());
    const input = b.stdinBase64 !== undefined ? Buffer.from(b.stdinBase64, 'base64') : b.stdin;
    const r = await controller.exec(id, scope(req), b.command, {
      ...(b.timeoutMs !== undefined ? { timeoutMs: b.timeoutMs } : {}),
      ...(input !== undefined ? { input: Buffer.from(input) } : {}),
      ...(b.maxOutputBytes !== undefined ? { maxOutputBytes: b.maxOutputBytes } : {}),
      signal: gone.signal,
    });
    const enc = b.encoding ?? 'utf8';
    const out: ExecResultView = {
      exitCode: r.exitCode,
      stdout: r.stdout.toString(enc),
      stderr: r.stderr.toString(enc),
      durationMs: r.durationMs,
      truncated: r.truncated,
      outputLimitBytes: r.outputLimitBytes,
    };
    return out;
  });

  registerToolboxRoutes(app, { controller });
  registerTemplateRoutes(app, { controller, store });

  app.post('/v1/sandboxes/:id/keepalive', async (req) => {
    const id = await sandboxId(req);
    const b = parse(KeepaliveBody, req.body ?? undefined, 'request body');
    const forMs = b?.for ?? 30 * 60_000;
    return view(await controller.keepalive(id, scope(req), Date.now() + forMs));
  });

  app.get('/v1/sandboxes/:id/logs', async (req, reply) => {
    const id = await sandboxId(req);
    const { follow, restore } = parse(LogsQuery, req.query, 'query');
    if (restore) {
      if (follow)
        throw new DormantError(
          ErrorCode.INVALID_ARGUMENT,
          'follow and restore cannot be combined: a restore log does not grow',
        );
      const text = await controller.restoreLog(id, scope(req));
      if (text === undefined)
        throw new DormantError('NO_RESTORE_LOG', `no restore of sandbox ${id} has failed on this node`);
      // A tenant reads what CRIU said, not where the node keeps things.
      return reply
        .type('text/plain; charset=utf-8')
        .send(req.principal.admin ? text : scrubHostPaths(text, hostPaths));
    }
    const path = await controller.logPath(id, scope(req));
    const size = await stat(path).then(
      (s) => s.size,
      () => 0,
    );
    if (!follow) {
      if (size === 0) return reply.type('text/plain; charset=utf-8').send('');
      return reply.type('text/plain; charset=utf-8').send(createReadStream(path));
    }
    return followLog(reply, path, async () => {
      try {
        return (await controller.get(id, scope(req))).state !== 'deleting';
      } catch {
        // Not found: the sandbox was deleted, which ends the follow like `deleting` does.
        return false;
      }
    });
  });

  app.get('/v1/checkpoints', async (req) => {
    const q = parse(CheckpointsQuery, req.query, 'query');
    const t = scope(req);
    if (q.sandbox !== undefined) await controller.get(q.sandbox, t);
    return {
      checkpoints: (
        await store.listCheckpoints({
          ...(q.sandbox !== undefined ? { sandboxId: q.sandbox } : {}),
          ...(t !== undefined ? { tenant: t } : {}),
        })
      ).map(checkpointView),
    };
  });

  registerCheckpointRoutes(app, { store, vault: opts.checkpointVault });

  // An archive as the request body: what a tenant, who names no host paths, imports with.
  app.addContentTypeParser('application/octet-stream', (_req, payload, done) => {
    done(null, payload);
  });
  app.post('/v1/checkpoints/import', async (req, reply) => {
    if (isReadable(req.body)) {
      const q = parse(ImportUploadQuery, req.query, 'query');
      const s = await controller.importUpload(
        {
          tenant: req.principal.tenant,
          admin: req.principal.admin,
          ...(q.fileName !== undefined ? { fileName: q.fileName } : {}),
          ...(q.image !== undefined ? { image: q.image } : {}),
          ...(q.name !== undefined ? { name: q.name } : {}),
          ...(q.ports !== undefined ? { ports: q.ports } : {}),
          ...(q.memory !== undefined ? { memoryBytes: q.memory } : {}),
          ...(q.egress !== undefined ? { egress: q.egress } : {}),
        },
        req.body,
        opts.maxUploadBytes ?? DEFAULT_MAX_UPLOAD_BYTES,
      );
      return reply.status(201).send(await view(s));
    }
    const b = parse(ImportBody, req.body, 'request body');
    const s = await controller.importArchive({
      tenant: req.principal.tenant,
      admin: req.principal.admin,
      archive: b.archive,
      ...(b.image !== undefined ? { image: b.image } : {}),
      ...(b.name !== undefined ? { name: b.name } : {}),
      ...(b.ports !== undefined ? { ports: b.ports } : {}),
      ...(b.memory !== undefined ? { memoryBytes: b.memory } : {}),
      ...(b.egress !== undefined ? { egress: b.egress } : {}),
    });
    return reply.status(201).send(await view(s));
  });

  // The archive is built in memory-backed staging, streamed, and wiped when the answer ends.
  app.get('/v1/checkpoints/:id/export', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    const q = parse(ExportQuery, req.query, 'query');
    const r = await controller.exportArchive(id, scope(req), {
      allowPlaintext: q.allowPlaintext === 'true' || q.allowPlaintext === '1',
      encrypted: q.encrypted === 'true' || q.encrypted === '1',
      compression: q.compression ?? 'zstd',
    });
    const body = createReadStream(r.file);
    body.once('close', () => void r.close());
    return reply
      .type('application/octet-stream')
      .header('content-length', String(r.sizeBytes))
      .header('x-dormant-secrets-found', String(r.findings))
      .send(body);
  });

  app.get('/v1/checkpoints/:id', async (req) => {
    const { id } = parse(IdParams, req.params, 'path');
    const c = await store.getCheckpoint(id);
    const t = scope(req);
    if (!c || (t !== undefined && c.tenant !== t)) {
      throw new DormantError(ErrorCode.CHECKPOINT_NOT_FOUND, `no checkpoint ${id}`);
    }
    return checkpointView(c);
  });

  app.get('/v1/events', async (req, reply) => {
    const t = scope(req);
    const { since } = parse(EventsQuery, req.query, 'query');
    const last = Number(req.headers['last-event-id'] ?? since ?? NaN);
    let cursor = Number.isFinite(last)
      ? last
      : ((await store.transitions({ limit: 1_000_000 })).at(-1)?.id ?? 0);
    reply.hijack();
    reply.raw.writeHead(200, {
      'content-type': 'text/event-stream',
      'cache-control': 'no-cache',
      connection: 'keep-alive',
    });
    reply.raw.write(': dormant events\n\n');
    let closed = false;
    let reading = false;
    const tick = async (): Promise<void> => {
      // One read at a time: two from the same cursor would send the same events twice.
      if (reading) return;
      reading = true;
      try {
        for (const tr of await store.transitions({ sinceId: cursor, limit: 500 })) {
          if (closed) return;
          cursor = tr.id;
          if (t !== undefined && tr.tenant !== t) continue;
          reply.raw.write(`id: ${tr.id}\nevent: transition\ndata: ${JSON.stringify(transitionView(tr))}\n\n`);
        }
      } finally {
        reading = false;
      }
    };
    const stop = (): void => {
      closed = true;
      clearInterval(timer);
      clearInterval(ping);
    };
    // Not awaited (a timer's pass): a failed read ends the stream, and the client comes back
    // with Last-Event-ID.
    const pass = (): void => {
      tick().catch(() => {
        stop();
        reply.raw.end();
      });
    };
    const timer = setInterval(pass, 250);
    const ping = setInterval(() => reply.raw.write(': ping\n\n'), 15_000);
    pass();
    req.raw.on('close', stop);
  });

  return app;
}

/** The table's code for one of fastify's own 4xx answers (its status is then the code's). */
function fastifyCode(statusCode: number): ErrorCode {
  if (statusCode === 413) return ErrorCode.REQUEST_TOO_LARGE;
  if (statusCode === 415) return ErrorCode.UNSUPPORTED_MEDIA_TYPE;
  return ErrorCode.INVALID_ARGUMENT;
}

/** Streams a log file as it grows, until the client goes away or the sandbox is deleted. */
function followLog(reply: FastifyReply, path: string, stillThere: () => Promise<boolean>): void {
  reply.hijack();
  reply.raw.writeHead(200, { 'content-type': 'text/plain; charset=utf-8', 'cache-control': 'no-cache' });
  let offset = 0;
  let busy = false;
  let closed = false;
  const pump = async (): Promise<void> => {
    if (busy || closed) return;
    busy = true;
    try {
      const size = await stat(path).then(
        (s) => s.size,
        () => 0,
      );
      if (size > offset) {
        await new Promise<void>((resolve, reject) => {
          const rs = createReadStream(path, { start: offset, end: size - 1 });
          rs.on('data', (c) => reply.raw.write(c));
          rs.on('end', resolve);
          rs.on('error', reject);
        });
        offset = size;
      }
      if (!(await stillThere())) stop();
    } catch {
      // The log went with its sandbox, or the client left: either way the follow is over.
      stop();
    } finally {
      busy = false;
    }
  };
  const timer = setInterval(() => void pump(), 200);
  const stop = (): void => {
    if (closed) return;
    closed = true;
    clearInterval(timer);
    reply.raw.end();
  };
  reply.raw.on('close', stop);
  void pump();
}
