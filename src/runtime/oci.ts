/**
 * The sandbox spec, validated, and the OCI runtime config (config.json) made from it.
 * Pure: no I/O, so the isolation a sandbox gets can be read and tested here in one place.
 */
import { DormantError, ErrorCode } from '../domain/errors.js';
import { netnsName } from './network.js';
import type { SandboxSpec } from './runtime.js';
import type { UserNamespace } from './userns.js';

/** Smallest disk quota: ext4's journal and metadata take ~5 MiB of the image (quota.ts). */
export const MIN_DISK_BYTES = 32 * 1024 * 1024;
/** Largest: ext4 (4 KiB blocks) files end at 16 TiB, and the image is one file on the host. */
export const MAX_DISK_BYTES = 16 * 1024 ** 4 - 1024 ** 3;

const ID_RE = /^[a-z0-9][a-z0-9_.-]{0,47}$/;

function invalid(message: string): DormantError {
  return new DormantError(ErrorCode.INVALID_ARGUMENT, message, { status: 400 });
}

/** Checks a spec and returns a frozen copy with defaults filled in. */
export function compileSandboxSpec(raw: SandboxSpec): Readonly<SandboxSpec> {
  if (!ID_RE.test(raw.id))
    throw invalid(
      `sandbox id "${raw.id}" is not valid: use 1-48 of a-z, 0-9, '-', '_', '.', starting with a letter or digit`,
    );
  if (!raw.rootfs.startsWith('/')) throw invalid(`sandbox ${raw.id}: rootfs must be an absolute path`);
  if (raw.args.length === 0) throw invalid(`sandbox ${raw.id}: a command is required`);
  const ports = [...new Set(raw.ports ?? [])];
  for (const p of ports)
    if (!Number.isInteger(p) || p < 1 || p > 65535)
      throw invalid(`sandbox ${raw.id}: port ${p} is not valid`);
  const limits = raw.limits ?? {};
  if (limits.memoryBytes !== undefined && !(limits.memoryBytes >= 4 * 1024 * 1024))
    throw invalid(`sandbox ${raw.id}: memory limit must be at least 4 MiB`);
  if (limits.cpus !== undefined && !(limits.cpus > 0 && limits.cpus <= 1024))
    throw invalid(`sandbox ${raw.id}: cpus must be > 0`);
  if (limits.pids !== undefined && !(Number.isInteger(limits.pids) && limits.pids > 0))
    throw invalid(`sandbox ${raw.id}: pids limit must be a positive integer`);
  if (
    limits.diskBytes !== undefined &&
    !(
      Number.isSafeInteger(limits.diskBytes) &&
      limits.diskBytes >= MIN_DISK_BYTES &&
      limits.diskBytes <= MAX_DISK_BYTES
    )
  )
    throw invalid(
      `sandbox ${raw.id}: disk quota must be a whole number of bytes from 32 MiB to 16 TiB less 1 GiB`,
    );
  const hostname = raw.hostname ?? raw.id;
  if (!/^[a-zA-Z0-9]([a-zA-Z0-9.-]{0,62})$/.test(hostname))
    throw invalid(`sandbox ${raw.id}: hostname "${hostname}" is not valid`);
  for (const b of raw.readonlyBinds ?? [])
    if (!b.source.startsWith('/') || !b.destination.startsWith('/'))
      throw invalid(`sandbox ${raw.id}: bind ${b.source}:${b.destination} must use absolute paths`);
  for (const b of raw.engineBinds ?? [])
    if (!b.destination.startsWith('/') || b.destination.split('/').includes('..') || b.destination === '/')
      throw invalid(`sandbox ${raw.id}: engine bind ${b.destination} must be an absolute path below /`);
  for (const d of raw.devices ?? [])
    if (
      !/^\/dev\/[A-Za-z0-9][A-Za-z0-9._-]*$/.test(d.path) ||
      !Number.isInteger(d.major) ||
      !Number.isInteger(d.minor) ||
      d.major < 0 ||
      d.minor < 0
    )
      throw invalid(`sandbox ${raw.id}: device ${d.path} ${d.major}:${d.minor} is not valid`);
  for (const k of Object.keys(raw.env ?? {}))
    if (!/^[A-Za-z_][A-Za-z0-9_]*$/.test(k)) throw invalid(`sandbox ${raw.id}: env name "${k}" is not valid`);
  return Object.freeze({
    id: raw.id,
    rootfs: raw.rootfs,
    args: Object.freeze([...raw.args]),
    env: Object.freeze({ ...(raw.env ?? {}) }),
    cwd: raw.cwd ?? '/',
    hostname,
    ports: Object.freeze(ports.sort((a, b) => a - b)),
    limits: Object.freeze({ ...limits }),
    readonlyBinds: Object.freeze((raw.readonlyBinds ?? []).map((b) => Object.freeze({ ...b }))),
    ...(raw.engineBinds !== undefined && raw.engineBinds.length > 0
      ? { engineBinds: Object.freeze(raw.engineBinds.map((b) => Object.freeze({ ...b }))) }
      : {}),
    ...(raw.cgroupNamespace === false ? { cgroupNamespace: false } : {}),
    ...(raw.egress !== undefined ? { egress: Object.freeze(structuredClone(raw.egress)) } : {}),
    // Only when there are some: the spec of a sandbox without devices stays what it was.
    ...(raw.devices !== undefined && raw.devices.length > 0
      ? {
          devices: Object.freeze(
            raw.devices.map((d) => Object.freeze({ path: d.path, major: d.major, minor: d.minor })),
          ),
        }
      : {}),
  });
}

