#!/usr/bin/env bash
# Makes a fresh Debian machine (bookworm or trixie, amd64 or arm64) ready for dormant, as root.
# Safe to run again: a second run checks, changes nothing and takes seconds.
#
# What it installs, and why this way:
#   - From the host's own suites: runc, iptables (CRIU's network lock needs iptables-restore),
#     busybox-static (test root filesystems), iproute2, zstd, python3 (test programs inside
#     sandboxes), restic and borgbackup (the peers `npm run bench` compares the vault with),
#     haproxy (the peer relay of the proxy bench; only its binary is used: the service Debian
#     starts on install is stopped and disabled again), podman (the interchange tests make real
#     podman checkpoints at run time and restore dormant's exports with it; its checkpoints go
#     through runc, which finds the private CRIU below through the wrapper on PATH), skopeo
#     (the daemon pulls registry images with it) and docker-registry (the registry tests start
#     their own on loopback; Debian's service is stopped and disabled, as haproxy's), postgresql
#     (the PostgreSQL state store's tests start a private server of their own from its binaries,
#     on loopback in a temp folder; the cluster Debian makes is stopped and set to start
#     manually, so no system-wide PostgreSQL runs), and runsc
#     (gVisor, the second runtime: bookworm's 2022 build runs, checkpoints and restores here on
#     the ptrace platform; sid's 2024 build's sentry dies at its first task on this kernel).
#   - CRIU >= 4.2 and checkpointctl into a private prefix, /opt/dormant/criu, NOT through the
#     host's apt. bookworm's CRIU 3.17 cannot start on current kernels and trixie's 4.1.1 cannot
#     dump a process with a TCP socket (since kernel 6.16); sid's 4.2.1 works but needs a newer
#     libc than bookworm has. Adding trixie/sid to the host's apt sources risks a later plain
#     `apt-get install` upgrading libc6 and systemd. Instead a private apt configuration (its own
#     sources list, lists, cache and an empty dpkg status) downloads criu and checkpointctl with
#     their whole library closure from sid, `dpkg -x` unpacks them into the prefix, and small
#     wrappers in /usr/local/bin run them through the prefix's own dynamic loader. The host's
#     apt sources, preferences and installed packages are left exactly as they were.
#   - Ceph's radosgw (trixie's, with the SQLite dbstore backend) into /opt/dormant/radosgw the
#     same way, by scripts/setup-radosgw.sh: the real S3 server the S3 vault is tested against.
#   - The wrapper exports CRIU_FAULT=130 when `criu check` says hardware breakpoints do not work
#     (some VMs): CRIU then uses PTRACE_SYSCALL instead, and podman (which does not pass the
#     caller's environment to criu) gets the fallback too. dormant sets it on its own calls as well.
set -euo pipefail

PREFIX=${DORMANT_CRIU_PREFIX:-/opt/dormant/criu}
APTDIR=${DORMANT_APT_DIR:-/opt/dormant/apt}
BINDIR=${DORMANT_BIN_DIR:-/usr/local/bin}
SUITE=${DORMANT_CRIU_SUITE:-sid}
MIN_CRIU=4.2
HOST_PKGS=(runc iptables busybox-static iproute2 e2fsprogs mount zstd ca-certificates debian-archive-keyring python3 restic borgbackup chromium haproxy podman skopeo docker-registry postgresql runsc)

log() { printf 'setup: %s\n' "$*" >&2; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (it installs packages and writes ${PREFIX})"
[ -r /etc/debian_version ] || die "this script supports Debian (bookworm, trixie); found $(. /etc/os-release 2>/dev/null; echo "${PRETTY_NAME:-an unknown system}")"
ARCH=$(dpkg --print-architecture)
case "$ARCH" in amd64 | arm64) ;; *) die "architecture ${ARCH} is not supported (amd64, arm64)" ;; esac
case "$ARCH" in amd64) TRIPLET=x86_64-linux-gnu LOADER=usr/lib64/ld-linux-x86-64.so.2 ;; arm64) TRIPLET=aarch64-linux-gnu LOADER=usr/lib/ld-linux-aarch64.so.1 ;; esac
export DEBIAN_FRONTEND=noninteractive

