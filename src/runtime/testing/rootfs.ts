/**
 * Test fixtures: a busybox root filesystem built from the host's busybox-static, with
 * `lib`/`lib64` pointing into `usr` so that a read-only bind of the host's /usr gives the
 * sandbox python3 (the host is merged-/usr Debian).
 */
import { copyFile, mkdir, symlink, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { run } from '../../sys/exec.js';

export async function buildBusyboxRootfs(dir: string, files: Record<string, string> = {}): Promise<void> {
  await mkdir(join(dir, 'bin'), { recursive: true });
  await copyFile('/bin/busybox', join(dir, 'bin', 'busybox'));
  const { stdout } = await run('/bin/busybox', ['--list'], { timeoutMs: 5000 });
  for (const applet of stdout.split('\n').filter((a) => a !== '' && a !== 'busybox'))
    await symlink('busybox', join(dir, 'bin', applet));
  for (const d of ['proc', 'sys', 'dev', 'tmp', 'etc', 'root', 'usr', 'srv'])
    await mkdir(join(dir, d), { recursive: true });
  await symlink('usr/lib', join(dir, 'lib'));
  await symlink('usr/lib64', join(dir, 'lib64'));
  await symlink('bin', join(dir, 'sbin'));
  await writeFile(join(dir, 'etc', 'passwd'), 'root:x:0:0:root:/root:/bin/sh\n');
  for (const [path, text] of Object.entries(files)) await writeFile(join(dir, path), text);
}
