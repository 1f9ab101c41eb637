/**
 * Test helpers for the fault, crash and load tests: a plain HTTP GET to a sandbox, polling
 * with a deadline, and a census of what a sandbox may leave on the host (processes, mounts,
 * network namespace, cgroups) so a test can assert that nothing of it remains.
 */
import { existsSync, readFileSync, readdirSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { request, type IncomingHttpHeaders } from 'node:http';
import { createServer } from 'node:net';

/** GET http://host:port/path; resolves with the body (any status), rejects on a network error. */
export function httpGet(host: string, port: number, path = '/', timeoutMs = 5000): Promise<string> {
  return new Promise((resolve, reject) => {
    const req = request({ host, port, path, agent: false, timeout: timeoutMs }, (res) => {
      let body = '';
      res.setEncoding('utf8');
      res.on('data', (c: string) => (body += c));
      res.on('end', () => {
        resolve(body);
      });
      res.on('error', reject);
    });
    req.on('timeout', () => req.destroy(new Error(`GET ${host}:${port}${path}: timeout`)));
    req.on('error', reject);
    req.end();
  });
}

/** What a wake proxy answered. */
export interface ProxyAnswer {
  status: number;
  body: string;
  headers: IncomingHttpHeaders;
}

/**
 * GET `path` through the wake proxy on 127.0.0.1:`port` with Host `host` (`PORT-ID.DOMAIN`) and
 * `headers` (the token, say); resolves with any status, rejects on a network error or timeout.
 */
export function viaProxy(
  port: number,
  host: string,
  o: { path?: string; headers?: Record<string, string>; timeoutMs?: number } = {},
): Promise<ProxyAnswer> {
  return new Promise((resolve, reject) => {
    const req = request(
      {
        host: '127.0.0.1',
        port,
        path: o.path ?? '/',
        headers: { host, ...o.headers },
        agent: false,
        timeout: o.timeoutMs ?? 60_000,
      },
      (res) => {
        let body = '';
        res.setEncoding('utf8');
        res.on('data', (c: string) => (body += c));
        res.on('end', () => resolve({ status: res.statusCode ?? 0, body, headers: res.headers }));
        res.on('error', reject);
      },
    );
    req.on('timeout', () => req.destroy(new Error(`GET ${host}${o.path ?? '/'} through the proxy: timeout`)));
    req.on('error', reject);
    req.end();
  });
}

/** A TCP port on loopback that was free a moment ago. */
export function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.once('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const a = s.address();
      s.close(() => (typeof a === 'object' && a ? resolve(a.port) : reject(new Error('no port'))));
    });
  });
}

/** Retries `fn` until it resolves or `timeoutMs` passes; then throws with the last error. */
export async function eventually<T>(what: string, fn: () => Promise<T>, timeoutMs = 20_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  let last: unknown;
  while (Date.now() < deadline) {
    try {
      return await fn();
    } catch (e) {
      last = e;
      await new Promise((r) => setTimeout(r, 100));
    }
  }
  throw new Error(`${what}: not after ${timeoutMs} ms: ${String(last)}`);
}

/** The text of file `path`, or `fallback` when it cannot be read (a process gone meanwhile). */
export function readOr(path: string, fallback: string): string {
  try {
    return readFileSync(path, 'utf8');
  } catch {
    // The process or file went away while we looked.
    return fallback;
  }
}

/** Live processes in the sandbox's cgroup (its own; not the host-side log collector). */
export function sandboxProcesses(id: string): number[] {
  const pids: number[] = [];
  for (const p of readdirSync('/proc')) {
    if (!/^\d+$/.test(p)) continue;
    const status = readOr(`/proc/${p}/status`, '');
    if (status === '' || /^State:\s+Z/m.test(status)) continue;
    if (readOr(`/proc/${p}/cgroup`, '').includes(id)) pids.push(Number(p));
  }
  return pids;
}

/**
 * Everything on the host that still names the sandbox: live processes (by command line or
 * cgroup), mounts, its network namespace, its cgroups. Empty when the sandbox left no trace.
 */
