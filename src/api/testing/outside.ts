/**
 * An "outside" host for egress tests: a network namespace the test makes, reached from the
 * host through a veth carrying 198.18.<n>.0/24 (the benchmarking range, RFC 2544: never a
 * real address), with an HTTP server on two of its addresses and a small DNS server.
 *
 *   host end     198.18.<n>.1   (interface dto<pid>)
 *   outside      198.18.<n>.2   HTTP :8080 ("outside <address>", "got N" for a POST's body;
 *                              /bytes/N answers N bytes), DNS :53
 *                198.18.<n>.3   HTTP :8080 (an address a list can leave out)
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { run } from '../../sys/exec.js';

export interface Outside {
  netns: string;
  /** 198.18.<n>. */
  prefix: string;
  /** Its first address (HTTP and DNS). */
  address: string;
  /** Its second address (HTTP only). */
  other: string;
  hostAddress: string;
  /** Changes what its DNS server answers (at once: the file is read at every query). */
  setNames(names: Record<string, string>): Promise<void>;
  close(): Promise<void>;
}

/** Answers A queries from `names` (NXDOMAIN otherwise), and serves HTTP on :8080. */
const SERVERS = String.raw`
const dgram = require('node:dgram');
const http = require('node:http');
const fs = require('node:fs');
// Read again at every query: a test changes an answer by rewriting the file.
const names = () => JSON.parse(fs.readFileSync(process.argv[1], 'utf8'));
http.createServer((req, res) => {
  if (req.url.startsWith('/bytes/')) { res.end(Buffer.alloc(Number(req.url.slice(7)), 120)); return; }
  // A POST's body is read and counted: the upload direction.
  let got = 0;
  req.on('data', (d) => (got += d.length));
  req.on('end', () => res.end('outside ' + req.socket.localAddress + (got > 0 ? ' got ' + got : '') + '\n'));
}).listen(8080, '0.0.0.0');
const sock = dgram.createSocket('udp4');
sock.on('message', (q, rinfo) => {
  let i = 12; const labels = [];
  while (q[i] !== 0) { labels.push(q.subarray(i + 1, i + 1 + q[i]).toString()); i += q[i] + 1; }
  const qtype = q.readUInt16BE(i + 1);
  const question = q.subarray(12, i + 5);
  const addr = names()[labels.join('.').toLowerCase()];
  const found = addr !== undefined && qtype === 1;
  const head = Buffer.alloc(12);
  q.copy(head, 0, 0, 2);
  head.writeUInt16BE(0x8180 | (addr === undefined ? 3 : 0), 2);
  head.writeUInt16BE(1, 4);
  head.writeUInt16BE(found ? 1 : 0, 6);
  const answer = found
    ? Buffer.concat([Buffer.from([0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 1, 0, 4]), Buffer.from(addr.split('.').map(Number))])
    : Buffer.alloc(0);
  sock.send(Buffer.concat([head, question, answer]), rinfo.port, rinfo.address);
});
sock.bind(53, '0.0.0.0', () => console.log('ready'));
`;

async function sh(cmd: string): Promise<void> {
  await run('sh', ['-c', cmd], { timeoutMs: 10_000 });
}

/** Makes the namespace and starts its servers; `names` maps host names to addresses. */
export async function startOutside(names: (prefix: string) => Record<string, string>): Promise<Outside> {
  const pid = process.pid;
  const n = (pid % 250) + 2;
  const prefix = `198.18.${n}.`;
  const netns = `dormant-t-out-${pid}`;
  const veth = `dto${pid}`;
  await sh(
    [
      `ip netns add ${netns}`,
      `ip -n ${netns} link set lo up`,
      `ip link add ${veth} type veth peer name ${veth}p`,
      `ip link set ${veth}p netns ${netns}`,
      `ip addr add ${prefix}1/24 dev ${veth}`,
      `ip link set ${veth} up`,
      `ip -n ${netns} addr add ${prefix}2/24 dev ${veth}p`,
      `ip -n ${netns} addr add ${prefix}3/24 dev ${veth}p`,
      `ip -n ${netns} link set ${veth}p up`,
    ].join(' && '),
  );
  let child: ChildProcess | undefined;
  const folder = await mkdtemp(join(tmpdir(), 'dormant-t-out-'));
  const namesFile = join(folder, 'names.json');
  const setNames = (n: Record<string, string>): Promise<void> => writeFile(namesFile, JSON.stringify(n));
  await setNames(names(prefix));
  const close = async (): Promise<void> => {
    if (child?.pid !== undefined) child.kill('SIGKILL');
    await rm(folder, { recursive: true, force: true });
    await sh(`ip netns del ${netns} 2>/dev/null; ip link del ${veth} 2>/dev/null; true`);
  };
  try {
    child = spawn('ip', ['netns', 'exec', netns, process.execPath, '-e', SERVERS, namesFile], {
      stdio: ['ignore', 'pipe', 'inherit'],
    });
    await new Promise<void>((resolve, reject) => {
      child!.stdout!.once('data', () => resolve());
      child!.once('exit', (code) => reject(new Error(`the outside servers exited (${code})`)));
    });
  } catch (e) {
    await close();
    throw e;
  }
  return {
    netns,
    prefix,
    address: `${prefix}2`,
    other: `${prefix}3`,
    hostAddress: `${prefix}1`,
    setNames,
    close,
  };
}
