/*
 * Files: stat, ls, read, write, mkdir, remove, rename, watch. The agent runs inside the
 * sandbox's root and namespaces, so the kernel resolves every path (`..`, symlinks) within the
 * sandbox: nothing here needs to check paths for escapes.
 */
#define _GNU_SOURCE
#include "agent.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/sendfile.h>
#include <sys/vfs.h>
#include <linux/magic.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_LS_ENTRIES 100000
#define MAX_LS_DEPTH 16
#define MAX_WATCHES 8192
/* write's temp files, named so that watch can hide them and tell a new file from a rewrite */
#define TMP_NEW ".dormant-new-"
#define TMP_UPD ".dormant-upd-"

/* The absolute form of path for results: relative paths are taken from the agent's cwd, and
 * `.`, `..` and repeated slashes are folded (the result names the file; the kernel still
 * resolved the original path). */
static void abs_path(const char *path, char *out, size_t size) {
  char tmp[PATH_MAX * 2];
  if (path[0] == '/')
    snprintf(tmp, sizeof tmp, "%s", path);
  else {
    char cwd[PATH_MAX];
    if (!getcwd(cwd, sizeof cwd)) strcpy(cwd, "/");
    snprintf(tmp, sizeof tmp, "%s/%s", cwd, path);
  }
  size_t n = 0;
  out[n++] = '/';
  for (char *save = NULL, *part = strtok_r(tmp, "/", &save); part; part = strtok_r(NULL, "/", &save)) {
    if (strcmp(part, ".") == 0) continue;
    if (strcmp(part, "..") == 0) {
      while (n > 1 && out[n - 1] != '/') n--;
      if (n > 1) n--;
      continue;
    }
    size_t len = strlen(part);
    if (n + len + 2 > size) break;
    if (n > 1) out[n++] = '/';
    memcpy(out + n, part, len);
    n += len;
  }
  out[n] = 0;
}

static const char *base_name(const char *path) {
  const char *slash = strrchr(path, '/');
  return slash && slash[1] ? slash + 1 : path;
}

static void file_info(struct sb *b, const char *abspath, const struct stat *st, const char *link) {
  const char *type = S_ISREG(st->st_mode) ? "file" : S_ISDIR(st->st_mode) ? "dir" : S_ISLNK(st->st_mode) ? "symlink" : "other";
  sb_str(b, "{\"name\":");
  sb_json(b, base_name(abspath));
  sb_str(b, ",\"path\":");
  sb_json(b, abspath);
  sb_fmt(b, ",\"type\":\"%s\",\"size\":%lld,\"mode\":%u,\"mtimeMs\":%lld", type, (long long)st->st_size,
         (unsigned)(st->st_mode & 07777), (long long)st->st_mtim.tv_sec * 1000 + st->st_mtim.tv_nsec / 1000000);
  if (link) {
    sb_str(b, ",\"symlinkTarget\":");
    sb_json(b, link);
  }
  sb_str(b, "}");
}

static const char *need_path(struct conn *c, const struct request *rq, const char *key) {
  const char *p = req_get(rq, key);
  if (!p || !*p) send_error(c, "EINVAL", "a path is needed");
  return p && *p ? p : NULL;
}

void op_stat(struct conn *c, const struct request *rq) {
  const char *path = need_path(c, rq, "path");
  if (!path) return;
  struct stat st;
  if (lstat(path, &st) < 0) {
    send_errno(c, errno, path);
    return;
  }
  char full[PATH_MAX], link[PATH_MAX];
  abs_path(path, full, sizeof full);
  ssize_t n = S_ISLNK(st.st_mode) ? readlink(path, link, sizeof link - 1) : -1;
  if (n >= 0) link[n] = 0;
  struct sb b;
  sb_init(&b);
  file_info(&b, full, &st, n >= 0 ? link : NULL);
  send_sb(c, 'R', &b);
}

/* ---- ls ---- */

struct entry {
  char *path; /* sort key */
  char *json;
};

struct listing {
  struct entry *v;
  size_t n, cap;
  int err; /* errno that ended the walk (E2BIG: too many entries) */
};

