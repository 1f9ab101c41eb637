/**
 * Templates: a named, warmed checkpoint that new sandboxes start from (template-start.ts).
 * Made from a running or paused sandbox (which keeps running, as a fork's source does), or
 * from a builder sandbox started for the purpose, checkpointed once its ready probe passes and
 * then removed. The checkpoint belongs to the template's own id in the vault and the database,
 * so no sandbox's pruning or removal touches it: only `template rm` does (and shreds its key).
 */

import { randomBytes } from 'node:crypto';
import { mkdir, readFile } from 'node:fs/promises';
import { DormantError, ErrorCode, asError } from '../../domain/errors.js';
import { assertLegal, newId, validateName, type Sandbox } from '../../domain/sandbox.js';
import type { TemplateRecord, TemplateStore } from '../../state/templates.js';
import { LifecycleContext, invalid } from '../context.js';
import { sandboxListens } from '../listens.js';
import { createSandbox, type CreateSandboxInput } from './create.js';
import { gpuGate } from './gpu.js';
import { dumpToVault } from './hibernate.js';
import { removeSandbox } from './remove.js';
import { forgetTemplateImages } from './template-cache.js';

export const TEMPLATE_ID = /^tp-[a-z2-7]{16}$/;

/** When a builder sandbox is ready to be checkpointed. */
export interface ReadyProbe {
  /** A TCP port something inside listens on (read from its network namespace's tables). */
  port?: number;
  /** A command run inside that exits 0. */
  command?: string[];
  /** How long to wait for it. Default 60 s. */
  timeoutMs?: number;
}

export interface CreateTemplateInput {
  tenant: string;
  admin: boolean;
  name: string;
  /** Every tenant sees it (admin only). */
  public?: boolean;
  /** A running or paused sandbox to checkpoint (id or name). */
  from?: string;
  /** Or: a builder sandbox made from this (rootfs or image, command, ...), then removed. */
  build?: Omit<CreateSandboxInput, 'tenant' | 'admin' | 'name'>;
  ready?: ReadyProbe;
}

const DEFAULT_READY_TIMEOUT_MS = 60_000;

/** The template store; a controller made without one (embedding, unit tests) has no templates. */
export function templateStore(ctx: LifecycleContext): TemplateStore {
  const s = ctx.opts.templates;
  if (!s) throw new DormantError(ErrorCode.TEMPLATES_UNAVAILABLE, 'this controller keeps no templates');
  return s;
}

function notFound(ref: string): DormantError {
  return new DormantError(ErrorCode.TEMPLATE_NOT_FOUND, `no template ${ref.slice(0, 80)}`);
}

/**
 * The template `ref` (id or name) as `tenant` sees it: its own first, then a public one of
 * that name (a tenant's own name shadows a public one). An admin (tenant undefined) sees all.
 * Read through `store` (a transaction's) when given.
 */
export async function resolveTemplate(
  ctx: LifecycleContext,
  ref: string,
  tenant: string | undefined,
  store: TemplateStore = templateStore(ctx),
): Promise<TemplateRecord> {
  const visible = (t: TemplateRecord): boolean => tenant === undefined || t.tenant === tenant || t.public;
  if (TEMPLATE_ID.test(ref)) {
    const t = await store.getTemplate(ref);
    if (t && visible(t)) return t;
    throw notFound(ref);
  }
  const all = (await store.listTemplates(tenant)).filter((t) => t.name === ref);
  const own = tenant !== undefined ? all.find((t) => t.tenant === tenant) : undefined;
  const found = own ?? all.find((t) => t.public) ?? (all.length === 1 ? all[0] : undefined);
  if (!found) throw notFound(ref);
  return found;
}

export async function listTemplates(
  ctx: LifecycleContext,
  tenant: string | undefined,
): Promise<TemplateRecord[]> {
  return templateStore(ctx).listTemplates(tenant);
}

/** A public name is one name for every tenant: two tenants' public templates never share it. */
async function checkPublicName(
  ctx: LifecycleContext,
  name: string,
  exceptId?: string,
  store: TemplateStore = templateStore(ctx),
): Promise<void> {
  if ((await store.listTemplates(undefined)).some((t) => t.public && t.name === name && t.id !== exceptId))
    throw new DormantError(ErrorCode.TEMPLATE_NAME_TAKEN, `a public template named ${name} already exists`);
}

