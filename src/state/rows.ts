/**
 * Rows as both stores keep them, and the records they read back as. SQLite hands JSON columns
 * back as text, PostgreSQL as parsed values: `J` is that column's form, and `json` turns it
 * into the value.
 */
import type { GpuPolicy } from '../domain/gpu.js';
import type { Sandbox, SandboxSpec, SandboxState } from '../domain/sandbox.js';
import type { CheckpointRecord } from './store.js';

export interface SandboxRow<J> {
  id: string;
  tenant: string;
  name: string;
  state: string;
  spec: J;
  created_at: number;
  state_since: number;
  last_active_at: number;
  checkpoint_id: string | null;
  last_error: string | null;
  memory_bytes: number;
  address: string | null;
  gpus: string | null;
  gpu_policy: string;
  lazy_restore_of: string | null;
  node: string | null;
}

export interface CheckpointRow<J> {
  id: string;
  sandbox_id: string;
  tenant: string;
  created_at: number;
  kind: string;
  logical_bytes: number;
  stored_bytes: number;
  meta: J;
}

export function sandboxFromRow<J>(r: SandboxRow<J>, json: (v: J) => unknown): Sandbox {
  const s: Sandbox = {
    id: r.id,
    tenant: r.tenant,
    name: r.name,
    state: r.state as SandboxState,
    spec: json(r.spec) as SandboxSpec,
    createdAt: r.created_at,
    stateSince: r.state_since,
    lastActiveAt: r.last_active_at,
    memoryBytes: r.memory_bytes,
    gpuPolicy: r.gpu_policy as GpuPolicy,
  };
  if (r.gpus !== null) s.gpus = r.gpus;
  if (r.checkpoint_id !== null) s.checkpointId = r.checkpoint_id;
  if (r.last_error !== null) s.lastError = r.last_error;
  if (r.address !== null) s.address = r.address;
  if (r.lazy_restore_of !== null) s.lazyRestoreOf = r.lazy_restore_of;
  if (r.node !== null && r.node !== undefined) s.node = r.node;
  return s;
}

export function checkpointFromRow<J>(r: CheckpointRow<J>, json: (v: J) => unknown): CheckpointRecord {
  return {
    id: r.id,
    sandboxId: r.sandbox_id,
    tenant: r.tenant,
    createdAt: r.created_at,
    kind: r.kind as CheckpointRecord['kind'],
    logicalBytes: r.logical_bytes,
    storedBytes: r.stored_bytes,
    meta: json(r.meta) as Record<string, unknown>,
  };
}

/** The sandboxes column of each field a patch may change (id and state are not among them). */
const COLUMNS: Record<string, string> = {
  tenant: 'tenant',
  name: 'name',
  spec: 'spec',
  createdAt: 'created_at',
  stateSince: 'state_since',
  lastActiveAt: 'last_active_at',
  checkpointId: 'checkpoint_id',
  lastError: 'last_error',
  memoryBytes: 'memory_bytes',
  address: 'address',
  gpus: 'gpus',
  gpuPolicy: 'gpu_policy',
  lazyRestoreOf: 'lazy_restore_of',
  node: 'node',
};

/**
 * The patch's known fields as [column, value]: the spec as JSON text (never the object: pg
 * would send a JS array as a PostgreSQL array), undefined as NULL; unknown fields are ignored.
 */
export function patchAssignments(patch: Partial<Sandbox>): [string, unknown][] {
  const out: [string, unknown][] = [];
  for (const [k, v] of Object.entries(patch)) {
    const col = COLUMNS[k];
    if (col !== undefined) out.push([col, k === 'spec' ? JSON.stringify(v) : (v ?? null)]);
  }
  return out;
}
