/*
 * dormant-agent: the toolbox agent that runs inside a sandbox (docs/ARCHITECTURE.md, "The
 * toolbox agent"). It serves commands, PTYs and files over a small framed protocol on TCP.
 *
 * Files: main.c (start, install, listen, dispatch), wire.c (frames, requests, JSON text),
 * procs.c (the process table, run/attach and friends), files.c (file ops and watch).
 */
#ifndef DORMANT_AGENT_H
#define DORMANT_AGENT_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define AGENT_VERSION 1
#define MAX_FRAME (1u << 20)     /* largest payload either side accepts */
#define MAX_FIELDS 4096          /* fields in one request */
#define RING_BYTES (4u << 20)    /* output kept per process for attach */
#define DATA_CHUNK (256u << 10)  /* file data frames */

/* ---- wire.c: frames ---- */

struct conn {
  int fd;
  pthread_mutex_t wlock; /* a follower and its input thread may both write (errors) */
};

/* Reads one frame; returns 0, or -1 on EOF/error, -2 when the frame is too big (then an E2BIG
 * error has been sent). The payload is malloc'd (caller frees) and NUL-terminated. */
int read_frame(struct conn *c, char *type, char **payload, uint32_t *len);
int send_frame(struct conn *c, char type, const void *data, size_t len);
/* Sends `!` {"code","message"}; the caller then closes. */
void send_error(struct conn *c, const char *code, const char *message);
/* Sends an error named after errno (ENOENT, EACCES, ...). */
void send_errno(struct conn *c, int err, const char *what);
const char *errno_code(int err);

/* ---- wire.c: requests ---- */

struct request {
  char *buf;    /* the Q payload; fields point into it */
  char **fields;
  size_t nfields; /* fields[0] = token, fields[1] = op, then key=value */
};

int parse_request(char *payload, uint32_t len, struct request *rq);
/* The value of the first `key=` field, or NULL. */
const char *req_get(const struct request *rq, const char *key);
/* Every value of `key=` in order; returns the count, fills up to max. */
size_t req_all(const struct request *rq, const char *key, const char **out, size_t max);

/* ---- wire.c: growable text for JSON results ---- */

struct sb {
  char *p;
  size_t len, cap;
  int oom;
};

void sb_init(struct sb *b);
void sb_free(struct sb *b);
void sb_raw(struct sb *b, const char *s, size_t n);
void sb_str(struct sb *b, const char *s); /* raw text */
void sb_fmt(struct sb *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void sb_json(struct sb *b, const char *s); /* a quoted, escaped JSON string */
void sb_jsonn(struct sb *b, const char *s, size_t n);
int send_sb(struct conn *c, char type, struct sb *b); /* sends and frees */

int64_t now_ms(void);      /* wall clock, for startedAt */
int64_t mono_ms(void);     /* monotonic, for durations and deadlines */

/* ---- procs.c ---- */

void procs_init(void);
void procs_kill_all(void);
void op_run(struct conn *c, const struct request *rq);
void op_attach(struct conn *c, const struct request *rq);
void op_list(struct conn *c, const struct request *rq);
void op_signal(struct conn *c, const struct request *rq);
void op_stdin(struct conn *c, const struct request *rq);
void op_resize(struct conn *c, const struct request *rq);

/* ---- files.c ---- */

void op_stat(struct conn *c, const struct request *rq);
void op_ls(struct conn *c, const struct request *rq);
void op_read(struct conn *c, const struct request *rq);
void op_write(struct conn *c, const struct request *rq);
void op_mkdir(struct conn *c, const struct request *rq);
void op_remove(struct conn *c, const struct request *rq);
void op_rename(struct conn *c, const struct request *rq);
void op_watch(struct conn *c, const struct request *rq);
/* Creates every missing folder above path (0755). Returns 0 or -1 with errno. */
int make_parents(const char *path);

#endif
