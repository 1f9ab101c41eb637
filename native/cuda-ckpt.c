/*
 * dormant-cuda-ckpt: moves a process's CUDA state out of the GPU and back, through the CUDA
 * driver's checkpoint API (cuCheckpointProcess*, driver 570 and newer).
 *
 * libcuda.so.1 is opened at run time, so this builds on any machine and, on one without an
 * NVIDIA driver, says so and exits 2. The few types and functions used are declared here;
 * native/abi-check.c compares them with cuda.h where that header is installed.
 *
 *   dormant-cuda-ckpt info                 JSON: driver version, devices (name, memory, uuid)
 *   dormant-cuda-ckpt state PID            JSON: running | locked | checkpointed | failed
 *   dormant-cuda-ckpt lock PID [TIMEOUT_MS]
 *   dormant-cuda-ckpt checkpoint PID       device memory -> host memory, GPU handles released
 *   dormant-cuda-ckpt restore PID          host memory -> device memory
 *   dormant-cuda-ckpt unlock PID
 *   dormant-cuda-ckpt restore-tid PID      the thread the driver restores through
 *
 * Exit status: 0 done; 1 the driver refused (the CUDA error name is printed); 2 no usable
 * driver here; 64 usage error. Errors go to stderr as one line of JSON: {"error":"...","code":"..."}.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda-ckpt.h"

static struct {
  dc_result (*cuInit)(unsigned int);
  dc_result (*cuDriverGetVersion)(int *);
  dc_result (*cuDeviceGetCount)(int *);
  dc_result (*cuDeviceGet)(dc_device *, int);
  dc_result (*cuDeviceGetName)(char *, int, dc_device);
  dc_result (*cuDeviceTotalMem)(size_t *, dc_device);
  dc_result (*cuDeviceGetUuid)(dc_uuid *, dc_device);
  dc_result (*cuGetErrorName)(dc_result, const char **);
  dc_result (*cuCheckpointProcessGetRestoreThreadId)(int, int *);
  dc_result (*cuCheckpointProcessGetState)(int, dc_process_state *);
  dc_result (*cuCheckpointProcessLock)(int, dc_lock_args *);
  dc_result (*cuCheckpointProcessCheckpoint)(int, dc_checkpoint_args *);
  dc_result (*cuCheckpointProcessRestore)(int, dc_restore_args *);
  dc_result (*cuCheckpointProcessUnlock)(int, dc_unlock_args *);
} cu;

static void json_string(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\')
      fprintf(f, "\\%c", c);
    else if (c < 0x20)
      fprintf(f, "\\u%04x", c);
    else
      fputc(c, f);
  }
  fputc('"', f);
}

static int fail(int status, const char *code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(int status, const char *code, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fputs("{\"error\":", stderr);
  json_string(stderr, msg);
  fputs(",\"code\":", stderr);
  json_string(stderr, code);
  fputs("}\n", stderr);
  return status;
}

static const char *error_name(dc_result r) {
  const char *name = NULL;
  if (cu.cuGetErrorName && cu.cuGetErrorName(r, &name) == 0 && name) return name;
  static char buf[32];
  snprintf(buf, sizeof buf, "CUresult %d", (int)r);
  return buf;
}

/* Opens the driver library and finds every symbol; 0 when done, else an exit status. */
static int load(int need_checkpoint_api) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *why = dlerror();
    return fail(2, "NO_DRIVER", "no NVIDIA driver on this machine: libcuda.so.1 cannot be loaded (%s)",
                why ? why : "not found");
  }
#define SYM(field, name, required)                                                                      \
  do {                                                                                                 \
    *(void **)&cu.field = dlsym(h, name);                                                              \
    if (!cu.field && (required))                                                                       \
      return fail(2, "NO_SYMBOL", "libcuda.so.1 has no %s%s", name,                                    \
                  strncmp(name, "cuCheckpoint", 12) == 0 ? " (the checkpoint API needs driver 570 or newer)" \
                                                         : "");                                        \
  } while (0)
  SYM(cuGetErrorName, "cuGetErrorName", 0);
  SYM(cuInit, "cuInit", 1);
  SYM(cuDriverGetVersion, "cuDriverGetVersion", 1);
  SYM(cuDeviceGetCount, "cuDeviceGetCount", 1);
  SYM(cuDeviceGet, "cuDeviceGet", 1);
  SYM(cuDeviceGetName, "cuDeviceGetName", 1);
  /* cuda.h maps cuDeviceTotalMem to the _v2 entry point (size_t bytes). */
  SYM(cuDeviceTotalMem, "cuDeviceTotalMem_v2", 1);
  SYM(cuDeviceGetUuid, "cuDeviceGetUuid", 0);
  SYM(cuCheckpointProcessGetRestoreThreadId, "cuCheckpointProcessGetRestoreThreadId", need_checkpoint_api);
  SYM(cuCheckpointProcessGetState, "cuCheckpointProcessGetState", need_checkpoint_api);
  SYM(cuCheckpointProcessLock, "cuCheckpointProcessLock", need_checkpoint_api);
  SYM(cuCheckpointProcessCheckpoint, "cuCheckpointProcessCheckpoint", need_checkpoint_api);
  SYM(cuCheckpointProcessRestore, "cuCheckpointProcessRestore", need_checkpoint_api);
  SYM(cuCheckpointProcessUnlock, "cuCheckpointProcessUnlock", need_checkpoint_api);
#undef SYM
  dc_result r = cu.cuInit(0);
  if (r != 0)
    return fail(2, error_name(r), "the NVIDIA driver is installed but cuInit failed: %s", error_name(r));
  return 0;
}

