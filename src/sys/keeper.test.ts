import { after, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { readFileSync, writeFileSync } from 'node:fs';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { createServer, type Server, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';

const OWNER = fileURLToPath(new URL('./testing/keeper-owner.js', import.meta.url));

function alive(pid: number): boolean {
  try {
    return !/^\d+ \(.*\) [ZX]/.test(readFileSync(`/proc/${pid}/stat`, 'utf8'));
  } catch {
    return false;
  }
}

async function until(what: string, fn: () => boolean, ms = 10_000): Promise<void> {
  const deadline = Date.now() + ms;
  while (!fn()) {
    if (Date.now() > deadline) assert.fail(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 10));
  }
}

interface Setup {
  owner: ChildProcess;
  keeperPid: number;
  victim: ChildProcess;
  /** The server's end of the owner's connection. */
  conn: Socket;
  /** When the connection closed and when the victim died (performance.now()), once they did. */
  closedAt: () => number | undefined;
  victimDiedAt: () => number | undefined;
  lines: AsyncIterator<string>;
}

/**
 * The connection closed only after the processes were dead, and then not at once: the keeper
 * exits once it has read the cgroup empty three times, 50 ms apart. (An owner's own socket
 * closes the moment it dies, before a keeper could have killed anything, so a connection that
 * was not held closes before the processes die.)
 */
function heldPast(s: Setup): void {
  const gap = s.closedAt()! - s.victimDiedAt()!;
  assert.ok(
    gap >= 100,
    `the connection stayed open until well after the processes were dead (${gap.toFixed(0)} ms)`,
  );
}

describe('keeper', () => {
  const started: ChildProcess[] = [];
  const servers: Server[] = [];
  let dir: string | undefined;
  after(async () => {
    for (const c of started) if (c.exitCode === null && c.signalCode === null) c.kill('SIGKILL');
    for (const s of servers) s.close();
    if (dir !== undefined) await rm(dir, { recursive: true, force: true });
  });

  async function setup(): Promise<Setup> {
    dir ??= await mkdtemp(join(tmpdir(), 'dormant-keeper-'));
    // The processes the keeper must end: one sleep, listed the way a cgroup.procs lists them.
    const victim = spawn('sleep', ['600'], { stdio: 'ignore' });
    started.push(victim);
    let victimDied: number | undefined;
    const procs = join(dir, `procs-${String(victim.pid)}`);
    await writeFile(procs, `${String(victim.pid)}\n`);
    // As a cgroup's list does, it empties when its process is gone.
    victim.once('exit', () => {
      victimDied = performance.now();
      writeFileSync(procs, '');
    });
    const server = createServer();
    servers.push(server);
    server.listen(0, '127.0.0.1');
    await once(server, 'listening');
    const port = (server.address() as { port: number }).port;
    const accepted = once(server, 'connection') as Promise<[Socket]>;
    const owner = spawn(process.execPath, [OWNER, String(port), procs], {
      stdio: ['pipe', 'pipe', 'inherit'],
    });
    started.push(owner);
    const [conn] = await accepted;
    let closed: number | undefined;
    conn.on('close', () => (closed = performance.now()));
    conn.on('error', () => undefined);
    conn.resume();
    const lines = createInterface({ input: owner.stdout })[Symbol.asyncIterator]();
    const first = await lines.next();
    const { keeper } = JSON.parse(String(first.value)) as { keeper: number };
    assert.ok(alive(keeper), 'the keeper runs');
    return {
      owner,
      keeperPid: keeper,
      victim,
      conn,
      closedAt: () => closed,
      victimDiedAt: () => victimDied,
      lines,
    };
  }

  test('the owner dies: the listed processes are killed before the held connection closes', async () => {
    const s = await setup();
    s.owner.kill('SIGKILL');
    await until('the victim to die', () => s.victimDiedAt() !== undefined);
    assert.equal(s.victim.signalCode, 'SIGKILL');
    await until('the connection to close', () => s.closedAt() !== undefined);
    heldPast(s);
    await until('the keeper to exit', () => !alive(s.keeperPid));
  });

  test('released: nothing is killed, the keeper exits, the connection closes with its owner', async () => {
    const s = await setup();
    s.owner.stdin!.write('release\n');
    assert.equal((await s.lines.next()).value, 'released');
    await until('the keeper to exit', () => !alive(s.keeperPid));
    await until('the connection to close', () => s.closedAt() !== undefined);
    // Its exit may already have been reported while the waits above ran: an `exit` listener
    // attached now would wait forever.
    await until('the owner to exit', () => s.owner.exitCode !== null || s.owner.signalCode !== null);
    await new Promise((r) => setTimeout(r, 300));
    assert.ok(alive(s.victim.pid!), 'the victim still runs');
    s.victim.kill('SIGKILL');
  });

  test('SIGTERM and SIGINT to the keeper do not drop the connection it holds', async () => {
    const s = await setup();
    process.kill(s.keeperPid, 'SIGTERM');
    process.kill(s.keeperPid, 'SIGINT');
    process.kill(s.keeperPid, 'SIGHUP');
    await new Promise((r) => setTimeout(r, 300));
    assert.ok(alive(s.keeperPid), 'the keeper ignores them');
    // The owner closes its end: the connection stays open while the keeper holds it.
    s.owner.kill('SIGKILL');
    await until('the victim to die', () => s.victimDiedAt() !== undefined);
    await until('the connection to close', () => s.closedAt() !== undefined);
    heldPast(s);
  });
});
