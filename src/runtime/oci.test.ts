import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, readdir, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { ErrorCode, isDormantError } from '../domain/errors.js';
import {
  firewallRules,
  ipv4,
  parseSubnet,
  preferredSlot,
  reserveSlot,
  releaseSlot,
  slotNetwork,
} from './network.js';
import {
  buildOciConfig,
  compileSandboxSpec,
  exportedOciConfig,
  MASKED_PATHS,
  SANDBOX_CAPABILITIES,
} from './oci.js';

describe('compileSandboxSpec', () => {
  test('fills defaults and freezes', () => {
    const s = compileSandboxSpec({ id: 'box-1', rootfs: '/r', args: ['sh'], ports: [8080, 80, 8080] });
    assert.equal(s.hostname, 'box-1');
    assert.equal(s.cwd, '/');
    assert.deepEqual(s.ports, [80, 8080]);
    assert.ok(Object.isFrozen(s));
  });

  test('rejects what runc or the network would choke on, with INVALID_ARGUMENT', () => {
    const bad = [
      { id: 'Upper', rootfs: '/r', args: ['sh'] },
      { id: '../x', rootfs: '/r', args: ['sh'] },
      { id: 'ok', rootfs: 'relative', args: ['sh'] },
      { id: 'ok', rootfs: '/r', args: [] },
      { id: 'ok', rootfs: '/r', args: ['sh'], ports: [0] },
      { id: 'ok', rootfs: '/r', args: ['sh'], limits: { memoryBytes: 1024 } },
      { id: 'ok', rootfs: '/r', args: ['sh'], env: { 'A=B': 'x' } },
    ];
    for (const spec of bad)
      assert.throws(
        () => compileSandboxSpec(spec),
        (e) => isDormantError(e, ErrorCode.INVALID_ARGUMENT),
        JSON.stringify(spec),
      );
  });
});

