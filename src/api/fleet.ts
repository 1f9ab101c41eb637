/**
 * The API in a fleet: any node answers every request. A request for a sandbox that lives on
 * another node is forwarded there whole (body and answer streamed, one hop); a sleeping one
 * wakes where placement says (domain/node.ts placeWake). And the nodes' own routes:
 * GET /v1/nodes, POST /v1/nodes/{name}/drain and /undrain (admin).
 */
import { request as httpRequest, type IncomingMessage } from 'node:http';
import { connect } from 'node:net';
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { z } from 'zod';
import { DormantError, ErrorCode } from '../domain/errors.js';
import { AWAKE_STATES, mostRoom, placeWake, type NodeInfo, type WakeNeeds } from '../domain/node.js';
import type { Sandbox } from '../domain/sandbox.js';
import type { NodeMembership } from '../control/fleet.js';
import type { SandboxController } from '../control/sandboxes.js';
import type { FleetStore } from '../state/store.js';
import { parse } from './validate.js';

/** What the API knows of the fleet; `membership` is set once the node has joined. */
export interface FleetHooks {
  name: string;
  store: FleetStore;
  membership?: NodeMembership;
  /** What a node needs to wake sandbox `s` (its checkpoint's facts, its runtime). */
  wakeNeeds?: (s: Sandbox) => Promise<WakeNeeds | undefined>;
}

/** The header a forwarded request carries: the node it came from. A forwarded request is never forwarded again. */
export const FORWARDED_HEADER = 'x-dormant-forwarded-by';

/** Request headers not passed on (hop by hop). */
const HOP = new Set([
  'connection',
  'keep-alive',
  'transfer-encoding',
  'upgrade',
  'proxy-connection',
  'te',
  'trailer',
]);

/**
 * Routes of a sleeping sandbox that restore its checkpoint: resume, the toolbox's (which wake it
 * first), and fork (its copy restored from the same checkpoint, on a node that can).
 */
const WAKES = /^\/(resume|exec|files|commands|fork)(\/|$)/;

/**
 * Requests that make a sandbox: sent elsewhere while this node drains. An import sent as the
 * body (application/octet-stream, as the server reads it) goes too; one that names an archive
 * by its path (JSON) stays, the path being on this machine, and the drain hibernates what it
 * makes.
 */
const makes = (path: string, contentType: string | undefined): boolean =>
  path === '/v1/sandboxes' ||
  (path === '/v1/checkpoints/import' && /^application\/octet-stream\b/i.test(contentType ?? ''));

const NodeParams = z.strictObject({ name: z.string().min(1).max(63) });

export function nodeView(n: NodeInfo): Record<string, unknown> {
  return {
    name: n.name,
    url: n.url,
    proxyUrl: n.proxyUrl ?? null,
    state: n.expired && n.state !== 'lost' ? 'unreachable' : n.state,
    leaseUntil: new Date(n.leaseUntil).toISOString(),
    startedAt: new Date(n.startedAt).toISOString(),
    lostAt: n.lostAt !== undefined ? new Date(n.lostAt).toISOString() : null,
    capacity: n.capacity,
    sandboxes: n.sandboxes,
    memoryUsedBytes: n.memoryUsedBytes,
  };
}

function adminOnly(req: FastifyRequest): void {
  if (!req.principal.admin)
    throw new DormantError(
      ErrorCode.FORBIDDEN,
      'the fleet’s nodes are the operator’s: this needs an admin token',
    );
}

export function registerFleetRoutes(app: FastifyInstance, fleet: FleetHooks | undefined): void {
  const get = async (name: string): Promise<NodeInfo> => {
    const n = fleet ? await fleet.store.getNode(name) : undefined;
    if (!n) throw new DormantError(ErrorCode.NODE_NOT_FOUND, `no node named ${name}`);
    return n;
  };
  app.get('/v1/nodes', async (req) => {
    adminOnly(req);
    return { node: fleet?.name ?? null, nodes: fleet ? (await fleet.store.listNodes()).map(nodeView) : [] };
  });
  app.get('/v1/nodes/:name', async (req) => {
    adminOnly(req);
    return nodeView(await get(parse(NodeParams, req.params, 'path').name));
  });
  for (const [verb, state] of [
    ['drain', 'draining'],
    ['undrain', 'active'],
  ] as const) {
    app.post(`/v1/nodes/:name/${verb}`, async (req) => {
      adminOnly(req);
      const { name } = parse(NodeParams, req.params, 'path');
      const n = await get(name);
      if (!(await fleet!.store.setNodeState(name, state)))
        throw new DormantError(ErrorCode.NODE_UNAVAILABLE, `node ${name} is ${n.state}: it cannot ${verb}`, {
          hint: 'a lost node joins again when it starts; its sandboxes were taken back to their checkpoints',
        });
      // The node itself hibernates its sandboxes at its next renewal (control/fleet.ts).
      return nodeView(await get(name));
    });
  }
}

