/**
 * envd, the in-sandbox API of E2B, over dormant's toolbox: the `process.Process` and
 * `filesystem.Filesystem` Connect services and the `/files` upload and download. Every call
 * goes through `controller.toolbox` (control/ops/toolbox.ts), the same operation dormant's own
 * toolbox routes use (routes-toolbox.ts): the sandbox is woken if it sleeps, the call counts
 * as activity, and the agent inside the sandbox does the work (paths resolve within the
 * sandbox's root). One implementation, two protocols.
 *
 * Messages follow envd's protobuf definitions in their JSON form (lowerCamelCase fields, enums
 * by name, bytes in base64, int64 as strings). E2B names a process by its pid (or its tag);
 * dormant's agent by an id: a pid is looked up in the agent's list.
 */
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { randomUUID } from 'node:crypto';
import { pipeline } from 'node:stream/promises';
import { posix } from 'node:path';
import type { SandboxController } from '../../control/sandboxes.js';
import { toolboxError } from '../../control/ops/toolbox.js';
import type { Sandbox } from '../../domain/sandbox.js';
import type {
  AgentClient,
  FileInfo,
  ProcessHandle,
  ProcessInfo,
  RunSpec,
  WatchEvent,
} from '../../runtime/agent-client.js';
import {
  ConnectError,
  MAX_MESSAGE_BYTES,
  ServerStream,
  parseJson,
  sendUnaryError,
  unwrapEnvelope,
} from './connect.js';
import { readMultipart } from './multipart.js';

/** What the envd routes need: the controller, and the sandbox an envd request is for. */
export interface EnvdDeps {
  controller: SandboxController;
  /** The sandbox of an envd request, its access token checked; throws otherwise. */
  sandboxOf(req: FastifyRequest): Promise<Sandbox>;
  /** Largest multipart upload read into memory (an octet-stream one is streamed). */
  maxMultipartBytes: number;
}

type Json = Record<string, unknown>;

function obj(v: unknown, what: string): Json {
  if (v === undefined || v === null) return {};
  if (typeof v !== 'object' || Array.isArray(v))
    throw new ConnectError('invalid_argument', `${what}: expected an object`);
  return v as Json;
}

function str(v: unknown, what: string, required = true): string | undefined {
  if (v === undefined || v === null) {
    if (required) throw new ConnectError('invalid_argument', `${what} is required`);
    return undefined;
  }
  if (typeof v !== 'string') throw new ConnectError('invalid_argument', `${what}: expected a string`);
  return v;
}

function uint(v: unknown, what: string): number | undefined {
  if (v === undefined || v === null) return undefined;
  const n = typeof v === 'string' ? Number(v) : v;
  if (typeof n !== 'number' || !Number.isInteger(n) || n < 0 || n > 0xffffffff)
    throw new ConnectError('invalid_argument', `${what}: expected an unsigned integer`);
  return n;
}

function bytes(v: unknown, what: string): Buffer {
  if (typeof v !== 'string') throw new ConnectError('invalid_argument', `${what}: expected base64 bytes`);
  return Buffer.from(v, 'base64');
}

/** Signal enum values (by name or number) as Linux signal numbers. */
function signalOf(v: unknown): number {
  if (v === 'SIGNAL_SIGKILL' || v === 9) return 9;
  if (v === 'SIGNAL_SIGTERM' || v === 15) return 15;
  throw new ConnectError('invalid_argument', 'signal: expected SIGNAL_SIGKILL or SIGNAL_SIGTERM');
}

const FILE_TYPE: Readonly<Record<FileInfo['type'], string>> = {
  file: 'FILE_TYPE_FILE',
  dir: 'FILE_TYPE_DIRECTORY',
  symlink: 'FILE_TYPE_SYMLINK',
  other: 'FILE_TYPE_UNSPECIFIED',
};

const EVENT_TYPE: Readonly<Record<string, string>> = {
  create: 'EVENT_TYPE_CREATE',
  write: 'EVENT_TYPE_WRITE',
  remove: 'EVENT_TYPE_REMOVE',
  rename: 'EVENT_TYPE_RENAME',
  chmod: 'EVENT_TYPE_CHMOD',
};

