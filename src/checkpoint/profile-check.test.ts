/**
 * The profile check over synthetic decoded images: a sandbox-shaped checkpoint passes, and each
 * way out of the profile (capabilities, no_new_privs, seccomp, ids, securebits, namespaces, user
 * namespace mappings, mounts, missing credentials) is refused with what and why. The images are
 * modelled on a real CRIU 4.2 dump of a dormant sandbox (runc 1.1, cgroup v1).
 */
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import type { CoreEntry, CredsEntry, MountEntry, TaskKobjIds } from '../criu/images/messages.js';
import { SANDBOX_CAPABILITIES } from '../runtime/oci.js';
import {
  checkAgainstProfile,
  outsideProfile,
  problemText,
  sandboxProfile,
  type ProfileImages,
  type SandboxProfile,
} from './profile-check.js';
import { isDormantError } from '../domain/errors.js';

/** The host's namespace ids (inventory root_ids) and a sandbox task's. */
const HOST: TaskKobjIds = {
  vmId: 1,
  filesId: 1,
  fsId: 1,
  pidNs: 1,
  netNs: 2,
  ipcNs: 3,
  utsNs: 4,
  mntNs: 6,
  userNs: 7,
  cgroupNs: 8,
  timeNs: 5,
};
const SANDBOX: TaskKobjIds = {
  ...HOST,
  vmId: 2,
  filesId: 2,
  fsId: 2,
  pidNs: 9,
  netNs: 10,
  ipcNs: 11,
  utsNs: 12,
  mntNs: 13,
};
/** CAP_CHOWN .. CAP_AUDIT_WRITE as runc gives a sandbox: 0x200405fb. */
const SANDBOX_CAPS = [0x200405fb, 0];

function creds(over: Partial<CredsEntry> = {}): CredsEntry {
  return {
    uid: 0,
    gid: 0,
    euid: 0,
    egid: 0,
    suid: 0,
    sgid: 0,
    fsuid: 0,
    fsgid: 0,
    capInh: [0, 0],
    capPrm: SANDBOX_CAPS,
    capEff: SANDBOX_CAPS,
    capBnd: SANDBOX_CAPS,
    capAmb: [0, 0],
    secbits: 0,
    groups: [],
    noNewPrivs: 1,
    ...over,
  };
}

/** A thread's core; `null`: one without credentials. */
function core(c: CredsEntry | null = creds(), seccompMode = 2): CoreEntry {
  return {
    arch: 'x86_64',
    comm: 'python3',
    taskState: 1,
    exitCode: 0,
    threadCore: { ...(c ? { creds: c } : {}), seccompMode, seccompFilter: 0 },
  };
}

function mount(
  mntId: number,
  parentMntId: number,
  fstype: number,
  mountpoint: string,
  over: Partial<MountEntry> = {},
): MountEntry {
  return {
    fstype,
    mntId,
    rootDev: 0,
    parentMntId,
    flags: 0x200000,
    root: '/',
    mountpoint,
    source: 'none',
    options: '',
    extMount: false,
    withPlugin: false,
    ...over,
  };
}

/** The mount table of a dormant sandbox (as CRIU dumped one). */
function sandboxMounts(): MountEntry[] {
  return [
    mount(242, 164, 17, '/', { source: 'overlay' }),
    mount(243, 242, 1, '/proc'),
    mount(244, 242, 5, '/dev', { flags: 0x1000002 }),
    mount(291, 244, 6, '/dev/pts', { flags: 0x20000a }),
    mount(292, 244, 5, '/dev/shm', { flags: 0x20000e }),
    mount(293, 244, 14, '/dev/mqueue', { flags: 0x20000e }),
    mount(294, 242, 2, '/sys', { flags: 0x20000f }),
    mount(295, 294, 5, '/sys/fs/cgroup', { flags: 0x20000e }),
    mount(296, 295, 12, '/sys/fs/cgroup/cpu', {
      flags: 0x20000f,
      root: '/dormant/sb-x',
      extKey: '/sys/fs/cgroup/cpu',
    }),
    mount(320, 242, 0, '/usr', { flags: 0x200007, root: '/usr', extKey: '/usr', source: '/dev/vda' }),
    mount(170, 243, 1, '/proc/sys', { flags: 0x200001, root: '/sys' }),
    mount(189, 243, 5, '/proc/timer_list', { flags: 0x1000002, root: '/null', extKey: '/dev/null' }),
    mount(190, 294, 5, '/sys/firmware', { flags: 0x200001 }),
  ];
}

