/**
 * A new sandbox from a template: the fork path without a source to dump. The template's
 * checkpoint is restored (lazily where resumes are: large memory stays in the vault and is
 * served through the page server) while the sandbox's network and writable layer are made;
 * the sandbox gets its own id, name, address and hostname (written into the checkpoint's UTS
 * image before the restore), and the template's files as its writable layer's start.
 */

import { randomBytes } from 'node:crypto';
import { DormantError, ErrorCode, asError, isDormantError } from '../../domain/errors.js';
import { DEFAULT_GPU_POLICY } from '../../domain/gpu.js';
import { newId, validateLabels, validateName, type Sandbox } from '../../domain/sandbox.js';
import type { TemplateRecord } from '../../state/templates.js';
import { LifecycleContext, invalid } from '../context.js';
import type { CreateSandboxInput } from './create.js';
import { afterLazyRestore } from './lazy.js';
import { restoreFromVault } from './restore.js';
import { templateCacheKeeps, templateImages } from './template-cache.js';
import { resolveTemplate, usingTemplate } from './template.js';

/** What a sandbox made from a template takes from it, not from the create. */
const FROM_TEMPLATE = [
  'rootfs',
  'image',
  'env',
  'ports',
  'memoryBytes',
  'cpus',
  'diskBytes',
  'gpus',
  'gpuPolicy',
] as const satisfies readonly (keyof CreateSandboxInput)[];

/**
 * Starts a sandbox from template `input.template`. Resolves once it runs; with a lazy
 * restore its pages are still coming in, and `pagesLoaded` settles when they are (the
 * sandbox's lock is held until then, as for a resume).
 */
export async function createFromTemplate(
  ctx: LifecycleContext,
  input: CreateSandboxInput & { template: string },
  answer: (s: Sandbox) => void,
): Promise<void> {
  for (const k of FROM_TEMPLATE) {
    const v: unknown = input[k];
    // An empty list or map says nothing (clients send them by default).
    const empty = Array.isArray(v)
      ? v.length === 0
      : typeof v === 'object' && v !== null && Object.keys(v).length === 0;
    if (v !== undefined && !empty)
      throw invalid(`a sandbox made from a template takes its ${k} from the template`);
  }
  if (input.command.length > 0) throw invalid('a sandbox made from a template runs what the template runs');
  const labels = validateLabels(input.labels ?? {});
  // Seen as the caller sees templates: its own, then the public ones.
  const tpl = await resolveTemplate(ctx, input.template, input.tenant);
  // A use from here on: a `template rm` now waits for it before the checkpoint goes.
  await usingTemplate(ctx, tpl.id, startFrom(ctx, tpl, input, labels, answer));
}

async function startFrom(
  ctx: LifecycleContext,
  tpl: TemplateRecord,
  input: CreateSandboxInput,
  labels: Record<string, string>,
  answer: (s: Sandbox) => void,
): Promise<void> {
  const ck = await ctx.store.getCheckpoint(tpl.checkpointId);
  if (!ck) throw damaged(tpl, 'its checkpoint record is missing');
  const id = newId('sb', randomBytes);
  const name = validateName(input.name ?? id);
  if ((await ctx.store.listSandboxes(input.tenant)).some((s) => s.name === name))
    throw new DormantError('SANDBOX_NAME_TAKEN', `a sandbox named ${name} already exists`);
  const now = ctx.clock.now();
  const env = ctx.opts.secrets ? await ctx.opts.secrets.open(tpl.tenant, tpl.id, tpl.spec.env) : tpl.spec.env;
  const sandbox: Sandbox = {
    id,
    ...ctx.placed(),
    tenant: input.tenant,
    name,
    state: 'creating',
    gpuPolicy: DEFAULT_GPU_POLICY,
    spec: {
      ...tpl.spec,
      env: await ctx.sealEnv(input.tenant, id, env),
      policy: { ...tpl.spec.policy, ...input.policy },
      ...(input.onResume ? { onResume: input.onResume } : {}),
      ...(Object.keys(labels).length > 0 ? { labels } : {}),
    },
    createdAt: now,
    stateSince: now,
    lastActiveAt: now,
    memoryBytes: 0,
  };
  const why = `from template ${tpl.name} (${tpl.id})`;
  await ctx.store.insertSandbox(sandbox, why);
  const t = ctx.timer();
  let ok = false;
  let pagesLoaded: Promise<void> | undefined;
  const made = ctx.locks.run(id, async () => {
    try {
      let address: string;
      ({ pagesLoaded, address } = await restoreFromVault(
        ctx,
        sandbox,
        tpl.checkpointId,
        t,
        tpl.tenant,
        // A checkpoint too big to keep restores as any other (pages served from the vault).
        templateCacheKeeps(ctx, ck) ? (dest) => templateImages(ctx, tpl, dest) : undefined,
      ));
      await ctx.store.transition(id, 'creating', 'running', why, ctx.clock.now(), { address });
    } catch (e) {
      // As a failed create: nothing of it runs or stays mounted, the record says why.
      await ctx.runtime.destroy(id).catch((x: unknown) => ctx.warnCleanup(id, 'destroy', x));
      await ctx.store.transition(id, 'creating', 'failed', 'create from template failed', ctx.clock.now(), {
        lastError: asError(e).message,
        lazyRestoreOf: undefined,
      });
      if (isDormantError(e) && e.code.startsWith('VAULT_'))
        throw damaged(
          tpl,
          `its checkpoint ${tpl.checkpointId} cannot be read (${e.code}): ${e.message.split('\n')[0] ?? ''}`,
          e,
        );
      throw e;
    }
    t.mark('running');
    answer(await ctx.get(id));
    ok = pagesLoaded
      ? await t.time('pages loaded', async () => afterLazyRestore(ctx, await ctx.get(id), pagesLoaded!))
      : true;
  });
  try {
    await made;
  } finally {
    ctx.report(t.finish('template', id, ok));
  }
}

function damaged(tpl: TemplateRecord, why: string, cause?: unknown): DormantError {
  return new DormantError(ErrorCode.TEMPLATE_DAMAGED, `template ${tpl.name} (${tpl.id}) is damaged: ${why}`, {
    ...(cause !== undefined ? { cause } : {}),
  });
}