export async function createTemplate(
  ctx: LifecycleContext,
  input: CreateTemplateInput,
): Promise<TemplateRecord> {
  const store = templateStore(ctx);
  const name = validateName(input.name);
  if (input.public === true && !input.admin)
    throw new DormantError(ErrorCode.FORBIDDEN, 'only an admin token publishes a template to every tenant');
  if ((input.from === undefined) === (input.build === undefined))
    throw invalid('a template needs --from SANDBOX, or --image/--rootfs and a command', 'not both');
  if (input.from !== undefined && input.ready !== undefined)
    throw invalid('a ready probe is for a template built from an image or rootfs, not --from');
  if (input.public === true) await checkPublicName(ctx, name);
  if (input.from !== undefined) {
    const src = await ctx.get(input.from, input.admin ? undefined : input.tenant);
    if ((await store.listTemplates(src.tenant)).some((t) => t.tenant === src.tenant && t.name === name))
      throw new DormantError(ErrorCode.TEMPLATE_NAME_TAKEN, `a template named ${name} already exists`);
    return checkpointAsTemplate(ctx, src, name, input.public === true, `sandbox ${src.id}`);
  }
  if ((await store.listTemplates(input.tenant)).some((t) => t.tenant === input.tenant && t.name === name))
    throw new DormantError(ErrorCode.TEMPLATE_NAME_TAKEN, `a template named ${name} already exists`);
  const build = input.build!;
  const builder = await createSandbox(ctx, {
    ...build,
    tenant: input.tenant,
    admin: input.admin,
    labels: { ...build.labels, 'dormant.template-builder': name },
  });
  try {
    await waitReady(ctx, builder, input.ready ?? {});
    const origin =
      builder.spec.source.kind === 'image'
        ? `image ${build.image ?? ''}`
        : `rootfs ${builder.spec.source.path}`;
    return await checkpointAsTemplate(ctx, builder, name, input.public === true, origin);
  } finally {
    // The builder has done its part (or failed it): nothing of it stays.
    await ctx.locks
      .run(builder.id, () => removeSandbox(ctx, builder.id, undefined, `template ${name} built`))
      .catch((e: unknown) => ctx.warnCleanup(builder.id, 'remove the template builder', e));
  }
}

/** Waits for the builder's probe (a port listening, a command exiting 0), or TEMPLATE_NOT_READY. */
async function waitReady(ctx: LifecycleContext, s: Sandbox, probe: ReadyProbe): Promise<void> {
  if (probe.port === undefined && probe.command === undefined) return;
  const timeoutMs = probe.timeoutMs ?? DEFAULT_READY_TIMEOUT_MS;
  const deadline = performance.now() + timeoutMs;
  let last = '';
  for (let delay = 10; ; delay = Math.min(delay * 2, 250)) {
    const st = await ctx.runtime.state(s.id).catch(() => undefined);
    if (st?.status !== 'running')
      throw notReady(
        s,
        `its command ended (the sandbox is ${st?.status ?? 'gone'})`,
        await logTail(st?.logPath),
      );
    let ready = true;
    if (probe.port !== undefined)
      ready = (await sandboxListens(ctx.runtime, s.id, probe.port, st.pid)) === true;
    if (ready && probe.command !== undefined) {
      const left = Math.max(1, Math.round(deadline - performance.now()));
      const r = await ctx.runtime
        .exec(s.id, probe.command, { timeoutMs: left })
        .catch((e: unknown) => ({ exitCode: -1, stdout: '', stderr: asError(e).message }));
      ready = r.exitCode === 0;
      if (!ready)
        last = `the probe command exited ${r.exitCode}: ${(r.stderr || r.stdout).trim().slice(-300)}`;
    }
    if (ready) return;
    if (performance.now() + delay > deadline) {
      const what =
        probe.port !== undefined && last === ''
          ? `nothing listened on port ${probe.port}`
          : last || 'the probe did not pass';
      throw notReady(s, `${what} within ${Math.round(timeoutMs / 1000)} s`, await logTail(st.logPath));
    }
    await new Promise((r) => setTimeout(r, delay));
  }
}

function notReady(s: Sandbox, why: string, log: string): DormantError {
  return new DormantError(
    ErrorCode.TEMPLATE_NOT_READY,
    `the template's builder sandbox ${s.id} was not ready: ${why}${log ? `; its output ended with:\n${log}` : ''}`,
  );
}

async function logTail(path: string | undefined): Promise<string> {
  if (path === undefined) return '';
  const text = await readFile(path, 'utf8').catch(() => '');
  return text.split('\n').slice(-10).join('\n').trim().slice(-2000);
}

/**
 * Checkpoints `src` (running or paused; it keeps running) under its lock into a checkpoint
 * owned by a new template, and records the template.
 */