function sandboxImages(): ProfileImages {
  return {
    inventory: {
      imgVersion: 2,
      fdinfoPerId: true,
      nsPerId: true,
      rootIds: HOST,
      tcpClose: true,
      plugins: [],
    },
    tasks: [{ pid: 1, ids: SANDBOX, threads: [{ tid: 1, core: core() }] }],
    userns: new Map(),
    mounts: new Map([[13, sandboxMounts()]]),
    seccompFilters: 1,
  };
}

const PROFILE = sandboxProfile({ capabilities: SANDBOX_CAPABILITIES, readonlyBinds: ['/usr'] });
/** The profile of sandboxes in a user namespace mapping 0..65535 to 100000.. on the host. */
const MAPPED = sandboxProfile({
  capabilities: SANDBOX_CAPABILITIES,
  readonlyBinds: ['/usr'],
  userNamespace: {
    uidMap: [{ first: 0, lowerFirst: 100000, count: 65536 }],
    gidMap: [{ first: 0, lowerFirst: 100000, count: 65536 }],
  },
});

function problems(images: ProfileImages, profile: SandboxProfile = PROFILE): string[] {
  return checkAgainstProfile(images, profile).map(problemText);
}

function thread(images: ProfileImages, c: CoreEntry): ProfileImages {
  return { ...images, tasks: [{ ...images.tasks[0]!, threads: [{ tid: 1, core: c }] }] };
}