/** `ls -l`'s permission string of a mode. */
function permissions(f: FileInfo): string {
  const t = f.type === 'dir' ? 'd' : f.type === 'symlink' ? 'L' : '-';
  let s = '';
  for (let i = 8; i >= 0; i--) s += f.mode & (1 << i) ? 'rwx'[(8 - i) % 3]! : '-';
  return t + s;
}

/** envd's EntryInfo. The agent reports no owner: the sandbox's processes all run as its user. */
function entryInfo(f: FileInfo): Json {
  return {
    name: f.name,
    type: FILE_TYPE[f.type],
    path: f.path,
    size: String(f.size),
    mode: f.mode & 0o7777,
    permissions: permissions(f),
    owner: 'root',
    group: 'root',
    modifiedTime: new Date(f.mtimeMs).toISOString(),
    ...(typeof f.symlinkTarget === 'string' ? { symlinkTarget: f.symlinkTarget } : {}),
  };
}

/** envd's FilesystemEvent: the name relative to the watched folder. */
function watchEvent(dir: string, e: WatchEvent): Json {
  return {
    name: posix.relative(dir, e.path) || posix.basename(e.path),
    type: EVENT_TYPE[e.type] ?? 'EVENT_TYPE_UNSPECIFIED',
  };
}

/** envd's ProcessConfig of a process the agent lists. */
function processConfig(p: ProcessInfo): Json {
  return { cmd: p.args[0] ?? '', args: p.args.slice(1), envs: {}, ...(p.cwd !== '' ? { cwd: p.cwd } : {}) };
}

/** The process a ProcessSelector names: by pid or by tag, among those the agent knows. */
async function selected(agent: AgentClient, selector: unknown): Promise<ProcessInfo> {
  const sel = obj(obj(selector, 'process').selector ?? selector, 'process');
  const pid = uint(sel.pid, 'process.pid');
  const tag = str(sel.tag, 'process.tag', false);
  if (pid === undefined && tag === undefined)
    throw new ConnectError('invalid_argument', 'process: give a pid or a tag');
  const list = await agent.list();
  // The newest first: a pid may have been used again after an earlier process ended.
  const found = list
    .filter((p) => (pid !== undefined ? p.pid === pid : p.tag === tag))
    .sort((a, b) => Number(b.running) - Number(a.running) || b.startedAt - a.startedAt)[0];
  if (!found) throw new ConnectError('not_found', `process ${pid ?? tag} not found`);
  return found;
}

/**
 * Keepalive messages on a quiet stream, as envd sends them (the SDK asks every 50 s): an idle
 * HTTP client or proxy would otherwise end a long, silent command's stream.
 */
function keepalive(out: ServerStream, message: object): NodeJS.Timeout {
  const t = setInterval(() => out.send(message), KEEPALIVE_MS);
  t.unref();
  return t;
}

/** Streams a followed process as envd's ProcessEvents: start, data..., end. */
async function streamEvents(reply: FastifyReply, h: ProcessHandle, pty: boolean, id: string): Promise<void> {
  reply.hijack();
  const out = new ServerStream(reply.raw);
  out.send({ event: { start: { pid: h.pid } } });
  h.onOutput((stream, data) => {
    const key = pty ? 'pty' : stream;
    out.send({ event: { data: { [key]: data.toString('base64') } } });
  });
  const ended = h.exited.then(
    (x) => {
      const exitCode = x.exitCode ?? -1;
      const status = x.exitCode !== null ? `exit status ${x.exitCode}` : `signal: ${x.signal ?? 'killed'}`;
      out.send({
        event: {
          end: {
            exitCode,
            exited: x.exitCode !== null,
            status,
            ...(exitCode !== 0 ? { error: status } : {}),
          },
        },
      });
      out.end();
    },
    (e: unknown) => out.end(toolboxError(e, id)),
  );
  const beat = keepalive(out, { event: { keepalive: {} } });
  // A client that leaves ends the stream, not the process: E2B's disconnect() leaves it running.
  await Promise.race([ended, out.closed]);
  clearInterval(beat);
  h.detach();
}