/**
 * Forwards requests for sandboxes of other nodes (and creates and imports, while this node
 * drains; a fork of a sleeping sandbox goes where it would wake). Runs
 * after authentication: a tenant is forwarded only for a sandbox it may see, and the other node
 * authenticates the same token against the same database.
 */
export function installForwarding(
  app: FastifyInstance,
  o: { fleet: FleetHooks; controller: SandboxController; scope: (req: FastifyRequest) => string | undefined },
): void {
  const { fleet } = o;
  app.addHook('onRequest', async (req, reply) => {
    if (req.headers[FORWARDED_HEADER] !== undefined) return;
    const [path = '', query = ''] = req.url.split('?');
    const m = /^\/v1\/sandboxes\/([^/]+)(\/.*)?$/.exec(path);
    let target: NodeInfo | undefined;
    if (m) {
      let s: Sandbox;
      try {
        s = await o.controller.get(decodeURIComponent(m[1]!), o.scope(req));
      } catch {
        return; // the route answers it (not found, a bad id)
      }
      target = await routeFor(fleet, s, req.method, m[2] ?? '', new URLSearchParams(query).get('node'));
    } else if (
      req.method === 'POST' &&
      makes(path, req.headers['content-type']) &&
      fleet.membership?.state === 'draining'
    ) {
      target = mostRoom(
        open(await fleet.store.listNodes({ counts: false })).filter((n) => n.name !== fleet.name),
      );
      if (!target)
        throw new DormantError(
          ErrorCode.NODE_UNAVAILABLE,
          `node ${fleet.name} is draining and no other node takes sandboxes`,
        );
    }
    if (!target || target.name === fleet.name) return;
    // A WebSocket (a terminal, a command's output): the connection joined to that node's.
    if (req.headers.upgrade !== undefined) forwardUpgrade(req, reply, target, fleet.name);
    else await forward(req, reply, target, fleet.name);
  });
}

const open = (nodes: readonly NodeInfo[]): NodeInfo[] =>
  nodes.filter((n) => n.state === 'active' && !n.expired);
const alive = (n: NodeInfo | undefined): boolean => n !== undefined && n.state !== 'lost' && !n.expired;

