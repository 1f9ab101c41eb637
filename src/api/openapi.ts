/**
 * GET /v1/openapi.json: the OpenAPI 3.1 document of the API, generated at start from the zod
 * schemas that validate requests (schemas.ts) and from response schemas kept here, which the
 * API tests check real answers against so the document cannot drift from the server.
 *
 * Why zod's own z.toJSONSchema and not @fastify/swagger: the routes validate with zod inside
 * their handlers (one `parse` that produces our error shape), so fastify never sees a schema
 * to document; a table here plus z.toJSONSchema documents exactly what is validated, with no
 * second schema language and no plugin.
 */
import type { FastifyInstance } from 'fastify';
import { z } from 'zod';
import {
  CheckpointSchema,
  ErrorSchema,
  ExecResultSchema,
  HealthSchema,
  SandboxSchema,
  SandboxUrlSchema,
  TokenSchema,
  TransitionSchema,
  CheckpointsQuery,
  CostQuery,
  CreateSandboxBody,
  CreateTokenBody,
  EventsQuery,
  ExecBody,
  ExportQuery,
  ForkBody,
  ImportBody,
  KeepaliveBody,
  ListSandboxesQuery,
  LogsQuery,
  MetricsQuery,
  ResumeBody,
  ResumeQuery,
  NodeSchema,
  SandboxListSchema,
  SandboxMetricsSchema,
  UpdateSandboxBody,
  RegistryLoginBody,
} from './schemas.js';
import { TOOLBOX_ROUTES } from './openapi-toolbox.js';
import { TEMPLATE_ROUTES } from './routes-templates.js';

// The response schemas live with the request ones (schemas.ts); tests import them from here too.
export { CheckpointSchema, ErrorSchema, ExecResultSchema, SandboxSchema, TokenSchema, TransitionSchema };

export interface Route {
  method: 'get' | 'post' | 'put' | 'delete' | 'patch';
  path: string;
  summary: string;
  body?: z.ZodType;
  query?: z.ZodObject;
  /** Status and schema of the success answer; a string is a media type without a schema. */
  ok: [number, z.ZodType | string | null];
  admin?: boolean;
  public?: boolean;
}

const idParam = { name: 'id', in: 'path', required: true, schema: { type: 'string' } } as const;
const cidParam = { name: 'cid', in: 'path', required: true, schema: { type: 'string' } } as const;
const hostParam = { name: 'host', in: 'path', required: true, schema: { type: 'string' } } as const;
const nameParam = { name: 'name', in: 'path', required: true, schema: { type: 'string' } } as const;

const RegistryLoginSchema = z.object({
  host: z.string(),
  username: z.string(),
  tenant: z.string(),
  createdAt: z.iso.datetime(),
});

/** Registry logins and the image cache (routes-images.ts, docs/IMAGES.md). */
const IMAGE_ROUTES: Route[] = [
  {
    method: 'put',
    path: '/v1/registries/{host}',
    summary: "store the tenant's login to a registry (checked with it; the password sealed)",
    body: RegistryLoginBody,
    ok: [200, RegistryLoginSchema],
  },
  {
    method: 'get',
    path: '/v1/registries',
    summary: "the tenant's registry logins (an admin: every tenant's); never a password",
    ok: [200, z.object({ registries: z.array(RegistryLoginSchema) })],
  },
  { method: 'delete', path: '/v1/registries/{host}', summary: 'forget a registry login', ok: [204, null] },
  {
    method: 'get',
    path: '/v1/images',
    summary: 'the unpacked images and the sandboxes using each',
    ok: [
      200,
      z.object({
        images: z.array(
          z.object({
            digest: z.string(),
            unpackedAt: z.iso.datetime(),
            refs: z.array(z.string()),
            sandboxes: z.number().int(),
          }),
        ),
      }),
    ],
    admin: true,
  },
  {
    method: 'post',
    path: '/v1/images/prune',
    summary: 'remove the unpacked images and blobs no sandbox uses',
    ok: [200, z.object({ images: z.array(z.string()), blobs: z.number().int() })],
    admin: true,
  },
];

