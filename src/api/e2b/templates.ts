/**
 * E2B template ids as what a dormant sandbox is made from. One function decides it, so every
 * way of naming a template goes through the same place.
 */
import { DormantError, ErrorCode } from '../../domain/errors.js';

/** A template of the configuration (`e2b.templates.NAME`): a rootfs folder or an OCI image layout. */
export type E2bTemplate = ({ rootfs: string } | { image: string }) & {
  /** The sandbox's main process. Default: one that sleeps (E2B's sandboxes run none of their own). */
  command?: string[];
  memoryBytes?: number;
  cpus?: number;
};

export type ResolvedTemplate = ({ rootfs: string } | { image: string }) & {
  command: string[];
  memoryBytes?: number;
  cpus?: number;
};

/** A main process that does nothing, for as long as the sandbox lives. */
export const IDLE_COMMAND = ['/bin/sh', '-c', 'while :; do sleep 3600; done'];

/**
 * What sandbox E2B's `templateID` makes, from the configured map (`base` is what a program
 * that names no template asks for).
 */
export function resolveTemplate(
  templates: Readonly<Record<string, E2bTemplate>>,
  templateID: string,
): ResolvedTemplate {
  const t = Object.hasOwn(templates, templateID) ? templates[templateID] : undefined;
  if (t !== undefined) return { ...t, command: t.command ?? IDLE_COMMAND };
  // (A dormant template of that name, `dormant template create`, is tried before this: rest.ts.)
  throw new DormantError(ErrorCode.NOT_FOUND, `template ${templateID.slice(0, 100)} not found`, {
    hint: `map it in the daemon's configuration: e2b.templates.${templateID.slice(0, 60)} = { rootfs | image, command }`,
  });
}
