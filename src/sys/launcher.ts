/**
 * A small process that starts the daemon's commands for it.
 *
 * On Linux, Node starts a child with fork() then exec(), and the event loop waits until the
 * child has exec'd. fork() copies the page tables of the whole process, so that wait grows with
 * the memory the process has touched: 5 ms at 55 MiB, 21 ms at 556 MiB and 42 ms at 1.5 GiB on
 * the 2-core test host, idle (docs/BENCHMARKS.md, "Load: where the API's time goes"). A daemon
 * runs hundreds of commands (runc, ip, iptables, mount, criu) per minute under load, and every
 * one of those waits was a request that could not be answered. The launcher is a separate
 * Node process of ~40 MiB that does the fork and exec; the daemon only passes messages.
 *
 * `run` (exec.ts) asks it for every command. The launcher starts each child in a process group
 * of its own (as a direct spawn did), tells its pid at once, and forwards its output and its
 * exit as they come; timeouts, aborts and killing the group stay with the caller, by pid. If
 * the launcher cannot be started, commands are spawned directly, as before; if it dies, the
 * commands it had started are killed (their outcome is unknown) and their runs fail, and the
 * next command starts a fresh launcher.
 */
import { spawn, type ChildProcess } from 'node:child_process';

/** The launcher's own code, run with `node -e`: no file to find next to a bundle. */
const LAUNCHER = `
const { spawn } = require('node:child_process');
// The daemon's signals are not the launcher's: a Ctrl-C or a hangup at the daemon's terminal
// (its own process group, too) must not end the commands it runs. It ends when the daemon's
// channel closes.
for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP', 'SIGQUIT']) process.on(sig, () => {});
process.on('disconnect', () => process.exit(0));
const send = (m, cb) => {
  if (!process.connected) return true;
  return process.send(m, cb);
};
const children = new Map();
const letGo = (c) => { c.stdout?.destroy(); c.stderr?.destroy(); };
const start = (m) => {
  const id = m.id;
  const child = spawn(m.cmd, m.args, {
    cwd: m.cwd,
    env: m.env,
    detached: true,
    stdio: [m.input === undefined ? 'ignore' : 'pipe', 'pipe', 'pipe'],
  });
  children.set(id, child);
  if (child.pid !== undefined) send({ t: 'pid', id, pid: child.pid });
  // Output goes on only as fast as the daemon takes it: a child that writes without end waits
  // on its pipe, as it would for the daemon itself, instead of piling up here.
  let paused = false;
  const resume = () => {
    if (!paused) return;
    paused = false;
    child.stdout?.resume();
    child.stderr?.resume();
  };
  const out = (fd) => (b) => {
    if (send({ t: 'out', id, fd, b }, resume)) return;
    paused = true;
    child.stdout?.pause();
    child.stderr?.pause();
  };
  child.stdout?.on('data', out(1));
  child.stderr?.on('data', out(2));
  if (m.input !== undefined && child.stdin) {
    child.stdin.on('error', () => {});
    child.stdin.end(m.input);
  }
  child.on('error', (e) => {
    children.delete(id);
    send({ t: 'error', id, code: e.code, message: String(e) });
  });
  child.on('exit', (code, sig) => send({ t: 'exit', id, code, sig }));
  child.on('close', (code, sig) => {
    children.delete(id);
    send({ t: 'close', id, code, sig });
  });
};
process.on('message', (m) => {
  if (m.t === 'done') {
    const c = children.get(m.id);
    children.delete(m.id);
    if (c) letGo(c);
    return;
  }
  if (m.t !== 'run') return;
  try {
    start(m);
  } catch (e) {
    const c = children.get(m.id);
    children.delete(m.id);
    if (c) letGo(c);
    send({ t: 'thrown', id: m.id, message: String(e) });
  }
});
`;

/** A command the launcher started. */
export interface Launched {
  /** The caller is done with it: no more of its events, its pipes let go. */
  done(): void;
}

/** What the launcher reports of one command. */
export interface LaunchEvents {
  pid(pid: number): void;
  out(fd: 1 | 2, b: Buffer): void;
  /** The child could not start (ENOENT, EACCES, ...): Node's 'error' event. */
  error(code: string | undefined, message: string): void;
  /** spawn() itself threw (bad arguments). */
  thrown(message: string): void;
  exit(code: number | null, sig: NodeJS.Signals | null): void;
  close(code: number | null, sig: NodeJS.Signals | null): void;
  /**
   * The launcher died before the command's end: its outcome is unknown. `killed`: its process
   * group was sent SIGKILL (false: it had not started, or was gone).
   */
  lost(killed: boolean): void;
}

export interface LaunchRequest {
  cmd: string;
  args: readonly string[];
  cwd: string | undefined;
  env: Record<string, string>;
  input: string | Buffer | undefined;
}

interface Message {
  t: 'pid' | 'out' | 'error' | 'thrown' | 'exit' | 'close';
  id: number;
  pid?: number;
  fd?: 1 | 2;
  b?: Uint8Array;
  code?: number | string | null;
  sig?: NodeJS.Signals | null;
  message?: string;
}

class Launcher {
  private readonly runs = new Map<
    number,
    { ev: LaunchEvents; pid?: number; exited?: { code: number | null; sig: NodeJS.Signals | null } }
  >();
  private nextId = 1;
  /** Whether it ever answered: one that dies before that counts as a failed start. */
  private answered = false;
  dead = false;