describe('checkpoint profile check', () => {
  test("a sandbox's own checkpoint is inside the profile", () => {
    assert.deepEqual(problems(sandboxImages()), []);
  });

  test("every capability and no no_new_privs (the issue's edit) is refused, naming each", () => {
    const all = [0xffffffff, 0x1ff];
    const img = thread(
      sandboxImages(),
      core(creds({ capEff: all, capPrm: all, capBnd: all, noNewPrivs: undefined })),
    );
    const p = problems(img);
    assert.equal(p.length, 2, p.join('\n'));
    assert.match(
      p[0]!,
      /^pid 1 thread 1: capabilities .*CAP_SYS_ADMIN.* in the effective, permitted and bounding sets are not in the sandbox profile$/,
    );
    assert.doesNotMatch(p[0]!, /CAP_CHOWN/, "the sandbox's own capabilities are not named");
    assert.equal(p[1], 'pid 1 thread 1: no_new_privs is 0: a sandbox runs with no_new_privs set');
    const e = outsideProfile(checkAgainstProfile(img, PROFILE), 'the archive');
    assert.ok(isDormantError(e, 'CHECKPOINT_OUTSIDE_PROFILE'));
    assert.equal(e.status, 422);
    assert.match(e.message, /^the archive holds more than a sandbox may: pid 1 thread 1: capabilities/);
  });

  test('one extra capability in one set, in another thread, is named alone', () => {
    const img = sandboxImages();
    img.tasks[0]!.threads.push({ tid: 7, core: core(creds({ capAmb: [1 << 21, 0] })) });
    assert.deepEqual(problems(img), [
      'pid 1 thread 7: capability CAP_SYS_ADMIN in the ambient set is not in the sandbox profile',
    ]);
    // A bit past the kernel's last capability is outside too.
    assert.match(
      problems(thread(sandboxImages(), core(creds({ capInh: [0, 1 << 20] }))))[0]!,
      /capability 52 in the inheritable set/,
    );
  });

  test('a thread without credentials, or without a core, is refused', () => {
    assert.deepEqual(problems(thread(sandboxImages(), core(null))), [
      'pid 1 thread 1: no credentials recorded (thread_core.creds)',
    ]);
    const img = sandboxImages();
    img.tasks[0]!.threads.push({ tid: 8 });
    assert.deepEqual(problems(img), ['pid 1 thread 8: core-8.img is missing']);
  });

  test('seccomp disabled is refused when the profile requires a filter; a filter missing from seccomp.img too', () => {
    const off = thread(sandboxImages(), core(creds(), 0));
    assert.deepEqual(problems(off), [
      'pid 1 thread 1: seccomp mode 0 (disabled): a sandbox runs under a seccomp filter',
    ]);
    assert.deepEqual(problems(off, { ...PROFILE, seccompRequired: false }), []);
    // The deprecated per-task field wins on the leader, as in CRIU.
    const old = thread(sandboxImages(), { ...core(), oldSeccompMode: 0 });
    assert.match(problems(old)[0]!, /seccomp mode 0/);
    assert.match(
      problems({ ...sandboxImages(), seccompFilters: undefined })[0]!,
      /seccomp filter 0 is not in seccomp.img/,
    );
  });

  test("a thread without its own seccomp record (as CRIU 4.2 dumps them) is judged by its leader's", () => {
    const unrecorded = (leaderMode: number): ProfileImages => {
      const im = sandboxImages();
      const noRecord: CoreEntry = { ...core(), threadCore: { creds: creds() } };
      im.tasks = [
        {
          pid: 1,
          ids: SANDBOX,
          threads: [
            { tid: 1, core: core(creds(), leaderMode) },
            { tid: 2, core: noRecord },
          ],
        },
      ];
      return im;
    };
    assert.deepEqual(problems(unrecorded(2)), []);
    assert.ok(
      problems(unrecorded(0)).includes(
        'pid 1 thread 2: seccomp mode 0 (disabled): a sandbox runs under a seccomp filter',
      ),
      'a leader without a filter fails its threads too',
    );
  });

  test('ids that are no id and unknown securebits are refused', () => {
    const p = problems(
      thread(sandboxImages(), core(creds({ euid: 0xffffffff, groups: [0, 0xffffffff], secbits: 0x10000 }))),
    );
    assert.deepEqual(p, [
      'pid 1 thread 1: securebits 0x10000 has bits the kernel does not define',
      'pid 1 thread 1: euid is 4294967295, which is no id',
      'pid 1 thread 1: groups[1] is 4294967295, which is no id',
    ]);
  });

  test("host namespaces where a sandbox has its own, and namespaces it doesn't have, are refused", () => {
    const img = sandboxImages();
    img.tasks[0]!.ids = { ...SANDBOX, pidNs: HOST.pidNs, timeNs: 99 };
    assert.deepEqual(problems(img), [
      "pid 1: runs in the host's pid namespace: a sandbox has its own",
      'pid 1: has a time namespace of its own, which a sandbox does not have',
    ]);
    // A cgroup namespace of its own (dormant's sandboxes have one) or the host's: both pass.
    for (const cgroupNs of [99, HOST.cgroupNs]) {
      const c = sandboxImages();
      c.tasks[0]!.ids = { ...SANDBOX, cgroupNs };
      assert.deepEqual(problems(c), [], `cgroupNs ${String(cgroupNs)}`);
    }
    // inventory.img's root ids decide what CRIU creates: without them, nothing can be judged.
    assert.match(problems({ ...sandboxImages(), inventory: undefined })[0]!, /records no root namespace ids/);
  });

  test('a child in a nested namespace is refused', () => {
    const img = sandboxImages();
    img.tasks.push({
      pid: 2,
      ids: { ...SANDBOX, userNs: 40, netNs: 41 },
      threads: [{ tid: 2, core: core() }],
    });
    assert.deepEqual(problems(img), [
      'pid 2: is in another net namespace than pid 1 (nested namespaces are not restored into a sandbox)',
      'pid 2: is in another user namespace than pid 1 (nested namespaces are not restored into a sandbox)',
    ]);
  });

  test('user namespaces: refused where sandboxes have none; held to the mapping where they do', () => {
    const own = sandboxImages();
    own.tasks[0]!.ids = { ...SANDBOX, userNs: 20 };
    own.userns.set(20, {
      uidMap: [{ first: 0, lowerFirst: 0, count: 4294967295 }],
      gidMap: [{ first: 0, lowerFirst: 0, count: 4294967295 }],
    });
    assert.deepEqual(problems(own), [
      'pid 1: runs in a user namespace of its own, which sandboxes on this node do not have',
    ]);

    const mapped = MAPPED;
    // Identity mapping: root inside is root outside.
    assert.deepEqual(problems(own, mapped), [
      'user namespace 20: uid_map line "0 0 4294967295" is outside the sandbox\'s mapping (0 100000 65536)',
      'user namespace 20: gid_map line "0 0 4294967295" is outside the sandbox\'s mapping (0 100000 65536)',
    ]);
    const inside = sandboxImages();
    inside.tasks[0]!.ids = { ...SANDBOX, userNs: 20 };
    inside.userns.set(20, {
      uidMap: [{ first: 0, lowerFirst: 100000, count: 1000 }],
      gidMap: [{ first: 0, lowerFirst: 100000, count: 65536 }],
    });
    assert.deepEqual(problems(inside, mapped), []);
    // Credentials must be ids the image's namespace maps.
    assert.deepEqual(problems(thread(inside, core(creds({ fsuid: 5000 }))), mapped), [
      "pid 1 thread 1: fsuid 5000 is not mapped by the checkpoint's user namespace",
    ]);
    // No user namespace where sandboxes have one: refused with why, unless the profile allows it.
    assert.deepEqual(problems(sandboxImages(), mapped), [
      "pid 1: runs in the host's user namespace (the checkpoint has no user namespace, so its root would be the host's root); sandboxes here run in one mapping root to an unprivileged host range (podman's and CRI-O's checkpoints have none: import them on a daemon run with --no-user-namespace)",
    ]);
    assert.deepEqual(problems(sandboxImages(), { ...mapped, allowHostUserNamespace: true }), []);
    const missing = sandboxImages();
    missing.tasks[0]!.ids = { ...SANDBOX, userNs: 21 };
    assert.match(problems(missing, mapped)[0]!, /userns-21.img is missing/);
  });

  test('mounts a sandbox cannot have are refused', () => {
    const withMount = (m: MountEntry, drop?: string): ProfileImages => {
      const img = sandboxImages();
      const list = img.mounts.get(13)!.filter((x) => x.mountpoint !== drop);
      img.mounts.set(13, [...list, m]);
      return img;
    };
    const cases: [MountEntry, RegExp, string?][] = [
      // A host block device (CRIU's "auto" type mounts whatever fsname says).
      [
        mount(400, 242, 16, '/mnt', { fsname: 'ext4', source: '/dev/sda1' }),
        /mount \/mnt: a auto \(ext4\) mount is not one a sandbox has/,
      ],
      [mount(401, 242, 3, '/host-dev', { source: 'devtmpfs' }), /a devtmpfs mount is not one/],
      [mount(402, 242, 17, '/lower', { options: 'lowerdir=/etc' }), /a overlay mount is not one/],
      [mount(403, 242, 2, '/sys2', { flags: 0x20000e }), /mount \/sys2: sysfs mounted read-write/],
      [mount(404, 242, 1, '/tmp/proc'), /mount \/tmp\/proc: proc mounted read-write/],
      [
        mount(405, 243, 1, '/proc/sys', { flags: 0x200000, root: '/sys' }),
        /mount \/proc\/sys: proc mounted read-write/,
      ],
      [mount(406, 242, 12, '/cg', { flags: 0x20000e }), /cgroup mounted read-write/],
      // The read-only bind of /usr made writable.
      [
        mount(320, 242, 0, '/usr', { flags: 0x200000, root: '/usr', extKey: '/usr' }),
        /mount \/usr: unsupported bind mount flags 0x200000: a sandbox has it read-only, nosuid, nodev/,
        '/usr',
      ],
      [
        mount(407, 242, 0, '/host', { root: '/', extKey: '/', fsname: 'ext4' }),
        /external mount "\/" is bound at another path/,
      ],
      [
        mount(408, 242, 0, '/root-home', { extKey: '/root-home', fsname: 'ext4' }),
        /external ext4 mount \/root-home is not one a sandbox has/,
      ],
      [mount(409, 242, 5, '/plugin', { withPlugin: true }), /restored by a CRIU plugin/],
    ];
    for (const [m, why, drop] of cases) {
      const p = problems(withMount(m, drop));
      assert.ok(
        p.some((x) => why.test(x)),
        `${m.mountpoint}: ${p.join('; ')}`,
      );
    }
    // What podman and CRI-O record as external: allowed.
    for (const path of ['/etc/hosts', '/etc/resolv.conf', '/run/secrets/token', '/dev/shm'])
      assert.deepEqual(problems(withMount(mount(500, 242, 0, path, { extKey: path, flags: 0 }))), [], path);
    // The device nodes runc binds into a sandbox with a user namespace: only there.
    const devBind = (path: string): ProfileImages =>
      withMount(mount(502, 242, 6, path, { extKey: path, flags: 0, fsname: 'devtmpfs' }));
    const mapped = { ...MAPPED, allowHostUserNamespace: true };
    assert.deepEqual(problems(devBind('/dev/urandom'), mapped), []);
    assert.deepEqual(problems(devBind('/dev/urandom')), [
      'mount /dev/urandom: external devtmpfs mount /dev/urandom is not one a sandbox has',
    ]);
    assert.deepEqual(problems(devBind('/dev/sda'), mapped), [
      'mount /dev/sda: external devtmpfs mount /dev/sda is not one a sandbox has',
    ]);
    // /proc/sys left read-write by dropping its read-only cover.
    assert.deepEqual(problems(withMount(mount(501, 242, 5, '/tmp'), '/proc/sys')), [
      'mount /proc/sys: is missing or read-write: a sandbox has it read-only',
    ]);
  });
});
