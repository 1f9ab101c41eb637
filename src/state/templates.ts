/**
 * Templates in the database of record: a named, warmed checkpoint that new sandboxes start
 * from (control/ops/template.ts). One row per template, its name unique within its tenant; a
 * public one is seen by every tenant. The checkpoint itself is an ordinary row of
 * `checkpoints`, owned by the template's id (no sandbox prunes or shreds it).
 */
import type Database from 'better-sqlite3';
import type { SandboxSpec } from '../domain/sandbox.js';
import { DormantError, ErrorCode } from '../domain/errors.js';

export interface TemplateRecord {
  /** `tp-...`: also the checkpoint's owner in the vault (its key is the template's). */
  id: string;
  tenant: string;
  name: string;
  /** Seen (and used) by every tenant, not only its own. Only an admin sets it. */
  public: boolean;
  checkpointId: string;
  /** What a sandbox made from it is given: the spec of the sandbox it was made from, its env sealed under the template's id. */
  spec: SandboxSpec;
  /** Where it came from, for people: `sandbox sb-...`, `image REF`, `rootfs DIR`. */
  origin: string;
  createdAt: number;
}

export interface TemplateStore {
  /** Throws TEMPLATE_NAME_TAKEN when the tenant already has a template of that name. */
  insertTemplate(t: TemplateRecord): Promise<void>;
  getTemplate(id: string): Promise<TemplateRecord | undefined>;
  /** The tenant's own and every public template (undefined: every template), oldest first. */
  listTemplates(tenant?: string): Promise<TemplateRecord[]>;
  setTemplatePublic(id: string, isPublic: boolean): Promise<void>;
  /** False when it was not there. */
  deleteTemplate(id: string): Promise<boolean>;
}

/** The table, appended to the store's migrations. */
export const TEMPLATES_MIGRATION = `CREATE TABLE templates (
     id TEXT PRIMARY KEY,
     tenant TEXT NOT NULL,
     name TEXT NOT NULL,
     public INTEGER NOT NULL DEFAULT 0,
     checkpoint_id TEXT NOT NULL,
     spec TEXT NOT NULL,
     origin TEXT NOT NULL,
     created_at INTEGER NOT NULL,
     UNIQUE (tenant, name)
   );`;

interface TemplateRow {
  id: string;
  tenant: string;
  name: string;
  public: number;
  checkpoint_id: string;
  spec: string;
  origin: string;
  created_at: number;
}

const toTemplate = (r: TemplateRow): TemplateRecord => ({
  id: r.id,
  tenant: r.tenant,
  name: r.name,
  public: r.public === 1,
  checkpointId: r.checkpoint_id,
  spec: JSON.parse(r.spec) as SandboxSpec,
  origin: r.origin,
  createdAt: r.created_at,
});

/**
 * The templates table of the state store's SQLite database. `run` is how the store reaches its
 * rows (after an open transaction, or inside it for a transaction's store): each call goes
 * through it.
 */
export class SqliteTemplateStore implements TemplateStore {
  constructor(
    private readonly db: Database.Database,
    private readonly run: <T>(f: () => T) => Promise<T>,
  ) {}

  insertTemplate(t: TemplateRecord): Promise<void> {
    return this.run(() => {
      try {
        this.db
          .prepare(
            'INSERT INTO templates (id, tenant, name, public, checkpoint_id, spec, origin, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)',
          )
          .run(
            t.id,
            t.tenant,
            t.name,
            t.public ? 1 : 0,
            t.checkpointId,
            JSON.stringify(t.spec),
            t.origin,
            t.createdAt,
          );
      } catch (e) {
        if ((e as { code?: string }).code === 'SQLITE_CONSTRAINT_UNIQUE')
          throw new DormantError(ErrorCode.TEMPLATE_NAME_TAKEN, `a template named ${t.name} already exists`);
        throw e;
      }
    });
  }

  getTemplate(id: string): Promise<TemplateRecord | undefined> {
    return this.run(() => {
      const r = this.db.prepare('SELECT * FROM templates WHERE id = ?').get(id) as TemplateRow | undefined;
      return r && toTemplate(r);
    });
  }

  listTemplates(tenant?: string): Promise<TemplateRecord[]> {
    return this.run(() => {
      const rows = (
        tenant === undefined
          ? this.db.prepare('SELECT * FROM templates ORDER BY created_at, id').all()
          : this.db
              .prepare('SELECT * FROM templates WHERE tenant = ? OR public = 1 ORDER BY created_at, id')
              .all(tenant)
      ) as TemplateRow[];
      return rows.map(toTemplate);
    });
  }

  setTemplatePublic(id: string, isPublic: boolean): Promise<void> {
    return this.run(() => {
      this.db.prepare('UPDATE templates SET public = ? WHERE id = ?').run(isPublic ? 1 : 0, id);
    });
  }

  deleteTemplate(id: string): Promise<boolean> {
    return this.run(() => this.db.prepare('DELETE FROM templates WHERE id = ?').run(id).changes > 0);
  }
}
