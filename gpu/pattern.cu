// The device check's test program: holds a known pattern in N GiB of GPU memory and keeps
// computing on the GPU, so a checkpoint/restore can be seen to keep both.
//
//   pattern GIB DIR
//
// DIR/status is rewritten every ~50 ms: "ready BYTES ticks T counter C" (C is a counter in
// device memory that a kernel increments each tick). On SIGUSR1 it checks every word of the
// buffer and writes DIR/verify: "verify mismatches M counter C ticks T". Files are opened per
// write and stdio should be /dev/null, so the process holds no file a restore must reopen.
#include <cuda_runtime.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

__device__ __forceinline__ uint32_t expected(uint64_t i) {
  return (uint32_t)(i * 2654435761ull) ^ 0xA5A5A5A5u ^ (uint32_t)(i >> 32);
}

__global__ void fill(uint32_t *p, uint64_t n) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
    p[i] = expected(i);
}

__global__ void check(const uint32_t *p, uint64_t n, unsigned long long *bad) {
  unsigned long long mine = 0;
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
    if (p[i] != expected(i)) mine++;
  if (mine) atomicAdd(bad, mine);
}

__global__ void tick(unsigned long long *counter) { counter[0] += 1; }

static volatile sig_atomic_t want_verify = 0;
static void on_usr1(int) { want_verify = 1; }

static void die(const char *what, cudaError_t e) {
  fprintf(stderr, "pattern: %s: %s\n", what, cudaGetErrorString(e));
  exit(1);
}
#define CK(x)                    \
  do {                           \
    cudaError_t e_ = (x);        \
    if (e_ != cudaSuccess) die(#x, e_); \
  } while (0)

static void put(const char *dir, const char *name, const char *text) {
  char path[4096], tmp[4200];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "w");
  if (!f) return;
  fputs(text, f);
  fclose(f);
  rename(tmp, path);
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: pattern GIB DIR\n");
    return 64;
  }
  double gib = atof(argv[1]);
  const char *dir = argv[2];
  uint64_t bytes = (uint64_t)(gib * 1024.0 * 1024.0 * 1024.0);
  uint64_t n = bytes / 4;
  signal(SIGUSR1, on_usr1);
  CK(cudaSetDevice(0));
  uint32_t *buf;
  unsigned long long *counter, *bad;
  CK(cudaMalloc(&buf, n * 4));
  CK(cudaMalloc(&counter, sizeof *counter));
  CK(cudaMalloc(&bad, sizeof *bad));
  CK(cudaMemset(counter, 0, sizeof *counter));
  fill<<<4096, 256>>>(buf, n);
  CK(cudaDeviceSynchronize());
  char line[256];
  for (unsigned long long t = 1;; t++) {
    tick<<<1, 1>>>(counter);
    unsigned long long c = 0;
    CK(cudaMemcpy(&c, counter, sizeof c, cudaMemcpyDeviceToHost));
    snprintf(line, sizeof line, "ready %llu ticks %llu counter %llu\n", (unsigned long long)bytes, t, c);
    put(dir, "status", line);
    if (want_verify) {
      want_verify = 0;
      unsigned long long m = 0;
      CK(cudaMemset(bad, 0, sizeof *bad));
      check<<<4096, 256>>>(buf, n, bad);
      CK(cudaMemcpy(&m, bad, sizeof m, cudaMemcpyDeviceToHost));
      snprintf(line, sizeof line, "verify mismatches %llu counter %llu ticks %llu\n", m, c, t);
      put(dir, "verify", line);
    }
    usleep(50 * 1000);
  }
}
