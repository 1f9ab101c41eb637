/**
 * Test helper run as a child process: stores one folder in a vault. The crash test starts it
 * with DORMANT_VAULT_TEST_KILL_AT=<step> so that it dies by SIGKILL at that step.
 * Usage: node ingest-child.js VAULT_DIR KEY_HEX SRC_DIR CHECKPOINT_ID
 */
import { openVault } from '../index.js';

const [dir, keyHex, srcDir, checkpointId] = process.argv.slice(2);
if (dir === undefined || keyHex === undefined || srcDir === undefined || checkpointId === undefined) {
  process.stderr.write('usage: ingest-child VAULT_DIR KEY_HEX SRC_DIR CHECKPOINT_ID\n');
  process.exit(2);
}
const vault = await openVault({
  dir,
  masterKey: { key: Buffer.from(keyHex, 'hex') },
  packTargetBytes: 8 * 1024 * 1024,
});
await vault.putCheckpoint({ tenant: 'crash', sandboxId: 'sb', checkpointId, srcDir });
await vault.close();
process.stdout.write('stored\n');
