import type { Command } from '@commander-js/extra-typings';
import { resolve } from 'node:path';
import { startDaemon } from '../../api/daemon.js';
import { parseDurationMs, parseSizeBytes } from '../../domain/units.js';
import { DormantError, ErrorCode } from '../../domain/errors.js';
import { defaultDataDir } from '../env.js';

const collect = (v: string, prev: string[] = []): string[] => [...prev, v];

export function registerServe(program: Command): void {
  program
    .command('serve')
    .description(
      'run the daemon: API, dashboard, wake proxy, policy loop, on the embedded defaults (SQLite, local vault)',
    )
    .option('--listen <host:port>', 'where the API listens', '127.0.0.1:7420')
    .option('--data-dir <dir>', 'state, vault and keys (default $DORMANT_DATA_DIR or /var/lib/dormant)')
    .option('--proxy-listen <host:port>', "the wake proxy's address (default: the API's port + 1)")
    .option('--proxy-domain <domain>', 'sandbox URLs are PORT-ID.<domain>', 'dormant.localhost')
    .option('--wake-timeout <duration>', 'how long a request is held while its sandbox wakes', '30s')
    .option('--no-proxy', 'run without the wake proxy')
    .option('--no-policy', 'run without the idle policy loop (sandboxes sleep only when told)')
    .option(
      '--lazy-restore',
      'resume with CRIU lazy pages (userfaultfd): running sooner, memory copied in behind (the default; eager where userfaultfd is missing)',
    )
    .option('--no-lazy-restore', 'resume eagerly: every page in memory before the sandbox runs')
    .option(
      '--stage-lazy-pages',
      "lazy resume copies the page images to staging and CRIU's lazy-pages daemon reads them there, instead of asking dormant's page server to read them from the vault (the default)",
    )
    .option(
      '--allow-root <dir>',
      "tenants' root filesystems, images and archives may come from this folder (repeatable; without it tenant tokens name no host path, admin tokens any)",
      collect,
      [],
    )
    .option(
      '--seccomp-profile <file>',
      "every sandbox's seccomp profile (OCI linux.seccomp JSON; default: config/seccomp-default.json)",
    )
    .option('--apparmor-profile <name>', 'an AppArmor profile loaded on this host, for every sandbox')
    .option(
      '--disk <size>',
      "disk quota of a sandbox's writable layer when its create gives none (a sparse ext4 image per sandbox)",
      '10G',
    )
    .option('--log', 'log every request to stderr')
    .addHelpText(
      'after',
      '\nExamples:\n  dormant serve\n  dormant serve --listen 0.0.0.0:7420 --proxy-domain sandboxes.example.com --allow-root /srv/images',
    )
    .action(async (o) => {
      const dataDir = o.dataDir ?? defaultDataDir();
      let wakeTimeoutMs: number;
      try {
        wakeTimeoutMs = parseDurationMs(o.wakeTimeout);
      } catch (e) {
        throw new DormantError(
          ErrorCode.INVALID_ARGUMENT,
          `--wake-timeout ${o.wakeTimeout}: ${(e as Error).message}`,
        );
      }
      let defaultDiskBytes: number;
      try {
        defaultDiskBytes = parseSizeBytes(o.disk);
      } catch (e) {
        throw new DormantError(ErrorCode.INVALID_ARGUMENT, `--disk ${o.disk}: ${(e as Error).message}`);
      }
      const d = await startDaemon({
        dataDir,
        defaultDiskBytes,
        listen: o.listen,
        logger: !!o.log,
        proxy: o.proxy
          ? {
              domain: o.proxyDomain,
              wakeTimeoutMs,
              ...(o.proxyListen !== undefined ? { listen: o.proxyListen } : {}),
            }
          : false,
        ...(o.policy ? {} : { policy: false as const }),
        ...(o.lazyRestore === false ? { lazyRestore: false } : {}),
        ...(o.stageLazyPages === true ? { servePagesFromVault: false } : {}),
        ...(o.allowRoot.length > 0 ? { allowedSourceRoots: o.allowRoot.map((r) => resolve(r)) } : {}),
        ...(o.seccompProfile !== undefined ? { seccompProfile: resolve(o.seccompProfile) } : {}),
        ...(o.apparmorProfile !== undefined ? { apparmorProfile: o.apparmorProfile } : {}),
      });
      for (const r of d.reconciled)
        process.stderr.write(`dormant: reconciled ${r.id}: ${r.from} -> ${r.to}\n`);
      process.stderr.write(
        `dormant: serving on ${d.url} (data in ${dataDir}; admin token in ${dataDir}/admin-token)\n`,
      );
      process.stderr.write(`dormant: dashboard at ${d.url}/ (\`dormant dashboard\` prints it signed in)\n`);
      await new Promise<void>((done) => {
        process.once('SIGINT', () => done());
        process.once('SIGTERM', () => done());
      });
      process.stderr.write('dormant: shutting down (sandboxes keep running)\n');
      await d.close();
    });
}
