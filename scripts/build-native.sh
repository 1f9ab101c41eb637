#!/usr/bin/env bash
# Builds dormant's native helpers into build/native/ (git-ignored):
#   dormant-cuda-ckpt  moves a process's CUDA state out of the GPU and back (docs/GPU.md).
# It needs only gcc and libc: libcuda is opened at run time, so the helper builds and runs on
# machines without an NVIDIA driver (and says so). Without gcc this warns and skips: the rest of
# dormant works without the helper; GPU sandboxes with the checkpoint policy are then refused.
# Usage: scripts/build-native.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/native}
cc=${CC:-gcc}
if ! command -v "$cc" >/dev/null 2>&1; then
  echo "build-native: no C compiler ($cc); dormant-cuda-ckpt not built" >&2
  exit 0
fi
mkdir -p "$out"
src=native/cuda-ckpt.c
bin="$out/dormant-cuda-ckpt"
if [ ! -x "$bin" ] || [ "$src" -nt "$bin" ] || [ native/cuda-ckpt.h -nt "$bin" ]; then
  "$cc" -O2 -Wall -Wextra -Werror -o "$bin.tmp.$$" "$src" -ldl
  mv "$bin.tmp.$$" "$bin"
fi