export function leftovers(id: string): string[] {
  const found: string[] = [];
  for (const p of readdirSync('/proc')) {
    if (!/^\d+$/.test(p) || Number(p) === process.pid) continue;
    const status = readOr(`/proc/${p}/status`, '');
    if (status === '' || /^State:\s+Z/m.test(status)) continue;
    const cmdline = readOr(`/proc/${p}/cmdline`, '').replaceAll('\0', ' ').trim();
    if (cmdline.includes(id) || readOr(`/proc/${p}/cgroup`, '').includes(id))
      found.push(`process ${p}: ${cmdline.slice(0, 200)}`);
  }
  for (const line of readOr('/proc/self/mountinfo', '').split('\n'))
    if (line.includes(id)) found.push(`mount: ${line.slice(0, 200)}`);
  if (existsSync(`/run/netns/dormant-${id}`)) found.push(`network namespace dormant-${id}`);
  for (const hierarchy of readdirSync('/sys/fs/cgroup')) {
    for (const parent of ['dormant', '']) {
      const path = `/sys/fs/cgroup/${hierarchy}/${parent}/${id}`.replace('//', '/');
      if (existsSync(path)) found.push(`cgroup ${path}`);
    }
  }
  return found;
}

/** Regular files under `root` (not following links) whose raw bytes contain `needle`. */
export function filesHolding(
  root: string,
  needle: string,
  maxFileBytes = Number.POSITIVE_INFINITY,
): string[] {
  const hits: string[] = [];
  const want = Buffer.from(needle);
  let entries;
  try {
    entries = readdirSync(root, { withFileTypes: true, recursive: true });
  } catch {
    return hits;
  }
  for (const e of entries) {
    if (!e.isFile()) continue;
    const p = join(e.parentPath, e.name);
    try {
      if (statSync(p).size > maxFileBytes) continue;
      if (readFileSync(p).includes(want)) hits.push(p);
    } catch {
      // Gone while we looked (another test's staging, say).
    }
  }
  return hits;
}

/** Sandbox `id` once it is in state `want` (polled through `client`). */
export function untilState<S extends { state: string }>(
  client: { getSandbox(id: string): Promise<S> },
  id: string,
  want: string,
  timeoutMs = 30_000,
): Promise<S> {
  return eventually(
    `${id} ${want}`,
    async () => {
      const s = await client.getSandbox(id);
      if (s.state !== want) throw new Error(`still ${s.state}`);
      return s;
    },
    timeoutMs,
  );
}

/** How the resume of a sandbox with a damaged checkpoint failed. */
export interface DamagedResume {
  /** True when the damage was found as the pages streamed in from the vault (lazy resume). */
  late: boolean;
  message: string;
  hint: string;
}

/**
 * Resumes sandbox `id`, whose checkpoint is damaged, and returns how it failed. The damage is
 * found at once (API error CHECKPOINT_DAMAGED, 409) when it lies in what must be restored
 * before the sandbox runs; when it lies in a lazy page served from the vault, the resume
 * answers running and the sandbox is back to hibernated as soon as the page is asked for,
 * its last error saying the same (message and hint).
 */
export async function resumeDamaged(
  client: {
    resume(id: string): Promise<{ state: string }>;
    getSandbox(id: string): Promise<{ state: string; lastError?: string | null }>;
  },
  id: string,
): Promise<DamagedResume> {
  let running: { state: string };
  try {
    running = await client.resume(id);
  } catch (e) {
    const x = e as { code?: string; status?: number; message: string; hint?: string };
    if (x.code !== 'CHECKPOINT_DAMAGED' || x.status !== 409)
      throw new Error(
        `resume failed, but not as CHECKPOINT_DAMAGED 409: ${String(x.code)} ${String(x.status)}: ${x.message}`,
      );
    return { late: false, message: x.message, hint: x.hint ?? '' };
  }
  if (running.state !== 'running') throw new Error(`resume answered ${running.state}`);
  const back = await untilState(client, id, 'hibernated');
  const m =
    /^lazy restore failed, back to its checkpoint: (.*cannot be read \(VAULT_[A-Z_]+\).*) \((.*)\)$/s.exec(
      back.lastError ?? '',
    );
  if (!m)
    throw new Error(
      `hibernated again, but its last error does not say the checkpoint is damaged: ${back.lastError ?? ''}`,
    );
  return { late: true, message: m[1]!, hint: m[2]! };
}