/**
 * Capabilities a sandbox keeps: enough for an agent to install packages and run servers as
 * root inside; without raw sockets, mknod, module loading, mounts, ptrace or admin rights.
 */
export const SANDBOX_CAPABILITIES = Object.freeze([
  'CAP_CHOWN',
  'CAP_DAC_OVERRIDE',
  'CAP_FOWNER',
  'CAP_FSETID',
  'CAP_KILL',
  'CAP_SETGID',
  'CAP_SETUID',
  'CAP_SETPCAP',
  'CAP_NET_BIND_SERVICE',
  'CAP_SYS_CHROOT',
  'CAP_AUDIT_WRITE',
]);

/** Kernel interfaces hidden from the sandbox (the same set runc's default spec hides). */
export const MASKED_PATHS = Object.freeze([
  '/proc/acpi',
  '/proc/asound',
  '/proc/kcore',
  '/proc/keys',
  '/proc/latency_stats',
  '/proc/timer_list',
  '/proc/timer_stats',
  '/proc/sched_debug',
  '/proc/scsi',
  '/sys/firmware',
  // Block devices: a loop device's loop/backing_file names the host path of every sandbox's
  // disk image (quota.ts), and so the data folder and the other sandboxes' ids.
  '/sys/devices/virtual/block',
]);

export const READONLY_PATHS = Object.freeze([
  '/proc/bus',
  '/proc/fs',
  '/proc/irq',
  '/proc/sys',
  '/proc/sysrq-trigger',
]);

/** Where a sandbox's resolv.conf is: in its folder, next to its CRIU config. */
export function resolvConfPath(criuConfigPath: string): string {
  return criuConfigPath.replace(/[^/]*$/, 'resolv.conf');
}

/** The CFS period used for the CPU limit, in microseconds. */
export const CPU_PERIOD_US = 100_000;

export interface OciConfigInput {
  spec: Readonly<SandboxSpec>;
  /** The netns path (`/var/run/netns/NAME`) the sandbox joins instead of getting a fresh one. */
  netnsPath: string;
  /** cgroup path relative to each hierarchy's root, e.g. `/dormant/ID`. */
  cgroupsPath: string;
  /** Per-sandbox CRIU configuration file (runc reads it through the `org.criu.config` annotation). */
  criuConfigPath: string;
  /** The seccomp profile (OCI `linux.seccomp`), installed before the command runs. */
  seccomp?: Readonly<Record<string, unknown>>;
  /** An AppArmor profile the host has loaded, for the sandbox's processes. */
  apparmorProfile?: string;
  /** The host sources of the spec's engine binds, by destination (runc.ts makes them). */
  engineBindSources?: Readonly<Record<string, string>>;
  /**
   * The sandbox's user namespace (userns.ts): runc makes it with these maps, and the network
   * namespace inside it (`netnsPath` is then not joined: the runtime adopts the one runc made,
   * and CRIU dumps and restores it). Absent: no user namespace.
   */
  userns?: UserNamespace;
}

const DEFAULT_PATH = '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin';