describe('buildOciConfig', () => {
  const spec = compileSandboxSpec({
    id: 'box',
    rootfs: '/r',
    args: ['python3', 'app.py'],
    env: { TOKEN: 'x' },
    limits: { memoryBytes: 512 * 1024 * 1024, cpus: 1.5, pids: 100 },
    readonlyBinds: [{ source: '/usr', destination: '/usr' }],
  });
  const config = buildOciConfig({
    spec,
    netnsPath: '/var/run/netns/dormant-box',
    cgroupsPath: '/dormant/box',
    criuConfigPath: '/state/box/criu.conf',
  }) as {
    process: {
      noNewPrivileges: boolean;
      env: string[];
      capabilities: { bounding: string[] };
      terminal: boolean;
    };
    linux: {
      namespaces: { type: string; path?: string }[];
      resources: {
        memory: { limit: number };
        cpu: { quota: number; period: number };
        pids: { limit: number };
      };
      maskedPaths: string[];
      cgroupsPath: string;
    };
    mounts: { destination: string; source: string; options?: string[] }[];
    annotations: Record<string, string>;
  };

  test('own pid, mount, uts, ipc, cgroup namespaces and the prepared network namespace', () => {
    const ns = Object.fromEntries(config.linux.namespaces.map((n) => [n.type, n.path ?? 'new']));
    assert.deepEqual(ns, {
      pid: 'new',
      mount: 'new',
      uts: 'new',
      ipc: 'new',
      cgroup: 'new',
      network: '/var/run/netns/dormant-box',
    });
  });

  test('limits, privileges, masked paths, criu options', () => {
    assert.equal(config.linux.resources.memory.limit, 512 * 1024 * 1024);
    assert.deepEqual(config.linux.resources.cpu, { quota: 150_000, period: 100_000 });
    assert.equal(config.linux.resources.pids.limit, 100);
    assert.equal(config.linux.cgroupsPath, '/dormant/box');
    assert.equal(config.process.noNewPrivileges, true);
    assert.equal(config.process.terminal, false);
    assert.deepEqual(config.process.capabilities.bounding, [...SANDBOX_CAPABILITIES]);
    assert.ok(!config.process.capabilities.bounding.includes('CAP_SYS_ADMIN'));
    assert.deepEqual(config.linux.maskedPaths, [...MASKED_PATHS]);
    assert.ok(config.process.env.includes('TOKEN=x'));
    assert.equal(config.annotations['org.criu.config'], '/state/box/criu.conf');
    const usr = config.mounts.find((m) => m.destination === '/usr');
    assert.ok(usr?.options?.includes('ro'));
  });

  test('devices: all denied, only the declared ones (a GPU) created and allowed; none by default', () => {
    const withGpu = buildOciConfig({
      spec: compileSandboxSpec({
        id: 'gpu-box',
        rootfs: '/images/py',
        args: ['python3'],
        devices: [{ path: '/dev/nvidia0', major: 195, minor: 0 }],
      }),
      netnsPath: '/var/run/netns/dormant-gpu-box',
      cgroupsPath: '/dormant/gpu-box',
      criuConfigPath: '/state/gpu-box/criu.conf',
    }) as { linux: { devices?: unknown[]; resources: { devices: unknown[] } } };
    assert.deepEqual(withGpu.linux.resources.devices, [
      { allow: false, access: 'rwm' },
      { allow: true, type: 'c', major: 195, minor: 0, access: 'rwm' },
    ]);
    assert.deepEqual(withGpu.linux.devices, [
      { path: '/dev/nvidia0', type: 'c', major: 195, minor: 0, fileMode: 0o666, uid: 0, gid: 0 },
    ]);
    const plain = config as unknown as { linux: { devices?: unknown[]; resources: { devices: unknown[] } } };
    assert.equal(plain.linux.devices, undefined);
    assert.deepEqual(plain.linux.resources.devices, [{ allow: false, access: 'rwm' }]);
    assert.equal('devices' in spec, false, 'a spec without devices is unchanged (prepare compares it)');
    assert.throws(
      () =>
        compileSandboxSpec({
          id: 'x',
          rootfs: '/r',
          args: ['a'],
          devices: [{ path: '/etc/passwd', major: 1, minor: 1 }],
        }),
      /device \/etc\/passwd/,
    );
  });
  test("an imported container's engine binds: writable, from the runtime's sources, its /dev/shm instead of the sandbox's; no cgroup namespace when asked", () => {
    const imported = compileSandboxSpec({
      id: 'imp',
      rootfs: '/r',
      args: ['sh'],
      engineBinds: [
        { destination: '/dev/shm', dir: true },
        { destination: '/etc/hostname', dir: false },
      ],
      cgroupNamespace: false,
    });
    const c = buildOciConfig({
      spec: imported,
      netnsPath: '/var/run/netns/dormant-imp',
      cgroupsPath: '/dormant/imp',
      criuConfigPath: '/state/imp/criu.conf',
      engineBindSources: {
        '/dev/shm': '/state/imp/binds/dev_shm',
        '/etc/hostname': '/state/imp/binds/etc_hostname',
      },
    }) as {
      mounts: { destination: string; type: string; source: string; options?: string[] }[];
      linux: { namespaces: { type: string }[] };
    };
    const shm = c.mounts.filter((m) => m.destination === '/dev/shm');
    assert.deepEqual(shm, [
      {
        destination: '/dev/shm',
        type: 'bind',
        source: '/state/imp/binds/dev_shm',
        options: ['bind', 'rprivate', 'nosuid', 'nodev', 'noexec'],
      },
    ]);
    assert.equal(
      c.mounts.find((m) => m.destination === '/etc/hostname')?.source,
      '/state/imp/binds/etc_hostname',
    );
    assert.ok(!c.linux.namespaces.some((n) => n.type === 'cgroup'));
    assert.equal('engineBinds' in spec, false, 'a spec without them is unchanged (prepare compares it)');
    assert.throws(
      () =>
        compileSandboxSpec({
          id: 'x',
          rootfs: '/r',
          args: ['a'],
          engineBinds: [{ destination: '/../etc', dir: false }],
        }),
      /engine bind/,
    );
  });
});