static void list_dir(struct listing *l, int dirfd, const char *dirpath, int depth) {
  DIR *d = fdopendir(dirfd);
  if (!d) {
    close(dirfd);
    return;
  }
  struct dirent *de;
  while (!l->err && (de = readdir(d))) {
    if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
    struct stat st;
    if (fstatat(dirfd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0) continue; /* gone meanwhile */
    if (l->n == MAX_LS_ENTRIES) {
      l->err = E2BIG;
      break;
    }
    char path[PATH_MAX], link[PATH_MAX];
    snprintf(path, sizeof path, "%s/%s", strcmp(dirpath, "/") == 0 ? "" : dirpath, de->d_name);
    ssize_t ln = S_ISLNK(st.st_mode) ? readlinkat(dirfd, de->d_name, link, sizeof link - 1) : -1;
    if (ln >= 0) link[ln] = 0;
    struct sb b;
    sb_init(&b);
    file_info(&b, path, &st, ln >= 0 ? link : NULL);
    if (l->n == l->cap) {
      size_t cap = l->cap ? l->cap * 2 : 64;
      struct entry *v = realloc(l->v, cap * sizeof *v);
      if (!v) {
        l->err = ENOMEM;
        sb_free(&b);
        break;
      }
      l->v = v;
      l->cap = cap;
    }
    l->v[l->n].path = strdup(path);
    l->v[l->n].json = b.p;
    if (!l->v[l->n].path || b.oom) {
      l->err = ENOMEM;
      free(l->v[l->n].path);
      sb_free(&b);
      break;
    }
    l->n++;
    if (S_ISDIR(st.st_mode) && depth > 1) {
      int sub = openat(dirfd, de->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (sub >= 0) list_dir(l, sub, path, depth - 1);
    }
  }
  closedir(d);
}

static int by_path(const void *a, const void *b) { return strcmp(((const struct entry *)a)->path, ((const struct entry *)b)->path); }

void op_ls(struct conn *c, const struct request *rq) {
  const char *path = need_path(c, rq, "path");
  if (!path) return;
  const char *depth_s = req_get(rq, "depth");
  long depth = depth_s ? strtol(depth_s, NULL, 10) : 1;
  if (depth < 1 || depth > MAX_LS_DEPTH) {
    send_error(c, "EINVAL", "depth is 1 to 16");
    return;
  }
  int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    send_errno(c, errno, path);
    return;
  }
  char full[PATH_MAX];
  abs_path(path, full, sizeof full);
  struct listing l = {0};
  list_dir(&l, fd, full, (int)depth);
  if (l.err)
    send_errno(c, l.err, l.err == E2BIG ? "more than 100000 entries" : path);
  else {
    qsort(l.v, l.n, sizeof *l.v, by_path);
    int ok = 1;
    for (size_t i = 0; i < l.n && ok; i++) ok = send_frame(c, 'R', l.v[i].json, strlen(l.v[i].json)) == 0;
    if (ok) send_frame(c, 'Z', NULL, 0);
  }
  for (size_t i = 0; i < l.n; i++) {
    free(l.v[i].path);
    free(l.v[i].json);
  }
  free(l.v);
}

/* ---- read, write ---- */

#define RAW_MIN (1u << 20) /* smallest file sent raw */

/* Ends the connection with a reset, not a FIN: a raw read's client then sees an error, not
 * a file that ended early. */
static void reset_conn(struct conn *c) {
  struct linger l = {.l_onoff = 1, .l_linger = 0};
  setsockopt(c->fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
}

/* Whether a raw read suits this file: a large regular file of a real file system. The
 * sizes of /proc and /sys files say nothing of their contents (0, or 4096), so those, and
 * small files where framing costs nothing, go the framed way. */
static int raw_worth(int fd, const struct stat *st) {
  struct statfs fs;
  if (!S_ISREG(st->st_mode) || st->st_size < (off_t)RAW_MIN || fstatfs(fd, &fs) < 0) return 0;
  switch ((unsigned long)fs.f_type) {
  case PROC_SUPER_MAGIC:
  case SYSFS_MAGIC:
  case CGROUP_SUPER_MAGIC:
  case CGROUP2_SUPER_MAGIC:
  case DEBUGFS_MAGIC:
  case TRACEFS_MAGIC:
  case SECURITYFS_MAGIC:
    return 0;
  }
  return 1;
}

/* Sends bytes [off, size) of fd by pread and send; -1 on error or a file that shrank. */
static int copy_plain(int sock, int fd, off_t off, off_t size) {
  char *buf = malloc(DATA_CHUNK);
  int r = buf ? 0 : -1;
  while (r == 0 && off < size) {
    size_t want = size - off < (off_t)DATA_CHUNK ? (size_t)(size - off) : DATA_CHUNK;
    ssize_t n = pread(fd, buf, want, off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      r = -1;
      break;
    }
    for (ssize_t at = 0; at < n;) {
      ssize_t w = send(sock, buf + at, (size_t)(n - at), MSG_NOSIGNAL);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        r = -1;
        break;
      }
      at += w;
    }
    off += n;
  }
  free(buf);
  return r;
}

/* A raw read (the client asked with raw=1, for a regular file): after the R frame, exactly
 * `size` bytes with no framing, straight from the page cache (sendfile: one copy fewer than
 * read and send, and no frame headers to parse), then the end of the connection. The client
 * counts the bytes: a file that shrank meanwhile, or any error, resets the connection. A
 * file that grew is sent as it was when the read began (its first `size` bytes). */
static void read_raw(struct conn *c, int fd, off_t size) {
  struct sb b;
  sb_init(&b);
  sb_fmt(&b, "{\"size\":%lld,\"raw\":true}", (long long)size);
  if (send_sb(c, 'R', &b) < 0) return;
  off_t off = 0;
  while (off < size) {
    size_t want = size - off < (off_t)(4u << 20) ? (size_t)(size - off) : (4u << 20);
    ssize_t n = sendfile(c->fd, fd, &off, want);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EINVAL || errno == ENOSYS)) {
      /* A file system without sendfile from its files: the same bytes by read and send. */
      if (copy_plain(c->fd, fd, off, size) < 0) reset_conn(c);
      return;
    }
    if (n <= 0) {
      reset_conn(c);
      return;
    }
  }
}