const ROUTES: Route[] = [
  {
    method: 'get',
    path: '/v1/health',
    summary: 'liveness and version',
    ok: [200, HealthSchema],
    public: true,
  },
  {
    method: 'get',
    path: '/v1/openapi.json',
    summary: 'this document',
    ok: [200, 'application/json'],
    public: true,
  },
  {
    method: 'get',
    path: '/v1/sandboxes',
    summary: "the token's sandboxes (every tenant's for an admin), filtered, a page at a time",
    query: ListSandboxesQuery,
    ok: [200, SandboxListSchema],
  },
  {
    method: 'post',
    path: '/v1/sandboxes',
    summary: 'start a sandbox',
    body: CreateSandboxBody,
    ok: [201, SandboxSchema],
  },
  {
    method: 'get',
    path: '/v1/sandboxes/{id}',
    summary: 'one sandbox (by id or name)',
    ok: [200, SandboxSchema],
  },
  {
    method: 'delete',
    path: '/v1/sandboxes/{id}',
    summary: 'delete the sandbox and its data (one already gone answers 204 too)',
    ok: [204, null],
  },
  {
    method: 'patch',
    path: '/v1/sandboxes/{id}',
    summary: 'change its labels and idle policy',
    body: UpdateSandboxBody,
    ok: [200, SandboxSchema],
  },
  {
    method: 'get',
    path: '/v1/sandboxes/{id}/metrics',
    summary: "the meter's samples of its CPU, memory and disk",
    query: MetricsQuery,
    ok: [200, SandboxMetricsSchema],
  },
  {
    method: 'post',
    path: '/v1/sandboxes/{id}/pause',
    summary: 'freeze (memory kept)',
    ok: [200, SandboxSchema],
  },
  {
    method: 'post',
    path: '/v1/sandboxes/{id}/hibernate',
    summary: 'CRIU checkpoint into the vault; memory freed',
    ok: [200, SandboxSchema],
  },
  {
    method: 'post',
    path: '/v1/sandboxes/{id}/resume',
    summary: 'back to running from paused, hibernated or archived',
    query: ResumeQuery,
    body: ResumeBody,
    ok: [200, SandboxSchema],
  },
  {
    method: 'post',
    path: '/v1/sandboxes/{id}/archive',
    summary: 'keep only the filesystem',
    ok: [200, SandboxSchema],
  },
  {
    method: 'post',
    path: '/v1/sandboxes/{id}/fork',
    summary: 'a new sandbox from the latest checkpoint',
    body: ForkBody,
    ok: [201, SandboxSchema],
  },
  {
    method: 'post',
    path: '/v1/sandboxes/{id}/exec',
    summary: 'run a command inside',
    body: ExecBody,
    ok: [200, ExecResultSchema],
  },
  ...TOOLBOX_ROUTES,
  ...TEMPLATE_ROUTES,
  {
    method: 'post',
    path: '/v1/sandboxes/{id}/keepalive',
    summary: 'tell the policy the sandbox is busy',
    body: KeepaliveBody,
    ok: [200, SandboxSchema],
  },
  {
    method: 'get',
    path: '/v1/sandboxes/{id}/logs',
    summary: "the sandbox's output (follow=1 streams it)",
    query: LogsQuery,
    ok: [200, 'text/plain'],
  },
  {
    method: 'get',
    path: '/v1/sandboxes/{id}/url',
    summary: 'the wake-proxy address of a port',
    query: z.object({ port: z.coerce.number().int() }),
    ok: [200, SandboxUrlSchema],
  },
  {
    method: 'get',
    path: '/v1/checkpoints',
    summary: 'checkpoints, newest first',
    query: CheckpointsQuery,
    ok: [200, z.object({ checkpoints: z.array(CheckpointSchema) })],
  },
  { method: 'get', path: '/v1/checkpoints/{id}', summary: 'one checkpoint', ok: [200, CheckpointSchema] },
  {
    method: 'get',
    path: '/v1/checkpoints/{id}/inspect',
    summary: 'process tree, files, sockets, memory, mounts',
    ok: [200, 'application/json'],
  },
  {
    method: 'get',
    path: '/v1/checkpoints/{id}/scan',
    summary: 'secrets found in memory and files',
    ok: [200, 'application/json'],
  },
  {
    method: 'post',
    path: '/v1/checkpoints/import',
    summary: 'a podman or kubelet checkpoint archive on the daemon host becomes a hibernated sandbox',
    body: ImportBody,
    ok: [201, SandboxSchema],
  },
  {
    method: 'get',
    path: '/v1/checkpoints/{id}/export',
    summary:
      'the checkpoint as a podman / CRI-O archive (409 CHECKPOINT_HAS_SECRETS unless allowPlaintext, or encrypted: the client encrypts it)',
    query: ExportQuery,
    ok: [200, 'application/octet-stream'],
  },
  {
    method: 'get',
    path: '/v1/events',
    summary: 'server-sent events: `event: transition`, data a Transition',
    query: EventsQuery,
    ok: [200, 'text/event-stream'],
  },
  {
    method: 'get',
    path: '/v1/cost',
    summary: 'what was spent, what staying warm would have cost, what sleeping saved',
    query: CostQuery,
    ok: [200, 'application/json'],
  },
  {
    method: 'get',
    path: '/v1/e2b',
    summary: "where E2B's SDK reaches this node: { apiUrl, sandboxUrl, domain } (docs/E2B.md); 404 while off",
    ok: [200, 'application/json'],
  },
  {
    method: 'get',
    path: '/v1/nodes',
    summary: "a fleet's nodes, with their sandboxes by state (empty on a node alone)",
    ok: [200, z.object({ node: z.string().nullable(), nodes: z.array(NodeSchema) })],
    admin: true,
  },
  {
    method: 'get',
    path: '/v1/nodes/{name}',
    summary: 'one node',
    ok: [200, NodeSchema],
    admin: true,
  },
  {
    method: 'post',
    path: '/v1/nodes/{name}/drain',
    summary: 'hibernate the node’s sandboxes and keep it out of placement',
    ok: [200, NodeSchema],
    admin: true,
  },
  {
    method: 'post',
    path: '/v1/nodes/{name}/undrain',
    summary: 'let the node take sandboxes again',
    ok: [200, NodeSchema],
    admin: true,
  },
  {
    method: 'post',
    path: '/v1/tokens',
    summary: 'mint a token for a tenant (answered once)',
    body: CreateTokenBody,
    ok: [201, TokenSchema.extend({ token: z.string() })],
    admin: true,
  },
  {
    method: 'get',
    path: '/v1/tokens',
    summary: 'every token (hashes only ever stored)',
    ok: [200, z.object({ tokens: z.array(TokenSchema) })],
    admin: true,
  },
  {
    method: 'delete',
    path: '/v1/tokens/{id}',
    summary: 'revoke a token',
    ok: [200, TokenSchema],
    admin: true,
  },
  { method: 'get', path: '/metrics', summary: 'Prometheus metrics', ok: [200, 'text/plain'], admin: true },
  ...IMAGE_ROUTES,
];

