/**
 * `dormant vault ...`: checks and maintenance of the checkpoint vault on this node.
 * Handlers compute a report; printing happens at the edge (table for people, --json for programs).
 */
import type { Command } from '@commander-js/extra-typings';
import Table from 'cli-table3';
import pc from 'picocolors';
import { join } from 'node:path';
import { formatBytes, formatDurationMs } from '../../domain/units.js';
import { DormantError } from '../../domain/errors.js';
import type { MasterKeySource, Vault } from '../../vault/index.js';
import type { S3VaultConfig } from '../../daemon/config.js';
import { EXIT_ERROR, EXIT_OK, printJson } from '../output.js';

interface CommonOpts {
  json?: true;
  dataDir?: string;
  config?: string;
}

/** The daemon's data directory and master key: its configuration (file, DORMANT_* variables), --data-dir over it. */
async function vaultOf(opts: CommonOpts): Promise<{
  dataDir: string;
  masterKey: MasterKeySource;
  s3: S3VaultConfig | undefined;
  state: { url: string } | undefined;
}> {
  // Loaded when a vault command runs: the rest of the CLI starts without the daemon's modules.
  const { loadConfig } = await import('../../daemon/config.js');
  const { masterKeySource } = await import('../../daemon/daemon.js');
  const { config } = loadConfig({
    ...(opts.config !== undefined ? { file: opts.config } : {}),
    flags: opts.dataDir !== undefined ? { dataDir: opts.dataDir } : {},
  });
  return {
    dataDir: config.dataDir,
    masterKey: masterKeySource(config),
    s3: config.vault,
    state: config.state,
  };
}

/** A node backup holds a SQLite state.db: one whose state is in PostgreSQL is backed up with PostgreSQL's tools. */
function refuseWithPostgresState(state: { url: string } | undefined, what: string): void {
  if (state === undefined) return;
  throw new DormantError(
    'INVALID_ARGUMENT',
    `vault ${what}: this node's database of record is PostgreSQL (state.url), not a state.db a backup can hold`,
    { hint: 'back the database up with pg_dump (and the vault with it); docs/STATE.md, "Backups"' },
  );
}

async function withVault<T>(opts: CommonOpts, create: boolean, fn: (v: Vault) => Promise<T>): Promise<T> {
  const { dataDir, masterKey, s3, state } = await vaultOf(opts);
  const { openVault } = await import('../../vault/index.js');
  const dir = join(dataDir, 'vault');
  const warn = (m: string): void => void process.stderr.write(`warning: ${m}\n`);
  // An S3 vault (the daemon's vault.url) is opened the way the daemon opens it, with the same
  // locks: a gc here must wait for the daemon's writers, and theirs for it.
  const s3Module = s3 ? await import('../../daemon/vault-store.js') : undefined;
  const locks = await s3Module?.vaultLocksFor(state, s3, warn);
  try {
    const store = s3 ? await s3Module?.s3VaultStore(s3, dir, warn, locks) : undefined;
    try {
      const vault = await openVault({
        dir,
        masterKey,
        create,
        ...(store ? { store } : {}),
        ...(locks ? { locks } : {}),
      });
      try {
        return await fn(vault);
      } finally {
        await vault.close();
      }
    } finally {
      store?.destroy();
    }
  } finally {
    await locks?.close();
  }
}

function table(head: string[]): Table.Table {
  return new Table({ head: head.map((h) => pc.bold(h)), style: { head: [], border: [] }, wordWrap: true });
}

