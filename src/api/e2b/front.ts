/**
 * The E2B front: a listener of its own (off unless `e2b.listen` is set) that answers E2B's
 * REST API and envd's, so a program written for E2B's SDK runs against this node with only
 * its environment changed (E2B_API_URL and E2B_SANDBOX_URL may both be this listener's URL;
 * the two are told apart by path). docs/E2B.md says what is supported.
 *
 * Keys: an `e2b_` key is an API token like any other (routes-tokens.ts mints it with
 * `e2b: true`), stored hashed, with the tenant rules of every token; the SDK sends it as
 * X-API-Key. envd calls carry no key: each carries the sandbox's `envdAccessToken`, an HMAC
 * of the sandbox id under a key derived from the node's secret (nothing stored), handed out
 * only by create and connect to the sandbox's own tenant, and checked on every call.
 */
import Fastify, { type FastifyInstance, type FastifyRequest } from 'fastify';
import { createHmac, randomBytes, timingSafeEqual } from 'node:crypto';
import { DormantError, ErrorCode, asError, errorInfo } from '../../domain/errors.js';
import type { Sandbox } from '../../domain/sandbox.js';
import type { SandboxController } from '../../control/sandboxes.js';
import type { StateStore } from '../../state/store.js';
import { Unauthorized, authenticate, type Principal } from '../auth.js';
import { scrubHostPaths } from '../server.js';
import { ConnectError, sendUnaryError } from './connect.js';
import { registerEnvd } from './envd.js';
import { registerRest } from './rest.js';
import { MAX_METRIC_POINTS, metricPoints } from '../../control/meter.js';
import type { E2bTemplate } from './templates.js';

export interface E2bFrontOptions {
  controller: SandboxController;
  store: StateStore;
  /** HOST:PORT of the front's listener. */
  listen: string;
  templates: Readonly<Record<string, E2bTemplate>>;
  /** The key envd access tokens are derived under (the caller's copy is wiped after use). */
  accessKey?: () => Buffer;
  /** E2B_DOMAIN: the wake proxy's domain. */
  domain?: string;
  /** The daemon's folders, scrubbed from every message. */
  hostPaths?: readonly string[];
  /** Largest multipart upload to /files. Default 64 MiB. */
  maxMultipartBytes?: number;
  logger?: boolean;
}

export interface E2bFront {
  url: string;
  app: FastifyInstance;
  close(): Promise<void>;
}

/** What `dormant e2b` prints: the variables an E2B program is run with. */
export interface E2bInfo {
  apiUrl: string;
  sandboxUrl: string;
  domain: string | null;
}

/** E2B's API key format, which its SDK checks before it sends anything. */
export const E2B_KEY_PATTERN = /^e2b_[0-9a-f]+$/;

/** A new E2B-format API key: `e2b_` and 40 hex digits (160 random bits). */
export function newE2bKey(): string {
  return `e2b_${randomBytes(20).toString('hex')}`;
}

/** Without the node's secret (an embedding), tokens last as long as this process. */
const processKey = randomBytes(32);

/** The paths of envd's Connect services: their errors are Connect's. */
const isConnectPath = (url: string): boolean => /^\/(process\.Process|filesystem\.Filesystem)\//.test(url);

