import type { Command } from '@commander-js/extra-typings';
import { startDaemon } from '../../api/daemon.js';
import { defaultDataDir } from '../env.js';

export function registerServe(program: Command): void {
  program
    .command('serve')
    .description('run the daemon: API, lifecycle, on the embedded defaults (SQLite, local vault)')
    .option('--listen <host:port>', 'where the API listens', '127.0.0.1:7420')
    .option('--data-dir <dir>', 'state, vault and keys (default $DORMANT_DATA_DIR or /var/lib/dormant)')
    .option('--log', 'log every request to stderr')
    .action(async (o) => {
      const dataDir = o.dataDir ?? defaultDataDir();
      const d = await startDaemon({ dataDir, listen: o.listen, logger: !!o.log });
      for (const r of d.reconciled)
        process.stderr.write(`dormant: reconciled ${r.id}: ${r.from} -> ${r.to}\n`);
      process.stderr.write(
        `dormant: serving on ${d.url} (data in ${dataDir}; admin token in ${dataDir}/admin-token)\n`,
      );
      await new Promise<void>((resolve) => {
        const stop = (): void => resolve();
        process.once('SIGINT', stop);
        process.once('SIGTERM', stop);
      });
      process.stderr.write('dormant: shutting down (sandboxes keep running)\n');
      await d.close();
    });
}
