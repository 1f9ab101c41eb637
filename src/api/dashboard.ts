/**
 * The dashboard's static files at `/` (index.html) and `/dashboard/*`. They are public: the
 * page holds no data, and talks to the API with the token the user pastes (kept in the
 * browser's localStorage) or passes once as `/#token=...`, which never reaches a server log.
 *
 * The files are hand-written HTML, CSS and JavaScript modules (src/dashboard/static), copied
 * to dist/dashboard/static by `npm run build`; served from src/ when it is there (a checkout),
 * else from that copy. `sse.js` is the SDK's event-stream reader, compiled (SSE_MODULE).
 */
import type { FastifyInstance } from 'fastify';
import { readFile } from 'node:fs/promises';
import { existsSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { DormantError, ErrorCode } from '../domain/errors.js';

const TYPES: Record<string, string> = {
  'index.html': 'text/html; charset=utf-8',
  'app.js': 'text/javascript; charset=utf-8',
  'detail.js': 'text/javascript; charset=utf-8',
  'ui.js': 'text/javascript; charset=utf-8',
  'sse.js': 'text/javascript; charset=utf-8',
  'style.css': 'text/css; charset=utf-8',
};

/**
 * The event-stream reader the dashboard shares with the SDK: the SDK's module as tsc compiled
 * it (plain ECMAScript with no imports), next to this file's own compiled copy.
 */
const SSE_MODULE = fileURLToPath(new URL('../sdk/sse.js', import.meta.url));

export function dashboardDir(): string {
  // In a checkout the source folder is the truth (a dist copy from an older build may lag
  // behind it); an installed package has only the built copy.
  const source = fileURLToPath(new URL('../../src/dashboard/static/', import.meta.url));
  if (existsSync(`${source}index.html`)) return source;
  return fileURLToPath(new URL('../dashboard/static/', import.meta.url));
}

/** Paths the auth hook lets through without a token. */
export function isDashboardPath(path: string): boolean {
  return path === '/' || path === '/index.html' || path === '/favicon.ico' || path.startsWith('/dashboard/');
}

export function registerDashboard(app: FastifyInstance): void {
  const dir = dashboardDir();
  const send = async (name: string) => {
    const type = TYPES[name];
    if (type === undefined) throw new DormantError(ErrorCode.NOT_FOUND, `no dashboard file ${name}`);
    return { type, body: await readFile(name === 'sse.js' ? SSE_MODULE : `${dir}${name}`) };
  };
  const headers = {
    'cache-control': 'no-cache',
    // The page loads only its own files and talks only to this origin's API.
    'content-security-policy':
      "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'; frame-ancestors 'none'",
    'x-content-type-options': 'nosniff',
    'referrer-policy': 'no-referrer',
  };
  app.get('/', async (_req, reply) => {
    const f = await send('index.html');
    return reply.headers(headers).type(f.type).send(f.body);
  });
  app.get('/index.html', async (_req, reply) => reply.redirect('/'));
  app.get('/dashboard/:file', async (req, reply) => {
    const f = await send((req.params as { file: string }).file);
    return reply.headers(headers).type(f.type).send(f.body);
  });
}
