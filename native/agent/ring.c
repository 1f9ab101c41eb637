/*
 * A command's output ring: the last RING_BYTES bytes it wrote, stdout and stderr interleaved,
 * as pieces (chunks) that each carry their type and their offset in the whole output. The
 * pieces sit in a circular array; a piece grows while the same stream keeps writing, up to
 * CHUNK_MAX. The caller (procs.c) holds the lock that guards it.
 */
#define _GNU_SOURCE
#include "agent.h"

#include <stdlib.h>
#include <string.h>

#define MAX_CHUNKS 65536 /* bounds the bookkeeping for tiny interleaved writes */

static void drop_front(struct ring *p) {
  struct chunk *k = &p->v[p->head];
  p->kept -= k->len;
  free(k->data);
  p->head = (p->head + 1) % p->cap;
  p->count--;
}

static int new_chunk(struct ring *p, char type) {
  if (p->count == MAX_CHUNKS) drop_front(p);
  if (p->count == p->cap) {
    size_t cap = p->cap ? p->cap * 2 : 16;
    struct chunk *r = malloc(cap * sizeof *r);
    if (!r) return -1;
    for (size_t i = 0; i < p->count; i++) r[i] = p->v[(p->head + i) % p->cap];
    free(p->v);
    p->v = r;
    p->cap = cap;
    p->head = 0;
  }
  struct chunk *k = &p->v[(p->head + p->count) % p->cap];
  *k = (struct chunk){.start = p->end, .type = type};
  p->count++;
  return 0;
}

void ring_append(struct ring *p, char type, const char *data, size_t n) {
  while (n > 0) {
    struct chunk *k = p->count ? &p->v[(p->head + p->count - 1) % p->cap] : NULL;
    if (!k || k->type != type || k->len == CHUNK_MAX) {
      if (new_chunk(p, type) < 0) return;
      k = &p->v[(p->head + p->count - 1) % p->cap];
    }
    size_t take = n < CHUNK_MAX - k->len ? n : CHUNK_MAX - k->len;
    if (k->len + take > k->cap) {
      size_t cap = k->cap ? k->cap * 2 : 256;
      while (cap < k->len + take) cap *= 2;
      if (cap > CHUNK_MAX) cap = CHUNK_MAX;
      char *d = realloc(k->data, cap);
      if (!d) return;
      k->data = d;
      k->cap = (uint32_t)cap;
    }
    memcpy(k->data + k->len, data, take);
    k->len += (uint32_t)take;
    p->end += take;
    p->kept += take;
    data += take;
    n -= take;
    while (p->kept > RING_BYTES && p->count > 1) drop_front(p);
  }
}

uint64_t ring_first(const struct ring *p) { return p->count ? p->v[p->head].start : p->end; }

/* Copies the piece of output at pos (pos must be in [ring_first, end)). */
size_t ring_read(const struct ring *p, uint64_t pos, char *buf, char *type) {
  size_t lo = 0, hi = p->count; /* the last chunk starting at or before pos */
  while (hi - lo > 1) {
    size_t mid = (lo + hi) / 2;
    if (p->v[(p->head + mid) % p->cap].start <= pos)
      lo = mid;
    else
      hi = mid;
  }
  const struct chunk *k = &p->v[(p->head + lo) % p->cap];
  size_t n = k->len - (size_t)(pos - k->start);
  memcpy(buf, k->data + (pos - k->start), n);
  *type = k->type;
  return n;
}

void ring_free(struct ring *p) {
  for (size_t i = 0; i < p->count; i++) free(p->v[(p->head + i) % p->cap].data);
  free(p->v);
  memset(p, 0, sizeof *p);
}