# 1. Host packages, from the host's own suites.
missing=()
for p in "${HOST_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The bench starts haproxy itself with its own config; Debian's service is not wanted.
  if printf '%s\n' "${missing[@]}" | grep -qx haproxy && [ -d /run/systemd/system ]; then
    systemctl disable --now haproxy >/dev/null 2>&1 || true
  fi
  # The registry tests start docker-registry themselves on a free port; Debian's service is not wanted.
  if printf '%s\n' "${missing[@]}" | grep -qx docker-registry && [ -d /run/systemd/system ]; then
    systemctl disable --now docker-registry >/dev/null 2>&1 || true
  fi
  # The PostgreSQL tests start their own server; the cluster Debian creates (and starts, with
  # systemd or without) is not wanted: stopped, and left to start only by hand.
  if printf '%s\n' "${missing[@]}" | grep -qx postgresql; then
    if [ -d /run/systemd/system ]; then systemctl disable --now postgresql >/dev/null 2>&1 || true; fi
    pg_lsclusters -h 2>/dev/null | while read -r ver name _; do
      pg_ctlcluster "$ver" "$name" stop >/dev/null 2>&1 || true
      echo manual >"/etc/postgresql/$ver/$name/start.conf"
    done
  fi
else
  log "host packages present: ${HOST_PKGS[*]}"
fi

version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }

run_private() { "$PREFIX/$LOADER" --library-path "$PREFIX/usr/lib/$TRIPLET" "$@"; }

private_criu_version() {
  [ -x "$PREFIX/usr/sbin/criu" ] || return 1
  run_private "$PREFIX/usr/sbin/criu" --version 2>/dev/null | sed -n 's/^Version: *//p'
}

# 2. CRIU and checkpointctl into the private prefix.
have=$(private_criu_version || true)
if [ -n "$have" ] && version_ge "$have" "$MIN_CRIU" && [ -x "$PREFIX/usr/bin/checkpointctl" ]; then
  log "criu ${have} and checkpointctl present in ${PREFIX}"
else
  log "fetching criu and checkpointctl from Debian ${SUITE} into ${PREFIX} (private apt in ${APTDIR})"
  mkdir -p "$APTDIR"/etc/apt.conf.d "$APTDIR"/etc/preferences.d "$APTDIR"/lists/partial "$APTDIR"/cache/archives/partial
  keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  cat >"$APTDIR/etc/sources.list" <<SRC
