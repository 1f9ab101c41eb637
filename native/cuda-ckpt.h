/*
 * The part of the CUDA driver API that dormant-cuda-ckpt calls, declared here so the helper
 * builds without the CUDA toolkit. The layouts follow cuda.h (CUDA 12.8+/13); abi-check.c
 * asserts, where cuda.h is installed, that they agree with it.
 */
#ifndef DORMANT_CUDA_CKPT_H
#define DORMANT_CUDA_CKPT_H
#include <stdint.h>

typedef int dc_result;  /* CUresult: 0 is CUDA_SUCCESS */
typedef int dc_device;  /* CUdevice: an ordinal */

typedef struct {
  char bytes[16];
} dc_uuid; /* CUuuid */

typedef enum {
  DC_PROCESS_STATE_RUNNING = 0,
  DC_PROCESS_STATE_LOCKED = 1,
  DC_PROCESS_STATE_CHECKPOINTED = 2,
  DC_PROCESS_STATE_FAILED = 3,
} dc_process_state; /* CUprocessState */

typedef struct {
  unsigned int timeoutMs; /* 0: wait without limit */
  unsigned int reserved0;
  uint64_t reserved1[7];
} dc_lock_args; /* CUcheckpointLockArgs */

typedef struct {
  uint64_t reserved[8];
} dc_checkpoint_args; /* CUcheckpointCheckpointArgs */

typedef struct {
  dc_uuid oldUuid;
  dc_uuid newUuid;
} dc_gpu_pair; /* CUcheckpointGpuPair */

typedef struct {
  dc_gpu_pair *gpuPairs; /* NULL: restore onto the same GPUs */
  unsigned int gpuPairsCount;
  char reserved[52 - sizeof(dc_gpu_pair *)];
  uint64_t reserved1;
} dc_restore_args; /* CUcheckpointRestoreArgs (all zero: restore in place) */

typedef struct {
  uint64_t reserved[8];
} dc_unlock_args; /* CUcheckpointUnlockArgs */

#endif