describe('exportedOciConfig', () => {
  type Exported = {
    process: { user: { uid: number }; capabilities: { bounding: string[] }; args: string[] };
    mounts: { destination: string; type: string; source: string }[];
    annotations?: unknown;
    linux: { namespaces: { type: string; path?: string }[]; cgroupsPath?: string; maskedPaths: string[] };
  };

  test("the sandbox's process, namespaces, masks and host binds; nothing only this node has (cgroup path, CRIU config, engine and resolv.conf sources)", () => {
    const spec = compileSandboxSpec({
      id: 'box',
      rootfs: '/r',
      args: ['sh', '-c', 'loop'],
      readonlyBinds: [{ source: '/usr', destination: '/usr' }],
      egress: { mode: 'internet' },
    });
    const c = exportedOciConfig(spec) as Exported;
    assert.deepEqual(c.process.args, ['sh', '-c', 'loop']);
    assert.equal(c.process.user.uid, 0);
    assert.deepEqual(c.process.capabilities.bounding, [...SANDBOX_CAPABILITIES]);
    assert.deepEqual(
      c.linux.namespaces,
      ['pid', 'network', 'ipc', 'uts', 'mount', 'cgroup'].map((type) =>
        type === 'network' ? { type, path: '/var/run/netns/dormant-box' } : { type },
      ),
      'the network namespace the sandbox joined (outside the dump), which the engine replaces',
    );
    assert.equal(c.linux.cgroupsPath, undefined);
    assert.equal(c.annotations, undefined, 'no CRIU config of this node');
    assert.deepEqual(c.linux.maskedPaths, [...MASKED_PATHS]);
    assert.equal(c.mounts.find((m) => m.destination === '/usr')?.source, '/usr');
    assert.equal(
      c.mounts.find((m) => m.destination === '/etc/resolv.conf'),
      undefined,
      "the engine's goes there",
    );
    assert.equal(c.mounts.find((m) => m.destination === '/dev/shm')?.type, 'tmpfs');
  });

  test("an imported sandbox's engine binds are left out, its /dev/shm place too (the engine binds its own)", () => {
    const c = exportedOciConfig(
      compileSandboxSpec({
        id: 'imp',
        rootfs: '/r',
        args: ['sh'],
        engineBinds: [
          { destination: '/dev/shm', dir: true },
          { destination: '/etc/hostname', dir: false },
        ],
        cgroupNamespace: false,
      }),
    ) as Exported;
    const places = c.mounts.map((m) => m.destination);
    assert.ok(!places.includes('/dev/shm') && !places.includes('/etc/hostname'), places.join(' '));
    assert.ok(!c.linux.namespaces.some((n) => n.type === 'cgroup'));
  });
});

describe('network addressing', () => {
  test('a /30 per slot: host .1, sandbox .2 of each block of four', () => {
    const subnet = parseSubnet('10.213.0.0/16');
    assert.equal(subnet.slots, 16384);
    assert.deepEqual(slotNetwork('a', subnet, 0), {
      netns: 'dormant-a',
      hostAddress: '10.213.0.1',
      address: '10.213.0.2',
      prefixLength: 30,
      hostInterface: 'dmh0',
    });
    const last = slotNetwork('b', subnet, 16383);
    assert.equal(last.address, '10.213.255.254');
    assert.ok(last.hostInterface.length <= 15, 'fits IFNAMSIZ');
    assert.equal(ipv4(parseSubnet('192.168.7.9/24').base), '192.168.7.0');
    assert.throws(
      () => parseSubnet('10.0.0.0/30'),
      (e) => isDormantError(e, ErrorCode.INVALID_ARGUMENT),
    );
  });

  test('reservations never collide, are idempotent per id, and are released', async () => {
    const dir = await mkdtemp(join(tmpdir(), 'dormant-net-'));
    try {
      const subnet = parseSubnet('10.0.0.0/28'); // four slots
      // Two ids whose preferred slot is the same still get different slots.
      const ids = ['a', 'b', 'c', 'd', 'e', 'f', 'g', 'h'];
      const prefs = new Map<number, string[]>();
      for (const id of ids) prefs.set(preferredSlot(id, 4), [...(prefs.get(preferredSlot(id, 4)) ?? []), id]);
      const clash = [...prefs.values()].find((v) => v.length > 1)!;
      const slots = await Promise.all(clash.slice(0, 2).map((id) => reserveSlot(dir, id, subnet)));
      assert.notEqual(slots[0], slots[1]);
      assert.equal(await reserveSlot(dir, clash[0]!, subnet), slots[0], 'same id, same slot');
      const others = ids.filter((id) => !clash.slice(0, 2).includes(id)).slice(0, 2);
      for (const id of others) await reserveSlot(dir, id, subnet);
      await assert.rejects(reserveSlot(dir, 'z', subnet), (e) =>
        isDormantError(e, ErrorCode.RUNTIME_NO_ADDRESS),
      );
      await releaseSlot(dir, slots[0]!);
      assert.equal(await reserveSlot(dir, 'z', subnet), slots[0]);
      assert.equal((await readdir(dir)).length, 4);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  test('the firewall admits declared ports only and blocks connections to the host', () => {
    const rules = firewallRules(slotNetwork('a', parseSubnet('10.213.0.0/16'), 0), [8080, 3000]);
    assert.match(rules, /:INPUT DROP/);
    assert.match(rules, /--dport 8080 -j ACCEPT/);
    assert.match(rules, /--dport 3000 -j ACCEPT/);
    assert.match(rules, /-A OUTPUT -o eth0 -j REJECT/);
  });
});