deb [signed-by=${keyring}] http://deb.debian.org/debian ${SUITE} main
SRC
  : >"$APTDIR/status"
  APT_OPTS=(
    -o "Dir::Etc=$APTDIR/etc" -o "Dir::Etc::sourcelist=$APTDIR/etc/sources.list"
    -o "Dir::Etc::sourceparts=-" -o "Dir::Etc::Parts=$APTDIR/etc/apt.conf.d"
    -o "Dir::Etc::PreferencesParts=$APTDIR/etc/preferences.d" -o "Dir::Etc::preferences=$APTDIR/etc/preferences"
    -o "Dir::State=$APTDIR" -o "Dir::State::Lists=$APTDIR/lists" -o "Dir::State::status=$APTDIR/status"
    -o "Dir::Cache=$APTDIR/cache" -o "Dir::Cache::archives=$APTDIR/cache/archives"
    -o "APT::Architecture=$ARCH" -o "APT::Architectures::=$ARCH"
    # The machines' Debian mirror is a dated snapshot: sid's Release file would count as expired.
    -o "Acquire::Check-Valid-Until=false"
    -o "APT::Install-Recommends=false" -o "Debug::NoLocking=true"
  )
  apt-get "${APT_OPTS[@]}" -qq update
  rm -f "$APTDIR"/cache/archives/*.deb
  # With an empty dpkg status apt resolves the whole library closure from that one suite,
  # which is what the private loader needs.
  apt-get "${APT_OPTS[@]}" -qq -y --download-only install criu checkpointctl >/dev/null
  mkdir -p "${PREFIX%/*}"
  stage=$(mktemp -d "${PREFIX%/*}/.criu-stage.XXXXXX")
  trap 'rm -rf "$stage"' EXIT
  for deb in "$APTDIR"/cache/archives/*.deb; do dpkg -x "$deb" "$stage"; done
  ls "$APTDIR"/cache/archives/*.deb | xargs -n1 basename >"$stage/.packages"
  got=$("$stage/$LOADER" --library-path "$stage/usr/lib/$TRIPLET" "$stage/usr/sbin/criu" --version | sed -n 's/^Version: *//p')
  version_ge "$got" "$MIN_CRIU" || die "Debian ${SUITE} offers criu ${got}; dormant needs ${MIN_CRIU} or newer"
  rm -rf "$PREFIX.old"
  [ -e "$PREFIX" ] && mv "$PREFIX" "$PREFIX.old"
  mv "$stage" "$PREFIX"
  trap - EXIT
  rm -rf "$PREFIX.old" "$APTDIR"/cache/archives/*.deb
  log "criu ${got} installed in ${PREFIX}"
fi

# 3. Wrappers on PATH. Written only when their content changes.
write_if_changed() { # path, content
  if [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; then return 0; fi
  printf '%s\n' "$2" >"$1.tmp.$$" && chmod 0755 "$1.tmp.$$" && mv "$1.tmp.$$" "$1"
  log "wrote $1"
}

fault_line=''
if run_private "$PREFIX/usr/sbin/criu" check 2>&1 | grep -q "Hardware breakpoints don't seem to work"; then
  fault_line='# criu check on this machine: "Hardware breakpoints don'"'"'t seem to work" (a VM). CRIU_FAULT=130
# (FI_NO_BREAKPOINTS) makes criu use PTRACE_SYSCALL instead, so dump cannot hang waiting for a trap.
export CRIU_FAULT="${CRIU_FAULT:-130}"'
fi

mkdir -p "$BINDIR"
write_if_changed "$BINDIR/criu" "#!/bin/sh
# Written by dormant's scripts/setup.sh: criu from ${PREFIX}, run through its own loader.
${fault_line}
P=${PREFIX}
exec \"\$P/${LOADER}\" --argv0 criu --library-path \"\$P/usr/lib/${TRIPLET}\" \"\$P/usr/sbin/criu\" \"\$@\""
write_if_changed "$BINDIR/checkpointctl" "#!/bin/sh
# Written by dormant's scripts/setup.sh: checkpointctl from ${PREFIX}, run through its own loader.
P=${PREFIX}
exec \"\$P/${LOADER}\" --argv0 checkpointctl --library-path \"\$P/usr/lib/${TRIPLET}\" \"\$P/usr/bin/checkpointctl\" \"\$@\""

# 3b. Ceph's radosgw into its own private prefix, the same way: the S3 vault's tests run
#     against it (scripts/setup-radosgw.sh says why trixie's and not the host's).
bash "$(cd "$(dirname "$0")" && pwd)/setup-radosgw.sh"

# 4. Native helpers into /opt/dormant/bin: dormant-agent (the in-sandbox toolbox agent),
#    dormant-idmap-mount (sandboxes with a user namespace) and dormant-cuda-ckpt (GPU
#    sandboxes, docs/GPU.md).
if command -v gcc >/dev/null 2>&1; then
  bash "$(cd "$(dirname "$0")" && pwd)/build-native.sh" /opt/dormant/bin
else
  log "no gcc: dormant-agent and dormant-cuda-ckpt not built (the toolbox and GPU checkpoints need them)"
fi

# 5. podman checkpoints with the CRIU of step 3: runc (the runtime the tests pick) runs the
# first `criu` on PATH, and /usr/sbin/criu from the host's suites must not come before it.
criu_on_path=$(command -v criu || true)
[ "$criu_on_path" = "$BINDIR/criu" ] || log "warning: \`criu\` on PATH is ${criu_on_path:-missing}, not ${BINDIR}/criu: podman checkpoints would use it"

log "ready: $("$BINDIR/criu" --version | head -n1 | tr -d '\n'), runc $(runc --version | sed -n 's/^runc version //p'), podman $(podman --version | sed -n 's/^podman version //p')"
