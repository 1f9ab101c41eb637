/*
 * Compiled (never run) by the native test where /usr/local/cuda/include/cuda.h exists: fails
 * to compile if dormant-cuda-ckpt's own declarations disagree with NVIDIA's header.
 */
#include <stddef.h>
#include <cuda.h>
#include "cuda-ckpt.h"

#define SAME_SIZE(a, b) _Static_assert(sizeof(a) == sizeof(b), "size of " #a " differs from " #b)
#define SAME_FIELD(a, b, f) \
  _Static_assert(offsetof(a, f) == offsetof(b, f), "offset of " #f " in " #a " differs from " #b)

SAME_SIZE(dc_result, CUresult);
SAME_SIZE(dc_device, CUdevice);
SAME_SIZE(dc_uuid, CUuuid);
SAME_SIZE(dc_process_state, CUprocessState);
_Static_assert((int)DC_PROCESS_STATE_RUNNING == (int)CU_PROCESS_STATE_RUNNING, "RUNNING");
_Static_assert((int)DC_PROCESS_STATE_LOCKED == (int)CU_PROCESS_STATE_LOCKED, "LOCKED");
_Static_assert((int)DC_PROCESS_STATE_CHECKPOINTED == (int)CU_PROCESS_STATE_CHECKPOINTED, "CHECKPOINTED");
_Static_assert((int)DC_PROCESS_STATE_FAILED == (int)CU_PROCESS_STATE_FAILED, "FAILED");
SAME_SIZE(dc_lock_args, CUcheckpointLockArgs);
SAME_FIELD(dc_lock_args, CUcheckpointLockArgs, timeoutMs);
SAME_FIELD(dc_lock_args, CUcheckpointLockArgs, reserved0);
SAME_FIELD(dc_lock_args, CUcheckpointLockArgs, reserved1);
SAME_SIZE(dc_checkpoint_args, CUcheckpointCheckpointArgs);
SAME_SIZE(dc_unlock_args, CUcheckpointUnlockArgs);
SAME_SIZE(dc_restore_args, CUcheckpointRestoreArgs);
#if CUDA_VERSION >= 12090
SAME_SIZE(dc_gpu_pair, CUcheckpointGpuPair);
SAME_FIELD(dc_restore_args, CUcheckpointRestoreArgs, gpuPairs);
SAME_FIELD(dc_restore_args, CUcheckpointRestoreArgs, gpuPairsCount);
SAME_FIELD(dc_restore_args, CUcheckpointRestoreArgs, reserved1);
#endif

/* The function types the helper looks up with dlsym, against the header's prototypes. */
#define SAME_FN(name, type) _Static_assert(__builtin_types_compatible_p(__typeof__(&name), type), #name)
SAME_FN(cuCheckpointProcessLock, CUresult (*)(int, CUcheckpointLockArgs *));
SAME_FN(cuCheckpointProcessCheckpoint, CUresult (*)(int, CUcheckpointCheckpointArgs *));
SAME_FN(cuCheckpointProcessRestore, CUresult (*)(int, CUcheckpointRestoreArgs *));
SAME_FN(cuCheckpointProcessUnlock, CUresult (*)(int, CUcheckpointUnlockArgs *));
SAME_FN(cuCheckpointProcessGetState, CUresult (*)(int, CUprocessState *));
SAME_FN(cuCheckpointProcessGetRestoreThreadId, CUresult (*)(int, int *));
SAME_FN(cuDriverGetVersion, CUresult (*)(int *));
SAME_FN(cuDeviceGetName, CUresult (*)(char *, int, CUdevice));
SAME_FN(cuDeviceTotalMem_v2, CUresult (*)(size_t *, CUdevice));
SAME_FN(cuDeviceGet, CUresult (*)(CUdevice *, int));
SAME_FN(cuInit, CUresult (*)(unsigned int));
