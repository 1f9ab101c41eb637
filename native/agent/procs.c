/*
 * Commands: the process table, starting a command (pipes or a PTY), its output ring, following
 * it (run, attach), and the ops that act on a running one (signal, stdin, resize, list).
 *
 * Each command has a pump thread that reads its output into a ring of the last RING_BYTES
 * bytes (stdout and stderr interleaved, each piece with its type) and kills its process group
 * at its deadline; one reaper thread waits for every child (the agent is a subreaper, so
 * orphans of commands are reaped too). Followers read the ring at their own offset, so a
 * slow or absent client never blocks a command. One mutex guards the table and the rings;
 * one condition variable wakes followers when anything changes.
 */
#define _GNU_SOURCE
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#define MAX_PROCS 4096       /* running and exited entries */
#define MAX_EXITED 256       /* exited entries kept for list/attach */
#define KEEP_EXITED_MS (10 * 60 * 1000)
#define DRAIN_MS 50           /* output read after exit while a background child holds the pipe */
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434 /* the same number on every architecture */
#endif

extern char **environ;


struct proc {
  int refs;
  int listed; /* still in the table */
  pid_t pid;
  char **args;
  size_t nargs;
  char *cwd, *tag;
  int pty;
  int64_t started_at, started_mono, ended_at, ended_mono, deadline;
  int exited, exit_code, term_sig, timed_out, out_eof;
  /* The pump says when the output of an exited command is all read (out_drained): it sees the
   * exit through a pidfd and then waits until the pipes stay empty for DRAIN_MS. Without a
   * pidfd (an old kernel) followers wait DRAIN_MS of their own after the exit instead, which a
   * pump starved of CPU can miss. */
  int pidfd, pump_drains, out_drained;
  pthread_mutex_t in_lock; /* stdin writes, close and resize */
  int in_fd;               /* stdin pipe, or (pty) a dup of the master; -1 once closed */
  struct ring out; /* its output, for followers */
  int out_fd, err_fd; /* owned by the pump */
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cond;
static struct proc *table[MAX_PROCS];
static size_t nprocs;
static unsigned long spawned; /* wakes the reaper when it has no children */

static void proc_unref(struct proc *p) { /* lock held */
  if (--p->refs > 0) return;
  ring_free(&p->out);
  for (size_t i = 0; i < p->nargs; i++) free(p->args[i]);
  free(p->args);
  free(p->cwd);
  free(p->tag);
  if (p->in_fd >= 0) close(p->in_fd);
  if (p->pidfd >= 0) close(p->pidfd);
  pthread_mutex_destroy(&p->in_lock);
  free(p);
}

static void unlist(size_t i) { /* lock held */
  struct proc *p = table[i];
  table[i] = table[--nprocs];
  p->listed = 0;
  proc_unref(p);
}

/* Drops exited entries older than KEEP_EXITED_MS, then the oldest beyond MAX_EXITED. */
static void prune(void) { /* lock held */
  int64_t now = now_ms();
  size_t exited = 0;
  for (size_t i = nprocs; i-- > 0;) {
    if (!table[i]->exited) continue;
    if (now - table[i]->ended_at > KEEP_EXITED_MS)
      unlist(i);
    else
      exited++;
  }
  while (exited > MAX_EXITED) {
    size_t oldest = nprocs;
    for (size_t i = 0; i < nprocs; i++)
      if (table[i]->exited && (oldest == nprocs || table[i]->ended_at < table[oldest]->ended_at)) oldest = i;
    unlist(oldest);
    exited--;
  }
}

static struct proc *find(const char *id) { /* lock held; returns a new reference */
  char *end;
  long pid = strtol(id ? id : "", &end, 10);
  if (!id || !*id || *end || pid <= 0) return NULL;
  for (size_t i = 0; i < nprocs; i++)
    if (table[i]->pid == pid) {
      table[i]->refs++;
      return table[i];
    }
  return NULL;
}

static struct proc *find_or_error(struct conn *c, const struct request *rq) {
  pthread_mutex_lock(&lock);
  struct proc *p = find(req_get(rq, "id"));
  pthread_mutex_unlock(&lock);
  if (!p) send_error(c, "ESRCH", "no such process");
  return p;
}

static void put(struct proc *p) {
  pthread_mutex_lock(&lock);
  proc_unref(p);
  pthread_mutex_unlock(&lock);
}

/* ---- threads ---- */

static void timed_wait_until(int64_t deadline_mono) { /* lock held */
  struct timespec ts = {.tv_sec = deadline_mono / 1000, .tv_nsec = (deadline_mono % 1000) * 1000000};
  pthread_cond_timedwait(&cond, &lock, &ts);
}

static void kill_on_deadline(struct proc *p) { /* lock held */
  if (p->deadline && !p->exited && mono_ms() >= p->deadline) {
    kill(-p->pid, SIGKILL);
    p->timed_out = 1;
    p->deadline = 0;
  }
}

static void *pump(void *arg) {
  struct proc *p = arg;
  char *buf = malloc(CHUNK_MAX);
  struct pollfd fds[3] = {{.fd = p->out_fd, .events = POLLIN},
                          {.fd = p->err_fd, .events = POLLIN},
                          {.fd = p->pidfd, .events = POLLIN}};
  /* Without a pidfd of a pump that drains, the process was reaped before it could be opened. */
  int gone = p->pump_drains && p->pidfd < 0;
  int open = (p->out_fd >= 0) + (p->err_fd >= 0);
  while (open > 0 && buf) {
    pthread_mutex_lock(&lock);
    kill_on_deadline(p);
    int timeout = p->deadline && !p->exited ? (int)(p->deadline - mono_ms()) : -1;
    int draining = gone && !p->out_drained;
    pthread_mutex_unlock(&lock);
    if (draining) timeout = DRAIN_MS;
    if (timeout < -1) timeout = 0;
    int ready = poll(fds, 3, timeout);
    if (ready == 0 && draining) {
      /* Exited, and nothing came for DRAIN_MS: what it wrote is all in the ring (what is
       * still open belongs to a background child, whose later output is kept as it comes). */
      pthread_mutex_lock(&lock);
      p->out_drained = 1;
      pthread_cond_broadcast(&cond);
      pthread_mutex_unlock(&lock);
      continue;
    }
    if (ready <= 0) continue;
    if (fds[2].fd >= 0 && fds[2].revents) {
      gone = 1;
      fds[2].fd = -1; /* the pidfd is closed with the entry */
    }
    for (int i = 0; i < 2; i++) {
      if (fds[i].fd < 0 || !fds[i].revents) continue;
      ssize_t r = read(fds[i].fd, buf, CHUNK_MAX);
      if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (r <= 0) { /* EOF, or EIO from a PTY master once its slave is closed */
        close(fds[i].fd);
        fds[i].fd = -1;
        open--;
        continue;
      }
      pthread_mutex_lock(&lock);
      ring_append(&p->out, i == 0 ? 'O' : 'E', buf, (size_t)r);
      pthread_cond_broadcast(&cond);
      pthread_mutex_unlock(&lock);
    }
  }
  free(buf);
  pthread_mutex_lock(&lock);
  p->out_eof = 1;
  pthread_cond_broadcast(&cond);
  while (!p->exited && p->deadline) {
    timed_wait_until(p->deadline);
    kill_on_deadline(p);
  }
  proc_unref(p);
  pthread_mutex_unlock(&lock);
  return NULL;
}

static void *reaper(void *arg) {
  (void)arg;
  unsigned long seen = 0;
  for (;;) {
    int st;
    pid_t pid = waitpid(-1, &st, 0);
    if (pid < 0) {
      if (errno == ECHILD) {
        pthread_mutex_lock(&lock);
        while (spawned == seen) pthread_cond_wait(&cond, &lock);
        seen = spawned;
        pthread_mutex_unlock(&lock);
      }
      continue;
    }
    struct proc *p = NULL;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < nprocs; i++)
      if (table[i]->pid == pid && !table[i]->exited) p = table[i];
    if (p) {
      p->exited = 1;
      p->ended_at = now_ms();
      p->ended_mono = mono_ms();
      p->exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
      p->term_sig = WIFSIGNALED(st) ? WTERMSIG(st) : 0;
      p->refs++;
      pthread_cond_broadcast(&cond);
    }
    pthread_mutex_unlock(&lock);
    if (p) { /* nobody can write to it any more; background children keep their own copies */
      pthread_mutex_lock(&p->in_lock);
      if (p->in_fd >= 0) close(p->in_fd);
      p->in_fd = -1;
      pthread_mutex_unlock(&p->in_lock);
      put(p);
    }
  }
  return NULL;
}