export async function startE2bFront(opts: E2bFrontOptions): Promise<E2bFront> {
  const { controller, store } = opts;
  const app = Fastify({ logger: opts.logger ?? false, bodyLimit: 4 * 1024 * 1024 });
  const hostPaths = opts.hostPaths ?? [];

  const accessToken = (sandboxId: string): string => {
    const key = opts.accessKey?.() ?? processKey;
    try {
      return createHmac('sha256', key).update(`e2b-envd:${sandboxId}`).digest('hex');
    } finally {
      if (key !== processKey) key.fill(0);
    }
  };

  const principalOf = async (req: FastifyRequest): Promise<Principal> => {
    const key = req.headers['x-api-key'];
    if (typeof key !== 'string' || key === '') throw new Unauthorized('no API key (X-API-Key)');
    return authenticate(`Bearer ${key}`, await store.listTokens());
  };

  const sandboxOf = async (req: FastifyRequest): Promise<Sandbox> => {
    const id = req.headers['e2b-sandbox-id'];
    const token = req.headers['x-access-token'];
    if (typeof id !== 'string' || id === '' || id.length > 200)
      throw new ConnectError('invalid_argument', 'no sandbox id (E2b-Sandbox-Id)');
    const want = Buffer.from(accessToken(id));
    const got = Buffer.from(typeof token === 'string' ? token : '');
    if (got.length !== want.length || !timingSafeEqual(got, want))
      throw new ConnectError('unauthenticated', 'invalid access token for this sandbox (X-Access-Token)');
    return await controller.get(id);
  };

  // Connect's streaming requests come as an enveloped body: bytes, read by the route.
  app.addContentTypeParser('application/connect+json', { parseAs: 'buffer' }, (_req, body, done) =>
    done(null, body),
  );
  // File uploads (multipart, octet-stream, or none) are streamed, never parsed here.
  app.addContentTypeParser('*', (_req, payload, done) => done(null, payload));

  app.setErrorHandler((err: unknown, req, reply) => {
    if (isConnectPath(req.url)) return sendUnaryError(reply, err);
    // E2B's REST errors (and envd's /files): { code: HTTP status, message }.
    let status = 500;
    let message = `internal error (request ${req.id})`;
    if (err instanceof DormantError) {
      status = errorInfo(err.code).status;
      message = scrubHostPaths(err.message, hostPaths);
    } else if (err instanceof ConnectError) {
      status = { invalid_argument: 400, unauthenticated: 401, not_found: 404 }[err.code as string] ?? 500;
      message = err.message;
    } else {
      const e = asError(err) as Error & { statusCode?: number };
      if (typeof e.statusCode === 'number' && e.statusCode >= 400 && e.statusCode < 500) {
        status = e.statusCode;
        message = e.message;
      } else app.log.error(err);
    }
    return reply.status(status).send({ code: status, message });
  });
  app.setNotFoundHandler((req, reply) => {
    const message = `no route ${req.method} ${(req.url.split('?')[0] ?? '').slice(0, 200)}`;
    if (isConnectPath(req.url)) return reply.status(501).send({ code: 'unimplemented', message });
    return reply.status(404).send({ code: 404, message });
  });

  registerRest(app, {
    controller,
    templates: opts.templates,
    principalOf,
    accessToken,
    domain: opts.domain,
    metrics: async (id, since) =>
      metricPoints(await store.sandboxSamples(id, { since, limit: MAX_METRIC_POINTS }), since),
  });
  registerEnvd(app, { controller, sandboxOf, maxMultipartBytes: opts.maxMultipartBytes ?? 64 * 1024 * 1024 });

  const m = /^(.*):(\d+)$/.exec(opts.listen);
  if (!m) throw new DormantError(ErrorCode.INVALID_ARGUMENT, `e2b.listen ${opts.listen}: expected HOST:PORT`);
  const host = m[1]!.replace(/^\[|\]$/g, '');
  await app.listen({ host, port: Number(m[2]) });
  const addr = app.server.address();
  const port = typeof addr === 'object' && addr ? addr.port : Number(m[2]);
  return {
    url: `http://${host.includes(':') ? `[${host}]` : host}:${port}`,
    app,
    close: () => app.close(),
  };
}

/**
 * GET /v1/e2b on dormant's own API: the variables an E2B program is run with, for
 * `dormant e2b`. 404 while the front is off.
 */
export function registerE2bInfo(app: FastifyInstance, info: () => E2bInfo | undefined): void {
  app.get('/v1/e2b', async () => {
    const i = info();
    if (i === undefined)
      throw new DormantError(ErrorCode.NOT_FOUND, 'the E2B front is off on this node', {
        hint: 'start the daemon with --e2b-listen 127.0.0.1:3001 (or e2b.listen in its configuration)',
      });
    return i;
  });
}
