/**
 * E2B's REST API (the sandbox calls of its OpenAPI) over dormant's lifecycle: create from a
 * template, pause = hibernate (the memory goes to the vault and is freed), connect = resume,
 * timeout = the idle policy (the sandbox hibernates after that long idle, where E2B's would be
 * killed), list with metadata = labels, fork, kill = rm. Every call is the controller's own
 * operation, under the key's tenant: another tenant's sandbox is 404, as one that is not there.
 */
import type { FastifyInstance, FastifyRequest } from 'fastify';
import { DormantError, ErrorCode, isDormantError } from '../../domain/errors.js';
import type { Sandbox } from '../../domain/sandbox.js';
import type { SandboxController } from '../../control/sandboxes.js';
import type { Principal } from '../auth.js';
import type { MetricPoint } from '../../control/meter.js';
import { resolveTemplate, type E2bTemplate } from './templates.js';

/** The envd version the front says it speaks: the SDK turns features on and off by it. */
export const ENVD_VERSION = '0.5.7';
/** The label that keeps the template a sandbox was made from (not shown as metadata). */
export const TEMPLATE_LABEL = 'e2b.dev/template';
/** Sandboxes a fork may make at once. */
const MAX_FORKS = 16;

export interface RestDeps {
  controller: SandboxController;
  templates: Readonly<Record<string, E2bTemplate>>;
  principalOf(req: FastifyRequest): Promise<Principal>;
  accessToken(sandboxId: string): string;
  /** E2B_DOMAIN: the wake proxy's domain, where `getHost(port)` leads. */
  domain: string | undefined;
  /** The meter's points for a sandbox from `since` (ms) on (GET /v1/sandboxes/ID/metrics's). */
  metrics(sandboxId: string, since: number): Promise<MetricPoint[]>;
}

type Json = Record<string, unknown>;

function body(req: FastifyRequest): Json {
  const b = req.body;
  if (b === undefined || b === null || b === '') return {};
  if (typeof b !== 'object' || Array.isArray(b))
    throw new DormantError(ErrorCode.INVALID_ARGUMENT, 'expected a JSON object');
  return b as Json;
}

/** A `timeout` in seconds, as milliseconds; undefined when absent. */
function timeoutMs(v: unknown): number | undefined {
  if (v === undefined || v === null) return undefined;
  if (typeof v !== 'number' || !Number.isInteger(v) || v < 0 || v > 31 * 86_400)
    throw new DormantError(ErrorCode.INVALID_ARGUMENT, 'timeout: whole seconds, at most 31 days');
  return v * 1000;
}

function metadataOf(v: unknown): Record<string, string> {
  if (v === undefined || v === null) return {};
  if (typeof v !== 'object' || Array.isArray(v))
    throw new DormantError(ErrorCode.INVALID_ARGUMENT, 'metadata: expected an object of strings');
  const out: Record<string, string> = {};
  for (const [k, val] of Object.entries(v)) {
    if (typeof val !== 'string')
      throw new DormantError(ErrorCode.INVALID_ARGUMENT, `metadata.${k.slice(0, 60)}: expected a string`);
    out[k] = val;
  }
  return out;
}

/** E2B has two states a caller sees: running, and paused (everything that sleeps). */
function stateOf(s: Sandbox): 'running' | 'paused' {
  return s.state === 'running' || s.state === 'creating' ? 'running' : 'paused';
}

function metadata(s: Sandbox): Record<string, string> {
  const { [TEMPLATE_LABEL]: _template, ...rest } = s.spec.labels ?? {};
  return rest;
}

