/*
 * The agent's wire format: frames (1 byte type, 4 bytes big-endian length, payload), the `Q`
 * request's NUL-separated fields, and the JSON text of results. Everything read here comes
 * from the network and is bounded: a frame is at most MAX_FRAME bytes, a request at most
 * MAX_FIELDS fields.
 */
#define _GNU_SOURCE
#include "agent.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static int read_full(int fd, void *buf, size_t n) {
  char *p = buf;
  while (n > 0) {
    ssize_t r = read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    p += r;
    n -= (size_t)r;
  }
  return 0;
}

static int write_full(int fd, const void *buf, size_t n) {
  const char *p = buf;
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

int read_frame(struct conn *c, char *type, char **payload, uint32_t *len) {
  unsigned char h[5];
  if (read_full(c->fd, h, 5) < 0) return -1;
  uint32_t n = ((uint32_t)h[1] << 24) | ((uint32_t)h[2] << 16) | ((uint32_t)h[3] << 8) | h[4];
  if (n > MAX_FRAME) {
    send_error(c, "E2BIG", "frame larger than 1 MiB");
    return -2;
  }
  char *p = malloc(n + 1);
  if (!p) return -1;
  if (read_full(c->fd, p, n) < 0) {
    free(p);
    return -1;
  }
  p[n] = 0;
  *type = (char)h[0];
  *payload = p;
  *len = n;
  return 0;
}

int send_frame(struct conn *c, char type, const void *data, size_t len) {
  if (len > MAX_FRAME) return -1;
  unsigned char h[5] = {(unsigned char)type, (unsigned char)(len >> 24), (unsigned char)(len >> 16),
                        (unsigned char)(len >> 8), (unsigned char)len};
  pthread_mutex_lock(&c->wlock);
  int r = write_full(c->fd, h, 5);
  if (r == 0 && len > 0) r = write_full(c->fd, data, len);
  pthread_mutex_unlock(&c->wlock);
  return r;
}

void send_error(struct conn *c, const char *code, const char *message) {
  struct sb b;
  sb_init(&b);
  sb_str(&b, "{\"code\":");
  sb_json(&b, code);
  sb_str(&b, ",\"message\":");
  sb_json(&b, message);
  sb_str(&b, "}");
  send_sb(c, '!', &b);
}

const char *errno_code(int err) {
  switch (err) {
  case ENOENT: return "ENOENT";
  case EACCES: return "EACCES";
  case EPERM: return "EPERM";
  case EEXIST: return "EEXIST";
  case ENOTDIR: return "ENOTDIR";
  case EISDIR: return "EISDIR";
  case ENOTEMPTY: return "ENOTEMPTY";
  case EINVAL: return "EINVAL";
  case ESRCH: return "ESRCH";
  case E2BIG: return "E2BIG";
  case EROFS: return "EROFS";
  case ENOSPC: return "ENOSPC";
  case EDQUOT: return "EDQUOT";
  case EXDEV: return "EXDEV";
  case ELOOP: return "ELOOP";
  case ENAMETOOLONG: return "ENAMETOOLONG";
  case EBUSY: return "EBUSY";
  case ENOMEM: return "ENOMEM";
  case EMFILE: return "EMFILE";
  case ETXTBSY: return "ETXTBSY";
  case ENOEXEC: return "ENOEXEC";
  default: return "EIO";
  }
}

void send_errno(struct conn *c, int err, const char *what) {
  char msg[512];
  snprintf(msg, sizeof msg, "%s: %s", what, strerror(err));
  send_error(c, errno_code(err), msg);
}

int parse_request(char *payload, uint32_t len, struct request *rq) {
  size_t n = 1;
  for (uint32_t i = 0; i < len; i++)
    if (payload[i] == 0) n++;
  /* A trailing NUL ends the last field rather than starting an empty one. */
  if (len > 0 && payload[len - 1] == 0) n--;
  if (n > MAX_FIELDS || n < 2) return -1;
  rq->fields = calloc(n, sizeof(char *));
  if (!rq->fields) return -1;
  rq->buf = payload;
  rq->nfields = n;
  char *p = payload;
  for (size_t i = 0; i < n; i++) {
    rq->fields[i] = p;
    p += strlen(p) + 1;
  }
  return 0;
}

const char *req_get(const struct request *rq, const char *key) {
  size_t k = strlen(key);
  for (size_t i = 2; i < rq->nfields; i++)
    if (strncmp(rq->fields[i], key, k) == 0 && rq->fields[i][k] == '=') return rq->fields[i] + k + 1;
  return NULL;
}

size_t req_all(const struct request *rq, const char *key, const char **out, size_t max) {
  size_t k = strlen(key), n = 0;
  for (size_t i = 2; i < rq->nfields; i++)
    if (strncmp(rq->fields[i], key, k) == 0 && rq->fields[i][k] == '=') {
      if (n < max) out[n] = rq->fields[i] + k + 1;
      n++;
    }
  return n;
}

void sb_init(struct sb *b) {
  b->p = NULL;
  b->len = b->cap = 0;
  b->oom = 0;
}

void sb_free(struct sb *b) {
  free(b->p);
  sb_init(b);
}

void sb_raw(struct sb *b, const char *s, size_t n) {
  if (b->oom) return;
  if (b->len + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + n + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
      b->oom = 1;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
  memcpy(b->p + b->len, s, n);
  b->len += n;
  b->p[b->len] = 0;
}

void sb_str(struct sb *b, const char *s) { sb_raw(b, s, strlen(s)); }

void sb_fmt(struct sb *b, const char *fmt, ...) {
  char tmp[256];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  if (n > 0) sb_raw(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

/* Bytes >= 0x80 pass through as they are: names are usually UTF-8, and the client decodes
 * invalid sequences as U+FFFD rather than failing. Control characters are escaped. */
void sb_jsonn(struct sb *b, const char *s, size_t n) {
  sb_raw(b, "\"", 1);
  size_t run = 0;
  for (size_t i = 0; i < n; i++) {
    unsigned char ch = (unsigned char)s[i];
    if (ch >= 0x20 && ch != '"' && ch != '\\') {
      run++;
      continue;
    }
    sb_raw(b, s + i - run, run);
    run = 0;
    char esc[8];
    if (ch == '"' || ch == '\\') {
      esc[0] = '\\';
      esc[1] = (char)ch;
      sb_raw(b, esc, 2);
    } else {
      snprintf(esc, sizeof esc, "\\u%04x", ch);
      sb_raw(b, esc, 6);
    }
  }
  sb_raw(b, s + n - run, run);
  sb_raw(b, "\"", 1);
}

void sb_json(struct sb *b, const char *s) { sb_jsonn(b, s, strlen(s)); }

int send_sb(struct conn *c, char type, struct sb *b) {
  int r = -1;
  if (!b->oom && b->len <= MAX_FRAME) r = send_frame(c, type, b->p ? b->p : "", b->len);
  sb_free(b);
  return r;
}

int64_t now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

int64_t mono_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}