/** The node a request for sandbox `s` belongs on; undefined: this one. */
async function routeFor(
  fleet: FleetHooks,
  s: Sandbox,
  method: string,
  rest: string,
  asked: string | null,
): Promise<NodeInfo | undefined> {
  const me = fleet.name;
  const sleeping = s.state === 'hibernated' || s.state === 'archived';
  if (asked !== null && rest === '/resume' && method === 'POST') {
    // resume --node: there, if it takes sandboxes (an awake sandbox stays where it is).
    if (!sleeping)
      return s.node !== undefined && s.node !== me ? await fleet.store.getNode(s.node) : undefined;
    const n = await fleet.store.getNode(asked);
    if (!n) throw new DormantError(ErrorCode.NODE_NOT_FOUND, `no node named ${asked}`);
    if (n.state !== 'active' || n.expired)
      throw new DormantError(
        ErrorCode.NODE_UNAVAILABLE,
        `node ${asked} does not take sandboxes: it is ${n.expired && n.state !== 'lost' ? 'unreachable' : n.state}`,
        { hint: 'dormant node ls shows the nodes that do' },
      );
    return n;
  }
  const owner = s.node !== undefined && s.node !== me ? await fleet.store.getNode(s.node) : undefined;
  if (sleeping && WAKES.test(rest)) {
    // Where placement says: its own node while that one takes sandboxes, else here, else the roomiest.
    const here = fleet.membership?.state ?? 'active';
    if (s.node === me && here === 'active') return undefined;
    const needs = await fleet.wakeNeeds?.(s);
    const place = placeWake(await fleet.store.listNodes({ counts: false }), s.node, me, needs);
    if (!place)
      throw new DormantError(
        ErrorCode.NODE_UNAVAILABLE,
        `no node that takes sandboxes can wake ${s.id}${needs ? ` (it needs ${needs.runtime}${needs.facts.arch ? ` on ${needs.facts.arch}` : ''} and its checkpoint's CPU and CRIU)` : ''}`,
        {
          hint: 'undrain a node (dormant node undrain NAME) or start one like the node that made its checkpoint',
        },
      );
    return place;
  }
  if (s.node === undefined || s.node === me) return undefined;
  if (owner && alive(owner)) return owner;
  // Its node stopped renewing: a sleeping sandbox is answered here; an awake one has nothing
  // here to answer with until the lease runs out and it is taken back.
  if (AWAKE_STATES.includes(s.state))
    throw new DormantError(
      ErrorCode.NODE_UNAVAILABLE,
      `sandbox ${s.id} is ${s.state} on node ${s.node}, which ${owner === undefined ? 'is not registered' : owner.state === 'lost' ? 'was lost' : 'does not answer (its lease ran out)'}`,
      {
        hint: 'once its lease has run out, the sandbox goes back to its last checkpoint and any node can wake it',
      },
    );
  return undefined;
}

/** The node a sleeping sandbox wakes on, for the wake proxy (undefined: this one). */
export async function placeWakeFor(fleet: FleetHooks, s: Sandbox): Promise<NodeInfo | undefined> {
  if (s.state !== 'hibernated' && s.state !== 'archived') {
    // Awake: where it is (the proxy's resume there is a no-op that answers its address).
    if (s.node === undefined || s.node === fleet.name) return undefined;
    const owner = await fleet.store.getNode(s.node);
    return owner && alive(owner) ? owner : undefined;
  }
  const place = await routeFor(fleet, s, 'POST', '/resume', null);
  return place?.name === fleet.name ? undefined : place;
}

/** Resumes sandbox `id` on node `to` through its API; the sandbox as that node answers it. */
export async function resumeOn(to: NodeInfo, id: string, token: string): Promise<Sandbox> {
  const res = await fetch(new URL(`/v1/sandboxes/${encodeURIComponent(id)}/resume`, to.url), {
    method: 'POST',
    headers: { authorization: `Bearer ${token}`, [FORWARDED_HEADER]: 'proxy' },
    signal: AbortSignal.timeout(120_000),
  }).catch((e: unknown) => {
    throw new DormantError(
      ErrorCode.NODE_UNAVAILABLE,
      `node ${to.name} at ${to.url} does not answer: ${String(e)}`,
    );
  });
  const body = (await res.json().catch(() => ({}))) as {
    state?: Sandbox['state'];
    address?: string | null;
    error?: { code?: string; message?: string };
  };
  if (!res.ok || body.state === undefined)
    throw new DormantError(
      ErrorCode.NODE_UNAVAILABLE,
      `node ${to.name} could not wake sandbox ${id}: ${body.error?.message ?? `HTTP ${res.status}`}`,
    );
  return { id, state: body.state, ...(body.address ? { address: body.address } : {}) } as Sandbox;
}

/** Passes the request to `to` and streams its answer back; one hop. */
async function forward(req: FastifyRequest, reply: FastifyReply, to: NodeInfo, from: string): Promise<void> {
  const url = new URL(req.url, to.url);
  const headers: Record<string, string | string[]> = {};
  for (const [k, v] of Object.entries(req.headers)) if (v !== undefined && !HOP.has(k)) headers[k] = v;
  headers.host = url.host;
  headers[FORWARDED_HEADER] = from;
  reply.hijack();
  const out = reply.raw;
  await new Promise<void>((resolve) => {
    // Connecting is bounded (a node past its lease may not answer at all); an answer may take
    // as long as the operation (a hibernate), so the socket's idle bound is generous.
    const up = httpRequest(url, { method: req.method, headers, timeout: 600_000 }, (res: IncomingMessage) => {
      const h: Record<string, string | string[]> = {};
      for (const [k, v] of Object.entries(res.headers)) if (v !== undefined && !HOP.has(k)) h[k] = v;
      h['x-dormant-node'] = to.name;
      out.writeHead(res.statusCode ?? 502, h);
      res.pipe(out);
      res.on('end', resolve);
      res.on('error', () => {
        out.destroy();
        resolve();
      });
    });
    up.on('error', (e) => {
      if (!out.headersSent) {
        const err = new DormantError(
          ErrorCode.NODE_UNAVAILABLE,
          `sandbox request for node ${to.name} at ${to.url} failed: ${e.message}`,
        );
        out.writeHead(err.status, { 'content-type': 'application/json' });
        out.end(JSON.stringify({ error: err.toJSON() }));
      } else out.destroy();
      resolve();
    });
    up.on('timeout', () => up.destroy(new Error('no answer within 10 minutes')));
    const connectBound = setTimeout(() => {
      if (!up.socket || up.socket.connecting) up.destroy(new Error('could not connect within 5 s'));
    }, 5_000);
    up.on('socket', (sock) => sock.once('connect', () => clearTimeout(connectBound)));
    up.on('close', () => clearTimeout(connectBound));
    // The client gone: the forwarded request goes too.
    out.on('close', () => up.destroy());
    req.raw.pipe(up);
  });
}

/** What a client sent past an upgrade request's head (@fastify/websocket keeps it on the request). */
function upgradeHead(raw: IncomingMessage): Buffer | undefined {
  const k = Object.getOwnPropertySymbols(raw).find((x) => x.description === 'ws-head');
  const v = k === undefined ? undefined : (raw as unknown as Record<symbol, unknown>)[k];
  return Buffer.isBuffer(v) ? v : undefined;
}

/**
 * An upgrade request (a WebSocket) for a sandbox on node `to`: the request head is sent there
 * as it came (its Host that node's, one hop), and the client's connection and that node's are
 * joined byte for byte, so that node answers the upgrade and speaks the WebSocket itself.
 * Connecting is bounded at 5 s; a node that does not answer is NODE_UNAVAILABLE to the client.
 */
function forwardUpgrade(req: FastifyRequest, reply: FastifyReply, to: NodeInfo, from: string): void {
  const client = req.raw.socket;
  const head = upgradeHead(req.raw);
  const url = new URL(req.url, to.url);
  reply.hijack();
  let lines = `${req.method} ${req.url} HTTP/1.1\r\n`;
  const raw = req.raw.rawHeaders;
  for (let i = 0; i + 1 < raw.length; i += 2) {
    const k = raw[i]!.toLowerCase();
    if (k === 'host' || k === FORWARDED_HEADER) continue;
    lines += `${raw[i]!}: ${raw[i + 1]!}\r\n`;
  }
  lines += `host: ${url.host}\r\n${FORWARDED_HEADER}: ${from}\r\n\r\n`;
  let joined = false;
  const up = connect({ host: url.hostname.replace(/^\[|\]$/g, ''), port: Number(url.port || 80) });
  const bound = setTimeout(() => up.destroy(new Error('could not connect within 5 s')), 5_000);
  up.once('connect', () => {
    clearTimeout(bound);
    joined = true;
    up.write(lines, 'latin1');
    if (head !== undefined && head.length > 0) up.write(head);
    up.pipe(client);
    client.pipe(up);
  });
  up.on('error', (e) => {
    clearTimeout(bound);
    if (joined || client.destroyed) {
      client.destroy();
      return;
    }
    const err = new DormantError(
      ErrorCode.NODE_UNAVAILABLE,
      `sandbox request for node ${to.name} at ${to.url} failed: ${e.message}`,
    );
    const body = JSON.stringify({ error: err.toJSON() });
    client.end(
      `HTTP/1.1 ${err.status} Service Unavailable\r\ncontent-type: application/json\r\n` +
        `content-length: ${Buffer.byteLength(body)}\r\nx-dormant-node: ${to.name}\r\nconnection: close\r\n\r\n${body}`,
    );
  });
  up.on('close', () => client.destroy());
  client.on('error', () => up.destroy());
  client.on('close', () => up.destroy());
}