void procs_init(void) {
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&cond, &ca);
  pthread_t t;
  if (pthread_create(&t, NULL, reaper, NULL) == 0) pthread_detach(t);
}

void procs_kill_all(void) {
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < nprocs; i++)
    if (!table[i]->exited) kill(-table[i]->pid, SIGKILL);
  pthread_mutex_unlock(&lock);
}

/* ---- stdin, signals, resize ---- */

/* Writes all of data unless the process ends or stop becomes set (then -1). */
static int stdin_write(struct proc *p, const char *data, size_t n, const int *stop) {
  int r = 0;
  pthread_mutex_lock(&p->in_lock);
  while (n > 0) {
    if (p->in_fd < 0 || __atomic_load_n(&p->exited, __ATOMIC_RELAXED) || (stop && __atomic_load_n(stop, __ATOMIC_RELAXED))) {
      r = -1;
      break;
    }
    ssize_t w = write(p->in_fd, data, n);
    if (w > 0) {
      data += w;
      n -= (size_t)w;
    } else if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
      /* a full pipe: wait a little, then look again whether we should stop */
      struct pollfd pf = {.fd = p->in_fd, .events = POLLOUT};
      poll(&pf, 1, 100);
    } else {
      r = -1;
      break;
    }
  }
  pthread_mutex_unlock(&p->in_lock);
  return r;
}

