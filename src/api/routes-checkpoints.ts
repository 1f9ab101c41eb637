/**
 * GET /v1/checkpoints/{id}/inspect and /v1/checkpoints/{id}/scan: the checkpoint is
 * restored from the vault into a private memory-backed folder, read, and wiped before the
 * answer is sent. A token sees only its tenant's checkpoints (another tenant's answers 404).
 */
import type { FastifyInstance, FastifyRequest } from 'fastify';
import { z } from 'zod';
import { DormantError, ErrorCode } from '../domain/errors.js';
import type { StateStore } from '../state/store.js';
import { inspectCheckpoint } from '../checkpoint/inspect.js';
import { scanCheckpoint } from '../checkpoint/scan.js';
import { openDormantCheckpoint, type OpenedCheckpoint, type VaultReader } from '../checkpoint/source.js';

export interface CheckpointRouteOptions {
  store: StateStore;
  /** The vault; without one these routes answer 503. */
  vault?: VaultReader;
  /** Memory-backed staging folder (default /dev/shm). */
  stagingDir?: string;
}

const Params = z.object({ id: z.string().min(1).max(128) });

export function registerCheckpointRoutes(app: FastifyInstance, opts: CheckpointRouteOptions): void {
  const open = async (req: FastifyRequest): Promise<OpenedCheckpoint> => {
    const p = Params.safeParse(req.params);
    if (!p.success) throw new DormantError(ErrorCode.INVALID_ARGUMENT, 'bad checkpoint id');
    const id = p.data.id;
    const c = await opts.store.getCheckpoint(id);
    if (!c || (!req.principal.admin && c.tenant !== req.principal.tenant))
      throw new DormantError(ErrorCode.CHECKPOINT_NOT_FOUND, `no checkpoint ${id}`);
    if (c.kind !== 'memory')
      throw new DormantError(
        ErrorCode.CHECKPOINT_FILESYSTEM_ONLY,
        `checkpoint ${id} holds only a filesystem (no processes)`,
      );
    if (!opts.vault)
      throw new DormantError(
        ErrorCode.CHECKPOINT_READS_DISABLED,
        'this daemon was started without a vault for checkpoint reads',
      );
    const meta: Record<string, string> = {};
    for (const [k, v] of Object.entries(c.meta)) if (typeof v === 'string') meta[k] = v;
    return openDormantCheckpoint({
      vault: opts.vault,
      tenant: c.tenant,
      checkpointId: c.id,
      sandboxId: c.sandboxId,
      createdAt: new Date(c.createdAt).toISOString(),
      meta,
      stagingDir: opts.stagingDir,
    });
  };

  app.get('/v1/checkpoints/:id/inspect', async (req) => {
    const ck = await open(req);
    try {
      return await inspectCheckpoint(ck);
    } finally {
      await ck.close();
    }
  });

  app.get('/v1/checkpoints/:id/scan', async (req) => {
    const ck = await open(req);
    try {
      return await scanCheckpoint(ck);
    } finally {
      await ck.close();
    }
  });
}
