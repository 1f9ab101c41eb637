/*
 * dormant-agent serve [--listen ADDR:PORT] [--no-install]
 *
 * Reads the token from the first line of stdin, then (unless --no-install) copies itself into
 * the sandbox's own /dev (/dev/.dormant/agent; /.dormant/agent where /dev is noexec) and
 * re-executes from there, so that the process
 * CRIU checkpoints and /proc/PID/exe name a file of the sandbox, never the host's copy it was
 * started from. Then it detaches (own session, stdio on /dev/null, no other fds) and serves
 * one request per TCP connection, each on its own thread.
 */
#define _GNU_SOURCE
#include "agent.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TOKEN_ENV "DORMANT_AGENT_TOKEN"
#define MAX_TOKEN 1024
#define MAX_CONNS 512

static char token[MAX_TOKEN + 1];
static size_t token_len;
static pthread_mutex_t conns_lock = PTHREAD_MUTEX_INITIALIZER;
static int conns;

static void die(const char *what) {
  fprintf(stderr, "dormant-agent: %s: %s\n", what, strerror(errno));
  exit(1);
}

/* The token is the first line of stdin (or, after the re-exec, an environment variable that
 * is removed at once so that no command the agent starts inherits it). */
static void read_token(void) {
  char *env = getenv(TOKEN_ENV);
  if (env) {
    token_len = strnlen(env, MAX_TOKEN);
    memcpy(token, env, token_len);
    /* Overwritten in place as well: /proc/PID/environ shows the original block. */
    memset(env, 'x', strlen(env));
    unsetenv(TOKEN_ENV);
  } else {
    while (token_len < MAX_TOKEN) {
      char ch;
      ssize_t r = read(0, &ch, 1);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0 || ch == '\n') break;
      token[token_len++] = ch;
    }
  }
  token[token_len] = 0;
  if (token_len == 0) {
    fprintf(stderr, "dormant-agent: no token on stdin\n");
    exit(2);
  }
}

/* Constant time in the given token's content: every byte of the expected token is compared. */
static int token_ok(const char *given) {
  size_t n = strnlen(given, MAX_TOKEN + 1);
  unsigned diff = (unsigned)(n != token_len);
  for (size_t i = 0; i < token_len; i++) diff |= (unsigned char)token[i] ^ (unsigned char)(i < n ? given[i] : 0);
  return diff == 0;
}

/* Where the agent copies itself, in order: the sandbox's own /dev tmpfs (nothing of the user's
 * filesystem changes), else the root of its filesystem, for a sandbox whose /dev is mounted
 * noexec (a podman container's is). */
static const char *const INSTALL_DIRS[] = {"/dev/.dormant", "/.dormant"};

/* Copies /proc/self/exe to DIR/agent (dir 0700, file 0500) and execs it; returns only when
 * that fails, with errno set. */
static void install_at(const char *dir, char **argv) {
  char path[64], tmp[80];
  snprintf(path, sizeof path, "%s/agent", dir);
  snprintf(tmp, sizeof tmp, "%s.%d", path, (int)getpid());
  if (mkdir(dir, 0700) < 0 && errno != EEXIST) return;
  if (chmod(dir, 0700) < 0) return;
  int in = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
  if (in < 0) return;
  int out = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0700);
  struct stat st;
  int ok = out >= 0 && fstat(in, &st) == 0;
  off_t off = 0;
  while (ok && off < st.st_size) {
    ssize_t w = sendfile(out, in, &off, (size_t)(st.st_size - off));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) ok = 0;
  }
  int saved = errno;
  close(in);
  if (out >= 0 && (fchmod(out, 0500) < 0 || close(out) < 0)) ok = 0;
  if (!ok || rename(tmp, path) < 0) {
    unlink(tmp);
    errno = ok ? errno : saved;
    return;
  }
  if (setenv(TOKEN_ENV, token, 1) < 0) die("setenv");
  argv[0] = "dormant-agent"; /* rather than the /proc/self/fd path it was started as */
  execv(path, argv);
}

static void install_and_reexec(char **argv) {
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    self[n] = 0;
    for (size_t i = 0; i < sizeof INSTALL_DIRS / sizeof *INSTALL_DIRS; i++) {
      size_t l = strlen(INSTALL_DIRS[i]);
      if (strncmp(self, INSTALL_DIRS[i], l) == 0 && strcmp(self + l, "/agent") == 0)
        return; /* already running from the sandbox's copy */
    }
  }
  for (size_t i = 0; i < sizeof INSTALL_DIRS / sizeof *INSTALL_DIRS; i++) {
    install_at(INSTALL_DIRS[i], argv);
    fprintf(stderr, "dormant-agent: install into %s: %s\n", INSTALL_DIRS[i], strerror(errno));
  }
  die("no folder of the sandbox lets the agent run from it");
}

/*
 * Stdio on /dev/null, no inherited fds, a session of its own, and a parent inside the sandbox:
 * runc's exec leaves the agent a child of runc on the host, outside the sandbox's process tree,
 * where a checkpoint (which dumps the tree under the sandbox's pid 1) would leave it behind. So
 * it forks and the first process exits: the orphan is adopted by the sandbox's pid 1 (the
 * reaper of the pid namespace its parent lived in) and is checkpointed with the sandbox.
 */
static void detach(void) {
  pid_t pid = fork();
  if (pid < 0) die("fork");
  if (pid > 0) _exit(0);
  if (syscall(SYS_close_range, 3U, ~0U, 0U) < 0)
    for (int fd = 3; fd < 1024; fd++) close(fd);
  int null = open("/dev/null", O_RDWR);
  if (null >= 0) {
    dup2(null, 0);
    dup2(null, 1);
    dup2(null, 2);
    if (null > 2) close(null);
  }
  setsid();
}