/** Registers envd's routes on `app` (the E2B front's own server). */
export function registerEnvd(app: FastifyInstance, deps: EnvdDeps): void {
  const { controller } = deps;
  const withAgent = async <T>(
    req: FastifyRequest,
    fn: (agent: AgentClient, s: Sandbox) => Promise<T>,
  ): Promise<T> => {
    const s = await deps.sandboxOf(req);
    return controller.toolbox(s.id, s.tenant, fn);
  };

  const unary = (path: string, fn: (body: Json, req: FastifyRequest) => Promise<object>): void => {
    app.post(path, { bodyLimit: MAX_MESSAGE_BYTES }, async (req, reply) => {
      let answer: object;
      try {
        // application/json: fastify has parsed it (its errors come to the front's handler).
        answer = await fn(obj(Buffer.isBuffer(req.body) ? parseJson(req.body) : req.body, 'request'), req);
      } catch (e) {
        return sendUnaryError(reply, e);
      }
      return reply.type('application/json').send(answer);
    });
  };

  const streaming = (
    path: string,
    fn: (body: Json, req: FastifyRequest, reply: FastifyReply) => Promise<void>,
  ): void => {
    app.post(path, { bodyLimit: MAX_MESSAGE_BYTES }, async (req, reply) => {
      try {
        const body = obj(unwrapEnvelope(req.body as Buffer), 'request');
        await fn(body, req, reply);
      } catch (e) {
        // Before the stream began, the error is a stream of one end frame.
        if (reply.sent || reply.raw.headersSent) return reply;
        reply.hijack();
        new ServerStream(reply.raw).end(e);
      }
      return reply;
    });
  };

  // ---- process.Process ----

  streaming('/process.Process/Start', async (b, req, reply) => {
    const p = obj(b.process, 'process');
    const cmd = str(p.cmd, 'process.cmd')!;
    const args = Array.isArray(p.args) ? p.args.map((a, i) => str(a, `process.args[${i}]`)!) : [];
    const envs = obj(p.envs, 'process.envs');
    const ptyIn = b.pty === undefined || b.pty === null ? undefined : obj(obj(b.pty, 'pty').size, 'pty.size');
    const tag = str(b.tag, 'tag', false);
    const spec: RunSpec = {
      args: [cmd, ...args],
      env: Object.fromEntries(Object.entries(envs).map(([k, v]) => [k, str(v, `process.envs.${k}`)!])),
      ...(typeof p.cwd === 'string' && p.cwd !== '' ? { cwd: p.cwd } : {}),
      // A PTY always has its input open; otherwise only when asked (envd >= 0.3.0).
      ...(ptyIn !== undefined || b.stdin === true ? { stdin: true } : {}),
      ...(ptyIn !== undefined
        ? { pty: { cols: uint(ptyIn.cols, 'pty.cols') ?? 80, rows: uint(ptyIn.rows, 'pty.rows') ?? 24 } }
        : {}),
      ...(tag !== undefined ? { tag } : {}),
    };
    await withAgent(req, async (agent, s) => {
      const h = await agent.run(spec);
      await streamEvents(reply, h, ptyIn !== undefined, s.id);
    });
  });

  streaming('/process.Process/Connect', async (b, req, reply) => {
    await withAgent(req, async (agent, s) => {
      const p = await selected(agent, b.process);
      // From now on, as envd does: what it wrote before was for the stream that started it.
      const h = await agent.attach(p.id, p.outputBytes);
      await streamEvents(reply, h, p.pty, s.id);
    });
  });

  unary('/process.Process/List', async (_b, req) =>
    withAgent(req, async (agent) => ({
      processes: (await agent.list())
        .filter((p) => p.running)
        .map((p) => ({ config: processConfig(p), pid: p.pid, ...(p.tag !== null ? { tag: p.tag } : {}) })),
    })),
  );

  unary('/process.Process/SendInput', async (b, req) =>
    withAgent(req, async (agent) => {
      const p = await selected(agent, b.process);
      const input = obj(b.input, 'input');
      const data =
        input.stdin !== undefined ? bytes(input.stdin, 'input.stdin') : bytes(input.pty, 'input.pty');
      await agent.stdin(p.id, data);
      return {};
    }),
  );

  unary('/process.Process/CloseStdin', async (b, req) =>
    withAgent(req, async (agent) => {
      const p = await selected(agent, b.process);
      await agent.stdin(p.id, Buffer.alloc(0), true);
      return {};
    }),
  );

  unary('/process.Process/SendSignal', async (b, req) =>
    withAgent(req, async (agent) => {
      const p = await selected(agent, b.process);
      if (!p.running) throw new ConnectError('not_found', `process ${p.pid} has ended`);
      await agent.signal(p.id, signalOf(b.signal));
      return {};
    }),
  );

  unary('/process.Process/Update', async (b, req) =>
    withAgent(req, async (agent) => {
      const p = await selected(agent, b.process);
      if (b.pty !== undefined && b.pty !== null) {
        const size = obj(obj(b.pty, 'pty').size, 'pty.size');
        await agent.resize(p.id, uint(size.cols, 'pty.cols') ?? 80, uint(size.rows, 'pty.rows') ?? 24);
      }
      return {};
    }),
  );

  // ---- filesystem.Filesystem ----

  const path = (b: Json, key = 'path'): string => str(b[key], key)!;

  unary('/filesystem.Filesystem/Stat', async (b, req) =>
    withAgent(req, async (agent) => ({ entry: entryInfo(await agent.stat(path(b))) })),
  );

  unary('/filesystem.Filesystem/ListDir', async (b, req) =>
    withAgent(req, async (agent) => {
      const depth = uint(b.depth, 'depth') ?? 1;
      return { entries: (await agent.ls(path(b), Math.max(1, depth))).map(entryInfo) };
    }),
  );

  unary('/filesystem.Filesystem/MakeDir', async (b, req) =>
    withAgent(req, async (agent) => {
      const p = path(b);
      if (!(await agent.mkdir(p))) throw new ConnectError('already_exists', `directory ${p} already exists`);
      return { entry: entryInfo(await agent.stat(p)) };
    }),
  );

  unary('/filesystem.Filesystem/Move', async (b, req) =>
    withAgent(req, async (agent) => {
      const to = path(b, 'destination');
      await agent.rename(path(b, 'source'), to);
      return { entry: entryInfo(await agent.stat(to)) };
    }),
  );

  unary('/filesystem.Filesystem/Remove', async (b, req) =>
    withAgent(req, async (agent) => {
      await agent.remove(path(b));
      return {};
    }),
  );

  streaming('/filesystem.Filesystem/WatchDir', async (b, req, reply) => {
    const dir = path(b);
    await withAgent(req, async (agent) => {
      // Events come only from I/O, after the stream below is open.
      const to: { out?: ServerStream } = {};
      const w = await agent.watch(dir, b.recursive === true, (e) =>
        to.out?.send({ filesystem: watchEvent(dir, e) }),
      );
      reply.hijack();
      const out = (to.out = new ServerStream(reply.raw));
      out.send({ start: {} });
      // The agent ended the watch (the folder went, the sandbox slept): so does the stream.
      const stop = w.closed.then(
        () => out.end(),
        (e: unknown) => out.end(e),
      );
      const beat = keepalive(out, { keepalive: {} });
      await Promise.race([stop, out.closed]);
      clearInterval(beat);
      w.close();
    });
  });

  // Polling watchers (the Python SDK's synchronous watch_dir): the same watch, its events kept
  // until asked for. Bounded in number and in events kept; one not polled for a while ends.
  const watchers = new Map<string, PolledWatcher>();
  const watcherOf = async (b: Json, req: FastifyRequest): Promise<PolledWatcher> => {
    const w = watchers.get(str(b.watcherId, 'watcherId')!);
    // Another sandbox's watcher is as unknown as one never made.
    if (!w || w.sandboxId !== (await deps.sandboxOf(req)).id)
      throw new ConnectError('not_found', 'no such watcher');
    w.polledAt = Date.now();
    return w;
  };

  unary('/filesystem.Filesystem/CreateWatcher', async (b, req) =>
    withAgent(req, async (agent, s) => {
      if (watchers.size >= MAX_WATCHERS) throw new ConnectError('resource_exhausted', 'too many watchers');
      const dir = path(b);
      const id = randomUUID();
      const events: Json[] = [];
      const handle = await agent.watch(dir, b.recursive === true, (e) => {
        if (events.length >= MAX_WATCHER_EVENTS) events.shift();
        events.push(watchEvent(dir, e));
      });
      const w: PolledWatcher = { sandboxId: s.id, events, close: () => handle.close(), polledAt: Date.now() };
      watchers.set(id, w);
      // The agent ended it (the folder went, the sandbox slept): what it saw can still be read.
      void handle.closed.catch(() => undefined);
      return { watcherId: id };
    }),
  );

  unary('/filesystem.Filesystem/GetWatcherEvents', async (b, req) => {
    const w = await watcherOf(b, req);
    return { events: w.events.splice(0) };
  });

  unary('/filesystem.Filesystem/RemoveWatcher', async (b, req) => {
    const w = await watcherOf(b, req);
    w.close();
    watchers.delete(str(b.watcherId, 'watcherId')!);
    return {};
  });

  const sweep = setInterval(() => {
    for (const [id, w] of watchers)
      if (Date.now() - w.polledAt > WATCHER_IDLE_MS) {
        w.close();
        watchers.delete(id);
      }
  }, 60_000);
  sweep.unref();
  app.addHook('onClose', async () => {
    clearInterval(sweep);
    for (const w of watchers.values()) w.close();
    watchers.clear();
  });

  // ---- /files: contents, as plain HTTP ----

  app.get('/files', async (req, reply) => {
    const q = req.query as Record<string, unknown>;
    const p = filesPath(q.path);
    return withAgent(req, async (agent) => {
      const f = await agent.read(p);
      reply.hijack();
      reply.raw.writeHead(200, {
        'content-type': 'application/octet-stream',
        'content-length': String(f.size),
        'content-disposition': `attachment; filename=${JSON.stringify(posix.basename(p))}`,
      });
      // Cut short (the agent or the client gone): the client sees fewer bytes than promised.
      await pipeline(f.stream, reply.raw).catch(() => reply.raw.destroy());
      return reply;
    });
  });

  app.post('/files', async (req, reply) => {
    const q = req.query as Record<string, unknown>;
    const type = req.headers['content-type'] ?? '';
    const body = req.body as NodeJS.ReadableStream;
    const written = await withAgent(req, async (agent) => {
      if (type.startsWith('multipart/form-data')) {
        const target = typeof q.path === 'string' && q.path !== '' ? q.path : undefined;
        const parts = await readMultipart(body, type, deps.maxMultipartBytes);
        const out: Json[] = [];
        for (const part of parts) {
          const p = filesPath(target ?? part.filename);
          const w = await agent.write(p, part.data);
          out.push({ name: posix.basename(w.path), type: 'file', path: w.path });
        }
        return out;
      }
      const p = filesPath(q.path);
      const w = await agent.write(p, body as AsyncIterable<Buffer>);
      return [{ name: posix.basename(w.path), type: 'file', path: w.path }];
    });
    return reply.send(written);
  });

  // The SDK's probe after a dropped connection: a sandbox that sleeps is woken by the next
  // call, so any sandbox still there is healthy.
  app.get('/health', async (req, reply) => {
    await deps.sandboxOf(req);
    return reply.status(204).send();
  });
}

const KEEPALIVE_MS = 30_000;

/** Polling watchers a front keeps at once, events each keeps, and how long one may go unpolled. */
const MAX_WATCHERS = 1024;
const MAX_WATCHER_EVENTS = 10_000;
const WATCHER_IDLE_MS = 10 * 60_000;

interface PolledWatcher {
  sandboxId: string;
  events: Json[];
  close(): void;
  polledAt: number;
}

/** A /files path: required, as the query gives it. */
function filesPath(v: unknown): string {
  if (typeof v !== 'string' || v === '') throw new ConnectError('invalid_argument', 'path is required');
  return v;
}
