/** `dormant checkpoint ...`: checkpoints in the vault and in archives. */
import type { Command } from '@commander-js/extra-typings';
import Table from 'cli-table3';
import pc from 'picocolors';
import { formatBytes } from '../../domain/units.js';
import { clientFromEnv } from '../client.js';
import { printJson } from '../output.js';
import { rename, rm, stat } from 'node:fs/promises';
import { createReadStream, createWriteStream } from 'node:fs';
import { basename, dirname, join, resolve } from 'node:path';
import { Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { DormantError, ErrorCode } from '../../domain/errors.js';
import type { InspectReport, InspectTreeNode } from '../../checkpoint/inspect.js';
import type { ScanReport } from '../../checkpoint/scan.js';
import type { openCheckpointPath } from '../../checkpoint/source.js';
import { randomBytes } from 'node:crypto';

/** Exit status of `scan` when it finds anything. */
export const EXIT_SECRETS_FOUND = 3;

/** A REF that names a file or folder on this machine is read here; anything else is a checkpoint id. */
async function isLocalRef(ref: string): Promise<boolean> {
  try {
    await stat(ref);
    return true;
  } catch {
    return false;
  }
}

async function withLocal<T>(
  ref: string,
  fn: (ck: Awaited<ReturnType<typeof openCheckpointPath>>) => Promise<T>,
  opts: { pagesInPlace?: boolean } = {},
): Promise<T> {
  // The checkpoint modules load when a command reads an archive, not for every CLI start.
  const { openCheckpointPath } = await import('../../checkpoint/source.js');
  const ck = await openCheckpointPath(ref, opts);
  try {
    return await fn(ck);
  } finally {
    await ck.close();
  }
}

function printInspect(r: InspectReport): void {
  const m = r.metadata;
  const out: string[] = [];
  out.push(`${pc.bold(m.name ?? r.ref)}  ${pc.dim(`(${r.kind}, engine ${m.engine})`)}`);
  const kv: [string, string | number | undefined][] = [
    ['image', m.image],
    ['runtime', m.runtime],
    ['arch', m.arch],
    ['kernel', m.kernel],
    ['criu', m.criuVersion],
    ['created', m.createdAt],
    ['checkpointed', m.checkpointedAt],
    ['memory pages', formatBytes(r.sizes.memoryPagesBytes)],
    ['images', formatBytes(r.sizes.imagesBytes)],
  ];
  for (const [k, v] of kv) if (v !== undefined) out.push(`  ${pc.dim(k.padEnd(13))}${v}`);
  const byPid = new Map(r.processes.map((p) => [p.pid, p]));
  const walk = (n: InspectTreeNode, indent: string): void => {
    const p = byPid.get(n.pid)!;
    const cmd = p.cmdline ? p.cmdline.join(' ') : p.comm;
    out.push(
      `${indent}${pc.bold(String(p.pid))} ${cmd}  ${pc.dim(`${p.state}, ${formatBytes(p.memory.storedBytes)} stored of ${formatBytes(p.memory.mappedBytes)} mapped`)}`,
    );
    for (const f of p.files)
      if (f.type !== 'INETSK' && f.type !== 'UNIXSK')
        out.push(`${indent}    ${pc.dim(`[${f.type} ${f.fd}]`)} ${f.path}`);
    for (const s of p.sockets) {
      const flag = s.listening
        ? pc.green(' listening')
        : s.needsReconnect
          ? pc.yellow(' needs reconnect')
          : '';
      out.push(
        `${indent}    ${pc.dim(`[${s.protocol} ${s.fd}]`)} ${s.state} ${s.local}${s.remote ? ` -> ${s.remote}` : ''}${flag}`,
      );
    }
    for (const c of n.children) walk(c, `${indent}  `);
  };
  out.push(pc.bold('processes'));
  for (const n of r.processTree) walk(n, '  ');
  if (r.mounts.length > 0) {
    out.push(pc.bold('mounts'));
    for (const mt of r.mounts) out.push(`  ${mt.mountpoint} ${pc.dim(`${mt.fstype} ${mt.source}`)}`);
  }
  process.stdout.write(`${out.join('\n')}\n`);
}

function printScan(r: ScanReport): void {
  if (r.findings.length === 0) {
    process.stdout.write(
      `no secrets found (${formatBytes(r.scanned.memoryBytes)} of memory, ${r.scanned.files} files, ${r.durationMs} ms)\n`,
    );
    return;
  }
  const t = new Table({
    head: ['kind', 'where', 'process', 'mapping / path', 'offset', 'preview', 'seen'].map((h) => pc.bold(h)),
    style: { head: [], border: [] },
  });
  for (const f of r.findings)
    t.push([
      f.kind,
      f.where,
      f.process ? `${f.process.pid} ${f.process.comm}` : '',
      f.where === 'memory' ? `${f.mapping ?? ''} ${f.address ?? ''}` : (f.path ?? ''),
      String(f.offset),
      f.preview,
      String(f.occurrences),
    ]);
  process.stdout.write(`${t.toString()}\n${pc.red(`${r.findings.length} secret(s) found`)}\n`);
}

export function registerCheckpoint(program: Command): void {
  const ck = program.command('checkpoint').description('checkpoints: list, inspect, scan, export, import');
  ck.command('ls')
    .description('checkpoints, newest first')
    .argument('[id]', 'only this sandbox (its id or name)')
    .option('--json', 'print JSON')
    .action(async (id, o) => {
      const client = clientFromEnv();
      // The list is filtered by id: a name is made one first (an unknown one is an error, not
      // an empty list).
      const sandbox = id !== undefined ? (await client.getSandbox(id)).id : undefined;
      const list = await client.listCheckpoints(sandbox);
      if (o.json) {
        printJson(list);
        return;
      }
      if (list.length === 0) {
        process.stdout.write('no checkpoints\n');
        return;
      }
      const t = new Table({
        head: ['id', 'sandbox', 'kind', 'created', 'logical', 'stored'].map((h) => pc.bold(h)),
        style: { head: [], border: [] },
      });
      for (const c of list)
        t.push([
          c.id,
          c.sandboxId,
          c.kind,
          c.createdAt,
          formatBytes(c.logicalBytes),
          formatBytes(c.storedBytes),
        ]);
      process.stdout.write(`${t.toString()}\n`);
    });

  ck.command('inspect')
    .description('process tree, files, sockets, memory, mounts and metadata of a checkpoint')
    .argument('<ref>', 'a checkpoint id, an archive (.tar, .tar.gz, .tar.zst) or a folder of CRIU images')
    .option('--json', 'print JSON')
    .action(async (ref, o) => {
      const r = (await isLocalRef(ref))
        ? await withLocal(ref, async (c) =>
            (await import('../../checkpoint/inspect.js')).inspectCheckpoint(c),
          )
        : ((await clientFromEnv().inspectCheckpoint(ref)) as unknown as InspectReport);
      if (o.json) printJson(r);
      else printInspect(r);
    });
  ck.command('scan')
    .description("secrets in a checkpoint's memory, files and metadata; exit 3 when any is found")
    .argument('<ref>', 'a checkpoint id, an archive or a folder of CRIU images')
    .option('--json', 'print JSON')
    .action(async (ref, o) => {
      const r = (await isLocalRef(ref))
        ? await withLocal(
            ref,
            async (c) => {
              const { scanCheckpoint } = await import('../../checkpoint/scan.js');
              const { defaultScanWorkers } = await import('../../checkpoint/scan-pool.js');
              // The workers keep a daemon's thread free; the CLI's has nothing else to do, and
              // one worker alone scans slower than the calling thread (docs/BENCHMARKS.md).
              return scanCheckpoint(c, defaultScanWorkers() > 1 ? {} : { workers: 0 });
            },
            {
              // The scan reads the pages only through readPages: no copy of them in staging.
              pagesInPlace: true,
            },
          )
        : ((await clientFromEnv().scanCheckpoint(ref)) as unknown as ScanReport);
      if (o.json) printJson(r);
      else printScan(r);
      if (r.findings.length > 0) process.exitCode = EXIT_SECRETS_FOUND;
    });
  ck.command('export')
    .description(
      'write a checkpoint as a podman / CRI-O archive or an OCI image (refused when it holds secrets)',
    )
    .argument('<ckpt>', 'a checkpoint id, an archive or a folder of CRIU images')
    .requiredOption(
      '--out <path>',
      'podman: the archive to write (.tar.zst, .tar.gz or .tar); oci: a new folder for the image layout',
    )
    .option('--format <format>', 'podman or oci', 'podman')
    .option('--name <name>', 'container name recorded in config.dump (and the OCI checkpoint annotation)')
    .option('--allow-plaintext', 'export even when the scan finds secrets')
    .option(
      '--encrypt',
      'oci only: encrypt the layer (ocicrypt AES_256_CTR_HMAC_SHA256, keys in a JWE) for each --recipient; allowed even when the scan finds secrets',
    )
    .option(
      '--recipient <jwe:pubkey.pem>',
      'an RSA public key (PEM) that can decrypt an --encrypt export (repeatable)',
      (v: string, prev: string[]) => [...prev, v],
      [] as string[],
    )
    .option('--json', 'print JSON')
    .action(async (ref, o) => {
      if (o.format !== 'podman' && o.format !== 'oci')
        throw new DormantError(ErrorCode.INVALID_ARGUMENT, `--format ${o.format}: expected podman or oci`);
      const oci = o.format === 'oci';
      const encrypt = o.encrypt === true;
      if (encrypt && !oci)
        throw new DormantError(ErrorCode.INVALID_ARGUMENT, '--encrypt needs --format oci', {
          hint: 'an encrypted export is an OCI image layout whose layer is encrypted (ocicrypt)',
        });
      if (!encrypt && o.recipient.length > 0)
        throw new DormantError(ErrorCode.INVALID_ARGUMENT, '--recipient is only used with --encrypt');
      // Recipients are read before anything is exported: a bad key file fails fast.
      const { loadRecipients } = await import('../../checkpoint/encrypt.js');
      const recipients = encrypt ? await loadRecipients(o.recipient) : undefined;
      // An OCI image's layer is the uncompressed podman archive, written beside the folder first;
      // when it is to be encrypted, in /dev/shm (memory), so its plaintext never reaches a disk.
      const archive = encrypt
        ? join('/dev/shm', `.dormant-export-${process.pid}-${randomBytes(6).toString('hex')}.tar`)
        : oci
          ? join(dirname(resolve(o.out)), `.${basename(o.out)}.${process.pid}.tar`)
          : o.out;
      const compression = oci || o.out.endsWith('.tar') ? 'none' : o.out.endsWith('.gz') ? 'gzip' : 'zstd';
      let findings: number;
      try {
        if (!(await isLocalRef(ref))) {
          // A checkpoint id: the daemon scans and builds the archive; it is written here atomically.
          const r = await clientFromEnv().exportCheckpoint(ref, {
            allowPlaintext: o.allowPlaintext === true,
            encrypted: encrypt,
            compression,
          });
          const tmp = join(dirname(archive), `.${basename(archive)}.${process.pid}.tmp`);
          try {
            await pipeline(
              Readable.fromWeb(r.body as Parameters<typeof Readable.fromWeb>[0]),
              createWriteStream(tmp, { mode: 0o600, flags: 'wx' }),
            );
            await rename(tmp, archive);
          } catch (e) {
            await rm(tmp, { force: true });
            throw e;
          }
          findings = r.secretsFound;
        } else {
          const { exportCheckpoint } = await import('../../checkpoint/export.js');
          const { exportedOciConfig } = await import('../../runtime/oci.js');
          // Not a sandbox of a daemon: its command and binds are not known, only a sandbox's
          // process (user, capabilities) and namespaces, which podman's exec and inspect read.
          const name = o.name ?? 'dormant-export';
          const oci = exportedOciConfig({ id: 'dormant-export', rootfs: '/', args: [] });
          const r = await withLocal(ref, (c) =>
            exportCheckpoint(c, {
              out: archive,
              format: 'podman',
              compression,
              allowPlaintext: o.allowPlaintext === true,
              encrypted: encrypt,
              meta: {
                id: Buffer.from(ref).toString('hex').padEnd(64, '0').slice(0, 64),
                name,
                oci,
              },
            }),
          );
          findings = r.scan.findings.length;
        }
        if (oci) {
          const { writeOciCheckpointImage } = await import('../../checkpoint/oci.js');
          await writeOciCheckpointImage(archive, o.out, {
            containerName: o.name ?? ((await isLocalRef(ref)) ? 'dormant-export' : ref),
            annotations: { 'org.dormant.checkpoint': ref },
            ...(recipients ? { encryptFor: recipients } : {}),
          });
        }
      } finally {
        if (oci) await rm(archive, { force: true });
      }
      const sizeBytes = oci ? 0 : (await stat(o.out)).size;
      if (o.json) printJson({ out: o.out, format: o.format, sizeBytes, findings, encrypted: encrypt });
      else
        process.stdout.write(
          `${o.out}${oci ? ` (OCI image layout${encrypt ? ', layer encrypted' : ''})` : ` (${formatBytes(sizeBytes)})`}${findings > 0 ? (encrypt ? pc.dim(` with ${findings} secret(s), encrypted`) : pc.yellow(` with ${findings} secret(s) in plaintext`)) : ''}\n`,
        );
    });
  ck.command('import')
    .description('a podman export or kubelet / CRI-O checkpoint archive becomes a hibernated sandbox')
    .argument('<archive>', 'the archive (.tar, .tar.gz, .tar.zst): sent to the daemon as the request body')
    .option(
      '--on-daemon',
      "the archive is a path on the daemon's machine, read there instead of sent (admin tokens, or folders the operator allowed)",
    )
    .option('--image <dir>', 'the base image as an OCI image layout folder (DIR[:TAG])')
    .option('--name <name>', 'the new sandbox name')
    .option(
      '--port <port>',
      'a port reachable through the proxy (repeatable; default: what the archive recorded)',
      (v: string, prev: string[]) => [...prev, v],
      [] as string[],
    )
    .option('--json', 'print JSON')
    .action(async (archive, o) => {
      const ports = o.port.map((p) => {
        const n = Number(p);
        if (!Number.isInteger(n) || n < 1 || n > 65535)
          throw new DormantError(ErrorCode.INVALID_ARGUMENT, `--port ${p}: expected 1 to 65535`);
        return n;
      });
      const rest = {
        ...(o.image !== undefined ? { image: resolve(o.image) } : {}),
        ...(o.name !== undefined ? { name: o.name } : {}),
        ...(ports.length > 0 ? { ports } : {}),
      };
      const client = clientFromEnv();
      const s =
        o.onDaemon === true
          ? await client.importCheckpoint({ archive: resolve(archive), ...rest })
          : await (async () => {
              const st = await stat(archive).catch(() => undefined);
              if (!st?.isFile())
                throw new DormantError(ErrorCode.INVALID_ARGUMENT, `archive ${archive}: no such file`);
              return client.uploadCheckpoint(
                Readable.toWeb(createReadStream(archive)) as ReadableStream<Uint8Array>,
                { fileName: basename(archive), ...rest },
              );
            })();
      if (o.json) printJson(s);
      else process.stdout.write(`${s.id} ${pc.dim(`(${s.name}, ${s.state}; dormant resume ${s.id})`)}\n`);
    });
}
