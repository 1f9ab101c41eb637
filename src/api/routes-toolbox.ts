/**
 * The toolbox routes: commands (streamed, in the background, reattached, on a terminal over a
 * WebSocket) and files inside a sandbox, through the agent that runs in it
 * (control/ops/toolbox.ts). Every route wakes a sleeping sandbox first and counts as activity
 * for as long as it runs, so a streaming command keeps its sandbox from being idled.
 */
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import websocket from '@fastify/websocket';
import type { WebSocket } from '@fastify/websocket';
import { pipeline } from 'node:stream/promises';
import { Readable } from 'node:stream';
import type { ServerResponse } from 'node:http';
import { DormantError, ErrorCode, asError } from '../domain/errors.js';
import type { SandboxController } from '../control/sandboxes.js';
import { signalNumber, toolboxError } from '../control/ops/toolbox.js';
import type { FileInfo, ProcessHandle, ProcessInfo, RunSpec } from '../runtime/agent-client.js';
import {
  CommandParams,
  FilePathQuery,
  IdParams,
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
  type CommandInfoSchema,
  type FileInfoSchema,
} from './schemas.js';
import { parse } from './validate.js';
import type { z } from 'zod';

/** Output a slow reader may leave unread before it is cut off (a foreground command then dies). */
const MAX_UNREAD_BYTES = 64 * 1024 * 1024;
const DEFAULT_COMMAND_TIMEOUT_MS = 60_000;
/** No body limit: a file or a stdin stream of any size is streamed through, never held. */
const NO_BODY_LIMIT = Number.MAX_SAFE_INTEGER;

type CommandInfo = z.output<typeof CommandInfoSchema>;

function commandInfo(p: ProcessInfo): CommandInfo {
  return {
    id: p.id,
    pid: p.pid,
    args: p.args,
    cwd: p.cwd,
    tag: p.tag,
    pty: p.pty,
    running: p.running,
    exitCode: p.exitCode,
    signal: p.signal,
    startedAt: new Date(p.startedAt).toISOString(),
  };
}

function fileInfo(f: FileInfo): z.output<typeof FileInfoSchema> {
  return {
    name: f.name,
    path: f.path,
    type: f.type,
    size: f.size,
    mode: f.mode,
    mtimeMs: f.mtimeMs,
    ...(typeof f.symlinkTarget === 'string' ? { symlinkTarget: f.symlinkTarget } : {}),
  };
}

/** A DormantError's code and message for a stream that has already begun. */
function errorLine(e: unknown, id: string): { type: 'error'; code: string; message: string } {
  const err = toolboxError(e, id);
  return err instanceof DormantError
    ? { type: 'error', code: err.code, message: err.message }
    : { type: 'error', code: ErrorCode.INTERNAL, message: 'internal error' };
}

/** A request body as a stream of bytes: the raw body, or none. */
function bodyStream(body: unknown): AsyncIterable<Buffer> {
  if (body instanceof Readable) return body;
  if (body === undefined || body === null) return Readable.from([]);
  throw new DormantError(ErrorCode.UNSUPPORTED_MEDIA_TYPE, 'send the bytes as application/octet-stream');
}

/** Writes one ndjson line; a reader too far behind is cut off (a stalled client holds no memory). */
function writeLine(res: ServerResponse, o: object): void {
  if (res.destroyed || res.writableEnded) return;
  res.write(`${JSON.stringify(o)}\n`);
  if (res.writableLength > MAX_UNREAD_BYTES) res.destroy();
}

/**
 * Streams process `h` as ndjson until its end line, or until the client leaves: then a
 * foreground command is killed (`kill`), a reattached one just left running.
 */