static void stdin_close(struct proc *p) {
  pthread_mutex_lock(&p->in_lock);
  if (p->in_fd >= 0) {
    if (p->pty) { /* a terminal has no end of input: send its EOF character instead */
      ssize_t w = write(p->in_fd, "\x04", 1);
      (void)w;
    } else {
      close(p->in_fd);
      p->in_fd = -1;
    }
  }
  pthread_mutex_unlock(&p->in_lock);
}

static int proc_signal(struct proc *p, int sig) {
  pthread_mutex_lock(&lock);
  int delivered = 0;
  if (!p->exited) delivered = kill(-p->pid, sig) == 0 || kill(p->pid, sig) == 0;
  pthread_mutex_unlock(&lock);
  return delivered;
}

static int proc_resize(struct proc *p, const char *cols, const char *rows) {
  long c = cols ? strtol(cols, NULL, 10) : 0, r = rows ? strtol(rows, NULL, 10) : 0;
  if (!p->pty || c <= 0 || r <= 0 || c > 65535 || r > 65535) return -1;
  struct winsize ws = {.ws_row = (unsigned short)r, .ws_col = (unsigned short)c};
  pthread_mutex_lock(&p->in_lock);
  int ok = p->in_fd >= 0 && ioctl(p->in_fd, TIOCSWINSZ, &ws) == 0;
  pthread_mutex_unlock(&p->in_lock);
  return ok ? 0 : -1;
}

/* Handles one client frame of a run/attach/stdin connection (I, C, S, T). */
static void input_frame(struct proc *p, char type, char *data, uint32_t len, const int *stop) {
  if (type == 'I')
    stdin_write(p, data, len, stop);
  else if (type == 'C')
    stdin_close(p);
  else if (type == 'S')
    proc_signal(p, atoi(data));
  else if (type == 'T') {
    char *space = strchr(data, ' ');
    if (space) proc_resize(p, data, space + 1);
  }
}

/* ---- following a process ---- */

struct follower {
  struct conn *c;
  struct proc *p;
  int closed;
};

static void *follower_input(void *arg) {
  struct follower *f = arg;
  for (;;) {
    char type, *data;
    uint32_t len;
    if (read_frame(f->c, &type, &data, &len) < 0) break;
    input_frame(f->p, type, data, len, &f->closed);
    free(data);
  }
  pthread_mutex_lock(&lock);
  __atomic_store_n(&f->closed, 1, __ATOMIC_RELAXED);
  pthread_cond_broadcast(&cond);
  pthread_mutex_unlock(&lock);
  return NULL;
}

