#!/usr/bin/env bash
# The README's "bring dormant up" command, as root on Debian: prepares the machine
# (idempotent), installs the project's dependencies, builds, checks this node with
# `dormant doctor`, starts `dormant serve` on its embedded defaults (SQLite, local vault,
# a generated master key, all under $DORMANT_DATA_DIR, default /var/lib/dormant) and creates
# a demo sandbox. Safe to run again: what is already up is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/prepare.sh
./bin/dormant doctor

DATA=${DORMANT_DATA_DIR:-/var/lib/dormant}
LISTEN=${DORMANT_LISTEN:-127.0.0.1:7420}
export DORMANT_DATA_DIR=$DATA DORMANT_URL=${DORMANT_URL:-http://$LISTEN}
mkdir -p "$DATA" && chmod 0700 "$DATA"

# Where systemd runs, dormant runs as its service (restart on failure, graceful stop);
# elsewhere (a container, a CI job) under nohup with its pid in a file.
if [ -d /run/systemd/system ]; then
  STOP="systemctl stop dormant   (sandboxes keep running; logs: journalctl -u dormant)"
else
  STOP="kill \$(cat $DATA/dormant.pid)   (sandboxes keep running)"
fi
if ./bin/dormant ls --json >/dev/null 2>&1; then
  echo "up: dormant is already serving at $DORMANT_URL"
else
  if [ -d /run/systemd/system ]; then
    echo "up: starting dormant.service"
    ./bin/dormant install-service --data-dir "$DATA" --listen "$LISTEN"
  else
    echo "up: starting dormant serve (log: $DATA/dormant.log)"
    nohup ./bin/dormant serve --listen "$LISTEN" --data-dir "$DATA" >>"$DATA/dormant.log" 2>&1 </dev/null &
    echo $! >"$DATA/dormant.pid"
  fi
  for _ in $(seq 1 100); do
    ./bin/dormant ls --json >/dev/null 2>&1 && break
    sleep 0.2
  done
  ./bin/dormant ls --json >/dev/null || {
    if [ -d /run/systemd/system ]; then journalctl -u dormant -n 20 --no-pager >&2; else tail -n 20 "$DATA/dormant.log" >&2; fi
    exit 1
  }
fi

# The demo sandbox: a busybox root filesystem and a shell loop whose counter lives only in
# its memory, so a hibernate and resume visibly carry on counting instead of starting over.
ROOTFS=$DATA/demo-rootfs
if [ ! -x "$ROOTFS/bin/busybox" ]; then
  mkdir -p "$ROOTFS"/{bin,proc,sys,dev,tmp,etc,root}
  cp /bin/busybox "$ROOTFS/bin/busybox"
  for applet in $("$ROOTFS/bin/busybox" --list); do [ -e "$ROOTFS/bin/$applet" ] || ln -s busybox "$ROOTFS/bin/$applet"; done
fi
if ./bin/dormant get demo --json >/dev/null 2>&1; then
  echo "up: the demo sandbox exists"
else
  ./bin/dormant create --name demo --rootfs "$ROOTFS" -- \
    sh -c 'i=0; while true; do i=$((i+1)); echo "demo: counted to $i"; sleep 1; done' >/dev/null
fi
./bin/dormant ls
cat <<MSG

dormant is up at $DORMANT_URL (admin token in $DATA/admin-token). Try:
  ./bin/dormant logs demo          # the counter
  ./bin/dormant hibernate demo     # checkpoint into the encrypted vault; memory freed
  ./bin/dormant resume demo        # back, still counting from where it was
  ./bin/dormant logs demo
Stop the daemon with: $STOP
MSG
