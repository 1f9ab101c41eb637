#!/usr/bin/env bash
# Assembles gpu-kit/ (git-ignored), everything scripts/gpu/device-check.sh needs on a GPU
# machine that has no CRIU, no compiler and no network:
#   gpu-kit/bin/dormant-cuda-ckpt  the project's CUDA checkpoint helper (native/cuda-ckpt.c)
#   gpu-kit/bin/pattern            the CUDA test program (gpu/pattern.cu, cudart linked statically)
#   gpu-kit/criu/                  CRIU 4.2.1 with its own loader and libraries (/opt/dormant/criu)
# Carry it with the working tree (the device tool's carry: ["gpu-kit"]); it must stay under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
KIT=gpu-kit
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
CRIU_PREFIX=${CRIU_PREFIX:-/opt/dormant/criu}
[ -x "$NVCC" ] || { echo "prepare: no nvcc at $NVCC (set NVCC)" >&2; exit 1; }
[ -x "$CRIU_PREFIX/usr/sbin/criu" ] || { echo "prepare: no CRIU in $CRIU_PREFIX (run scripts/setup.sh)" >&2; exit 1; }
rm -rf "$KIT"
mkdir -p "$KIT/bin"
bash scripts/build-native.sh "$KIT/bin"
# sm_90 is the H100/H200; the PTX lets newer GPUs JIT it. cudart is static: nothing to install.
"$NVCC" -O2 -cudart static -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90 \
  -o "$KIT/bin/pattern" gpu/pattern.cu
cp -a "$CRIU_PREFIX" "$KIT/criu"
# Only what criu needs to run: its loader, libraries and binary (checkpointctl and docs stay here).
rm -rf "$KIT/criu/usr/share" "$KIT/criu/usr/bin/checkpointctl"
"$NVCC" --version | tail -1 >"$KIT/BUILT-WITH"
size=$(du -sm "$KIT" | cut -f1)
echo "prepare: $KIT is ${size} MiB"
[ "$size" -lt 64 ] || { echo "prepare: $KIT is over 64 MiB; it cannot be carried" >&2; exit 1; }
