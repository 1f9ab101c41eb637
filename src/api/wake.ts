/**
 * What the daemon runs beside its API to make sleeping automatic and waking invisible: the
 * policy loop and the wake proxy, tied to the controller and the token store, and the
 * `GET /v1/sandboxes/{id}/url` route that says where a sandbox port is reached.
 */
import { AWAKE_STATES, type NodeInfo } from '../domain/node.js';
import { resumeOn } from './fleet.js';
import { join } from 'node:path';
import type { FastifyInstance } from 'fastify';
import { z } from 'zod';
import { DormantError, ErrorCode, isDormantError } from '../domain/errors.js';
import type { Sandbox } from '../domain/sandbox.js';
import type { StateStore } from '../state/store.js';
import {
  WakeProxy,
  type NodeProxy,
  type ProxiedSandbox,
  type ProxyOptions,
  type WakeTarget,
} from '../proxy/proxy.js';
import type { TrackingController } from '../control/activity.js';
import {
  PolicyLoop,
  type PolicyLoopOptions,
  type PolicyStep,
  type PolicyTarget,
} from '../control/policy-loop.js';
import type { PolicyDefaults } from '../control/policy.js';
import type { Clock } from '../control/sandboxes.js';
import { authenticate } from './auth.js';
import { SandboxUrlSchema } from './schemas.js';

export interface ProxyConfig {
  /** host:port. Default: the API's host, on the API's port + 1 (7421), or a free port when the API's is 0. */
  listen?: string;
  /** Sandbox hosts are `PORT-ID.<domain>`. Default `dormant.localhost`. */
  domain?: string;
  /** How long a request is held while its sandbox wakes. Default 30 s. */
  wakeTimeoutMs?: number;
  tcp?: ProxyOptions['tcp'];
}

export interface PolicyConfig {
  /** Milliseconds between passes. Default 5000; 0 runs no timer (tick by hand). */
  intervalMs?: number;
  /** Node and per-tenant defaults under each sandbox's own policy. */
  defaults?: PolicyDefaults;
  /** CPU share of one core above which a sandbox counts as busy. Default 0.05. */
  cpuActiveShare?: number;
  onStep?: (step: PolicyStep) => void;
}

export interface WakeServices {
  proxy: WakeProxy | undefined;
  policy: PolicyLoop | undefined;
  close(): Promise<void>;
}

/**
 * Activity never shortens a lease: `dormant keepalive` sets lastActiveAt in the future, and a
 * request in the meantime must not pull it back to now.
 */
async function touchKeepingLease(controller: TrackingController, clock: Clock, id: string): Promise<void> {
  let s: Sandbox;
  try {
    s = await controller.get(id);
  } catch {
    return; // removed meanwhile
  }
  if (s.lastActiveAt < clock.now()) await controller.touch(id);
}

/**
 * In a fleet: the node that wakes a sandbox (undefined: this one) and the token this node
 * asks it with (the admin token: the database, and so the tokens, are shared).
 */
export interface ProxyFleet {
  placeWake(s: Sandbox): Promise<NodeInfo | undefined>;
  token: string;
  /** A node as registered (its proxy's URL among the rest). */
  node(name: string): Promise<NodeInfo | undefined>;
}

export function wakeTarget(
  controller: TrackingController,
  store: StateStore,
  clock: Clock,
  fleet?: ProxyFleet,
): WakeTarget {
  // The proxy looks a sandbox up on every request, and a SQLite read costs tens of µs here:
  // what was read stays good until the store changes a sandbox, and is answered at once. A
  // store that other processes write too (no sandboxVersion) is read every time.
  const found = new Map<string, { version: number; boxes: ProxiedSandbox[] }>();
  // In a fleet, a sandbox awake on another node is served by that node's proxy.
  const here = (s: Sandbox): ProxiedSandbox => {
    const p = proxied(s);
    if (fleet && s.node !== undefined && s.node !== controller.node && AWAKE_STATES.includes(s.state))
      p.elsewhere = s.node;
    return p;
  };
  const read = async (ref: string): Promise<ProxiedSandbox[]> => {
    const byId = await store.getSandbox(ref);
    return byId ? [here(byId)] : (await store.listSandboxes()).filter((s) => s.name === ref).map(here);
  };
  return {
    find: (ref) => {
      // Taken before the read: a change during it leaves the entry stale, and so unused.
      const version = store.sandboxVersion;
      if (version === undefined) return read(ref);
      const hit = found.get(ref);
      if (hit?.version === version) return hit.boxes;
      return read(ref).then((boxes) => {
        if (found.size >= 1000) found.clear();
        found.set(ref, { version, boxes });
        return boxes;
      });
    },
    list: async () => (await controller.list()).map(proxied),
    wake: async (id, reason) => {
      // In a fleet, where placement says; the proxy then relays through that node's proxy
      // (nodeProxy) for HTTP, and connects to the address for raw TCP (docs/FLEET.md).
      const there = fleet ? await fleet.placeWake(await controller.get(id)) : undefined;
      const s = there
        ? await resumeOn(there, id, fleet!.token)
        : await controller.resume(id, undefined, reason);
      if (s.state !== 'running' || s.address === undefined) {
        throw new DormantError(ErrorCode.INTERNAL, `sandbox ${id} is ${s.state} after a resume`);
      }
      return s.address;
    },
    touch: (id) => touchKeepingLease(controller, clock, id),
    listening: async (id, port) => {
      // Another node's sandbox: this node's runtime cannot tell; the proxy probes instead.
      if (fleet && (await store.getSandbox(id))?.node !== controller.node) return undefined;
      return controller.listensOn(id, port);
    },
    ...(fleet
      ? {
          nodeProxy: async (name: string): Promise<NodeProxy | undefined> => {
            const n = await fleet.node(name);
            if (n?.proxyUrl === undefined) return undefined;
            const u = new URL(n.proxyUrl);
            return {
              host: u.hostname.replace(/^\[|\]$/g, ''),
              port: Number(u.port || 80),
              token: fleet.token,
            };
          },
        }
      : {}),
    authenticate: async (token) => {
      const tokens = await store.listTokens();
      try {
        return authenticate(`Bearer ${token}`, tokens);
      } catch (e) {
        if (isDormantError(e, 'UNAUTHORIZED')) return undefined;
        throw e;
      }
    },
  };
}