/* The X frame's text; built under the lock (it reads p), sent after it. */
static void exit_json(struct sb *b, const struct proc *p) {
  if (p->term_sig)
    sb_fmt(b, "{\"exitCode\":null,\"signal\":\"SIG%s\"", sigabbrev_np(p->term_sig) ? sigabbrev_np(p->term_sig) : "UNKNOWN");
  else
    sb_fmt(b, "{\"exitCode\":%d,\"signal\":null", p->exit_code);
  sb_fmt(b, ",\"durationMs\":%lld,\"timedOut\":%s}", (long long)(p->ended_mono - p->started_mono), p->timed_out ? "true" : "false");
}

static void follow(struct conn *c, struct proc *p, uint64_t pos) {
  struct follower f = {.c = c, .p = p};
  pthread_t in;
  int have_in = pthread_create(&in, NULL, follower_input, &f) == 0;
  char *buf = malloc(CHUNK_MAX);
  pthread_mutex_lock(&lock);
  while (buf && !f.closed) {
    uint64_t first = ring_first(&p->out);
    if (pos < first) { /* we fell behind the ring: say how much is gone */
      char note[64];
      int n = snprintf(note, sizeof note, "{\"lostBytes\":%llu}", (unsigned long long)(first - pos));
      pos = first;
      pthread_mutex_unlock(&lock);
      if (send_frame(c, 'L', note, (size_t)n) < 0) f.closed = 1;
      pthread_mutex_lock(&lock);
    } else if (pos < p->out.end) {
      char type;
      size_t n = ring_read(&p->out, pos, buf, &type);
      pos += n;
      pthread_mutex_unlock(&lock);
      if (send_frame(c, type, buf, n) < 0) f.closed = 1;
      pthread_mutex_lock(&lock);
    } else if (p->exited &&
               (p->out_eof || (p->pump_drains ? p->out_drained : mono_ms() >= p->ended_mono + DRAIN_MS))) {
      struct sb b;
      sb_init(&b);
      exit_json(&b, p);
      pthread_mutex_unlock(&lock); /* a client that does not read must not hold up the agent */
      send_sb(c, 'X', &b);
      pthread_mutex_lock(&lock);
      break;
    } else if (p->exited && !p->pump_drains) {
      timed_wait_until(p->ended_mono + DRAIN_MS);
    } else {
      pthread_cond_wait(&cond, &lock);
    }
  }
  pthread_mutex_unlock(&lock);
  free(buf);
  shutdown(c->fd, SHUT_RDWR); /* ends follower_input's read */
  if (have_in) pthread_join(in, NULL);
}

/* ---- ops ---- */

static char **build_env(const struct request *rq, int pty) {
  const char *add[MAX_FIELDS];
  size_t nadd = req_all(rq, "env", add, MAX_FIELDS);
  size_t nenv = 0;
  while (environ[nenv]) nenv++;
  char **env = calloc(nenv + nadd + 2, sizeof *env);
  if (!env) return NULL;
  size_t n = 0;
  int has_term = 0;
  for (size_t i = 0; i < nenv; i++) {
    const char *eq = strchr(environ[i], '=');
    size_t klen = eq ? (size_t)(eq - environ[i]) : strlen(environ[i]);
    int overridden = 0;
    for (size_t j = 0; j < nadd && !overridden; j++) overridden = strncmp(add[j], environ[i], klen) == 0 && add[j][klen] == '=';
    if (!overridden) env[n++] = environ[i];
  }
  for (size_t j = 0; j < nadd; j++)
    if (strchr(add[j], '=')) env[n++] = (char *)add[j];
  for (size_t i = 0; i < n; i++) has_term |= strncmp(env[i], "TERM=", 5) == 0;
  if (pty && !has_term) env[n++] = "TERM=xterm-256color";
  return env;
}

static void child(const char *cwd, char **argv, char **env, int pty_master, const char *slave, int fds[3], int status_fd) {
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, NULL);
  signal(SIGPIPE, SIG_DFL);
  /* Its own process group, so a timeout or a kill reaches all of it. A terminal needs its own
   * session too (to be its controlling tty); a plain command stays in the agent's session:
   * were it a session leader, a background child it leaves (`sleep 30 &`) would be an orphan
   * whose session leader is gone and whose parent (the agent, a subreaper) is in another
   * session, a process tree CRIU cannot restore ("Can't find a session leader"). */
  if (pty_master >= 0)
    setsid();
  else
    setpgid(0, 0);
  if (pty_master >= 0) {
    int s = open(slave, O_RDWR);
    if (s < 0 || ioctl(s, TIOCSCTTY, 0) < 0) goto fail;
    fds[0] = fds[1] = fds[2] = s;
  }
  for (int i = 0; i < 3; i++)
    if (dup2(fds[i], i) < 0) goto fail;
  if (cwd && *cwd && chdir(cwd) < 0) goto fail;
  execvpe(argv[0], argv, env);
