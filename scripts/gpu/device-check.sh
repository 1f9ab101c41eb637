#!/usr/bin/env bash
# GPU checkpoint/restore through dormant's own path, on a machine with an NVIDIA GPU. Run from
# the repository root after scripts/gpu/prepare.sh built gpu-kit/ (carried along). For each size
# (SIZES, GiB; default "1 16") it:
#   1. starts gpu-kit/bin/pattern holding a known pattern in that much device memory, counting on the GPU;
#   2. dormant-cuda-ckpt lock + checkpoint (device memory -> host memory)        [timed: cuda-checkpoint]
#   3. CRIU dumps the process, which ends it                                    [timed: criu-dump]
#   4. CRIU restores it (same pid)                                               [timed: criu-restore]
#   5. dormant-cuda-ckpt restore + unlock (host memory -> device memory)         [timed: cuda-restore]
#   6. checks every word of the pattern, and that the GPU counter keeps going.
# Results: $OUT/gpu-results.txt (one line per size, and PASS/FAIL), logs next to it.
# Exit 0 all passed; 1 a check failed; 2 no GPU/driver here (nothing was tried).
set -uo pipefail
cd "$(dirname "$0")/../.."
KIT=${KIT:-$PWD/gpu-kit}
OUT=${OUT:-/tmp/dormant-gpu-out}
SIZES=${SIZES:-1 16}
mkdir -p "$OUT"
RES="$OUT/gpu-results.txt"
: >"$RES"
log() { echo "$*" | tee -a "$RES"; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
H="$KIT/bin/dormant-cuda-ckpt"
criu() {
  "$KIT/criu/usr/lib64/ld-linux-x86-64.so.2" --argv0 criu --library-path "$KIT/criu/usr/lib/x86_64-linux-gnu" \
    "$KIT/criu/usr/sbin/criu" "$@"
}

[ -x "$H" ] && [ -x "$KIT/bin/pattern" ] && [ -x "$KIT/criu/usr/sbin/criu" ] || {
  log "FAIL: $KIT is incomplete: run scripts/gpu/prepare.sh first and carry gpu-kit"
  exit 2
}
if [ ! -r /proc/driver/nvidia/version ]; then
  log "NO-GPU: no NVIDIA driver on this machine (/proc/driver/nvidia/version missing); nothing tried"
  exit 2
fi
log "driver: $(head -1 /proc/driver/nvidia/version)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/gpu: /' | tee -a "$RES"
if ! timeout 60 "$H" info >"$OUT/info.json" 2>"$OUT/info.err"; then
  log "NO-GPU: dormant-cuda-ckpt info failed: $(cat "$OUT/info.err")"
  exit 2
fi
log "helper info: $(cat "$OUT/info.json")"
grep -q '"checkpointApi":true' "$OUT/info.json" || { log "FAIL: this driver has no cuCheckpointProcess* API (needs 570+)"; exit 2; }
log "criu: $(criu --version | head -1); $(timeout 60 criu check 2>&1 | tail -1)"

fails=0
base=/dev/shm
[ "$(df -Pk /dev/shm | awk 'NR==2 { print int($4 / 1048576) }')" -gt 40 ] || base=${TMPDIR:-/tmp}
for gib in $SIZES; do
  w="$base/dormant-gpu-$gib"
  rm -rf "$w"
  mkdir -p "$w/img"
  setsid "$KIT/bin/pattern" "$gib" "$w" </dev/null >/dev/null 2>"$OUT/pattern-$gib.err" &
  pid=$!
  fail() {
    log "FAIL ${gib}GiB: $*"
    fails=$((fails + 1))
    kill -9 "$pid" 2>/dev/null
    cp "$w"/*.log "$OUT/" 2>/dev/null
    rm -rf "$w"
  }
  for _ in $(seq 1 600); do grep -q '^ready' "$w/status" 2>/dev/null && break; kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  grep -q '^ready' "$w/status" 2>/dev/null || { fail "pattern did not start: $(cat "$OUT/pattern-$gib.err")"; continue; }
  sleep 1
  before=$(awk '{ print $6 }' "$w/status")
  t0=$(now)
  timeout 120 "$H" lock "$pid" 30000 >>"$OUT/helper.log" 2>&1 || { fail "cuda lock: $(tail -1 "$OUT/helper.log")"; continue; }
  timeout 300 "$H" checkpoint "$pid" >>"$OUT/helper.log" 2>&1 || { fail "cuda checkpoint: $(tail -1 "$OUT/helper.log")"; continue; }
  t1=$(now)
  state=$("$H" state "$pid" 2>&1)
  echo "$state" | grep -q checkpointed || { fail "after checkpoint the state is $state"; continue; }
  timeout 300 criu dump -t "$pid" -D "$w/img" -o dump.log -v4 || { cp "$w/img/dump.log" "$OUT/dump-$gib.log"; fail "criu dump (log in $OUT/dump-$gib.log)"; continue; }
  t2=$(now)
  cp "$w/img/dump.log" "$OUT/dump-$gib.log"
  img=$(du -sm "$w/img" | cut -f1)
  sleep 0.5
  kill -0 "$pid" 2>/dev/null && { fail "the process still runs after the dump"; continue; }
  t3=$(now)
  timeout 300 criu restore -D "$w/img" -d -o restore.log -v4 || { cp "$w/img/restore.log" "$OUT/restore-$gib.log"; fail "criu restore (log in $OUT/restore-$gib.log)"; continue; }
  t4=$(now)
  cp "$w/img/restore.log" "$OUT/restore-$gib.log"
  timeout 300 "$H" restore "$pid" >>"$OUT/helper.log" 2>&1 || { fail "cuda restore: $(tail -1 "$OUT/helper.log")"; continue; }
  timeout 120 "$H" unlock "$pid" >>"$OUT/helper.log" 2>&1 || { fail "cuda unlock: $(tail -1 "$OUT/helper.log")"; continue; }
  t5=$(now)
  rm -f "$w/verify"
  kill -USR1 "$pid"
  for _ in $(seq 1 300); do [ -s "$w/verify" ] && break; sleep 0.2; done
  [ -s "$w/verify" ] || { fail "no verify answer after restore (process alive: $(kill -0 "$pid" 2>/dev/null && echo yes || echo no))"; continue; }
  mism=$(awk '{ print $3 }' "$w/verify")
  c1=$(awk '{ print $6 }' "$w/status")
  sleep 1
  c2=$(awk '{ print $6 }' "$w/status")
  line="size ${gib}GiB: cuda-checkpoint $(secs "$t0" "$t1")s, criu-dump $(secs "$t1" "$t2")s (${img} MiB images), criu-restore $(secs "$t3" "$t4")s, cuda-restore $(secs "$t4" "$t5")s; counter before ${before}, after restore ${c1} -> ${c2}; pattern mismatches ${mism}"
  if [ "$mism" = 0 ] && [ "$c1" -ge "$before" ] && [ "$c2" -gt "$c1" ]; then
    log "PASS $line"
  else
    fail "$line"
    continue
  fi
  kill -9 "$pid" 2>/dev/null
  rm -rf "$w"
done
[ "$fails" = 0 ] && log "ALL PASS" || log "FAILED: $fails size(s)"
[ "$fails" = 0 ]