static int info(void) {
  int st = load(0);
  if (st) return st;
  int version = 0, count = 0;
  dc_result r = cu.cuDriverGetVersion(&version);
  if (r != 0) return fail(1, error_name(r), "cuDriverGetVersion failed: %s", error_name(r));
  r = cu.cuDeviceGetCount(&count);
  if (r != 0) return fail(1, error_name(r), "cuDeviceGetCount failed: %s", error_name(r));
  printf("{\"driverApiVersion\":%d,\"checkpointApi\":%s,\"devices\":[", version,
         cu.cuCheckpointProcessLock && cu.cuCheckpointProcessCheckpoint && cu.cuCheckpointProcessRestore &&
                 cu.cuCheckpointProcessUnlock
             ? "true"
             : "false");
  for (int i = 0; i < count; i++) {
    dc_device dev;
    char name[256] = "";
    size_t bytes = 0;
    if ((r = cu.cuDeviceGet(&dev, i)) != 0) return fail(1, error_name(r), "cuDeviceGet(%d): %s", i, error_name(r));
    if ((r = cu.cuDeviceGetName(name, (int)sizeof name, dev)) != 0)
      return fail(1, error_name(r), "cuDeviceGetName(%d): %s", i, error_name(r));
    if ((r = cu.cuDeviceTotalMem(&bytes, dev)) != 0)
      return fail(1, error_name(r), "cuDeviceTotalMem(%d): %s", i, error_name(r));
    printf("%s{\"index\":%d,\"name\":", i ? "," : "", i);
    json_string(stdout, name);
    printf(",\"memoryBytes\":%zu", bytes);
    dc_uuid u;
    if (cu.cuDeviceGetUuid && cu.cuDeviceGetUuid(&u, dev) == 0) {
      printf(",\"uuid\":\"GPU-");
      for (int k = 0; k < 16; k++)
        printf("%s%02x", (k == 4 || k == 6 || k == 8 || k == 10) ? "-" : "", (unsigned char)u.bytes[k]);
      printf("\"");
    }
    printf("}");
  }
  printf("]}\n");
  return 0;
}

static int parse_int(const char *s, const char *what, long max, long *out) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < 0 || v > max) return fail(64, "USAGE", "invalid %s: %s", what, s);
  *out = v;
  return 0;
}

static const char *state_name(dc_process_state s) {
  switch (s) {
    case DC_PROCESS_STATE_RUNNING: return "running";
    case DC_PROCESS_STATE_LOCKED: return "locked";
    case DC_PROCESS_STATE_CHECKPOINTED: return "checkpointed";
    case DC_PROCESS_STATE_FAILED: return "failed";
  }
  return "unknown";
}

static int usage(void) {
  fprintf(stderr,
          "usage: dormant-cuda-ckpt info | state PID | lock PID [TIMEOUT_MS] | checkpoint PID | restore PID | "
          "unlock PID | restore-tid PID\n");
  return 64;
}

int main(int argc, char **argv) {
  if (argc < 2) return usage();
  const char *cmd = argv[1];
  if (strcmp(cmd, "info") == 0) return argc == 2 ? info() : usage();
  if (argc < 3) return usage();
  long pid, timeout = 0;
  int st = parse_int(argv[2], "PID", 0x7fffffff, &pid);
  if (st) return st;
  if (pid == 0) return fail(64, "USAGE", "invalid PID: 0");
  if (strcmp(cmd, "lock") == 0 && argc == 4) {
    if ((st = parse_int(argv[3], "timeout (ms)", 0xffffffffL, &timeout))) return st;
  } else if (argc != 3) {
    return usage();
  }
  if (strcmp(cmd, "state") && strcmp(cmd, "lock") && strcmp(cmd, "checkpoint") && strcmp(cmd, "restore") &&
      strcmp(cmd, "unlock") && strcmp(cmd, "restore-tid"))
    return usage();
  if ((st = load(1))) return st;
  dc_result r;
  const char *step = cmd;
  if (strcmp(cmd, "state") == 0) {
    dc_process_state s;
    if ((r = cu.cuCheckpointProcessGetState((int)pid, &s)) == 0) {
      printf("{\"pid\":%ld,\"state\":\"%s\"}\n", pid, state_name(s));
      return 0;
    }
  } else if (strcmp(cmd, "restore-tid") == 0) {
    int tid = 0;
    if ((r = cu.cuCheckpointProcessGetRestoreThreadId((int)pid, &tid)) == 0) {
      printf("{\"pid\":%ld,\"tid\":%d}\n", pid, tid);
      return 0;
    }
  } else if (strcmp(cmd, "lock") == 0) {
    dc_lock_args a;
    memset(&a, 0, sizeof a);
    a.timeoutMs = (unsigned int)timeout;
    r = cu.cuCheckpointProcessLock((int)pid, &a);
  } else if (strcmp(cmd, "checkpoint") == 0) {
    dc_checkpoint_args a;
    memset(&a, 0, sizeof a);
    r = cu.cuCheckpointProcessCheckpoint((int)pid, &a);
  } else if (strcmp(cmd, "restore") == 0) {
    dc_restore_args a;
    memset(&a, 0, sizeof a);
    r = cu.cuCheckpointProcessRestore((int)pid, &a);
  } else {
    dc_unlock_args a;
    memset(&a, 0, sizeof a);
    r = cu.cuCheckpointProcessUnlock((int)pid, &a);
  }
  if (r != 0) return fail(1, error_name(r), "%s of process %ld failed: %s", step, pid, error_name(r));
  printf("{\"pid\":%ld,\"done\":\"%s\"}\n", pid, step);
  return 0;
}
