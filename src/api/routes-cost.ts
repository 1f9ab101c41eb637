/** GET /v1/cost: what was spent, what staying warm would have cost, what sleeping saved. */
import type { FastifyInstance } from 'fastify';
import { DormantError, ErrorCode } from '../domain/errors.js';
import { parseDurationMs } from '../domain/units.js';
import type { Meter } from '../control/meter.js';

export function registerCostRoutes(app: FastifyInstance, meter: Meter): void {
  app.get('/v1/cost', async (req) => {
    const q = req.query as { since?: unknown; by?: unknown; points?: unknown };
    const points = q.points === undefined ? 0 : Number(q.points);
    if (!Number.isInteger(points) || points < 0 || points > 200) {
      throw new DormantError(ErrorCode.INVALID_ARGUMENT, 'invalid points: expected an integer 0-200');
    }
    let sinceMs: number | undefined;
    if (q.since !== undefined) {
      try {
        if (typeof q.since !== 'string') throw new RangeError('expected a duration such as 24h');
        sinceMs = parseDurationMs(q.since);
      } catch (e) {
        throw new DormantError(ErrorCode.INVALID_ARGUMENT, `invalid since: ${(e as Error).message}`);
      }
    }
    if (q.by !== undefined && q.by !== 'sandbox' && q.by !== 'tenant') {
      throw new DormantError(ErrorCode.INVALID_ARGUMENT, 'invalid by: expected sandbox or tenant');
    }
    const tenant = req.principal.admin ? undefined : req.principal.tenant;
    const r = await meter.report({
      points,
      ...(sinceMs !== undefined ? { sinceMs } : {}),
      ...(tenant !== undefined ? { tenant } : {}),
    });
    return {
      currency: r.currency,
      since: new Date(r.since).toISOString(),
      until: new Date(r.until).toISOString(),
      prices: r.prices,
      totals: r.totals,
      ...(q.by === 'tenant' ? { tenants: r.tenants } : { sandboxes: r.sandboxes, tenants: r.tenants }),
      neverSlept: r.neverSlept,
      capacity: r.capacity,
      /** Cumulative spent and always-warm at `points` evenly spaced times (`?points=N`). */
      series: r.series.map((p) => ({
        at: new Date(p.at).toISOString(),
        spent: p.spent,
        alwaysWarm: p.alwaysWarm,
      })),
    };
  });
}
