#!/usr/bin/env bash
# Ceph's RADOS gateway (radosgw) into a private prefix, /opt/dormant/radosgw: the real
# S3-compatible server the S3 vault's tests run against (src/vault/testing/rgw.ts). Run by
# scripts/setup.sh, as root; safe to run again.
#
# Why this way: bookworm's radosgw (16.2) has no dbstore backend, so it needs a whole Ceph
# cluster; trixie's (18.2) can keep its buckets in one SQLite file (`rgw_backend_store =
# dbstore`), which is all a test needs. Installing it through the host's apt would pull
# trixie's libraries into a bookworm host. As setup.sh does for CRIU, a private apt
# configuration (its own sources list, lists, cache and an empty dpkg status) downloads
# radosgw with its whole library closure from trixie, `dpkg -x` unpacks it into the prefix,
# and a wrapper runs it through the prefix's own dynamic loader. The host's apt sources and
# packages stay exactly as they were.
set -euo pipefail

PREFIX=${DORMANT_RGW_PREFIX:-/opt/dormant/radosgw}
APTDIR=${DORMANT_RGW_APT_DIR:-/opt/dormant/apt-radosgw}
BINDIR=${DORMANT_BIN_DIR:-/usr/local/bin}
SUITE=${DORMANT_RGW_SUITE:-trixie}

log() { printf 'setup: %s\n' "$*" >&2; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (it writes ${PREFIX})"
ARCH=$(dpkg --print-architecture)
case "$ARCH" in amd64) TRIPLET=x86_64-linux-gnu LOADER=usr/lib64/ld-linux-x86-64.so.2 ;; arm64) TRIPLET=aarch64-linux-gnu LOADER=usr/lib/ld-linux-aarch64.so.1 ;; *) die "architecture ${ARCH} is not supported" ;; esac

# Ceph loads its plugins and libraries from usr/lib/TRIPLET/ceph too.
LIBS="\$P/usr/lib/${TRIPLET}:\$P/usr/lib/${TRIPLET}/ceph:\$P/usr/lib/${TRIPLET}/ceph/compressor:\$P/usr/lib/${TRIPLET}/ceph/crypto:\$P/usr/lib"

works() { # prefix
  P=$1 && eval "libs=\"$LIBS\"" && "$1/$LOADER" --library-path "$libs" "$1/usr/bin/radosgw" --version >/dev/null 2>&1
}

if [ -x "$PREFIX/usr/bin/radosgw" ] && works "$PREFIX"; then
  log "radosgw present in ${PREFIX}"
else
  log "fetching radosgw from Debian ${SUITE} into ${PREFIX} (private apt in ${APTDIR})"
  mkdir -p "$APTDIR"/etc/apt.conf.d "$APTDIR"/etc/preferences.d "$APTDIR"/lists/partial "$APTDIR"/cache/archives/partial
  cat >"$APTDIR/etc/sources.list" <<SRC
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian ${SUITE} main
SRC
  : >"$APTDIR/status"
  APT_OPTS=(
    -o "Dir::Etc=$APTDIR/etc" -o "Dir::Etc::sourcelist=$APTDIR/etc/sources.list"
    -o "Dir::Etc::sourceparts=-" -o "Dir::Etc::Parts=$APTDIR/etc/apt.conf.d"
    -o "Dir::Etc::PreferencesParts=$APTDIR/etc/preferences.d" -o "Dir::Etc::preferences=$APTDIR/etc/preferences"
    -o "Dir::State=$APTDIR" -o "Dir::State::Lists=$APTDIR/lists" -o "Dir::State::status=$APTDIR/status"
    -o "Dir::Cache=$APTDIR/cache" -o "Dir::Cache::archives=$APTDIR/cache/archives"
    -o "APT::Architecture=$ARCH" -o "APT::Architectures::=$ARCH"
    -o "Acquire::Check-Valid-Until=false"
    -o "APT::Install-Recommends=false" -o "Debug::NoLocking=true"
  )
  apt-get "${APT_OPTS[@]}" -qq update
  rm -f "$APTDIR"/cache/archives/*.deb
  # radosgw-admin is in the radosgw package too; with an empty dpkg status apt resolves the
  # whole library closure from trixie, which is what the private loader needs.
  apt-get "${APT_OPTS[@]}" -qq -y --download-only install radosgw >/dev/null
  mkdir -p "${PREFIX%/*}"
  stage=$(mktemp -d "${PREFIX%/*}/.radosgw-stage.XXXXXX")
  trap 'rm -rf "$stage"' EXIT
  for deb in "$APTDIR"/cache/archives/*.deb; do dpkg -x "$deb" "$stage"; done
  ls "$APTDIR"/cache/archives/*.deb | xargs -n1 basename >"$stage/.packages"
  works "$stage" || die "radosgw from Debian ${SUITE} does not start from ${stage}"
  rm -rf "$PREFIX.old"
  [ -e "$PREFIX" ] && mv "$PREFIX" "$PREFIX.old"
  mv "$stage" "$PREFIX"
  trap - EXIT
  rm -rf "$PREFIX.old" "$APTDIR"/cache/archives/*.deb
  log "radosgw $(grep -o '^radosgw_[^_]*' "$PREFIX/.packages" | cut -d_ -f2) installed in ${PREFIX}"
fi

# Wrappers on PATH, under names of their own: a host radosgw (if any) is not shadowed.
write_if_changed() { # path, content
  if [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; then return 0; fi
  printf '%s\n' "$2" >"$1.tmp.$$" && chmod 0755 "$1.tmp.$$" && mv "$1.tmp.$$" "$1"
  log "wrote $1"
}
mkdir -p "$BINDIR"
for tool in radosgw radosgw-admin; do
  write_if_changed "$BINDIR/dormant-${tool}" "#!/bin/sh
# Written by dormant's scripts/setup-radosgw.sh: ${tool} from ${PREFIX}, run through its own loader.
P=${PREFIX}
exec \"\$P/${LOADER}\" --argv0 ${tool} --library-path \"${LIBS}\" \"\$P/usr/bin/${tool}\" \"\$@\""
done