const json = (s: z.ZodType, io: 'input' | 'output'): Record<string, unknown> => {
  const out = z.toJSONSchema(s, { io, unrepresentable: 'any' }) as Record<string, unknown>;
  delete out.$schema;
  return out;
};

/** Builds the document. Pure: the same schemas always give the same document. */
export function openApiDocument(version: string): Record<string, unknown> {
  const paths: Record<string, Record<string, unknown>> = {};
  for (const r of ROUTES) {
    const parameters: unknown[] = [];
    if (r.path.includes('{id}')) parameters.push(idParam);
    if (r.path.includes('{cid}')) parameters.push(cidParam);
    if (r.path.includes('{host}')) parameters.push(hostParam);
    if (r.path.includes('{name}')) parameters.push(nameParam);
    if (r.query) {
      const q = json(r.query, 'input') as { properties?: Record<string, unknown>; required?: string[] };
      for (const [name, schema] of Object.entries(q.properties ?? {}))
        parameters.push({ name, in: 'query', required: q.required?.includes(name) ?? false, schema });
    }
    const [status, ok] = r.ok;
    const success =
      ok === null
        ? { description: 'done' }
        : typeof ok === 'string'
          ? { description: 'ok', content: { [ok]: {} } }
          : { description: 'ok', content: { 'application/json': { schema: json(ok, 'output') } } };
    const err = {
      description: 'an error',
      content: { 'application/json': { schema: { $ref: '#/components/schemas/Error' } } },
    };
    (paths[r.path] ??= {})[r.method] = {
      summary: r.summary,
      ...(r.public ? { security: [] } : {}),
      ...(parameters.length > 0 ? { parameters } : {}),
      ...(r.body
        ? {
            requestBody: {
              required: !r.body.safeParse(undefined).success,
              content: { 'application/json': { schema: json(r.body, 'input') } },
            },
          }
        : {}),
      responses: {
        [status]: success,
        ...(r.body || r.query ? { 400: err } : {}),
        ...(r.public ? {} : { 401: err }),
        ...(r.admin ? { 403: err } : {}),
        ...(r.path.includes('{id}') ? { 404: err } : {}),
        ...(r.method === 'post' && r.path.startsWith('/v1/sandboxes/') ? { 409: err } : {}),
        default: err,
      },
    };
  }
  return {
    openapi: '3.1.0',
    info: {
      title: 'dormant',
      version,
      description:
        "Pause and resume for AI-agent sandboxes. Every route but /v1/health and this document needs `Authorization: Bearer TOKEN`; another tenant's ids answer 404.",
    },
    servers: [{ url: '/' }],
    security: [{ bearer: [] }],
    components: {
      securitySchemes: { bearer: { type: 'http', scheme: 'bearer', description: 'a dmt_... token' } },
      schemas: {
        Error: json(ErrorSchema, 'output'),
        Sandbox: json(SandboxSchema, 'output'),
        Checkpoint: json(CheckpointSchema, 'output'),
        Transition: json(TransitionSchema, 'output'),
        Token: json(TokenSchema, 'output'),
      },
    },
    paths,
  };
}

/** `METHOD /path/{id}` of every documented route. */
export function documentedRoutes(): string[] {
  return ROUTES.map((r) => `${r.method.toUpperCase()} ${r.path}`);
}

/**
 * Serves the document, and records every route registered after it (`served`), so a test can
 * hold each one to being documented.
 */
export function registerOpenApi(app: FastifyInstance, version: string): { served: string[] } {
  const doc = openApiDocument(version);
  const served: string[] = ['GET /v1/health'];
  app.addHook('onRoute', (r) => {
    for (const m of Array.isArray(r.method) ? r.method : [r.method])
      if (m !== 'HEAD') served.push(`${m} ${r.url.replace(/:(\w+)/g, '{$1}')}`);
  });
  app.get('/v1/openapi.json', async () => doc);
  app.decorate('servedRoutes', served);
  return { served };
}

declare module 'fastify' {
  interface FastifyInstance {
    /** `METHOD /path/{id}` of each route registered after the OpenAPI route (openapi.ts). */
    servedRoutes: string[];
  }
}