fail:;
  int e = errno;
  ssize_t w = write(status_fd, &e, sizeof e);
  (void)w;
  _exit(127);
}

void op_run(struct conn *c, const struct request *rq) {
  const char *argv_in[MAX_FIELDS];
  size_t nargs = req_all(rq, "arg", argv_in, MAX_FIELDS);
  const char *cwd = req_get(rq, "cwd"), *tag = req_get(rq, "tag"), *ptyspec = req_get(rq, "pty");
  const char *tms = req_get(rq, "timeout_ms"), *sin = req_get(rq, "stdin");
  long cols = 0, rows = 0;
  if (nargs == 0 || !*argv_in[0]) {
    send_error(c, "EINVAL", "run needs arg=");
    return;
  }
  if (ptyspec && (sscanf(ptyspec, "%ld %ld", &cols, &rows) != 2 || cols <= 0 || rows <= 0 || cols > 65535 || rows > 65535))
    {
    send_error(c, "EINVAL", "pty wants COLS ROWS");
    return;
  }
  long long timeout = tms ? atoll(tms) : 0;
  if (timeout < 0) {
    send_error(c, "EINVAL", "bad timeout_ms");
    return;
  }

  struct proc *p = calloc(1, sizeof *p);
  char **argv = calloc(nargs + 1, sizeof *argv);
  char **env = build_env(rq, ptyspec != NULL);
  if (!p || !argv || !env) {
    free(p), free(argv), free(env);
    {
    send_error(c, "ENOMEM", "out of memory");
    return;
  }
  }
  memcpy(argv, argv_in, nargs * sizeof *argv);
  p->pty = ptyspec != NULL;
  p->in_fd = p->out_fd = p->err_fd = p->pidfd = -1;
  pthread_mutex_init(&p->in_lock, NULL);
  p->refs = 1;

  int master = -1, fds[3] = {-1, -1, -1}, in_pipe[2] = {-1, -1}, out_pipe[2] = {-1, -1}, err_pipe[2] = {-1, -1}, st[2] = {-1, -1};
  char slave[128] = "";
  int err = 0;
  if (pipe2(st, O_CLOEXEC) < 0) err = errno;
  if (!err && p->pty) { /* a PTY of the sandbox's own devpts (its /dev/ptmx) */
    master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
    struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
    if (master < 0 || grantpt(master) < 0 || unlockpt(master) < 0 || ptsname_r(master, slave, sizeof slave) != 0 ||
        ioctl(master, TIOCSWINSZ, &ws) < 0)
      err = errno ? errno : EIO;
  } else if (!err) {
    if (sin && strcmp(sin, "1") == 0) {
      if (pipe2(in_pipe, O_CLOEXEC) < 0) err = errno;
      fds[0] = in_pipe[0];
    } else if ((fds[0] = open("/dev/null", O_RDONLY | O_CLOEXEC)) < 0)
      err = errno;
    if (!err && (pipe2(out_pipe, O_CLOEXEC) < 0 || pipe2(err_pipe, O_CLOEXEC) < 0)) err = errno;
    fds[1] = out_pipe[1];
    fds[2] = err_pipe[1];
  }
  char here[4096];
  if (!err && !(cwd && *cwd) && !getcwd(here, sizeof here)) strcpy(here, "/");

  pid_t pid = -1;
  if (!err) {
    pthread_mutex_lock(&lock);
    prune();
    if (nprocs == MAX_PROCS) {
      err = EAGAIN;
    } else if ((pid = fork()) == 0) {
      child(cwd, argv, env, master, slave, fds, st[1]);
    } else if (pid < 0) {
      err = errno;
    } else {
      for (size_t i = nprocs; i-- > 0;) /* an old entry with the same pid is gone for good */
        if (table[i]->pid == pid) unlist(i);
      p->pid = pid;
      /* ESRCH: reaped already (the pump then drains at once); any other error: no pidfds here. */
      p->pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
      p->pump_drains = p->pidfd >= 0 || errno == ESRCH;
      p->listed = 1;
      p->refs++; /* the table's */
      p->started_at = now_ms();
      p->started_mono = mono_ms();
      p->deadline = timeout ? p->started_mono + timeout : 0;
      table[nprocs++] = p;
      spawned++;
      pthread_cond_broadcast(&cond);
    }
    pthread_mutex_unlock(&lock);
  }
  close(st[1]);
  if (fds[0] >= 0 && fds[0] != in_pipe[0]) close(fds[0]);
  if (in_pipe[0] >= 0) close(in_pipe[0]);
  if (out_pipe[1] >= 0) close(out_pipe[1]);
  if (err_pipe[1] >= 0) close(err_pipe[1]);
  int child_errno = 0;
  if (!err) { /* the status pipe closes on exec; an errno arrives when it failed */
    ssize_t r;
    do r = read(st[0], &child_errno, sizeof child_errno);
    while (r < 0 && errno == EINTR);
    if (r != sizeof child_errno) child_errno = 0;
  }
  if (st[0] >= 0) close(st[0]);
  free(argv);
  free(env);
  if (err || child_errno) {
    if (master >= 0) close(master);
    if (in_pipe[1] >= 0) close(in_pipe[1]);
    if (out_pipe[0] >= 0) close(out_pipe[0]);
    if (err_pipe[0] >= 0) close(err_pipe[0]);
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < nprocs; i++)
      if (table[i] == p) unlist(i);
    proc_unref(p);
    pthread_mutex_unlock(&lock);
    {
    send_errno(c, err ? err : child_errno, err ? "start" : argv_in[0]);
    return;
  }
  }

  /* Kept for list; copies, since the request's buffer goes away with this connection. */
  p->args = calloc(nargs, sizeof *p->args);
  for (size_t i = 0; p->args && i < nargs; i++)
    if ((p->args[i] = strdup(argv_in[i]))) p->nargs++;
  p->cwd = strdup(cwd && *cwd ? cwd : here);
  p->tag = tag ? strdup(tag) : NULL;
  int in_fd = p->pty ? fcntl(master, F_DUPFD_CLOEXEC, 3) : in_pipe[1];
  p->out_fd = p->pty ? master : out_pipe[0];
  p->err_fd = p->pty ? -1 : err_pipe[0];
  if (in_fd >= 0) fcntl(in_fd, F_SETFL, O_NONBLOCK);
  pthread_mutex_lock(&p->in_lock);
  if (__atomic_load_n(&p->exited, __ATOMIC_RELAXED) && in_fd >= 0) /* the reaper was quicker */
    close(in_fd);
  else
    p->in_fd = in_fd;
  pthread_mutex_unlock(&p->in_lock);
  pthread_mutex_lock(&lock);
  p->refs++; /* the pump's */
  pthread_mutex_unlock(&lock);
  pthread_t t;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_attr_setstacksize(&attr, 128 << 10);
  if (pthread_create(&t, &attr, pump, p) != 0) { /* no pump: it cannot be followed; end it */
    kill(-pid, SIGKILL);
    if (p->out_fd >= 0) close(p->out_fd);
    if (p->err_fd >= 0) close(p->err_fd);
    pthread_mutex_lock(&lock);
    p->out_eof = 1;
    proc_unref(p);
    pthread_mutex_unlock(&lock);
  }
  pthread_attr_destroy(&attr);

  struct sb b;
  sb_init(&b);
  sb_fmt(&b, "{\"id\":\"%d\",\"pid\":%d}", (int)pid, (int)pid);
  if (send_sb(c, 'R', &b) == 0) follow(c, p, 0);
  put(p);
}

