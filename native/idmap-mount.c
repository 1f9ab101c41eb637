/*
 * dormant-idmap-mount USERNS SRC DST
 *
 * Mounts the folder SRC at DST as an idmapped, read-only bind mount, mapped through the user
 * namespace file USERNS (/proc/PID/ns/user of a process the runtime started in a namespace with
 * the sandbox's maps; the mount keeps its own reference): a file owned by uid/gid N in SRC
 * appears owned by whatever N maps to in that namespace (root's files: by the sandbox's host
 * root, 100000 say). A sandbox's root filesystem is shared by every sandbox made from the
 * same image and owned by the host's root; the lower layer of its overlay is this mount, so
 * root inside the sandbox owns its files there, and nothing of the shared folder changes.
 *
 * Node has no open_tree/mount_setattr/move_mount (Linux >= 5.12), hence this helper. Needs
 * root. Exit 0 on success, 1 with a message on stderr otherwise, 2 on bad usage.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/mount.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static int fail(const char *what) {
  fprintf(stderr, "dormant-idmap-mount: %s: %s\n", what, strerror(errno));
  return 1;
}

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: dormant-idmap-mount USERNS SRC DST\n");
    return 2;
  }
  int ns = open(argv[1], O_RDONLY | O_CLOEXEC);
  if (ns < 0) return fail("open user namespace");
  int tree = (int)syscall(SYS_open_tree, AT_FDCWD, argv[2], OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
  if (tree < 0) return fail("open_tree");
  struct mount_attr attr;
  memset(&attr, 0, sizeof attr);
  attr.attr_set = MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV;
  attr.userns_fd = (unsigned long long)ns;
  if (syscall(SYS_mount_setattr, tree, "", AT_EMPTY_PATH, &attr, sizeof attr) < 0)
    return fail("mount_setattr");
  if (syscall(SYS_move_mount, tree, "", AT_FDCWD, argv[3], MOVE_MOUNT_F_EMPTY_PATH) < 0)
    return fail("move_mount");
  return 0;
}