static void dispatch(struct conn *c, const struct request *rq) {
  static const struct {
    const char *name;
    void (*fn)(struct conn *, const struct request *);
  } ops[] = {
      {"run", op_run},       {"attach", op_attach}, {"list", op_list},     {"signal", op_signal},
      {"stdin", op_stdin},   {"resize", op_resize}, {"stat", op_stat},     {"ls", op_ls},
      {"read", op_read},     {"write", op_write},   {"mkdir", op_mkdir},   {"remove", op_remove},
      {"rename", op_rename}, {"watch", op_watch},
  };
  const char *op = rq->fields[1];
  if (strcmp(op, "ping") == 0) {
    struct sb b;
    sb_init(&b);
    sb_fmt(&b, "{\"version\":%d,\"pid\":%d}", AGENT_VERSION, (int)getpid());
    send_sb(c, 'R', &b);
    return;
  }
  for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
    if (strcmp(op, ops[i].name) == 0) {
      ops[i].fn(c, rq);
      return;
    }
  send_error(c, "EINVAL", "unknown op");
}

static void *serve_conn(void *arg) {
  struct conn *c = arg;
  /* A request must arrive promptly; after it, ops such as run and watch follow for as long
   * as the client wants. */
  struct timeval tv = {.tv_sec = 10};
  setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char type;
  char *payload = NULL;
  uint32_t len;
  int r = read_frame(c, &type, &payload, &len);
  if (r == 0) {
    struct request rq = {0};
    if (type != 'Q' || parse_request(payload, len, &rq) < 0) {
      send_error(c, "EPROTO", "expected a request");
    } else if (!token_ok(rq.fields[0])) {
      send_error(c, "EAUTH", "bad token");
    } else {
      struct timeval none = {0};
      setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof none);
      dispatch(c, &rq);
    }
    free(rq.fields);
    free(payload);
  }
  close(c->fd);
  pthread_mutex_destroy(&c->wlock);
  free(c);
  pthread_mutex_lock(&conns_lock);
  conns--;
  pthread_mutex_unlock(&conns_lock);
  return NULL;
}

/* SIGTERM/SIGINT end the agent and every command it started (their process groups). */
static void *signal_thread(void *arg) {
  sigset_t *set = arg;
  int sig;
  sigwait(set, &sig);
  procs_kill_all();
  _exit(0);
}

static void parse_listen(const char *s, struct sockaddr_in *sa) {
  char host[64];
  const char *colon = strrchr(s, ':');
  if (!colon || (size_t)(colon - s) >= sizeof host) {
    fprintf(stderr, "dormant-agent: --listen wants ADDR:PORT\n");
    exit(2);
  }
  memcpy(host, s, (size_t)(colon - s));
  host[colon - s] = 0;
  long port = strtol(colon + 1, NULL, 10);
  memset(sa, 0, sizeof *sa);
  sa->sin_family = AF_INET;
  sa->sin_port = htons((uint16_t)port);
  if (port <= 0 || port > 65535 || inet_pton(AF_INET, host, &sa->sin_addr) != 1) {
    fprintf(stderr, "dormant-agent: bad --listen address %s\n", s);
    exit(2);
  }
}

int main(int argc, char **argv) {
  const char *listen_at = "0.0.0.0:49983";
  int install = 1;
  if (argc < 2 || strcmp(argv[1], "serve") != 0) {
    fprintf(stderr, "usage: dormant-agent serve [--listen ADDR:PORT] [--no-install]\n");
    return 2;
  }
  for (int i = 2; i < argc; i++) {
    if (strcmp(argv[i], "--no-install") == 0)
      install = 0;
    else if (strcmp(argv[i], "--listen") == 0 && i + 1 < argc)
      listen_at = argv[++i];
    else {
      fprintf(stderr, "dormant-agent: unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  struct sockaddr_in sa;
  parse_listen(listen_at, &sa);
  read_token();
  if (install) {
    install_and_reexec(argv);
    detach();
  }

  signal(SIGPIPE, SIG_IGN);
  static sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, NULL); /* inherited by every thread; commands unblock */
  pthread_t t;
  if (pthread_create(&t, NULL, signal_thread, &set) != 0) die("thread");
  /* Orphans of the commands it runs become its children, so it reaps them. */
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  procs_init();

  int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (ls < 0) die("socket");
  int one = 1;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(ls, (struct sockaddr *)&sa, sizeof sa) < 0) die("bind");
  if (listen(ls, 128) < 0) die("listen");

  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_attr_setstacksize(&attr, 2 << 20); /* ls and watch recurse with PATH_MAX buffers */
  for (;;) {
    int fd = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOMEM) usleep(50000);
      continue;
    }
    pthread_mutex_lock(&conns_lock);
    int busy = conns >= MAX_CONNS;
    if (!busy) conns++;
    pthread_mutex_unlock(&conns_lock);
    struct conn *c = busy ? NULL : calloc(1, sizeof *c);
    if (!c) {
      if (!busy) {
        pthread_mutex_lock(&conns_lock);
        conns--;
        pthread_mutex_unlock(&conns_lock);
      }
      close(fd);
      continue;
    }
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->fd = fd;
    pthread_mutex_init(&c->wlock, NULL);
    if (pthread_create(&t, &attr, serve_conn, c) != 0) {
      close(fd);
      pthread_mutex_destroy(&c->wlock);
      free(c);
      pthread_mutex_lock(&conns_lock);
      conns--;
      pthread_mutex_unlock(&conns_lock);
    }
  }
}