function streamProcess(
  reply: FastifyReply,
  h: ProcessHandle,
  start: object,
  sandboxId: string,
  kill: (() => Promise<unknown>) | undefined,
): Promise<void> {
  reply.hijack();
  const res = reply.raw;
  res.writeHead(200, { 'content-type': 'application/x-ndjson', 'cache-control': 'no-cache' });
  writeLine(res, { type: 'start', id: h.id, pid: h.pid, ...start });
  h.onOutput((stream, data) => writeLine(res, { type: stream, data: data.toString('base64') }));
  return new Promise<void>((resolve) => {
    let ended = false;
    res.once('close', () => {
      if (!ended) {
        ended = true;
        // On a connection of its own: this one may be stalled behind the output.
        void kill?.().catch(() => undefined);
        h.detach();
      }
      resolve();
    });
    h.exited.then(
      (x) => {
        ended = true;
        writeLine(res, { type: 'end', ...x });
        res.end();
      },
      (e: unknown) => {
        ended = true;
        writeLine(res, errorLine(e, sandboxId));
        res.end();
      },
    );
  });
}

export function registerToolboxRoutes(app: FastifyInstance, deps: { controller: SandboxController }): void {
  const { controller } = deps;
  const scope = (req: FastifyRequest): string | undefined =>
    req.principal.admin ? undefined : req.principal.tenant;
  const ref = (req: FastifyRequest): string => parse(IdParams, req.params, 'path').id;

  // Its own scope: the WebSocket plugin and a raw body parser for any content type (a file
  // PUT by curl -T carries none) apply to these routes only.
  void app.register(websocket, { options: { maxPayload: 1024 * 1024 } });
  void app.register(async (tb) => {
    tb.addContentTypeParser('*', (_req, payload, done) => done(null, payload));

    tb.post('/v1/sandboxes/:id/commands', async (req, reply) => {
      const b = parse(RunCommandBody, req.body, 'request body');
      const spec: RunSpec = {
        args: b.cmd !== undefined ? ['/bin/sh', '-c', b.cmd] : b.args!,
        timeoutMs: b.timeoutMs ?? DEFAULT_COMMAND_TIMEOUT_MS,
        ...(b.cwd !== undefined ? { cwd: b.cwd } : {}),
        ...(b.envs !== undefined ? { env: b.envs } : {}),
        ...(b.stdin !== undefined ? { stdin: b.stdin } : {}),
        ...(b.pty !== undefined ? { pty: b.pty } : {}),
        ...(b.tag !== undefined ? { tag: b.tag } : {}),
      };
      return controller.toolbox(ref(req), scope(req), async (agent, s) => {
        const h = await agent.run(spec);
        if (b.background) {
          h.detach();
          const p = (await agent.list()).find((x) => x.id === h.id);
          const info: CommandInfo = p
            ? commandInfo(p)
            : {
                id: h.id,
                pid: h.pid,
                args: spec.args,
                cwd: spec.cwd ?? '',
                tag: spec.tag ?? null,
                pty: spec.pty !== undefined,
                running: true,
                exitCode: null,
                signal: null,
                startedAt: new Date().toISOString(),
              };
          return reply.status(201).send(info);
        }
        await streamProcess(reply, h, {}, s.id, () => agent.signal(h.id, 9));
        return reply;
      });
    });

    tb.get('/v1/sandboxes/:id/commands', async (req) =>
      controller.toolbox(ref(req), scope(req), async (agent) => ({
        commands: (await agent.list()).map(commandInfo),
      })),
    );

    tb.get('/v1/sandboxes/:id/commands/:cid', async (req) => {
      const { id, cid } = parse(CommandParams, req.params, 'path');
      return controller.toolbox(id, scope(req), async (agent, s) => {
        const p = (await agent.list()).find((x) => x.id === cid);
        if (!p) throw new DormantError(ErrorCode.PROCESS_NOT_FOUND, `sandbox ${s.id} has no command ${cid}`);
        return commandInfo(p);
      });
    });

    tb.get('/v1/sandboxes/:id/commands/:cid/output', async (req, reply) => {
      const { id, cid } = parse(CommandParams, req.params, 'path');
      const { from } = parse(OutputQuery, req.query, 'query');
      return controller.toolbox(id, scope(req), async (agent, s) => {
        const h = await agent.attach(cid, from ?? 0);
        await streamProcess(reply, h, { from: h.from }, s.id, undefined);
        return reply;
      });
    });

    tb.post('/v1/sandboxes/:id/commands/:cid/stdin', { bodyLimit: NO_BODY_LIMIT }, async (req) => {
      const { id, cid } = parse(CommandParams, req.params, 'path');
      const { eof } = parse(StdinQuery, req.query, 'query');
      const body = bodyStream(req.body);
      return controller.toolbox(id, scope(req), async (agent) => {
        await agent.stdin(cid, body, eof);
        return {};
      });
    });

    tb.post('/v1/sandboxes/:id/commands/:cid/kill', async (req) => {
      const { id, cid } = parse(CommandParams, req.params, 'path');
      const b = parse(KillBody, req.body ?? undefined, 'request body');
      const sig = signalNumber(b?.signal ?? 'SIGKILL');
      return controller.toolbox(id, scope(req), async (agent) => ({ killed: await agent.signal(cid, sig) }));
    });

    tb.post('/v1/sandboxes/:id/commands/:cid/resize', async (req) => {
      const { id, cid } = parse(CommandParams, req.params, 'path');
      const b = parse(ResizeBody, req.body, 'request body');
      return controller.toolbox(id, scope(req), async (agent) => {
        await agent.resize(cid, b.cols, b.rows);
        return {};
      });
    });

    tb.get('/v1/sandboxes/:id/commands/:cid/ws', { websocket: true }, (socket, req) => {
      attachSocket(controller, socket, req, scope(req));
    });

    tb.get('/v1/sandboxes/:id/files', async (req, reply) => {
      const { path } = parse(FilePathQuery, req.query, 'query');
      return controller.toolbox(ref(req), scope(req), async (agent) => {
        const f = await agent.read(path);
        reply.hijack();
        reply.raw.writeHead(200, {
          'content-type': 'application/octet-stream',
          'content-length': String(f.size),
        });
        // A transfer cut short (the agent or the client gone) ends the response early: the
        // client sees fewer bytes than Content-Length said, never a silently short file.
        await pipeline(f.stream, reply.raw).catch(() => reply.raw.destroy());
        return reply;
      });
    });

    tb.put('/v1/sandboxes/:id/files', { bodyLimit: NO_BODY_LIMIT }, async (req) => {
      const q = parse(PutFileQuery, req.query, 'query');
      const body = bodyStream(req.body);
      return controller.toolbox(ref(req), scope(req), async (agent) => {
        const w = await agent.write(q.path, body, {
          ...(q.mode !== undefined ? { mode: parseInt(q.mode, 8) } : {}),
          ...(q.append ? { append: true } : {}),
        });
        return { path: w.path, size: w.size };
      });
    });

    tb.get('/v1/sandboxes/:id/files/stat', async (req) => {
      const { path } = parse(FilePathQuery, req.query, 'query');
      return controller.toolbox(ref(req), scope(req), async (agent) => fileInfo(await agent.stat(path)));
    });

    tb.get('/v1/sandboxes/:id/files/list', async (req) => {
      const q = parse(ListFilesQuery, req.query, 'query');
      return controller.toolbox(ref(req), scope(req), async (agent) => ({
        entries: (await agent.ls(q.path, q.depth ?? 1)).map(fileInfo),
      }));
    });

    tb.post('/v1/sandboxes/:id/files/mkdir', async (req) => {
      const { path } = parse(PathBody, req.body, 'request body');
      return controller.toolbox(ref(req), scope(req), async (agent) => ({
        created: await agent.mkdir(path),
      }));
    });

    tb.post('/v1/sandboxes/:id/files/remove', async (req) => {
      const { path } = parse(PathBody, req.body, 'request body');
      return controller.toolbox(ref(req), scope(req), async (agent) => {
        await agent.remove(path);
        return {};
      });
    });

    tb.post('/v1/sandboxes/:id/files/rename', async (req) => {
      const b = parse(RenameBody, req.body, 'request body');
      return controller.toolbox(ref(req), scope(req), async (agent) => {
        await agent.rename(b.from, b.to);
        return {};
      });
    });

    tb.get('/v1/sandboxes/:id/files/watch', async (req, reply) => {
      const q = parse(WatchQuery, req.query, 'query');
      return controller.toolbox(ref(req), scope(req), async (agent) => {
        const res = reply.raw;
        const w = await agent.watch(q.path, q.recursive, (e) =>
          writeLine(res, { type: e.type, path: e.path, isDir: e.isDir }),
        );
        reply.hijack();
        res.writeHead(200, { 'content-type': 'application/x-ndjson', 'cache-control': 'no-cache' });
        res.flushHeaders();
        await new Promise<void>((resolve) => {
          res.once('close', () => {
            w.close();
            resolve();
          });
          // The agent ended the watch (the folder went, the sandbox slept): so does the answer.
          void w.closed.finally(() => res.end());
        });
        return reply;
      });
    });
  });
}