export function registerRest(app: FastifyInstance, deps: RestDeps): void {
  const { controller } = deps;
  const scope = async (req: FastifyRequest): Promise<{ tenant: string | undefined; p: Principal }> => {
    const p = await deps.principalOf(req);
    return { tenant: p.admin ? undefined : p.tenant, p };
  };
  const idOf = (req: FastifyRequest): string => {
    const id = (req.params as { id?: unknown }).id;
    if (typeof id !== 'string' || id.length > 200)
      throw new DormantError(ErrorCode.INVALID_ARGUMENT, 'bad sandbox id');
    return id;
  };

  /** The answer of create and connect: what the SDK needs to reach the sandbox's envd. */
  const created = (s: Sandbox): Json => ({
    sandboxID: s.id,
    templateID: s.spec.labels?.[TEMPLATE_LABEL] ?? '',
    ...(s.name !== undefined && s.name !== null ? { alias: s.name } : {}),
    clientID: 'dormant',
    envdVersion: ENVD_VERSION,
    envdAccessToken: deps.accessToken(s.id),
    domain: deps.domain ?? null,
  });

  const listed = (s: Sandbox): Json => {
    const idle = s.spec.policy.hibernateAfterMs;
    return {
      sandboxID: s.id,
      templateID: s.spec.labels?.[TEMPLATE_LABEL] ?? '',
      ...(s.name !== undefined && s.name !== null ? { alias: s.name } : {}),
      clientID: 'dormant',
      startedAt: new Date(s.createdAt).toISOString(),
      // When the idle policy would put it to sleep (E2B's end of a sandbox's time).
      endAt: new Date(idle !== undefined ? s.lastActiveAt + idle : 8_640_000_000_000_000).toISOString(),
      cpuCount: Math.max(1, Math.ceil(s.spec.cpus)),
      memoryMB: Math.round(s.spec.memoryBytes / 1024 ** 2),
      diskSizeMB: Math.round((s.spec.diskBytes ?? 0) / 1024 ** 2),
      metadata: metadata(s),
      state: stateOf(s),
      envdVersion: ENVD_VERSION,
    };
  };

  const hasDormantTemplate = async (name: string, tenant: string): Promise<boolean> => {
    try {
      await controller.getTemplate(name, tenant);
      return true;
    } catch (e) {
      if (isDormantError(e, 'TEMPLATE_NOT_FOUND')) return false;
      throw e;
    }
  };

  app.post('/v2/sandboxes', async (req, reply) => {
    const { p } = await scope(req);
    const b = body(req);
    const templateID = typeof b.templateID === 'string' && b.templateID !== '' ? b.templateID : 'base';
    const idle = timeoutMs(b.timeout);
    const envs = metadataOf(b.envVars);
    // A dormant template of that name (the tenant's own, or a public one) wins over the
    // configured map: the sandbox starts with the template's memory in place.
    if (!Object.hasOwn(deps.templates, templateID) && (await hasDormantTemplate(templateID, p.tenant))) {
      const s = await controller.create({
        tenant: p.tenant,
        template: templateID,
        command: [],
        ...(Object.keys(envs).length > 0 ? { env: envs } : {}),
        labels: { ...metadataOf(b.metadata), [TEMPLATE_LABEL]: templateID },
        policy: idle !== undefined ? { hibernateAfterMs: idle } : {},
      });
      return reply.status(201).send(created(s));
    }
    const t = resolveTemplate(deps.templates, templateID);
    const s = await controller.create({
      tenant: p.tenant,
      // The source is the operator's (the configured template), never the caller's: its
      // host path is accepted outside the folders tenants may name.
      admin: true,
      command: t.command,
      ...('rootfs' in t ? { rootfs: t.rootfs } : { image: t.image }),
      ...(Object.keys(envs).length > 0 ? { env: envs } : {}),
      ...(t.memoryBytes !== undefined ? { memoryBytes: t.memoryBytes } : {}),
      ...(t.cpus !== undefined ? { cpus: t.cpus } : {}),
      labels: { ...metadataOf(b.metadata), [TEMPLATE_LABEL]: templateID },
      policy: idle !== undefined ? { hibernateAfterMs: idle } : {},
    });
    return reply.status(201).send(created(s));
  });

  const list = async (req: FastifyRequest, reply: import('fastify').FastifyReply): Promise<unknown> => {
    const { tenant } = await scope(req);
    const q = req.query as Record<string, unknown>;
    // metadata=k1%3Dv1%26k2%3Dv2 (a query string of its own); state=running,paused.
    const want = typeof q.metadata === 'string' ? new URLSearchParams(q.metadata) : undefined;
    const states = typeof q.state === 'string' ? q.state.split(',') : ['running', 'paused'];
    const limit = Math.min(1000, Math.max(1, Number(q.limit) || 1000));
    const after = typeof q.nextToken === 'string' ? q.nextToken : undefined;
    const all = (await controller.list(tenant))
      .filter((s) => s.state !== 'deleting')
      .filter((s) => states.includes(stateOf(s)))
      .filter((s) => !want || [...want].every(([k, v]) => metadata(s)[k] === v))
      .sort((a, b) => a.createdAt - b.createdAt || a.id.localeCompare(b.id));
    const from = after !== undefined ? all.findIndex((s) => s.id === after) + 1 : 0;
    const page = all.slice(from, from + limit);
    if (from + limit < all.length) void reply.header('x-next-token', page.at(-1)!.id);
    return page.map(listed);
  };
  app.get('/v2/sandboxes', list);
  app.get('/sandboxes', list);

  app.get('/sandboxes/:id', async (req) => {
    const s = await controller.get(idOf(req), (await scope(req)).tenant);
    return { ...listed(s), envdAccessToken: deps.accessToken(s.id), domain: deps.domain ?? null };
  });

  app.delete('/sandboxes/:id', async (req, reply) => {
    await controller.remove(
      (await controller.get(idOf(req), (await scope(req)).tenant)).id,
      (await scope(req)).tenant,
      'e2b kill',
    );
    return reply.status(204).send();
  });

  app.post('/sandboxes/:id/pause', async (req, reply) => {
    const { tenant } = await scope(req);
    const s = await controller.get(idOf(req), tenant);
    if (s.state === 'hibernated' || s.state === 'archived')
      throw new DormantError(ErrorCode.ILLEGAL_TRANSITION, `sandbox ${s.id} is already paused`);
    await controller.hibernate(s.id, tenant, 'e2b pause');
    return reply.status(204).send();
  });

  const connect = async (req: FastifyRequest, reply: import('fastify').FastifyReply): Promise<unknown> => {
    const { tenant } = await scope(req);
    const idle = timeoutMs(body(req).timeout);
    let s = await controller.get(idOf(req), tenant);
    const asleep = s.state !== 'running';
    if (asleep) s = await controller.resume(s.id, tenant, 'e2b connect');
    if (idle !== undefined) s = await controller.update(s.id, tenant, { policy: { hibernateAfterMs: idle } });
    return reply.status(asleep ? 201 : 200).send(created(s));
  };
  app.post('/v2/sandboxes/:id/connect', connect);
  app.post('/sandboxes/:id/connect', connect);
  app.post('/sandboxes/:id/resume', connect);

  app.post('/sandboxes/:id/timeout', async (req, reply) => {
    const { tenant } = await scope(req);
    const idle = timeoutMs(body(req).timeout);
    if (idle === undefined) throw new DormantError(ErrorCode.INVALID_ARGUMENT, 'timeout is required');
    await controller.update((await controller.get(idOf(req), tenant)).id, tenant, {
      policy: { hibernateAfterMs: idle },
    });
    return reply.status(204).send();
  });

  app.post('/sandboxes/:id/fork', async (req) => {
    const { tenant } = await scope(req);
    const b = body(req);
    const count = b.count === undefined || b.count === null ? 1 : Number(b.count);
    if (!Number.isInteger(count) || count < 1 || count > MAX_FORKS)
      throw new DormantError(ErrorCode.INVALID_ARGUMENT, `count: 1 to ${MAX_FORKS}`);
    const idle = timeoutMs(b.timeout);
    const origin = await controller.get(idOf(req), tenant);
    const out: Json[] = [];
    // One after the other: each fork checkpoints its origin, which holds the origin's lock.
    for (let i = 0; i < count; i++) {
      try {
        let f = await controller.fork(origin.id, tenant);
        if (idle !== undefined)
          f = await controller.update(f.id, tenant, { policy: { hibernateAfterMs: idle } });
        out.push({ sandbox: created(f) });
      } catch (e) {
        const status = e instanceof DormantError ? e.status : 500;
        out.push({
          error: { code: status, message: e instanceof DormantError ? e.message : 'internal error' },
        });
      }
    }
    return out;
  });

  // Snapshots are dormant templates made from the sandbox (its memory, processes and files);
  // `Sandbox.create(snapshotId)` then starts from one like from any dormant template.
  const snapshotInfo = (name: string): Json => ({ snapshotID: name, names: [name] });
  app.post('/sandboxes/:id/snapshots', async (req, reply) => {
    const { tenant, p } = await scope(req);
    const s = await controller.get(idOf(req), tenant);
    const b = body(req);
    const name =
      typeof b.name === 'string' && b.name !== ''
        ? b.name
        : `snapshot-${s.id.replace(/^sb-/, '')}-${Date.now().toString(36)}`;
    const t = await controller.createTemplate({ tenant: s.tenant, admin: p.admin, name, from: s.id });
    return reply.status(201).send(snapshotInfo(t.name));
  });
  app.get('/snapshots', async (req) => {
    const { tenant } = await scope(req);
    const q = req.query as Record<string, unknown>;
    return (await controller.listTemplates(tenant))
      .filter((t) => tenant === undefined || t.tenant === tenant)
      .filter((t) => typeof q.sandboxID !== 'string' || t.origin === `sandbox ${q.sandboxID}`)
      .filter((t) => typeof q.name !== 'string' || t.name === q.name || t.id === q.name)
      .map((t) => snapshotInfo(t.name));
  });
  app.delete('/templates/:id', async (req, reply) => {
    await controller.removeTemplate(idOf(req), (await scope(req)).tenant);
    return reply.status(204).send();
  });

  // The meter's samples in E2B's shape: `start`/`end` in Unix seconds (default: the last hour).
  app.get('/sandboxes/:id/metrics', async (req) => {
    const s = await controller.get(idOf(req), (await scope(req)).tenant);
    const q = req.query as Record<string, unknown>;
    const start = Number(q.start);
    const end = Number(q.end);
    const since = Number.isFinite(start) && start > 0 ? start * 1000 : Date.now() - 3_600_000;
    const until = Number.isFinite(end) && end > 0 ? end * 1000 : Infinity;
    return (await deps.metrics(s.id, since))
      .filter((m) => m.at <= until)
      .map((m) => ({
        timestamp: new Date(m.at).toISOString(),
        timestampUnix: Math.floor(m.at / 1000),
        cpuCount: Math.max(1, Math.ceil(s.spec.cpus)),
        // E2B's percentage is of the sandbox's CPUs; the meter's is of one CPU.
        cpuUsedPct: m.cpuPercent === null ? 0 : m.cpuPercent / Math.max(1, s.spec.cpus),
        memUsed: m.memoryBytes,
        memTotal: s.spec.memoryBytes,
        memCache: 0,
        diskUsed: m.diskBytes ?? 0,
        diskTotal: s.spec.diskBytes ?? 0,
      }));
  });

  // Named so a program gets a clear answer rather than a bare 404 (docs/E2B.md: not supported).
  for (const [method, path] of [
    ['GET', '/templates'],
    ['PUT', '/sandboxes/:id/network'],
  ] as const) {
    app.route({
      method,
      url: path,
      handler: async () => {
        throw new DormantError(
          ErrorCode.NOT_FOUND,
          `${method} ${path} is not supported by dormant’s E2B front`,
          {
            hint: 'docs/E2B.md lists what is supported',
          },
        );
      },
    });
  }
}

/** Whether `e` is the controller's not-found of a sandbox (a kill of one gone is answered 404). */
export function isSandboxGone(e: unknown): boolean {
  return isDormantError(e, 'SANDBOX_NOT_FOUND');
}
