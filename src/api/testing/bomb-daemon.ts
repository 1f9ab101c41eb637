/**
 * Test-only: the daemon in a child process of its own, so that its peak RSS (VmHWM in
 * /proc/PID/status) is the daemon's alone, not the test runner's. Prints
 * `{"url","token","pid"}` on one line of stdout once it listens; SIGTERM closes it.
 * Usage: node bomb-daemon.js DATA_DIR   (DORMANT_TEST_IMPORT_LIMITS: JSON of importLimits)
 */
import { startTestDaemon } from './daemon.js';

const dataDir = process.argv[2];
if (dataDir === undefined) {
  process.stderr.write('usage: bomb-daemon DATA_DIR\n');
  process.exit(2);
}
const limits = process.env.DORMANT_TEST_IMPORT_LIMITS;
const { daemon } = await startTestDaemon({
  dataDir,
  readonlyBinds: [],
  proxy: false,
  policy: false,
  ...(limits ? { importLimits: JSON.parse(limits) as Record<string, number> } : {}),
});
process.stdout.write(`${JSON.stringify({ url: daemon.url, token: daemon.adminToken, pid: process.pid })}\n`);
process.on('SIGTERM', () => {
  void daemon.close().then(() => process.exit(0));
});
