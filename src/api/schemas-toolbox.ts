/**
 * Request and response shapes of the toolbox routes (routes-toolbox.ts): commands and files
 * inside a sandbox. Part of the API's contract like schemas.ts, which exports them all.
 */
import { z } from 'zod';

const SIGNALS = [
  'SIGHUP',
  'SIGINT',
  'SIGQUIT',
  'SIGKILL',
  'SIGUSR1',
  'SIGSEGV',
  'SIGUSR2',
  'SIGPIPE',
  'SIGALRM',
  'SIGTERM',
  'SIGCONT',
  'SIGSTOP',
  'SIGTSTP',
  'SIGWINCH',
] as const;

/** A query flag: `true`/`1` or `false`/`0`. */
const flag = z
  .enum(['1', 'true', '0', 'false'])
  .optional()
  .transform((v) => v === '1' || v === 'true');

/** A path inside the sandbox: absolute, or relative to its working directory. NUL is never part of one. */
const sandboxPath = z
  .string()
  .min(1)
  .max(4096)
  .refine((p) => !p.includes('\0'), 'a path holds no NUL byte');

const terminalSize = z.strictObject({
  cols: z.number().int().min(1).max(1000),
  rows: z.number().int().min(1).max(1000),
});

export const RunCommandBody = z
  .strictObject({
    cmd: z.string().min(1).max(1_048_576).optional().describe('run as /bin/sh -c CMD'),
    args: z.array(z.string().max(65_536)).min(1).max(1024).optional().describe('argv, run as given'),
    cwd: z.string().min(1).max(4096).optional(),
    envs: z.record(z.string().max(256), z.string().max(65_536)).optional(),
    timeoutMs: z
      .number()
      .int()
      .nonnegative()
      .max(7 * 86_400_000)
      .optional()
      .describe('killed (SIGKILL) after this long; default 60000, 0: never'),
    background: z.boolean().optional().describe('answer at once with the command; it runs on'),
    stdin: z.boolean().optional().describe('keep its stdin open for POST .../stdin'),
    pty: terminalSize.optional().describe('run it on a terminal of this size'),
    tag: z.string().max(256).optional(),
  })
  .refine((b) => (b.cmd === undefined) !== (b.args === undefined), 'give either cmd or args');

export const CommandParams = z.object({
  id: z.string().min(1).max(128),
  cid: z.string().regex(/^[0-9]{1,10}$/, 'a command id is a number'),
});

export const OutputQuery = z.object({ from: z.coerce.number().int().nonnegative().optional() });
export const StdinQuery = z.object({ eof: flag });
export const KillBody = z.strictObject({ signal: z.enum(SIGNALS).optional() }).optional();
export const ResizeBody = terminalSize;

export const FilePathQuery = z.object({ path: sandboxPath });
export const PutFileQuery = z.object({
  path: sandboxPath,
  mode: z
    .string()
    .regex(/^[0-7]{3,4}$/, 'mode is octal, like 644')
    .optional(),
  append: flag,
});
export const ListFilesQuery = z.object({
  path: sandboxPath,
  depth: z.coerce.number().int().min(1).max(16).optional(),
});
export const WatchQuery = z.object({ path: sandboxPath, recursive: flag });
export const PathBody = z.strictObject({ path: sandboxPath });
export const RenameBody = z.strictObject({ from: sandboxPath, to: sandboxPath });

/** A command the sandbox's agent runs or ran (kept 10 minutes after its end). */
export const CommandInfoSchema = z.object({
  id: z.string().describe('the command id: its pid inside the sandbox'),
  pid: z.number().int(),
  args: z.array(z.string()),
  cwd: z.string(),
  tag: z.string().nullable(),
  pty: z.boolean(),
  running: z.boolean(),
  exitCode: z.number().int().nullable(),
  signal: z.string().nullable().describe('the signal that ended it'),
  startedAt: z.string(),
});

export const CommandListSchema = z.object({ commands: z.array(CommandInfoSchema) });

/** One line of a command's ndjson stream (POST .../commands, GET .../output). */
export const CommandEventSchema = z.discriminatedUnion('type', [
  z.object({
    type: z.literal('start'),
    id: z.string(),
    pid: z.number().int(),
    from: z.number().int().optional().describe('the output offset the replay starts at'),
  }),
  z.object({ type: z.literal('stdout'), data: z.string().describe('base64') }),
  z.object({ type: z.literal('stderr'), data: z.string().describe('base64') }),
  z.object({
    type: z.literal('end'),
    exitCode: z.number().int().nullable(),
    signal: z.string().nullable(),
    durationMs: z.number(),
    timedOut: z.boolean(),
  }),
  z.object({ type: z.literal('error'), code: z.string(), message: z.string() }),
]);

export const FileInfoSchema = z.object({
  name: z.string(),
  path: z.string(),
  type: z.enum(['file', 'dir', 'symlink', 'other']),
  size: z.number().int(),
  mode: z.number().int().describe('permission bits'),
  mtimeMs: z.number(),
  symlinkTarget: z.string().optional(),
});

export const FileListSchema = z.object({ entries: z.array(FileInfoSchema) });
export const FileWrittenSchema = z.object({ path: z.string(), size: z.number().int() });

export const WatchEventSchema = z.object({
  type: z.enum(['create', 'write', 'remove', 'rename', 'chmod']),
  path: z.string(),
  isDir: z.boolean(),
});