void op_read(struct conn *c, const struct request *rq) {
  const char *path = need_path(c, rq, "path");
  if (!path) return;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) < 0) {
    send_errno(c, errno, path);
    if (fd >= 0) close(fd);
    return;
  }
  if (S_ISDIR(st.st_mode)) {
    close(fd);
    send_errno(c, EISDIR, path);
    return;
  }
  const char *raw = req_get(rq, "raw");
  if (raw && strcmp(raw, "1") == 0 && raw_worth(fd, &st)) {
    read_raw(c, fd, st.st_size);
    close(fd);
    return;
  }
  char *buf = malloc(DATA_CHUNK);
  struct sb b;
  sb_init(&b);
  sb_fmt(&b, "{\"size\":%lld}", (long long)st.st_size);
  int ok = buf && send_sb(c, 'R', &b) == 0;
  while (ok) {
    ssize_t r = read(fd, buf, DATA_CHUNK);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      send_errno(c, errno, path);
      ok = 0;
    } else if (r == 0) {
      send_frame(c, 'Z', NULL, 0);
      break;
    } else
      ok = send_frame(c, 'D', buf, (size_t)r) == 0;
  }
  free(buf);
  close(fd);
}

int make_parents(const char *path) {
  char buf[PATH_MAX];
  if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) {
    errno = ENAMETOOLONG;
    return -1;
  }
  for (char *p = buf + 1; *p; p++) {
    if (*p != '/') continue;
    *p = 0;
    if (mkdir(buf, 0755) < 0 && errno != EEXIST) return -1;
    *p = '/';
  }
  return 0;
}

static int write_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

void op_write(struct conn *c, const struct request *rq) {
  const char *given = need_path(c, rq, "path");
  if (!given) return;
  const char *mode_s = req_get(rq, "mode"), *append_s = req_get(rq, "append");
  long mode = mode_s ? strtol(mode_s, NULL, 8) : 0644;
  int append = append_s && strcmp(append_s, "1") == 0;
  if (mode < 0 || mode > 07777) {
    send_error(c, "EINVAL", "bad mode");
    return;
  }
  /* A symlink is written through, as open() would, rather than replaced by the rename. */
  char path[PATH_MAX], tmp[PATH_MAX + 32] = "";
  struct stat st;
  int exists = lstat(given, &st) == 0;
  if (!(exists && S_ISLNK(st.st_mode) && realpath(given, path))) snprintf(path, sizeof path, "%s", given);
  if (make_parents(path) < 0) {
    send_errno(c, errno, path);
    return;
  }
  int fd;
  if (append)
    fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, (mode_t)mode);
  else {
    /* the temp file sits next to the target, so the rename is atomic */
    const char *base = base_name(path);
    int dirlen = (int)(base - path);
    snprintf(tmp, sizeof tmp, "%.*s.%.100s%sXXXXXX", dirlen, path, base, exists ? TMP_UPD : TMP_NEW);
    fd = mkostemp(tmp, O_CLOEXEC);
    if (fd >= 0 && fchmod(fd, (mode_t)mode) < 0) {
      int e = errno;
      close(fd), unlink(tmp);
      errno = e;
      fd = -1;
    }
  }
  if (fd < 0) {
    send_errno(c, errno, path);
    return;
  }
  int done = 0, err = 0;
  while (!done && !err) {
    char type, *data;
    uint32_t len;
    if (read_frame(c, &type, &data, &len) < 0) break; /* connection lost: target unchanged */
    if (type == 'D' && write_all(fd, data, len) < 0) err = errno;
    done = type == 'F';
    free(data);
  }
  if (done && !err && !append && rename(tmp, path) < 0) err = errno;
  if (done && !err && fstat(fd, &st) < 0) err = errno;
  close(fd);
  if ((!done || err) && !append) unlink(tmp);
  if (err)
    send_errno(c, err, path);
  else if (done) {
    char full[PATH_MAX];
    abs_path(path, full, sizeof full);
    struct sb b;
    sb_init(&b);
    sb_str(&b, "{\"path\":");
    sb_json(&b, full);
    sb_fmt(&b, ",\"size\":%lld}", (long long)st.st_size);
    send_sb(c, 'R', &b);
  }
}