void op_attach(struct conn *c, const struct request *rq) {
  struct proc *p = find_or_error(c, rq);
  if (!p) return;
  const char *from_s = req_get(rq, "from");
  uint64_t from = from_s ? strtoull(from_s, NULL, 10) : 0;
  pthread_mutex_lock(&lock);
  uint64_t first = ring_first(&p->out), lost = 0;
  if (from > p->out.end) from = p->out.end;
  if (from < first) {
    lost = first - from;
    from = first;
  }
  pthread_mutex_unlock(&lock);
  struct sb b;
  sb_init(&b);
  sb_fmt(&b, "{\"id\":\"%d\",\"pid\":%d,\"from\":%llu}", (int)p->pid, (int)p->pid, (unsigned long long)from);
  int ok = send_sb(c, 'R', &b) == 0;
  if (ok && lost) {
    char note[64];
    int n = snprintf(note, sizeof note, "{\"lostBytes\":%llu}", (unsigned long long)lost);
    ok = send_frame(c, 'L', note, (size_t)n) == 0;
  }
  if (ok) follow(c, p, from);
  put(p);
}

void op_list(struct conn *c, const struct request *rq) {
  (void)rq;
  struct sb b;
  sb_init(&b);
  sb_str(&b, "[");
  pthread_mutex_lock(&lock);
  prune();
  for (size_t i = 0; i < nprocs; i++) {
    const struct proc *p = table[i];
    sb_fmt(&b, "%s{\"id\":\"%d\",\"pid\":%d,\"args\":[", i ? "," : "", (int)p->pid, (int)p->pid);
    for (size_t a = 0; a < p->nargs; a++) {
      if (a) sb_str(&b, ",");
      sb_json(&b, p->args[a]);
    }
    sb_str(&b, "],\"cwd\":");
    sb_json(&b, p->cwd ? p->cwd : "");
    sb_str(&b, ",\"tag\":");
    if (p->tag)
      sb_json(&b, p->tag);
    else
      sb_str(&b, "null");
    sb_fmt(&b, ",\"pty\":%s,\"running\":%s,", p->pty ? "true" : "false", p->exited ? "false" : "true");
    if (p->exited && !p->term_sig)
      sb_fmt(&b, "\"exitCode\":%d,\"signal\":null", p->exit_code);
    else if (p->exited)
      sb_fmt(&b, "\"exitCode\":null,\"signal\":\"SIG%s\"", sigabbrev_np(p->term_sig) ? sigabbrev_np(p->term_sig) : "UNKNOWN");
    else
      sb_str(&b, "\"exitCode\":null,\"signal\":null");
    sb_fmt(&b, ",\"startedAt\":%lld,\"outputBytes\":%llu}", (long long)p->started_at, (unsigned long long)p->out.end);
  }
  pthread_mutex_unlock(&lock);
  sb_str(&b, "]");
  if (b.oom || b.len > MAX_FRAME) {
    sb_free(&b);
    {
    send_error(c, "E2BIG", "the process list is larger than a frame");
    return;
  }
  }
  send_sb(c, 'R', &b);
}

