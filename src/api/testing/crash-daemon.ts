/**
 * Test-only: the daemon in a child process that kills itself (SIGKILL, no cleanup, exactly as
 * the kernel's OOM killer or a power cut would leave things) when the controller reaches the
 * step named by DORMANT_TEST_CRASH_AT. Prints `{"url","token","pid"}` on one line of stdout
 * once it listens. Usage: node crash-daemon.js DATA_DIR
 */
import { startTestDaemon } from './daemon.js';

const dataDir = process.argv[2];
if (dataDir === undefined) {
  process.stderr.write('usage: crash-daemon DATA_DIR\n');
  process.exit(2);
}
const crashAt = process.env.DORMANT_TEST_CRASH_AT;

const { daemon } = await startTestDaemon({
  dataDir,
  proxy: false,
  policy: false,
  // Every lazy resume serves its pages from the vault, the tests' small sandboxes' too; with
  // DORMANT_TEST_STAGE_LAZY_PAGES=1 every one stages them (CRIU's own daemon reads them).
  ...(process.env.DORMANT_TEST_STAGE_LAZY_PAGES === '1'
    ? { servePagesFromVault: false }
    : { pagesFromVaultAboveBytes: 0 }),
  failAt: (step) => {
    if (step === crashAt) {
      process.stderr.write(`crash-daemon: SIGKILL at ${step}\n`);
      process.kill(process.pid, 'SIGKILL');
    }
  },
});
process.stdout.write(`${JSON.stringify({ url: daemon.url, token: daemon.adminToken, pid: process.pid })}\n`);
process.on('SIGTERM', () => {
  void daemon.close().then(() => process.exit(0));
});
