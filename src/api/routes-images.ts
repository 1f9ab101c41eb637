/**
 * Registry logins and the image cache over HTTP (docs/IMAGES.md):
 * - `PUT /v1/registries/{host}` stores the token's tenant's login to a registry (checked with
 *   the registry first, the password sealed with the tenant's key); `GET /v1/registries` lists
 *   the logins (never a password), `DELETE /v1/registries/{host}` forgets one. An admin token
 *   lists every tenant's and logs in for its own tenant like any other.
 * - `GET /v1/images` (admin) lists the unpacked images and the sandboxes using each;
 *   `POST /v1/images/prune` (admin) removes what no sandbox uses now, as the timer does.
 */
import type { FastifyInstance } from 'fastify';
import type { ImageService, RegistryLogin } from '../control/images.js';
import { requireAdmin } from './routes-tokens.js';
import { RegistryHostParams, RegistryLoginBody } from './schemas.js';
import { parse } from './validate.js';

function loginView(l: RegistryLogin): Record<string, string> {
  return {
    host: l.host,
    username: l.username,
    tenant: l.tenant,
    createdAt: new Date(l.createdAt).toISOString(),
  };
}

export function registerImageRoutes(app: FastifyInstance, images: ImageService): void {
  app.put('/v1/registries/:host', async (req) => {
    const { host } = parse(RegistryHostParams, req.params, 'path');
    const b = parse(RegistryLoginBody, req.body, 'request body');
    return loginView(await images.login(req.principal.tenant, host, b.username, b.password));
  });

  app.get('/v1/registries', async (req) => ({
    registries: (await images.logins(req.principal.admin ? undefined : req.principal.tenant)).map(loginView),
  }));

  app.delete('/v1/registries/:host', async (req, reply) => {
    const { host } = parse(RegistryHostParams, req.params, 'path');
    await images.logout(req.principal.tenant, host);
    return reply.status(204).send();
  });

  app.get('/v1/images', async (req) => {
    requireAdmin(req, 'listing the image cache');
    return {
      images: (await images.list()).map((i) => ({ ...i, unpackedAt: new Date(i.unpackedAt).toISOString() })),
    };
  });

  app.post('/v1/images/prune', async (req) => {
    requireAdmin(req, 'pruning the image cache');
    return images.prune();
  });
}
