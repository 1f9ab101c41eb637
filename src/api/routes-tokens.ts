/**
 * API tokens over HTTP (admin only): POST /v1/tokens mints one for a tenant and answers the
 * token once; GET /v1/tokens lists them; DELETE /v1/tokens/{id} revokes one. A token's public
 * id is the first 12 hex digits of its SHA-256, so it can be named without being shown again.
 */
import type { FastifyInstance, FastifyRequest } from 'fastify';
import { DormantError, ErrorCode } from '../domain/errors.js';
import type { StateStore, TokenRow } from '../state/store.js';
import { hashToken, newToken } from './auth.js';
import { newE2bKey } from './e2b/front.js';
import { CreateTokenBody, TokenIdParams, type TokenView } from './schemas.js';
import { parse } from './validate.js';

/** How many hex digits of the hash name a token in the API and the CLI. */
export const TOKEN_ID_LENGTH = 12;

export function tokenView(t: TokenRow): TokenView {
  return {
    id: t.hash.slice(0, TOKEN_ID_LENGTH),
    tenant: t.tenant,
    admin: t.admin,
    createdAt: new Date(t.createdAt).toISOString(),
    revokedAt: t.revokedAt === undefined ? null : new Date(t.revokedAt).toISOString(),
  };
}

export function requireAdmin(req: FastifyRequest, what: string): void {
  if (!req.principal.admin) throw new DormantError(ErrorCode.FORBIDDEN, `${what} needs an admin token`);
}

export interface TokenRouteOptions {
  store: StateStore;
}

export function registerTokenRoutes(app: FastifyInstance, opts: TokenRouteOptions): void {
  const { store } = opts;

  app.post('/v1/tokens', async (req, reply) => {
    requireAdmin(req, 'creating a token');
    const b = parse(CreateTokenBody, req.body, 'request body');
    // An E2B-format key (`e2b_` + hex) for E2B's SDK: the same token otherwise (e2b/front.ts).
    const token = b.e2b ? newE2bKey() : newToken();
    const row: TokenRow = { hash: hashToken(token), tenant: b.tenant, admin: b.admin, createdAt: Date.now() };
    await store.insertToken(row);
    return reply.status(201).send({ ...tokenView(row), token });
  });

  app.get('/v1/tokens', async (req) => {
    requireAdmin(req, 'listing tokens');
    return { tokens: (await store.listTokens()).map(tokenView) };
  });

  app.delete('/v1/tokens/:id', async (req) => {
    requireAdmin(req, 'revoking a token');
    const { id } = parse(TokenIdParams, req.params, 'path');
    // The check and the revoke in one transaction: two admins revoked at once must not both
    // pass the last-admin check.
    return store.atomically(async (tx) => {
      const all = await tx.listTokens();
      const matches = all.filter((t) => t.hash.startsWith(id.toLowerCase()));
      if (matches.length === 0) throw new DormantError(ErrorCode.TOKEN_NOT_FOUND, `no token ${id}`);
      if (matches.length > 1)
        throw new DormantError(ErrorCode.INVALID_ARGUMENT, `token id ${id} is ambiguous`, {
          hint: `give more of the id (${TOKEN_ID_LENGTH} hex digits)`,
        });
      const t = matches[0]!;
      if (
        t.admin &&
        t.revokedAt === undefined &&
        all.filter((x) => x.admin && x.revokedAt === undefined).length === 1
      )
        throw new DormantError(ErrorCode.LAST_ADMIN_TOKEN, `token ${id} is the last admin token`);
      // Revoking twice is not an error: the token is revoked either way.
      await tx.revokeToken(t.hash, Date.now());
      return tokenView((await tx.listTokens()).find((x) => x.hash === t.hash) ?? t);
    });
  });
}
