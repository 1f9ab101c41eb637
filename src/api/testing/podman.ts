/**
 * What the podman suites share: whether a tool is installed, podman run with a timeout, and a
 * busybox base image made at test time both in podman's storage and as the OCI layout dormant
 * takes a base image in.
 */
import { join } from 'node:path';
import { buildBusyboxRootfs } from '../../runtime/testing/rootfs.js';
import { run } from '../../sys/exec.js';

/** True when `cmd --version` runs. */
export const installed = (cmd: string): Promise<boolean> =>
  run(cmd, ['--version'], { timeoutMs: 10_000 }).then(
    () => true,
    () => false,
  );

/** `podman ARGS`, failing after `timeoutMs`. */
export const podman = (args: string[], timeoutMs = 120_000) => run('podman', args, { timeoutMs });

/**
 * A busybox root filesystem under `dir`, imported into podman as `image` and saved beside it as
 * an OCI layout; returns the layout's path. The caller removes `image` (`podman rmi -f`).
 */
export async function busyboxImage(dir: string, image: string): Promise<string> {
  const rootfs = join(dir, 'rootfs');
  await buildBusyboxRootfs(rootfs);
  await run('tar', ['-C', rootfs, '-cf', join(dir, 'rootfs.tar'), '.'], { timeoutMs: 60_000 });
  await podman(['import', join(dir, 'rootfs.tar'), image]);
  const layout = join(dir, 'layout');
  await podman(['save', '--format', 'oci-dir', '-o', layout, image]);
  return layout;
}