/** The OCI runtime config for a sandbox: the whole isolation story in one object. */
export function buildOciConfig(input: OciConfigInput): Record<string, unknown> {
  const { spec } = input;
  const env = { PATH: DEFAULT_PATH, HOME: '/root', HOSTNAME: spec.hostname ?? spec.id, ...spec.env };
  const limits = spec.limits ?? {};
  const devices = spec.devices ?? [];
  const engineBinds = spec.engineBinds ?? [];
  const resources: Record<string, unknown> = {
    // Everything denied, then exactly the declared devices (a GPU's nodes) allowed.
    devices: [
      { allow: false, access: 'rwm' },
      ...devices.map((d) => ({ allow: true, type: 'c', major: d.major, minor: d.minor, access: 'rwm' })),
    ],
  };
  if (limits.memoryBytes !== undefined) resources.memory = { limit: limits.memoryBytes };
  if (limits.cpus !== undefined)
    resources.cpu = { quota: Math.round(limits.cpus * CPU_PERIOD_US), period: CPU_PERIOD_US };
  if (limits.pids !== undefined) resources.pids = { limit: limits.pids };
  const caps = [...SANDBOX_CAPABILITIES];
  return {
    ociVersion: '1.0.2',
    process: {
      terminal: false,
      user: { uid: 0, gid: 0 },
      args: [...spec.args],
      env: Object.entries(env).map(([k, v]) => `${k}=${v}`),
      cwd: spec.cwd ?? '/',
      capabilities: { bounding: caps, effective: caps, permitted: caps, inheritable: [], ambient: [] },
      noNewPrivileges: true,
      ...(input.apparmorProfile !== undefined ? { apparmorProfile: input.apparmorProfile } : {}),
    },
    root: { path: 'rootfs', readonly: false },
    hostname: spec.hostname ?? spec.id,
    mounts: [
      { destination: '/proc', type: 'proc', source: 'proc' },
      {
        destination: '/dev',
        type: 'tmpfs',
        source: 'tmpfs',
        options: ['nosuid', 'strictatime', 'mode=755', 'size=65536k'],
      },
      {
        destination: '/dev/pts',
        type: 'devpts',
        source: 'devpts',
        options: ['nosuid', 'noexec', 'newinstance', 'ptmxmode=0666', 'mode=0620', 'gid=5'],
      },
      // An engine's /dev/shm (an imported sandbox's) replaces the sandbox's own.
      ...(engineBinds.some((b) => b.destination === '/dev/shm')
        ? []
        : [
            {
              destination: '/dev/shm',
              type: 'tmpfs',
              source: 'shm',
              options: ['nosuid', 'noexec', 'nodev', 'mode=1777', 'size=65536k'],
            },
          ]),
      {
        destination: '/dev/mqueue',
        type: 'mqueue',
        source: 'mqueue',
        options: ['nosuid', 'noexec', 'nodev'],
      },
      { destination: '/sys', type: 'sysfs', source: 'sysfs', options: ['nosuid', 'noexec', 'nodev', 'ro'] },
      {
        destination: '/sys/fs/cgroup',
        type: 'cgroup',
        source: 'cgroup',
        options: ['nosuid', 'noexec', 'nodev', 'relatime', 'ro'],
      },
      ...(spec.readonlyBinds ?? []).map((b) => ({
        destination: b.destination,
        type: 'bind',
        source: b.source,
        options: ['bind', 'ro', 'nosuid', 'nodev'],
      })),
      // A sandbox with egress gets the runtime's resolv.conf (network.ts writes it beside the
      // CRIU config), read-only: outside the writable layer, so the sandbox cannot swap it.
      ...(spec.egress !== undefined && !engineBinds.some((b) => b.destination === '/etc/resolv.conf')
        ? [
            {
              destination: '/etc/resolv.conf',
              type: 'bind',
              source: resolvConfPath(input.criuConfigPath),
              options: ['bind', 'ro', 'nosuid', 'nodev', 'noexec'],
            },
          ]
        : []),
      ...engineBinds.map((b) => {
        const source = input.engineBindSources?.[b.destination];
        if (source === undefined)
          throw invalid(`sandbox ${spec.id}: engine bind ${b.destination} has no source`);
        return {
          destination: b.destination,
          type: 'bind',
          source,
          options: ['bind', 'rprivate', 'nosuid', 'nodev', ...(b.dir ? ['noexec'] : [])],
        };
      }),
    ],
    annotations: { 'org.criu.config': input.criuConfigPath },
    linux: {
      cgroupsPath: input.cgroupsPath,
      resources,
      ...(devices.length > 0
        ? {
            devices: devices.map((d) => ({
              path: d.path,
              type: 'c',
              major: d.major,
              minor: d.minor,
              fileMode: 0o666,
              uid: 0,
              gid: 0,
            })),
          }
        : {}),
      namespaces: [
        { type: 'pid' },
        input.userns !== undefined ? { type: 'network' } : { type: 'network', path: input.netnsPath },
        { type: 'ipc' },
        { type: 'uts' },
        { type: 'mount' },
        // Its own cgroup namespace: /proc/self/cgroup and the cgroup mounts inside show `/`,
        // not the host's cgroup path of the sandbox (all but imports that had none).
        ...(spec.cgroupNamespace === false ? [] : [{ type: 'cgroup' }]),
        ...(input.userns !== undefined ? [{ type: 'user' }] : []),
      ],
      ...(input.userns !== undefined
        ? {
            uidMappings: [{ containerID: 0, hostID: input.userns.hostId, size: input.userns.size }],
            gidMappings: [{ containerID: 0, hostID: input.userns.hostId, size: input.userns.size }],
          }
        : {}),
      ...(input.seccomp !== undefined ? { seccomp: input.seccomp } : {}),
      maskedPaths: [...MASKED_PATHS],
      readonlyPaths: [...READONLY_PATHS],
    },
  };
}

