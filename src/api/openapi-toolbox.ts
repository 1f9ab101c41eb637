/**
 * The toolbox routes (routes-toolbox.ts) as openapi.ts documents them: commands and files
 * inside a sandbox. `{cid}` is a command id (its pid inside the sandbox).
 */
import { z } from 'zod';
import type { Route } from './openapi.js';
import {
  CommandInfoSchema,
  CommandListSchema,
  FileInfoSchema,
  FileListSchema,
  FilePathQuery,
  FileWrittenSchema,
  KillBody,
  ListFilesQuery,
  OutputQuery,
  PathBody,
  PutFileQuery,
  RenameBody,
  ResizeBody,
  RunCommandBody,
  StdinQuery,
  WatchQuery,
} from './schemas-toolbox.js';

const NDJSON = 'application/x-ndjson';

export const TOOLBOX_ROUTES: Route[] = [
  {
    method: 'post',
    path: '/v1/sandboxes/{id}/commands',
    summary:
      'run a command: streamed as ndjson CommandEvents to its end (leaving kills it), or with background: 201 and its CommandInfo',
    body: RunCommandBody,
    ok: [200, NDJSON],
  },
  {
    method: 'get',
    path: '/v1/sandboxes/{id}/commands',
    summary: 'the commands running or ended in the last 10 minutes',
    ok: [200, CommandListSchema],
  },
  {
    method: 'get',
    path: '/v1/sandboxes/{id}/commands/{cid}',
    summary: 'one command (404 PROCESS_NOT_FOUND)',
    ok: [200, CommandInfoSchema],
  },
  {
    method: 'get',
    path: '/v1/sandboxes/{id}/commands/{cid}/output',
    summary: "a command's output from byte `from` (replay, then follow to its end line), as ndjson",
    query: OutputQuery,
    ok: [200, NDJSON],
  },
  {
    method: 'post',
    path: '/v1/sandboxes/{id}/commands/{cid}/stdin',
    summary:
      'raw bytes (application/octet-stream, any size, streamed) to its stdin; eof=true closes it after',
    query: StdinQuery,
    ok: [200, z.object({})],
  },
  {
    method: 'post',
    path: '/v1/sandboxes/{id}/commands/{cid}/kill',
    summary: 'send a signal (default SIGKILL); killed: false when it had already ended',
    body: KillBody,
    ok: [200, z.object({ killed: z.boolean() })],
  },
  {
    method: 'post',
    path: '/v1/sandboxes/{id}/commands/{cid}/resize',
    summary: "resize a command's terminal",
    body: ResizeBody,
    ok: [200, z.object({})],
  },
  {
    method: 'get',
    path: '/v1/sandboxes/{id}/commands/{cid}/ws',
    summary:
      'WebSocket attach: binary messages are stdin and output, text messages JSON control (resize, signal, eof) and events (start, stderr, end)',
    query: OutputQuery,
    ok: [101, null],
  },
  {
    method: 'get',
    path: '/v1/sandboxes/{id}/files',
    summary: "a file's bytes, streamed, with Content-Length",
    query: FilePathQuery,
    ok: [200, 'application/octet-stream'],
  },
  {
    method: 'put',
    path: '/v1/sandboxes/{id}/files',
    summary:
      'write a file from the raw body (any size, streamed; parent folders made; replaced whole at the end)',
    query: PutFileQuery,
    ok: [200, FileWrittenSchema],
  },
  {
    method: 'get',
    path: '/v1/sandboxes/{id}/files/stat',
    summary: 'what is at a path (a symlink itself, not its target); 404 FILE_NOT_FOUND',
    query: FilePathQuery,
    ok: [200, FileInfoSchema],
  },
  {
    method: 'get',
    path: '/v1/sandboxes/{id}/files/list',
    summary: 'a folder, `depth` levels down (1-16), sorted by path',
    query: ListFilesQuery,
    ok: [200, FileListSchema],
  },
  {
    method: 'post',
    path: '/v1/sandboxes/{id}/files/mkdir',
    summary: 'make a folder and its parents; created: false when it was there',
    body: PathBody,
    ok: [200, z.object({ created: z.boolean() })],
  },
  {
    method: 'post',
    path: '/v1/sandboxes/{id}/files/remove',
    summary: 'remove a file or a folder with everything in it',
    body: PathBody,
    ok: [200, z.object({})],
  },
  {
    method: 'post',
    path: '/v1/sandboxes/{id}/files/rename',
    summary: 'rename (move) a file or folder',
    body: RenameBody,
    ok: [200, z.object({})],
  },
  {
    method: 'get',
    path: '/v1/sandboxes/{id}/files/watch',
    summary: 'changes under a folder as ndjson WatchEvents, until the client closes',
    query: WatchQuery,
    ok: [200, NDJSON],
  },
];
