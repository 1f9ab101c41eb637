/**
 * Templates: POST/GET /v1/templates, GET/PATCH/DELETE /v1/templates/{id} (control/ops/template.ts).
 * A token sees its tenant's templates and the public ones; only an admin publishes one, and a
 * public template of another tenant is used, not removed, by a tenant.
 */
import type { FastifyInstance, FastifyRequest } from 'fastify';
import { z } from 'zod';
import { DormantError, ErrorCode, isDormantError } from '../domain/errors.js';
import type { SandboxController } from '../control/sandboxes.js';
import type { StateStore } from '../state/store.js';
import type { TemplateRecord } from '../state/templates.js';
import type { Route } from './openapi.js';
import {
  CreateTemplateBody,
  PublishTemplateBody,
  TemplateListSchema,
  TemplateSchema,
  type TemplateView,
} from './schemas.js';
import { parse, sourceAndLimits } from './validate.js';

const Params = z.object({ id: z.string().min(1).max(128) });

export async function templateView(
  t: TemplateRecord,
  store: Pick<StateStore, 'getCheckpoint'>,
): Promise<TemplateView> {
  const ck = await store.getCheckpoint(t.checkpointId);
  return {
    id: t.id,
    name: t.name,
    tenant: t.tenant,
    public: t.public,
    checkpointId: t.checkpointId,
    origin: t.origin,
    command: t.spec.command,
    ports: t.spec.ports,
    memoryLimitBytes: t.spec.memoryBytes,
    logicalBytes: ck?.logicalBytes ?? null,
    storedBytes: ck?.storedBytes ?? null,
    createdAt: new Date(t.createdAt).toISOString(),
  };
}

export function registerTemplateRoutes(
  app: FastifyInstance,
  opts: { controller: SandboxController; store: Pick<StateStore, 'getCheckpoint'> },
): void {
  const { controller, store } = opts;
  const scope = (req: FastifyRequest): string | undefined =>
    req.principal.admin ? undefined : req.principal.tenant;
  const ref = (req: FastifyRequest): string => parse(Params, req.params, 'path').id;

  app.post('/v1/templates', async (req, reply) => {
    const b = parse(CreateTemplateBody, req.body, 'request body');
    const build = b.from === undefined;
    const t = await controller.createTemplate({
      tenant: req.principal.tenant,
      admin: req.principal.admin,
      name: b.name,
      ...(b.public !== undefined ? { public: b.public } : {}),
      ...(b.from !== undefined ? { from: b.from } : {}),
      ...(b.ready !== undefined
        ? {
            ready: {
              ...(b.ready.port !== undefined ? { port: b.ready.port } : {}),
              ...(b.ready.command !== undefined ? { command: b.ready.command } : {}),
              ...(b.ready.timeout !== undefined ? { timeoutMs: b.ready.timeout } : {}),
            },
          }
        : {}),
      ...(build
        ? {
            build: {
              command: b.command,
              ...sourceAndLimits(b),
            },
          }
        : {}),
    });
    return reply.status(201).send(await templateView(t, store));
  });

  app.get('/v1/templates', async (req) => ({
    templates: await Promise.all(
      (await controller.listTemplates(scope(req))).map((t) => templateView(t, store)),
    ),
  }));

  app.get('/v1/templates/:id', async (req) =>
    templateView(await controller.getTemplate(ref(req), scope(req)), store),
  );

  app.patch('/v1/templates/:id', async (req) => {
    if (!req.principal.admin)
      throw new DormantError(ErrorCode.FORBIDDEN, 'only an admin token publishes a template to every tenant');
    const b = parse(PublishTemplateBody, req.body, 'request body');
    return templateView(await controller.publishTemplate(ref(req), b.public), store);
  });

  // Idempotent, as DELETE /v1/sandboxes/{id}: a template already gone is what was asked for.
  app.delete('/v1/templates/:id', async (req, reply) => {
    try {
      await controller.removeTemplate(ref(req), scope(req));
    } catch (e) {
      if (!isDormantError(e, 'TEMPLATE_NOT_FOUND')) throw e;
    }
    return reply.status(204).send();
  });
}

/** The routes as openapi.ts documents them. */
export const TEMPLATE_ROUTES: Route[] = [
  {
    method: 'post',
    path: '/v1/templates',
    summary:
      'make a template: checkpoint a running sandbox (from), or build one (rootfs or image, command, ready probe), checkpoint it and remove the builder',
    body: CreateTemplateBody,
    ok: [201, TemplateSchema],
  },
  {
    method: 'get',
    path: '/v1/templates',
    summary: "the tenant's templates and the public ones",
    ok: [200, TemplateListSchema],
  },
  {
    method: 'get',
    path: '/v1/templates/{id}',
    summary: 'one template, by id or name',
    ok: [200, TemplateSchema],
  },
  {
    method: 'patch',
    path: '/v1/templates/{id}',
    summary: 'publish a template to every tenant, or take it back',
    body: PublishTemplateBody,
    ok: [200, TemplateSchema],
    admin: true,
  },
  {
    method: 'delete',
    path: '/v1/templates/{id}',
    summary: 'remove a template and its checkpoint (sandboxes made from it stay)',
    ok: [204, null],
  },
];