/**
 * The OCI config a container engine restores an exported sandbox with (the spec.dump of a
 * podman-layout export): the sandbox's own, less what only this node has: no cgroup path, CRIU
 * config or AppArmor profile. The network namespace keeps the path the sandbox joined, as
 * podman's own spec.dump records its: the dump's namespace is external, and podman puts the
 * one it makes in its place (config.dump's createNetNS); an import reads a namespace with no
 * path as one inside the dump. The engine binds and the egress resolv.conf are left out: their
 * sources are this runtime's, and podman binds its own /etc/hostname, /etc/hosts,
 * /etc/resolv.conf, /run/.containerenv and /dev/shm where the spec leaves the place free,
 * which is what maps those external mounts of the dump. The read-only host binds stay: CRIU
 * needs a source for each, so the restoring host must have them. No seccomp filter: podman's
 * exec gets none from it; the restored processes keep theirs (CRIU restores it from the images).
 */
export function exportedOciConfig(spec: Readonly<SandboxSpec>): Record<string, unknown> {
  const engineShm = (spec.engineBinds ?? []).some((b) => b.destination === '/dev/shm');
  const { engineBinds: _binds, egress: _egress, ...own } = spec;
  const config = buildOciConfig({
    spec: own,
    netnsPath: `/var/run/netns/${netnsName(spec.id)}`,
    cgroupsPath: '',
    criuConfigPath: '',
  });
  delete (config.linux as Record<string, unknown>).cgroupsPath;
  delete config.annotations;
  // An imported sandbox's /dev/shm was the engine's bind: the place is left for the engine's.
  if (engineShm)
    config.mounts = (config.mounts as { destination: string }[]).filter((m) => m.destination !== '/dev/shm');
  return config;
}

/**
 * CRIU options runc cannot pass itself. `tcp-close`: established connections are dumped
 * as closed and restored closed (their peers get a reset and reconnect); listening sockets
 * are restored listening. `network-lock nftables`: CRIU locks the sandbox's network during a
 * dump or restore through libnftables, in-process, instead of running iptables-restore and
 * ip6tables-restore to lock and again to unlock (~0.2 s of a dump and ~0.15 s of a restore
 * here). A restore unlocks with the method its checkpoint was dumped with, so checkpoints
 * made with the iptables lock still restore. `skip-in-flight`: a connection still in a
 * listening socket's accept queue (a client that arrived while the sandbox was frozen for its
 * dump) is left out of the dump instead of failing it; that client sees its connection reset
 * and connects again, as with `tcp-close`. `veth-pair` (a sandbox in a user namespace, whose
 * network namespace CRIU dumps and makes again): the restored eth0's peer on the host gets the
 * sandbox's host-end name.
 */
export function criuConfigText(hostInterface?: string): string {
  return `tcp-close\nnetwork-lock nftables\nskip-in-flight\n${hostInterface !== undefined ? `veth-pair eth0=${hostInterface}\n` : ''}`;
}
