/**
 * The toolbox agent inside a real runc sandbox (RuncRuntime.ensureAgent): it starts once and
 * answers on the sandbox's address, it sees the sandbox's files and never the host's (no `..`
 * or symlink escape), it runs from the sandbox's own /dev rather than from a host file, the
 * host's copy it started from cannot be written, and a background command it runs survives a
 * checkpoint and restore of the sandbox with its output.
 */
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { open, readFile, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { errnoCode } from '../domain/errors.js';
import { AGENT_PORT, AgentClient, AgentError, type AgentAddress } from './agent-client.js';
import { agentHostCopy, locateAgentBinary } from './runc-agent.js';
import { RuncRuntime } from './runc.js';
import {
  cannotRun,
  CRIU,
  removeRuntimeFolders,
  runtimeFolders,
  type RuntimeFolders,
} from './testing/host.js';

const skip =
  (await cannotRun('criu')) ||
  ((await locateAgentBinary()) ? false : 'dormant-agent is not built: run scripts/build-native.sh');

async function agentError(p: Promise<unknown>): Promise<AgentError> {
  const e = await p.then(
    () => assert.fail('expected an AgentError'),
    (err: unknown) => err,
  );
  assert.ok(e instanceof AgentError, `an AgentError, got ${String(e)}`);
  return e;
}

async function text(client: AgentClient, args: string[]): Promise<string> {
  const h = await client.run({ args });
  const out: Buffer[] = [];
  h.onOutput((_s, d) => out.push(d));
  await h.exited;
  return Buffer.concat(out).toString();
}

describe('the toolbox agent in a runc sandbox', { skip }, () => {
  let folders: RuntimeFolders;
  let rt: RuncRuntime;
  const id = `agent-${randomBytes(3).toString('hex')}`;
  const token = randomBytes(32).toString('hex');
  let addr: AgentAddress;
  let client: AgentClient;
  let hostMarker = '';

  before(async () => {
    folders = await runtimeFolders('agent');
    rt = new RuncRuntime({ stateDir: join(folders.tmp, 'state'), criuPath: CRIU });
    // Where the host keeps something the sandbox must not see.
    hostMarker = join(folders.tmp, 'host-only-marker');
    await writeFile(hostMarker, 'host secret');
    await rt.create({
      id,
      rootfs: folders.rootfs,
      args: ['sh', '-c', 'while true; do sleep 1; done'],
      hostname: 'agent-box',
    });
    await rt.start(id);
  });

  after(() => removeRuntimeFolders(folders, [rt]));

  test('concurrent first calls start one agent, on the sandbox address', async () => {
    const addrs = await Promise.all([1, 2, 3].map(() => rt.ensureAgent(id, token)));
    addr = addrs[0]!;
    const { network } = await rt.state(id);
    assert.deepEqual(addr, { host: network.address, port: AGENT_PORT, token });
    client = new AgentClient(addr);
    const { pid } = await client.ping();
    const ps = await rt.exec(id, ['ps', '-o', 'pid,args']);
    const agents = ps.stdout.split('\n').filter((l) => l.includes('serve') && !l.includes('ps -o'));
    assert.equal(agents.length, 1, ps.stdout);
    assert.equal(Number(agents[0]!.trim().split(/\s+/)[0]), pid, 'its pid is the sandbox-side pid');
    // Again: the running agent is found, none is added.
    await rt.ensureAgent(id, token);
    assert.equal((await client.ping()).pid, pid);
    // An agent with another token (what an imported checkpoint carries in) is ended and one
    // with the caller's token started in its place: the old token is refused from then on.
    const other = new AgentClient(await rt.ensureAgent(id, 'another-token'));
    assert.notEqual((await other.ping()).pid, pid);
    assert.equal((await agentError(client.ping())).code, 'EAUTH');
    const again = (await rt.exec(id, ['ps', '-o', 'pid,args'])).stdout.split('\n');
    assert.equal(again.filter((l) => l.includes('serve') && !l.includes('ps -o')).length, 1, 'one agent');
    // And back, for the tests below.
    client = new AgentClient(await rt.ensureAgent(id, token));
    await client.ping();
  });

  test('paths resolve inside the sandbox: `..` and a symlink to / reach its files, not the host', async () => {
    // The host has an /etc/hostname; the sandbox's busybox root has none, until it writes one.
    assert.match((await agentError(client.stat('../../../../etc/hostname'))).code, /^ENOENT$/);
    await client.write('/etc/hostname', Buffer.from('agent-box\n'));
    assert.equal(await text(client, ['cat', '../../../../etc/hostname']), 'agent-box\n');
    const viaDots = await client.read('/tmp/../../../../../etc/hostname');
    const chunks: Buffer[] = [];
    for await (const c of viaDots.stream) chunks.push(c as Buffer);
    assert.equal(Buffer.concat(chunks).toString(), 'agent-box\n');
    assert.equal((await agentError(client.stat(hostMarker))).code, 'ENOENT');
    assert.equal((await agentError(client.read(`/../../..${hostMarker}`))).code, 'ENOENT');
    // a symlink to / made inside the sandbox is the sandbox's /
    await text(client, ['ln', '-s', '/', '/tmp/root-link']);
    assert.equal((await client.stat('/tmp/root-link')).symlinkTarget, '/');
    assert.equal((await agentError(client.read(`/tmp/root-link${hostMarker}`))).code, 'ENOENT');
    await client.write('/tmp/root-link/etc/written-through-link', Buffer.from('inside'));
    assert.equal((await rt.exec(id, ['cat', '/etc/written-through-link'])).stdout, 'inside');
    const host = await readFile('/etc/hostname', 'utf8');
    assert.notEqual(host, 'agent-box\n', 'the host’s own file is untouched');
  });

  test('the agent runs from the sandbox’s /dev, and the host copy cannot be written', async () => {
    const { pid } = await client.ping();
    assert.equal((await rt.exec(id, ['readlink', `/proc/${pid}/exe`])).stdout.trim(), '/dev/.dormant/agent');
    const modes = (await rt.exec(id, ['stat', '-c', '%a %n', '/dev/.dormant', '/dev/.dormant/agent'])).stdout;
    assert.equal(modes, '700 /dev/.dormant\n500 /dev/.dormant/agent\n');
    // The agent holds no host file: its open files are the sandbox's own.
    const fds = await rt.exec(id, ['sh', '-c', `ls -l /proc/${pid}/fd`]);
    assert.doesNotMatch(fds.stdout, /dormant-agent-/);
    // The host's copy: read-only (what a sandbox holding /proc/PID/exe of the agent before it
    // re-executes would reach).
    const copy = await agentHostCopy();
    await assert.rejects(open(copy, 'r+'), (e) => errnoCode(e) === 'EROFS');
    const fh = await open(copy, 'r');
    await fh.close();
  });

  test('a PTY is the sandbox’s own devpts; watch works under its seccomp filter; its token is not in its environment', async () => {
    const h = await client.run({ args: ['sh', '-c', 'tty; stty size'], pty: { cols: 90, rows: 30 } });
    let out = '';
    h.onOutput((_s, d) => (out += d.toString()));
    assert.equal((await h.exited).exitCode, 0);
    assert.match(out, /^\/dev\/pts\/\d+\r\n30 90\r\n$/);
    const events: string[] = [];
    const w = await client.watch('/tmp', false, (e) => events.push(`${e.type} ${e.path}`));
    await client.write('/tmp/seen.txt', Buffer.from('x'));
    while (!events.includes('create /tmp/seen.txt')) await new Promise((r) => setTimeout(r, 20));
    w.close();
    const { pid } = await client.ping();
    const environ = await rt.exec(id, ['cat', `/proc/${pid}/environ`]);
    assert.ok(!environ.stdout.includes(token), 'the token is not readable from /proc');
  });

  test('a background command survives a checkpoint and restore of the sandbox, output and all', async () => {
    const h = await client.run({
      args: ['sh', '-c', 'i=0; while true; do i=$((i+1)); echo n$i; sleep 0.05; done'],
      tag: 'counter',
    });
    let seen = '';
    h.onOutput((_s, d) => (seen += d.toString()));
    while (!seen.includes('n3\n')) await new Promise((r) => setTimeout(r, 20));
    h.detach();
    const { pid } = await client.ping();

    const imagesDir = join(folders.shm, 'images');
    await rt.checkpoint(id, { imagesDir, workDir: join(folders.tmp, 'work') });
    assert.equal((await rt.state(id)).status, 'absent');
    await rt.restore(id, { imagesDir, workDir: join(folders.tmp, 'work-restore') });

    // The same agent answers (no new one started) and still follows the command.
    assert.deepEqual(await rt.ensureAgent(id, token), addr);
    assert.equal((await client.ping()).pid, pid);
    const listed = (await client.list()).find((p) => p.id === h.id);
    assert.equal(listed?.running, true);
    assert.equal(listed?.tag, 'counter');
    const again = await client.attach(h.id);
    let replay = '';
    again.onOutput((_s, d) => (replay += d.toString()));
    const before = listed.outputBytes;
    while (replay.length <= before + 20) await new Promise((r) => setTimeout(r, 20));
    assert.ok(replay.startsWith('n1\nn2\nn3\n'), 'the output from before the checkpoint is replayed');
    assert.equal(await client.signal(h.id, 9), true);
    assert.equal((await again.exited).signal, 'SIGKILL');
  });
});