  constructor(readonly proc: ChildProcess) {
    proc.on('message', (m: Message) => {
      this.answered = true;
      failedStarts = 0;
      this.onMessage(m);
    });
    // Its death is known once the channel has closed: every message it sent before is read.
    proc.on('disconnect', () => this.onDeath());
    proc.on('close', () => this.onDeath());
    proc.on('error', () => this.onDeath());
    this.idle();
  }

  /** Starts `req`; undefined when the launcher is gone (the caller spawns it itself). */
  launch(req: LaunchRequest, ev: LaunchEvents): Launched | undefined {
    if (this.dead || !this.proc.connected) return undefined;
    const id = this.nextId++;
    this.runs.set(id, { ev });
    if (this.runs.size === 1) {
      // While a command runs, the channel keeps the process alive, as its own child would.
      this.proc.ref();
      (this.proc.channel as { ref?: () => void } | undefined)?.ref?.();
    }
    try {
      this.proc.send({ t: 'run', id, ...req, args: [...req.args] });
    } catch {
      this.end(id);
      return undefined;
    }
    return {
      done: () => {
        if (!this.runs.has(id)) return;
        this.end(id);
        // Settled on its exit while something (a daemonised grandchild) holds its pipes:
        // the launcher lets go of them too.
        try {
          if (this.proc.connected) this.proc.send({ t: 'done', id });
        } catch {
          // The launcher is going: nothing of it to let go.
        }
      },
    };
  }

  private onMessage(m: Message): void {
    const r = this.runs.get(m.id);
    if (!r) return;
    switch (m.t) {
      case 'pid':
        r.pid = m.pid;
        r.ev.pid(m.pid!);
        break;
      case 'out': {
        const b = m.b!;
        r.ev.out(m.fd!, Buffer.isBuffer(b) ? b : Buffer.from(b.buffer, b.byteOffset, b.length));
        break;
      }
      case 'error':
        this.end(m.id);
        r.ev.error(typeof m.code === 'string' ? m.code : undefined, m.message ?? '');
        break;
      case 'thrown':
        this.end(m.id);
        r.ev.thrown(m.message ?? '');
        break;
      case 'exit':
        r.exited = { code: typeof m.code === 'number' ? m.code : null, sig: m.sig ?? null };
        r.ev.exit(typeof m.code === 'number' ? m.code : null, m.sig ?? null);
        break;
      case 'close':
        this.end(m.id);
        r.ev.close(typeof m.code === 'number' ? m.code : null, m.sig ?? null);
        break;
    }
  }

  private end(id: number): void {
    this.runs.delete(id);
    if (this.runs.size === 0) this.idle();
  }

  private idle(): void {
    this.proc.unref();
    (this.proc.channel as { unref?: () => void } | undefined)?.unref?.();
  }

  private onDeath(): void {
    if (this.dead) return;
    if (!this.answered && ++failedStarts >= MAX_FAILED_STARTS) enabled = false;
    this.teardown();
  }

  /**
   * The launcher is gone: a command that had exited ends with its exit; one still running is
   * killed (nothing would report its end), and its call fails.
   */
  private teardown(): void {
    this.dead = true;
    if (launcher === this) launcher = undefined;
    const runs = [...this.runs.values()];
    this.runs.clear();
    for (const r of runs) {
      if (r.exited) {
        r.ev.close(r.exited.code, r.exited.sig);
        continue;
      }
      let killed = false;
      if (r.pid !== undefined) {
        try {
          process.kill(-r.pid, 'SIGKILL');
          killed = true;
        } catch {
          // Gone already.
        }
      }
      r.ev.lost(killed);
    }
  }

  stop(): void {
    this.proc.kill();
    this.teardown();
  }
}

/** Launchers that died before answering, in a row; at this many, commands are spawned here. */
const MAX_FAILED_STARTS = 3;
let failedStarts = 0;

let launcher: Launcher | undefined;
let enabled = process.platform === 'linux';

function current(): Launcher | undefined {
  if (!enabled) return undefined;
  if (launcher && !launcher.dead) return launcher;
  try {
    const proc = spawn(process.execPath, ['-e', LAUNCHER], {
      stdio: ['ignore', 'ignore', 'inherit', 'ipc'],
      // A process group of its own: a signal to the daemon's group (Ctrl-C) is not its.
      detached: true,
      serialization: 'advanced',
      // Not the daemon's Node options (a profiler, a preload): the launcher needs none.
      env: { ...process.env, NODE_OPTIONS: '' },
    });
    launcher = new Launcher(proc);
  } catch {
    launcher = undefined;
  }
  return launcher;
}

/**
 * Starts a command through the launcher. Undefined when there is none (turned off, or it could not
 * start or is gone): the caller spawns the command itself.
 */
export function launch(req: LaunchRequest, ev: LaunchEvents): Launched | undefined {
  return current()?.launch(req, ev);
}

/** Turns the launcher on or off (off: commands are spawned by this process, as before). */
export function useLauncher(on: boolean): void {
  enabled = on;
  if (!on) launcher?.stop();
}

/** The launcher's pid, if one runs (tests). */
export function launcherPid(): number | undefined {
  return launcher && !launcher.dead ? launcher.proc.pid : undefined;
}