async function checkpointAsTemplate(
  ctx: LifecycleContext,
  src: Sandbox,
  name: string,
  isPublic: boolean,
  origin: string,
): Promise<TemplateRecord> {
  // No template store: refused before any work (the record goes in through the transaction's).
  templateStore(ctx);
  const id = newId('tp', randomBytes);
  const ckId = newId('ck', randomBytes);
  const dir = ctx.staging(`${id}-template`);
  const t = ctx.timer();
  let stored = false;
  try {
    await mkdir(dir, { recursive: true, mode: 0o700 });
    return await ctx.locks.run(src.id, async () => {
      const cur = await ctx.get(src.id);
      assertLegal('fork', cur.state, cur.id);
      if (cur.state !== 'running' && cur.state !== 'paused')
        throw new DormantError(
          ErrorCode.ILLEGAL_TRANSITION,
          `sandbox ${cur.id} is ${cur.state}: a template is made from a running or paused sandbox`,
          { hint: `dormant resume ${cur.id} first` },
        );
      await gpuGate(ctx, cur, 'fork');
      await ctx.runtime.freeze(cur.id);
      let rec;
      try {
        rec = await dumpToVault(ctx, cur, ckId, dir, 'template', t, true, undefined, id);
        stored = true;
      } finally {
        if (cur.state === 'running') await ctx.runtime.thaw(cur.id);
      }
      const { hostname: _theirs, labels: _labels, ...spec } = cur.spec;
      const tpl: TemplateRecord = {
        id,
        tenant: cur.tenant,
        name,
        public: isPublic,
        checkpointId: ckId,
        spec: {
          ...spec,
          // Sealed again: a sealed value names what it belongs to.
          env: await ctx.sealEnv(cur.tenant, id, await ctx.openEnv(cur)),
          // The toolbox agent in the checkpoint answers to the source's token.
          agentSeed: cur.spec.agentSeed ?? cur.id,
        },
        origin,
        createdAt: ctx.clock.now(),
      };
      await ctx.store.atomically(async (tx) => {
        await tx.insertCheckpoint(rec);
        await tx.templates().insertTemplate(tpl);
      });
      return tpl;
    });
  } catch (e) {
    // Stored but not recorded: the database is the record, so the vault's copy goes too.
    if (stored)
      await ctx.vault
        .destroySandboxKey({ tenant: src.tenant, sandboxId: id })
        .catch((x: unknown) => ctx.warnCleanup(src.id, 'drop the unrecorded template checkpoint', x));
    throw e;
  } finally {
    await ctx.wipe(dir);
    ctx.report(t.finish('template', id, stored));
  }
}

/** Uses of a template in flight (a sandbox being made from it, its pages still coming in). */
const inUse = new WeakMap<LifecycleContext, Map<string, Set<Promise<unknown>>>>();

/** Runs `work` as a use of template `id`: `template rm` waits for it before deleting the checkpoint. */
export function usingTemplate<T>(ctx: LifecycleContext, id: string, work: Promise<T>): Promise<T> {
  let uses = inUse.get(ctx);
  if (!uses) inUse.set(ctx, (uses = new Map<string, Set<Promise<unknown>>>()));
  const set = uses.get(id) ?? new Set<Promise<unknown>>();
  uses.set(id, set);
  const p = work.finally(() => {
    set.delete(p);
    if (set.size === 0) uses.delete(id);
  });
  set.add(p);
  return p;
}

/**
 * Removes a template: no new sandbox starts from it at once; its checkpoint is deleted (its
 * key shredded) once the sandboxes being made from it have their memory in. Sandboxes made
 * from it are not touched. Only its tenant (or an admin) removes it.
 */
export async function removeTemplate(
  ctx: LifecycleContext,
  ref: string,
  tenant: string | undefined,
): Promise<void> {
  const tpl = await resolveTemplate(ctx, ref, tenant);
  if (tenant !== undefined && tpl.tenant !== tenant)
    throw new DormantError(
      ErrorCode.FORBIDDEN,
      `template ${tpl.name} is public, not yours: only an admin removes it`,
    );
  await ctx.store.atomically(async (tx) => {
    await tx.templates().deleteTemplate(tpl.id);
    await tx.deleteCheckpoint(tpl.checkpointId, ctx.clock.now());
  });
  await Promise.allSettled([...(inUse.get(ctx)?.get(tpl.id) ?? [])]);
  await forgetTemplateImages(ctx, tpl.checkpointId);
  await ctx.vault.destroySandboxKey({ tenant: tpl.tenant, sandboxId: tpl.id });
}

/** Publishes a template to every tenant, or takes it back (admin only: the API checks). */
export async function publishTemplate(
  ctx: LifecycleContext,
  ref: string,
  isPublic: boolean,
): Promise<TemplateRecord> {
  templateStore(ctx); // TEMPLATES_UNAVAILABLE before the transaction
  // The check and the change in one transaction: two templates of one name published at
  // once must not both pass the check.
  return ctx.store.atomically(async (tx) => {
    const store = tx.templates();
    const tpl = await resolveTemplate(ctx, ref, undefined, store);
    if (isPublic) await checkPublicName(ctx, tpl.name, tpl.id, store);
    await store.setTemplatePublic(tpl.id, isPublic);
    return { ...tpl, public: isPublic };
  });
}