/* ---- mkdir, remove, rename ---- */

void op_mkdir(struct conn *c, const struct request *rq) {
  const char *path = need_path(c, rq, "path");
  if (!path) return;
  struct stat st;
  int created = 1;
  if (make_parents(path) < 0 || mkdir(path, 0755) < 0) {
    if (errno != EEXIST) {
      send_errno(c, errno, path);
      return;
    }
    if (stat(path, &st) < 0 || !S_ISDIR(st.st_mode)) {
      send_errno(c, EEXIST, path);
      return;
    }
    created = 0;
  }
  struct sb b;
  sb_init(&b);
  sb_fmt(&b, "{\"created\":%s}", created ? "true" : "false");
  send_sb(c, 'R', &b);
}

static __thread int remove_errno;

static int remove_one(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st, (void)flag, (void)ftw;
  if (remove(path) < 0 && errno != ENOENT && !remove_errno) remove_errno = errno;
  return 0;
}

void op_remove(struct conn *c, const struct request *rq) {
  const char *path = need_path(c, rq, "path");
  if (!path) return;
  struct stat st;
  if (lstat(path, &st) < 0) {
    send_errno(c, errno, path);
    return;
  }
  remove_errno = 0;
  if (S_ISDIR(st.st_mode)) {
    if (nftw(path, remove_one, 32, FTW_DEPTH | FTW_PHYS) < 0 && !remove_errno) remove_errno = errno;
  } else if (unlink(path) < 0)
    remove_errno = errno;
  if (remove_errno) {
    send_errno(c, remove_errno, path);
    return;
  }
  send_frame(c, 'R', "{}", 2);
}

void op_rename(struct conn *c, const struct request *rq) {
  const char *from = need_path(c, rq, "from");
  if (!from) return;
  const char *to = need_path(c, rq, "to");
  if (!to) return;
  if (rename(from, to) < 0) {
    send_errno(c, errno, from);
    return;
  }
  send_frame(c, 'R', "{}", 2);
}

/* ---- watch ---- */

struct watches {
  int fd;
  int recursive;
  size_t n;
  struct {
    int wd;
    char *path;
  } v[MAX_WATCHES];
  uint32_t tmp_cookie; /* a write's temp file moved away under this cookie */
  int tmp_new;
};

#define WATCH_MASK (IN_CREATE | IN_MODIFY | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_ATTRIB | IN_DELETE_SELF)

static void add_watch(struct watches *w, const char *path) {
  if (w->n == MAX_WATCHES) return;
  int wd = inotify_add_watch(w->fd, path, WATCH_MASK);
  if (wd < 0) return;
  for (size_t i = 0; i < w->n; i++)
    if (w->v[i].wd == wd) return;
  char *copy = strdup(path);
  if (!copy) return;
  w->v[w->n].wd = wd;
  w->v[w->n].path = copy;
  w->n++;
}

