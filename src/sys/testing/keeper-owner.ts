/**
 * Test-only: a process that connects to 127.0.0.1:PORT, hands that connection to a keeper
 * that ends the processes listed in PROCS_FILE if this process dies, and prints
 * `{"keeper": PID}` once it has. A line "release" on stdin releases the keeper, then closes
 * the connection and exits. Usage: node keeper-owner.js PORT PROCS_FILE
 */
import { connect } from 'node:net';
import { once } from 'node:events';
import { createInterface } from 'node:readline';
import { startKeeper } from '../keeper.js';

const [port, procs] = process.argv.slice(2);
if (port === undefined || procs === undefined) {
  process.stderr.write('usage: keeper-owner PORT PROCS_FILE\n');
  process.exit(2);
}
const sock = connect(Number(port), '127.0.0.1');
await once(sock, 'connect');
const keeper = await startKeeper({ hold: [sock], procsFiles: ['/nonexistent/cgroup.procs', procs] });
process.stdout.write(`${JSON.stringify({ keeper: keeper.pid })}\n`);
for await (const line of createInterface({ input: process.stdin })) {
  if (line === 'release') {
    await keeper.release();
    sock.destroy();
    process.stdout.write('released\n');
    process.exit(0);
  }
}