void op_signal(struct conn *c, const struct request *rq) {
  const char *sig_s = req_get(rq, "sig");
  long sig = sig_s ? strtol(sig_s, NULL, 10) : 0;
  if (sig <= 0 || sig >= 65) {
    send_error(c, "EINVAL", "bad sig");
    return;
  }
  struct proc *p = find_or_error(c, rq);
  if (!p) return;
  int delivered = proc_signal(p, (int)sig);
  put(p);
  struct sb b;
  sb_init(&b);
  sb_fmt(&b, "{\"delivered\":%s}", delivered ? "true" : "false");
  send_sb(c, 'R', &b);
}

void op_stdin(struct conn *c, const struct request *rq) {
  struct proc *p = find_or_error(c, rq);
  if (!p) return;
  pthread_mutex_lock(&p->in_lock);
  int open = p->in_fd >= 0;
  pthread_mutex_unlock(&p->in_lock);
  if (!open) {
    put(p);
    {
    send_error(c, "EINVAL", "the process's stdin is not open");
    return;
  }
  }
  for (;;) {
    char type, *data;
    uint32_t len;
    if (read_frame(c, &type, &data, &len) < 0) break;
    int done = type == 'C';
    if (type == 'I' && stdin_write(p, data, len, NULL) < 0) {
      free(data);
      put(p);
      {
    send_error(c, "EPIPE", "the process's stdin is closed");
    return;
  }
    }
    if (done) stdin_close(p);
    free(data);
    if (done) break;
  }
  put(p);
  send_frame(c, 'R', "{}", 2);
}

void op_resize(struct conn *c, const struct request *rq) {
  struct proc *p = find_or_error(c, rq);
  if (!p) return;
  int r = proc_resize(p, req_get(rq, "cols"), req_get(rq, "rows"));
  put(p);
  if (r < 0) {
    send_error(c, "EINVAL", "not a running PTY process, or bad size");
    return;
  }
  send_frame(c, 'R', "{}", 2);
}
