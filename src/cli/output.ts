/** How the CLI prints: tables for people, one JSON value for programs, errors with hints. */
import pc from 'picocolors';
import { DormantError, asError } from '../domain/errors.js';
import { DormantApiError } from '../sdk/client.js';

export const EXIT_OK = 0;
export const EXIT_ERROR = 1;
export const EXIT_USAGE = 2;

export function printJson(value: unknown): void {
  process.stdout.write(`${JSON.stringify(value, null, 2)}\n`);
}

/**
 * A DormantError of another copy of the class: the bundled CLI (scripts/build-cli.mjs) inlines
 * its own, while what it imports lazily from dist/ (the daemon, the vault) throws dist's.
 */
function isForeignDormantError(e: unknown): e is DormantError {
  return (
    e instanceof Error && e.name === 'DormantError' && typeof (e as { code?: unknown }).code === 'string'
  );
}

/**
 * Prints an error as every command does: code and message (and hint) on stderr, or
 * `{"error":{...}}` on stdout with --json. Returns the exit code to use.
 */
export function reportError(e: unknown, json: boolean): number {
  const err =
    e instanceof DormantError
      ? e
      : isForeignDormantError(e)
        ? DormantError.relayed(e.code, e.message, e.status, e.hint)
        : e instanceof DormantApiError
          ? DormantError.relayed(e.code, e.message, e.status, e.hint)
          : new DormantError('INTERNAL', asError(e).message, {
              cause: e,
              hint: 'this is a bug in dormant; please report it',
            });
  if (json) {
    printJson({ error: err.toJSON() });
  } else {
    process.stderr.write(`${pc.red('error')} ${pc.bold(err.code)}: ${err.message}\n`);
    if (err.hint) process.stderr.write(`${pc.dim('hint:')} ${err.hint}\n`);
  }
  return err.code === 'INVALID_ARGUMENT' ? EXIT_USAGE : EXIT_ERROR;
}