static void add_tree(struct watches *w, const char *path, int depth) {
  add_watch(w, path);
  if (!w->recursive || depth > 32) return;
  DIR *d = opendir(path);
  if (!d) return;
  struct dirent *de;
  while ((de = readdir(d))) {
    if (de->d_type != DT_DIR || strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
    char sub[PATH_MAX];
    if (snprintf(sub, sizeof sub, "%s/%s", strcmp(path, "/") == 0 ? "" : path, de->d_name) < (int)sizeof sub) add_tree(w, sub, depth + 1);
  }
  closedir(d);
}

static int is_tmp(const char *name, int *is_new) {
  if (name[0] != '.') return 0;
  if (strstr(name, TMP_NEW)) return *is_new = 1;
  if (strstr(name, TMP_UPD)) return !(*is_new = 0);
  return 0;
}

static int emit(struct conn *c, const char *type, const char *dir, const char *name, int is_dir) {
  struct sb b;
  sb_init(&b);
  sb_fmt(&b, "{\"type\":\"%s\",\"path\":", type);
  char path[PATH_MAX * 2];
  if (*name)
    snprintf(path, sizeof path, "%s/%s", strcmp(dir, "/") == 0 ? "" : dir, name);
  else
    snprintf(path, sizeof path, "%s", dir);
  sb_json(&b, path);
  sb_fmt(&b, ",\"isDir\":%s}", is_dir ? "true" : "false");
  return send_sb(c, 'W', &b);
}

static int handle_event(struct conn *c, struct watches *w, const struct inotify_event *ev) {
  const char *dir = NULL;
  size_t idx = 0;
  for (size_t i = 0; i < w->n; i++)
    if (w->v[i].wd == ev->wd) dir = w->v[idx = i].path;
  if (!dir) return 0;
  if (ev->mask & IN_IGNORED) { /* the watched folder is gone */
    free(w->v[idx].path);
    w->v[idx] = w->v[--w->n];
    return 0;
  }
  const char *name = ev->len ? ev->name : "";
  int is_dir = (ev->mask & IN_ISDIR) != 0, tmp_new = 0;
  if (*name && is_tmp(name, &tmp_new)) { /* a write in progress: only its end is news */
    if (ev->mask & IN_MOVED_FROM) {
      w->tmp_cookie = ev->cookie;
      w->tmp_new = tmp_new;
    }
    return 0;
  }
  if (ev->mask & IN_MOVED_TO && ev->cookie && ev->cookie == w->tmp_cookie) {
    w->tmp_cookie = 0;
    if (w->tmp_new && emit(c, "create", dir, name, 0) < 0) return -1;
    return emit(c, "write", dir, name, 0);
  }
  if (ev->mask & IN_CREATE && is_dir && w->recursive) {
    char sub[PATH_MAX];
    snprintf(sub, sizeof sub, "%s/%s", strcmp(dir, "/") == 0 ? "" : dir, name);
    add_tree(w, sub, 0);
  }
  const char *type = ev->mask & (IN_CREATE | IN_MOVED_TO) ? "create"
                     : ev->mask & IN_MODIFY             ? "write"
                     : ev->mask & (IN_DELETE | IN_DELETE_SELF) ? "remove"
                     : ev->mask & IN_MOVED_FROM         ? "rename"
                     : ev->mask & IN_ATTRIB             ? "chmod"
                                                         : NULL;
  return type ? emit(c, type, dir, name, is_dir) : 0;
}

void op_watch(struct conn *c, const struct request *rq) {
  const char *path = need_path(c, rq, "path");
  if (!path) return;
  const char *rec = req_get(rq, "recursive");
  struct stat st;
  if (stat(path, &st) < 0) {
    send_errno(c, errno, path);
    return;
  }
  struct watches *w = calloc(1, sizeof *w);
  if (!w) {
    send_errno(c, ENOMEM, "watch");
    return;
  }
  w->recursive = rec && strcmp(rec, "1") == 0 && S_ISDIR(st.st_mode);
  w->fd = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
  char full[PATH_MAX];
  abs_path(path, full, sizeof full);
  if (w->fd >= 0) add_tree(w, full, 0);
  if (w->fd < 0 || w->n == 0) {
    send_errno(c, errno ? errno : EIO, path);
  } else if (send_frame(c, 'R', "{}", 2) == 0) {
    /* events until the client goes away (any byte or EOF from it ends the watch) */
    char buf[64 * 1024] __attribute__((aligned(__alignof__(struct inotify_event))));
    struct pollfd fds[2] = {{.fd = w->fd, .events = POLLIN}, {.fd = c->fd, .events = POLLIN}};
    for (int live = 1; live;) {
      if (poll(fds, 2, -1) < 0) continue;
      if (fds[1].revents) break;
      ssize_t n = read(w->fd, buf, sizeof buf);
      for (ssize_t off = 0; live && n > 0 && off < n;) {
        const struct inotify_event *ev = (const struct inotify_event *)(buf + off);
        if (handle_event(c, w, ev) < 0) live = 0;
        off += (ssize_t)(sizeof *ev + ev->len);
      }
      if (w->n == 0) live = 0;
    }
  }
  for (size_t i = 0; i < w->n; i++) free(w->v[i].path);
  if (w->fd >= 0) close(w->fd);
  free(w);
}