function proxied(s: Sandbox): ProxiedSandbox {
  return {
    id: s.id,
    name: s.name,
    tenant: s.tenant,
    state: s.state,
    address: s.address,
    ports: s.spec.ports,
  };
}

function defaultProxyListen(apiListen: string): string {
  const m = /^(.*):(\d+)$/.exec(apiListen);
  if (!m) return '127.0.0.1:7421';
  const port = Number(m[2]);
  return `${m[1]!}:${port === 0 ? 0 : port + 1}`;
}

export async function startWakeServices(o: {
  controller: TrackingController;
  store: StateStore;
  app: FastifyInstance;
  clock: Clock;
  dataDir: string;
  apiListen: string;
  proxy?: ProxyConfig | false;
  policy?: PolicyConfig | false;
  /** Warnings of the wake proxy. Default: stderr. */
  warn?: (message: string) => void;
  /** This node in a fleet: sleeping sandboxes wake where placement says. */
  fleet?: ProxyFleet;
}): Promise<WakeServices> {
  const { controller, store, clock } = o;
  const proxy =
    o.proxy === false
      ? undefined
      : await WakeProxy.start({
          target: wakeTarget(controller, store, clock, o.fleet),
          listen: o.proxy?.listen ?? defaultProxyListen(o.apiListen),
          tcpPortsFile: join(o.dataDir, 'proxy-ports.json'),
          ...(o.proxy?.domain !== undefined ? { domain: o.proxy.domain } : {}),
          ...(o.proxy?.wakeTimeoutMs !== undefined ? { wakeTimeoutMs: o.proxy.wakeTimeoutMs } : {}),
          ...(o.proxy?.tcp !== undefined ? { tcp: o.proxy.tcp } : {}),
          ...(o.warn !== undefined ? { warn: o.warn } : {}),
        });
  let policy: PolicyLoop | undefined;
  if (o.policy !== false) {
    const target: PolicyTarget = {
      // In a fleet, this node's sandboxes: each node applies the policy to its own.
      list: () => controller.listOwn(),
      get: (id) => controller.get(id),
      // The controller's pause takes no reason yet; its transition reads 'pause'.
      pause: (id, tenant) => controller.pause(id, tenant),
      hibernate: (id, tenant, reason) => controller.hibernate(id, tenant, reason),
      archive: (id, tenant, reason) => controller.archive(id, tenant, reason),
      remove: (id, tenant) => controller.remove(id, tenant),
      usage: (id) => controller.usage(id),
      touch: (id) => touchKeepingLease(controller, clock, id),
      note: (id, reason) => controller.note(id, reason),
    };
    const lo: PolicyLoopOptions = {
      target,
      clock,
      activity: (id) => ({
        openConnections: proxy?.openConnections(id) ?? 0,
        runningExecs: controller.execs.count(id),
      }),
      ...(o.policy?.intervalMs !== undefined ? { intervalMs: o.policy.intervalMs } : {}),
      ...(o.policy?.defaults !== undefined ? { defaults: o.policy.defaults } : {}),
      ...(o.policy?.cpuActiveShare !== undefined ? { cpuActiveShare: o.policy.cpuActiveShare } : {}),
      ...(o.policy?.onStep !== undefined ? { onStep: o.policy.onStep } : {}),
      ...(o.warn !== undefined ? { warn: o.warn } : {}),
    };
    policy = new PolicyLoop(lo);
    policy.start();
  }
  registerUrlRoute(o.app, controller, proxy);
  return {
    proxy,
    policy,
    async close() {
      await policy?.close();
      await proxy?.close();
    },
  };
}

const UrlQuery = z.object({ port: z.coerce.number().int().min(1).max(65535) });

function registerUrlRoute(
  app: FastifyInstance,
  controller: TrackingController,
  proxy: WakeProxy | undefined,
): void {
  app.get('/v1/sandboxes/:id/url', async (req) => {
    const params = req.params as { id?: string };
    const q = UrlQuery.safeParse(req.query);
    if (!q.success) {
      throw new DormantError(ErrorCode.INVALID_ARGUMENT, 'invalid query: port must be 1-65535');
    }
    const tenant = req.principal.admin ? undefined : req.principal.tenant;
    const s = await controller.get(params.id ?? '', tenant);
    if (!proxy) {
      throw new DormantError(ErrorCode.PROXY_DISABLED, 'this daemon runs no wake proxy');
    }
    await proxy.sync();
    const u = proxy.urlFor(proxied(s), q.data.port);
    if (!u) {
      const declared = s.spec.ports.map((p) => p.port).join(', ') || 'none';
      throw new DormantError(
        ErrorCode.INVALID_ARGUMENT,
        `sandbox ${s.id} did not declare port ${q.data.port}`,
        {
          hint: `declared ports: ${declared} (dormant create --port P)`,
        },
      );
    }
    const out: z.output<typeof SandboxUrlSchema> = {
      id: s.id,
      port: q.data.port,
      ...u,
      auth: u.public ? 'none' : 'token',
    };
    return out;
  });
}