/** How long a WebSocket may leave output unread before it is cut off. */
function overfull(socket: WebSocket): boolean {
  return socket.bufferedAmount > MAX_UNREAD_BYTES;
}

/**
 * A WebSocket attached to a command: binary messages are its stdin and its output (stdout,
 * or everything on a terminal), text messages JSON control (resize, signal, eof) and events
 * (start, stderr, end). Closing the socket leaves the command running.
 */
function attachSocket(
  controller: SandboxController,
  socket: WebSocket,
  req: FastifyRequest,
  tenant: string | undefined,
): void {
  const send = (o: object): void => {
    if (socket.readyState === socket.OPEN) socket.send(JSON.stringify(o));
  };
  const fail = (e: unknown, id: string): void => {
    send(errorLine(e, id));
    socket.close(1011);
  };
  let params: { id: string; cid: string };
  let from: number | undefined;
  try {
    params = parse(CommandParams, req.params, 'path');
    from = parse(OutputQuery, req.query, 'query').from;
  } catch (e) {
    send({ type: 'error', code: ErrorCode.INVALID_ARGUMENT, message: asError(e).message });
    socket.close(1008);
    return;
  }
  // Messages that come before the agent answered wait for it.
  const early: { data: Buffer; binary: boolean }[] = [];
  let onMessage = (data: Buffer, binary: boolean): void => void early.push({ data, binary });
  socket.on('message', (data: Buffer, binary: boolean) => onMessage(data, binary));
  const closed = new Promise<void>((resolve) => socket.once('close', () => resolve()));
  controller
    .toolbox(params.id, tenant, async (agent, s) => {
      const h = await agent.attach(params.cid, from ?? 0);
      send({ type: 'start', id: h.id, pid: h.pid, from: h.from });
      h.onOutput((stream, data) => {
        if (socket.readyState !== socket.OPEN) return;
        if (stream === 'stdout') socket.send(data, { binary: true });
        else send({ type: 'stderr', data: data.toString('base64') });
        if (overfull(socket)) socket.terminate();
      });
      onMessage = (data, binary) => {
        try {
          if (binary) return h.write(data);
          const m = JSON.parse(data.toString('utf8')) as {
            type?: string;
            cols?: unknown;
            rows?: unknown;
            signal?: unknown;
          };
          if (m.type === 'resize') {
            const size = parse(ResizeBody, { cols: m.cols, rows: m.rows }, 'resize');
            h.resize(size.cols, size.rows);
          } else if (m.type === 'signal') h.signal(signalNumber(String(m.signal)));
          else if (m.type === 'eof') h.closeStdin();
          else send({ type: 'error', code: ErrorCode.INVALID_ARGUMENT, message: 'unknown message type' });
        } catch (e) {
          send({
            type: 'error',
            code: ErrorCode.INVALID_ARGUMENT,
            message: asError(e).message.slice(0, 300),
          });
        }
      };
      for (const m of early.splice(0)) onMessage(m.data, m.binary);
      const ended = h.exited.then(
        (x) => {
          send({ type: 'end', ...x });
          socket.close(1000);
        },
        (e: unknown) => fail(e, s.id),
      );
      await Promise.race([ended, closed]);
      h.detach();
    })
    .catch((e: unknown) => fail(e, params.id));
}