export function registerVault(program: Command): void {
  const vault = program
    .command('vault')
    .description('the encrypted checkpoint vault on this node: verify, gc, stats');

  vault
    .command('verify')
    .description('decrypt and check every key, index, pack and manifest; name what is broken')
    .option('--json', 'print one JSON value (the verify report)')
    .option('--data-dir <dir>', "data directory (default: the daemon's configuration)")
    .option('--config <file>', "the daemon's configuration file (docs/CONFIG.md)")
    .addHelpText('after', '\nExit status: 0 when everything checks out, 1 when anything is damaged.')
    .action(async (opts) => {
      const report = await withVault(opts, false, (v) => v.verify());
      process.exitCode = report.ok ? EXIT_OK : EXIT_ERROR;
      if (opts.json) {
        printJson(report);
        return;
      }
      const o = report.orphans;
      process.stdout.write(
        `checked ${report.tenants} tenant(s), ${report.checkpoints} checkpoint(s), ${report.chunksChecked} chunk(s), ${formatBytes(report.bytesChecked)}\n`,
      );
      if (o.packs + o.indexes + o.temporaries > 0) {
        process.stdout.write(
          pc.dim(
            `leftovers of interrupted writes (gc removes them): ${o.packs} pack(s), ${o.temporaries} temporary file(s)\n`,
          ),
        );
      }
      if (report.shreddedTenants.length > 0) {
        process.stdout.write(pc.dim(`shredded tenants awaiting gc: ${report.shreddedTenants.join(', ')}\n`));
      }
      if (report.ok) {
        process.stdout.write(`${pc.green('ok')}: the vault is intact\n`);
        return;
      }
      const t = table(['tenant', 'checkpoints', 'object', 'problem']);
      for (const p of report.problems)
        t.push([p.tenant, p.checkpoints.join(', ') || '-', p.object, p.message]);
      process.stdout.write(`${t.toString()}\n${pc.red(`${report.problems.length} problem(s)`)}\n`);
    });

  vault
    .command('gc')
    .description(
      'delete what no checkpoint references and leftovers of interrupted writes (safe while writes go on)',
    )
    .option('--json', 'print one JSON value (the gc report)')
    .option('--data-dir <dir>', "data directory (default: the daemon's configuration)")
    .option('--config <file>', "the daemon's configuration file (docs/CONFIG.md)")
    .action(async (opts) => {
      const r = await withVault(opts, false, (v) => v.gc());
      if (opts.json) {
        printJson(r);
        return;
      }
      process.stdout.write(
        `reclaimed ${formatBytes(r.reclaimedBytes)} (${formatBytes(r.bytesBefore)} -> ${formatBytes(r.bytesAfter)}) in ${formatDurationMs(r.durationMs)}: ` +
          `${r.packsDeleted} pack(s) deleted, ${r.packsRepacked} repacked, ${r.temporariesDeleted} temporary file(s), ${r.tenantsShredded} shredded tenant(s)\n`,
      );
      for (const s of r.skippedTenants)
        process.stdout.write(`${pc.yellow('skipped')} tenant ${s.tenant}: ${s.reason}\n`);
    });

  vault
    .command('stats')
    .description('logical and stored bytes, deduplication and compression ratios')
    .option('--json', 'print one JSON value')
    .option('--data-dir <dir>', "data directory (default: the daemon's configuration)")
    .option('--config <file>', "the daemon's configuration file (docs/CONFIG.md)")
    .action(async (opts) => {
      const s = await withVault(opts, false, (v) => v.stats());
      if (opts.json) {
        printJson(s);
        return;
      }
      const t = table([
        'tenant',
        'checkpoints',
        'logical',
        'holes',
        'unique',
        'stored',
        'dedup',
        'compression',
        'overall',
      ]);
      for (const x of [...s.tenants, { tenant: pc.bold('total'), ...s.total }]) {
        t.push([
          x.tenant,
          String(x.checkpoints),
          formatBytes(x.logicalBytes),
          formatBytes(x.holeBytes),
          formatBytes(x.uniqueBytes),
          formatBytes(x.storedBytes),
          `${x.dedupRatio.toFixed(2)}x`,
          `${x.compressionRatio.toFixed(2)}x`,
          `${x.overallRatio.toFixed(2)}x`,
        ]);
      }
      process.stdout.write(`${s.location}\n${t.toString()}\n`);
    });

  vault
    .command('put')
    .description('store a folder (CRIU images) as a checkpoint')
    .argument('<dir>', 'the folder to store')
    .requiredOption('--id <checkpoint>', 'checkpoint id (never reused)')
    .option('--tenant <tenant>', 'tenant', 'default')
    .option('--sandbox <sandbox>', 'sandbox id (default: the checkpoint id)')
    .option('--json', 'print one JSON value')
    .option('--data-dir <dir>', "data directory (default: the daemon's configuration)")
    .option('--config <file>', "the daemon's configuration file (docs/CONFIG.md)")
    .action(async (dir, opts) => {
      const r = await withVault(opts, true, (v) =>
        v.putCheckpoint({
          tenant: opts.tenant,
          sandboxId: opts.sandbox ?? opts.id,
          checkpointId: opts.id,
          srcDir: dir,
        }),
      );
      if (opts.json) printJson(r);
      else {
        const mbps = r.logicalBytes / 1e6 / Math.max(r.durationMs / 1000, 1e-3);
        process.stdout.write(
          `stored ${opts.id}: ${formatBytes(r.logicalBytes)} in ${formatDurationMs(r.durationMs)} (${mbps.toFixed(0)} MB/s), ${formatBytes(r.newBytes)} new, ${formatBytes(r.storedBytes)} written\n`,
        );
      }
    });

  vault
    .command('get')
    .description('restore a checkpoint into a new or empty folder')
    .argument('<checkpoint>', 'checkpoint id')
    .requiredOption('--out <dir>', 'folder to restore into (new or empty)')
    .option('--tenant <tenant>', 'tenant', 'default')
    .option('--json', 'print one JSON value')
    .option('--data-dir <dir>', "data directory (default: the daemon's configuration)")
    .option('--config <file>', "the daemon's configuration file (docs/CONFIG.md)")
    .action(async (checkpoint, opts) => {
      const r = await withVault(opts, false, (v) =>
        v.restoreCheckpoint({ tenant: opts.tenant, checkpointId: checkpoint, destDir: opts.out }),
      );
      if (opts.json) printJson(r);
      else
        process.stdout.write(
          `restored ${checkpoint}: ${r.files} file(s), ${formatBytes(r.logicalBytes)} in ${formatDurationMs(r.durationMs)}\n`,
        );
    });

  vault
    .command('export')
    .description('back up this node (state and vault) into a new folder, while the daemon runs')
    .argument('<dir>', 'a new or empty folder')
    .option('--json', 'print one JSON value')
    .option('--data-dir <dir>', "data directory (default: the daemon's configuration)")
    .option('--config <file>', "the daemon's configuration file (docs/CONFIG.md)")
    .addHelpText(
      'after',
      '\nThe master key is not in the backup: the node that imports it needs the same one.\nRoot filesystems outside the data directory must exist at the same paths there.',
    )
    .action(async (dir, opts) => {
      const { dataDir, masterKey, state } = await vaultOf(opts);
      refuseWithPostgresState(state, 'export');
      const { backupNode } = await import('../../daemon/backup.js');
      const r = await backupNode({ dataDir, masterKey, dest: dir });
      if (opts.json) printJson(r);
      else
        process.stdout.write(
          `backed up ${dataDir} to ${r.dir}: ${r.files} file(s), ${formatBytes(r.bytes)} in ${formatDurationMs(r.durationMs)}\n`,
        );
    });

  vault
    .command('import')
    .description('make a fresh data directory from a backup `vault export` wrote (the daemon stopped)')
    .argument('<dir>', 'the backup folder')
    .option('--json', 'print one JSON value')
    .option(
      '--data-dir <dir>',
      "data directory to fill: new or without state (default: the daemon's configuration)",
    )
    .option('--config <file>', "the daemon's configuration file (docs/CONFIG.md)")
    .action(async (dir, opts) => {
      const { dataDir, masterKey, state } = await vaultOf(opts);
      refuseWithPostgresState(state, 'import');
      const { restoreNode } = await import('../../daemon/backup.js');
      const r = await restoreNode({ src: dir, dataDir, masterKey });
      if (opts.json) printJson(r);
      else
        process.stdout.write(
          `imported ${dir} into ${r.dir}: ${r.files} file(s), ${formatBytes(r.bytes)}; start \`dormant serve\` there: sandboxes that were running resume from their newest checkpoint\n`,
        );
    });
}
