#!/usr/bin/env bash
# Builds dormant's native helpers into build/native/ (git-ignored):
#   dormant-cuda-ckpt  moves a process's CUDA state out of the GPU and back (docs/GPU.md).
#   dormant-agent      the toolbox agent started inside each sandbox (native/agent/, docs/ARCHITECTURE.md).
#   dormant-idmap-mount  a sandbox's shared root filesystem idmapped into its user namespace
#                        (native/idmap-mount.c, docs/SECURITY.md); user namespaces need it.
# They need only gcc and libc. The cuda helper opens libcuda at run time, so it builds and runs
# on machines without an NVIDIA driver (and says so). The agent is linked statically: it runs
# inside sandboxes whose root filesystem may have no libc at all (or another one). Without gcc
# this warns and skips: the rest of dormant works without them; GPU sandboxes with the
# checkpoint policy and the toolbox routes are then refused.
# Usage: scripts/build-native.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/native}
cc=${CC:-gcc}
if ! command -v "$cc" >/dev/null 2>&1; then
  echo "build-native: no C compiler ($cc); dormant-cuda-ckpt and dormant-agent not built" >&2
  exit 0
fi
mkdir -p "$out"
# stale BIN SOURCES...: true when BIN is missing or older than any of its sources
stale() {
  local bin=$1 src
  shift
  [ -x "$bin" ] || return 0
  for src in "$@"; do [ "$src" -nt "$bin" ] && return 0; done
  return 1
}
bin="$out/dormant-cuda-ckpt"
if stale "$bin" native/cuda-ckpt.c native/cuda-ckpt.h; then
  "$cc" -O2 -Wall -Wextra -Werror -o "$bin.tmp.$$" native/cuda-ckpt.c -ldl
  mv "$bin.tmp.$$" "$bin"
fi
bin="$out/dormant-agent"
agent_src=(native/agent/*.c)
if stale "$bin" "${agent_src[@]}" native/agent/agent.h; then
  "$cc" -static -O2 -Wall -Wextra -Werror -pthread -o "$bin.tmp.$$" "${agent_src[@]}"
  mv "$bin.tmp.$$" "$bin"
fi
bin="$out/dormant-idmap-mount"
if stale "$bin" native/idmap-mount.c; then
  "$cc" -O2 -Wall -Wextra -Werror -o "$bin.tmp.$$" native/idmap-mount.c
  mv "$bin.tmp.$$" "$bin"
fi
