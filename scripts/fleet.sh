#!/usr/bin/env bash
# A fleet of dormant nodes on this machine, for trying the fleet and for its tests, as root on
# Debian after scripts/prepare.sh (or setup.sh and `npm run build`):
#
#   scripts/fleet.sh up N    starts PostgreSQL, an S3 server (Ceph RGW, dormant-radosgw) and N
#                            nodes (`dormant serve --node nodeK`) sharing that database and that
#                            bucket, and prints one JSON line on stdout:
#                              {"nodes":[{"name":"node1","url":"http://127.0.0.1:PORT"},...],"token":"dmt_..."}
#                            (everything else goes to stderr)
#   scripts/fleet.sh down    removes every node's sandboxes through its API, stops the nodes,
#                            the S3 server and PostgreSQL by their recorded pids, and removes
#                            the fleet's folder.
#
# Everything lives in one folder, $DORMANT_FLEET_DIR (default /var/lib/dormant-fleet):
#   pg/        PostgreSQL's data (owned by the postgres user: it refuses to run as root), log,
#              password; it listens on 127.0.0.1 only, on a free port
#   rgw/       RGW's configuration, its SQLite database, log and S3 keys; bucket `dormant`
#   master.key the vault's master key, one for every node: they share the bucket's keys
#   config.json the nodes' configuration file, empty (the host's /etc/dormant/config.json is not theirs)
#   nodes/nodeK/data  the node's data folder; nodeK/{port,proxy-port,pid,log}
#
# Sandboxes of every node share the host's default sandbox subnet: their /30 slots are
# reserved host-wide (/var/lib/dormant-net, O_EXCL files naming sandbox and node), and their
# cgroups (/dormant/NODE/ID) and network namespaces (dormant-NODE-ID) carry the node's name,
# so nodes on one host cannot collide there; `dormant serve` has no subnet setting to give
# each node its own, and needs none.
#
# `up` on a folder that already holds a fleet is refused (run `down` first); a failed `up`
# removes what it started. Secrets stay out of command lines (visible to every user in ps):
# the database password goes to the nodes as PGPASSWORD, the S3 keys as DORMANT_VAULT_*.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
FLEET=${DORMANT_FLEET_DIR:-/var/lib/dormant-fleet}
DORMANT=("$(command -v node || echo node)" "$ROOT/bin/dormant")
BUCKET=dormant
# Bounds, in tenths of a second for the polling loops.
NODE_START_TENTHS=${DORMANT_FLEET_NODE_START_TENTHS:-900}
STOP_TENTHS=300

log() { printf 'fleet: %s\n' "$*" >&2; }
die() {
  printf 'fleet: error: %s\n' "$*" >&2
  exit 1
}
usage() {
  cat >&2 <<USAGE
usage: scripts/fleet.sh up N     start PostgreSQL, an S3 server and N nodes; prints their URLs and a token (JSON)
       scripts/fleet.sh down     remove their sandboxes, stop them all, remove the fleet's folder
The fleet's folder is \$DORMANT_FLEET_DIR (default /var/lib/dormant-fleet).
USAGE
  exit 2
}

# A zombie (ended, its parent not yet reaped it) counts as gone.
alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null && ! grep -q '^[0-9]* (.*) Z ' "/proc/$1/stat" 2>/dev/null; }
# Reads a file that may be missing (a fleet half made, or half removed).
readf() { cat "$1" 2>/dev/null || true; }
random_hex() { head -c "$1" /dev/urandom | od -An -tx1 | tr -d ' \n'; }

# Ports on loopback that were free a moment ago, all held open together so none repeats.
free_ports() {
  node -e '
    const net = require("node:net");
    const n = Number(process.argv[1]);
    const servers = Array.from({ length: n }, () => net.createServer().listen(0, "127.0.0.1"));
    Promise.all(servers.map((s) => new Promise((r) => s.once("listening", r)))).then(() => {
      console.log(servers.map((s) => s.address().port).join(" "));
      for (const s of servers) s.close();
    });' "$1"
}

# The newest PostgreSQL server installed from Debian's packages (/usr/lib/postgresql/V/bin).
pg_bin() {
  local v best=''
  for v in /usr/lib/postgresql/*/bin/postgres; do
    [ -x "$v" ] || continue
    v=${v#/usr/lib/postgresql/}
    v=${v%%/*}
    if [ -z "$best" ] || [ "$v" -gt "$best" ]; then best=$v; fi
  done
  [ -n "$best" ] && echo "/usr/lib/postgresql/$best/bin"
}

# Everything `up` needs, each missing piece named with what installs it.
check_prerequisites() {
  local missing=()
  [ "$(id -u)" = 0 ] || die "run as root (nodes run sandboxes; PostgreSQL is started as the postgres user)"
  command -v node >/dev/null || missing+=("node (Node.js 20 or newer: scripts/prepare.sh expects it installed)")
  [ -f "$ROOT/dist/cli/main.js" ] || missing+=("dist/ (build it: npm run build, or bash scripts/prepare.sh)")
  [ -n "$(pg_bin)" ] || missing+=("PostgreSQL (/usr/lib/postgresql/*/bin: bash scripts/setup.sh installs postgresql)")
  id -u postgres >/dev/null 2>&1 || missing+=("the postgres user (the postgresql package makes it)")
  command -v dormant-radosgw >/dev/null || missing+=("dormant-radosgw (bash scripts/setup.sh unpacks it into /opt/dormant/radosgw)")
  command -v dormant-radosgw-admin >/dev/null || missing+=("dormant-radosgw-admin (bash scripts/setup.sh)")
  command -v curl >/dev/null || missing+=("curl (apt-get install curl)")
  command -v setpriv >/dev/null || missing+=("setpriv (apt-get install util-linux)")
  if [ ${#missing[@]} -gt 0 ]; then
    printf 'fleet: error: missing: %s\n' "${missing[@]}" >&2
    exit 1
  fi
}

# The folder `dormant serve` stages checkpoints in, and runc's bundles beside it, both in
# /dev/shm and named after the data folder (stagingDirFor in src/daemon/daemon.ts).
staging_dir() { printf '/dev/shm/dormant-%s' "$(printf '%s' "$(realpath -m "$1")" | sha256sum | cut -c1-12)"; }

start_postgres() {
  local bin port password
  bin=$(pg_bin)
  port=$1
  password=$(random_hex 18)
  mkdir -p "$FLEET/pg"
  printf '%s\n' "$password" >"$FLEET/pg/password"
  printf '%s\n' "$port" >"$FLEET/pg/port"
  chmod 0600 "$FLEET/pg/password"
  cp "$FLEET/pg/password" "$FLEET/pg/pwfile"
  chown -R postgres: "$FLEET/pg"
  chmod 0700 "$FLEET/pg"
  log "PostgreSQL: initdb in $FLEET/pg/data"
  # From its own folder: initdb and the server, as postgres, may not be able to enter ours.
  cd "$FLEET/pg"
  setpriv --reuid=postgres --regid=postgres --init-groups -- "$bin/initdb" -D "$FLEET/pg/data" -U dormant \
    --pwfile="$FLEET/pg/pwfile" --auth=scram-sha-256 --encoding=UTF8 >"$FLEET/pg/initdb.log" 2>&1 ||
    {
      tail -n 20 "$FLEET/pg/initdb.log" >&2
      die "initdb failed"
    }
  rm -f "$FLEET/pg/pwfile"
  # Its dynamic shared memory in the data folder, not /dev/shm/PostgreSQL.*: a server killed
  # outright would leave those behind.
  setsid setpriv --reuid=postgres --regid=postgres --init-groups -- "$bin/postgres" -D "$FLEET/pg/data" \
    -p "$port" -c listen_addresses=127.0.0.1 -c "unix_socket_directories=$FLEET/pg" \
    -c dynamic_shared_memory_type=mmap -c max_connections=200 \
    </dev/null >>"$FLEET/pg/server.log" 2>&1 &
  echo $! >"$FLEET/pg/pid"
  local i
  for ((i = 0; i < 300; i++)); do
    if PGPASSWORD=$password "$bin/pg_isready" -q -h 127.0.0.1 -p "$port" -U dormant -d postgres; then break; fi
    alive "$(readf "$FLEET/pg/pid")" || break
    sleep 0.1
  done
  PGPASSWORD=$password "$bin/pg_isready" -q -h 127.0.0.1 -p "$port" -U dormant -d postgres || {
    tail -n 20 "$FLEET/pg/server.log" >&2
    die "PostgreSQL did not start on 127.0.0.1:$port"
  }
  PGPASSWORD=$password "$bin/createdb" -h 127.0.0.1 -p "$port" -U dormant dormant
  cd "$ROOT"
  log "PostgreSQL: 127.0.0.1:$port, database dormant (pid $(readf "$FLEET/pg/pid"))"
}

start_rgw() {
  local port=$1 dir="$FLEET/rgw" name=client.rgw.dormant access secret i
  mkdir -p "$dir"
  chmod 0700 "$dir"
  cat >"$dir/ceph.conf" <<CONF
[global]
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
rgw_backend_store = dbstore
rgw_config_store = dbstore
dbstore_db_dir = $dir
dbstore_config_uri = file:$dir/config.db
run_dir = $dir
log_file = $dir/rgw.log
admin_socket =
rgw_multipart_min_part_size = 5242880
[$name]
rgw_frontends = beast endpoint=127.0.0.1:$port
CONF
  local base=(-c "$dir/ceph.conf" -n "$name" --rgw-backend-store dbstore)
  setsid dormant-radosgw "${base[@]}" -d </dev/null >>"$dir/out.log" 2>&1 &
  echo $! >"$dir/pid"
  for ((i = 0; i < 300; i++)); do
    if curl -s --max-time 5 -o /dev/null "http://127.0.0.1:$port/"; then break; fi
    alive "$(readf "$dir/pid")" || break
    sleep 0.1
  done
  curl -s --max-time 5 -o /dev/null "http://127.0.0.1:$port/" || {
    tail -n 20 "$dir/out.log" >&2
    die "the S3 server (dormant-radosgw) did not start on 127.0.0.1:$port"
  }
  access=DMT$(random_hex 8 | tr a-f A-F)
  secret=$(random_hex 20)
  # radosgw-admin sometimes prints the new user and then does not exit: the user is made once
  # its key is printed.
  timeout 20 dormant-radosgw-admin "${base[@]}" user create --uid=dormant --display-name=dormant \
    --access-key="$access" --secret="$secret" >"$dir/user.json" 2>>"$dir/out.log" || true
  grep -q "$access" "$dir/user.json" || {
    tail -n 20 "$dir/out.log" >&2
    die "dormant-radosgw-admin did not make the S3 user"
  }
  printf '%s\n' "$access" >"$dir/access-key-id"
  printf '%s\n' "$secret" >"$dir/secret-access-key"
  rm -f "$dir/user.json"
  # RGW checks the payload hash header that curl's SigV4 does not send by itself (an empty
  # body's SHA-256 here).
  curl -sf --max-time 30 --aws-sigv4 "aws:amz:us-east-1:s3" --user "$access:$secret" -X PUT \
    -H "x-amz-content-sha256: $(printf '' | sha256sum | cut -d' ' -f1)" \
    "http://127.0.0.1:$port/$BUCKET" >/dev/null || die "could not make bucket $BUCKET on the S3 server"
  printf 'http://127.0.0.1:%s\n' "$port" >"$dir/endpoint"
  log "S3: http://127.0.0.1:$port, bucket $BUCKET (pid $(readf "$dir/pid"))"
}

# Starts node K on ports PORT and PPORT and waits for its health endpoint.
start_node() {
  local k=$1 port=$2 pport=$3 dir="$FLEET/nodes/node$1" i
  mkdir -p "$dir/data"
  printf '%s\n' "$port" >"$dir/port"
  printf '%s\n' "$pport" >"$dir/proxy-port"
  local args=(serve --config "$FLEET/config.json" --data-dir "$dir/data" --listen "127.0.0.1:$port" --proxy-listen "127.0.0.1:$pport"
    --state "postgres://dormant@127.0.0.1:$(readf "$FLEET/pg/port")/dormant"
    --vault "s3://$BUCKET/fleet" --master-key-file "$FLEET/master.key"
    --node "node$k" --advertise "http://127.0.0.1:$port")
  PGPASSWORD=$(readf "$FLEET/pg/password") \
    DORMANT_VAULT_ENDPOINT=$(readf "$FLEET/rgw/endpoint") \
    DORMANT_VAULT_ACCESS_KEY_ID=$(readf "$FLEET/rgw/access-key-id") \
    DORMANT_VAULT_SECRET_ACCESS_KEY=$(readf "$FLEET/rgw/secret-access-key") \
    setsid nohup "${DORMANT[@]}" "${args[@]}" </dev/null >>"$dir/log" 2>&1 &
  echo $! >"$dir/pid"
  for ((i = 0; i < NODE_START_TENTHS; i++)); do
    if curl -sf --max-time 5 -o /dev/null "http://127.0.0.1:$port/v1/health"; then
      log "node$k: http://127.0.0.1:$port (proxy 127.0.0.1:$pport, pid $(readf "$dir/pid"), log $dir/log)"
      return 0
    fi
    alive "$(readf "$dir/pid")" || break
    sleep 0.1
  done
  log "node$k did not answer on http://127.0.0.1:$port/v1/health; the end of its log ($dir/log):"
  tail -n 30 "$dir/log" >&2 || true
  return 1
}

up() {
  local n=$1 ports i k
  [[ "$n" =~ ^[1-9][0-9]?$ ]] || die "up N: N is a number of nodes, 1 to 99 (got '$n')"
  check_prerequisites
  if [ -e "$FLEET/fleet" ]; then
    die "a fleet is already in $FLEET (scripts/fleet.sh down removes it; DORMANT_FLEET_DIR names another folder)"
  fi
  if [ -e "$FLEET" ] && [ -n "$(ls -A "$FLEET" 2>/dev/null)" ]; then
    die "$FLEET exists and is not empty; remove it or set DORMANT_FLEET_DIR to another folder"
  fi
  mkdir -p "$FLEET"
  # Searchable by others: the postgres user reaches pg/ through it, and a sandbox's mapped
  # root (user namespaces) its files below the nodes' data folders.
  chmod 0711 "$FLEET"
  echo "$n" >"$FLEET/fleet"
  # A failed step (an error, a `die`) ends the script: what it started goes with it.
  UP_DONE=no
  trap 'if [ "$UP_DONE" = no ]; then log "up failed; removing what it started"; down_all || true; fi' EXIT
  read -r -a ports <<<"$(free_ports $((2 + 2 * n)))"
  start_postgres "${ports[0]}"
  start_rgw "${ports[1]}"
  # The nodes' own configuration file, empty: without --config a node would read the host's
  # /etc/dormant/config.json, whose addresses (e2b.listen, say) every node would then share.
  echo '{}' >"$FLEET/config.json"
  random_hex 32 >"$FLEET/master.key"
  chmod 0600 "$FLEET/master.key"
  # Node 1 alone first: it writes the vault's first objects (FORMAT, the master key check)
  # and migrates the database; the others then find both made.
  for ((k = 1; k <= n; k++)); do
    start_node "$k" "${ports[2 * k]}" "${ports[2 * k + 1]}"
  done
  UP_DONE=yes
  local json='{"nodes":[' sep=''
  for ((k = 1; k <= n; k++)); do
    json+="$sep{\"name\":\"node$k\",\"url\":\"http://127.0.0.1:$(readf "$FLEET/nodes/node$k/port")\"}"
    sep=,
  done
  json+="],\"token\":\"$(tr -d '\n' <"$FLEET/nodes/node1/data/admin-token")\"}"
  log "up: $n node(s) in $FLEET; scripts/fleet.sh down stops them all"
  printf '%s\n' "$json"
}

# Sends SIG to PID, then SIGKILL after the bound; waits until it is gone.
stop_pid() {
  local pid=$1 sig=$2 what=$3 i
  alive "$pid" || return 0
  kill "-$sig" "$pid" 2>/dev/null || true
  for ((i = 0; i < STOP_TENTHS; i++)); do
    alive "$pid" || return 0
    sleep 0.1
  done
  log "$what (pid $pid) did not end on SIG$sig within $((STOP_TENTHS / 10)) s: SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
  for ((i = 0; i < 50; i++)); do
    alive "$pid" || return 0
    sleep 0.1
  done
  log "$what (pid $pid) is still there after SIGKILL"
  return 1
}

# Removes every sandbox node DIR lists, through its API, page by page.
remove_sandboxes() {
  local dir=$1 url token ids id cursor='' page n=0
  url="http://127.0.0.1:$(readf "$dir/port")"
  token=$(readf "$dir/data/admin-token")
  token=${token//$'\n'/}
  if ! curl -sf --max-time 5 -o /dev/null "$url/v1/health" || [ -z "$token" ]; then
    log "$(basename "$dir") does not answer at $url: its sandboxes (if any) cannot be removed through its API"
    return 1
  fi
  # The ids first, every page, then the deletes: deleting while paging would move the pages.
  ids=()
  while :; do
    page=$(curl -sf --max-time 60 -H "Authorization: Bearer $token" "$url/v1/sandboxes?limit=100${cursor:+&cursor=$cursor}") || {
      log "$(basename "$dir"): listing its sandboxes failed"
      return 1
    }
    # With a `node` field (nodes sharing a database list each other's sandboxes), only this
    # node's own: each node removes what runs on it.
    mapfile -t -O "${#ids[@]}" ids < <(node -e '
      for (const s of JSON.parse(process.argv[1]).sandboxes)
        if (s.node === undefined || s.node === null || s.node === process.argv[2]) console.log(s.id)' "$page" "$(basename "$dir")")
    cursor=$(node -e 'const c = JSON.parse(process.argv[1]).nextCursor; if (c) console.log(encodeURIComponent(c))' "$page")
    [ -n "$cursor" ] || break
  done
  for id in "${ids[@]}"; do
    # A removal waits for the sandbox's operation in flight (a hibernate) to end.
    curl -sf --max-time 300 -o /dev/null -X DELETE -H "Authorization: Bearer $token" "$url/v1/sandboxes/$id" || {
      log "$(basename "$dir"): removing sandbox $id failed"
      return 1
    }
    n=$((n + 1))
  done
  log "$(basename "$dir"): removed $n sandbox(es)"
}

# Mount points at or below any of the given paths, deepest first.
mounts_under() {
  local p m
  while read -r _ _ _ _ m _; do
    m=$(printf '%b' "${m//\\/\\0}")
    for p in "$@"; do
      if [ "$m" = "$p" ] || [[ "$m" == "$p/"* ]]; then
        echo "$m"
        break
      fi
    done
  done </proc/self/mountinfo | awk '{ print length($0) "\t" $0 }' | sort -rn | cut -f2-
}

# Everything down: `down_all restart` first starts a node that died again to remove its
# sandboxes (`down`); `down_all` alone does not (a failed `up`: its nodes made none).
down_all() {
  local restart=${1:-} dir pid failed=0 paths=() m shm k
  if [ ! -d "$FLEET" ]; then
    log "down: no fleet in $FLEET"
    return 0
  fi
  # Sandboxes first, while every node still runs: a node's own shutdown leaves its sandboxes
  # running (by design: a restarted daemon adopts them).
  for dir in "$FLEET"/nodes/node*; do
    [ -d "$dir/data" ] || continue
    # A node that died (killed, crashed) left its sandboxes running: started again on its
    # folder it adopts them (it reconciles at start), and they go through its API like the
    # others'. That needs the database and the S3 server; with those gone too (a reboot),
    # so are the sandboxes.
    if [ "$restart" = restart ] && ! alive "$(readf "$dir/pid")" && [ -s "$dir/port" ] && [ -s "$dir/proxy-port" ] &&
      alive "$(readf "$FLEET/pg/pid")" && alive "$(readf "$FLEET/rgw/pid")"; then
      k=${dir##*/node}
      log "node$k is not running: starting it again to remove its sandboxes"
      start_node "$k" "$(readf "$dir/port")" "$(readf "$dir/proxy-port")" || failed=1
    fi
    if alive "$(readf "$dir/pid")"; then remove_sandboxes "$dir" || failed=1; fi
  done
  for dir in "$FLEET"/nodes/node*; do
    [ -d "$dir" ] || continue
    pid=$(readf "$dir/pid")
    if alive "$pid"; then
      log "stopping $(basename "$dir") (pid $pid)"
      stop_pid "$pid" TERM "$(basename "$dir")" || failed=1
    fi
  done
  pid=$(readf "$FLEET/rgw/pid")
  if alive "$pid"; then
    log "stopping the S3 server (pid $pid)"
    stop_pid "$pid" TERM "dormant-radosgw" || failed=1
  fi
  pid=$(readf "$FLEET/pg/pid")
  if alive "$pid"; then
    log "stopping PostgreSQL (pid $pid)"
    # SIGINT: fast shutdown (clients are gone already; nothing worth a checkpoint wait).
    local backends
    backends=$(readf "/proc/$pid/task/$pid/children")
    stop_pid "$pid" INT PostgreSQL || failed=1
    for m in $backends; do stop_pid "$m" KILL "a PostgreSQL backend" || failed=1; done
  fi
  # What a node killed outright can leave: its staging tmpfs and bundles in /dev/shm, mounts
  # below its data folder.
  paths=("$FLEET")
  for dir in "$FLEET"/nodes/node*; do
    [ -d "$dir" ] || continue
    shm=$(staging_dir "$dir/data")
    paths+=("$shm" "$shm-bundles" "$shm-bundles-runsc")
  done
  while read -r m; do
    [ -n "$m" ] || continue
    umount "$m" 2>/dev/null || umount -l "$m" || failed=1
  done < <(mounts_under "${paths[@]}")
  rm -rf "${paths[@]:1}"
  rm -rf "$FLEET" || failed=1
  if [ "$failed" = 1 ]; then
    log "down: done, with the errors above"
    return 1
  fi
  log "down: the fleet in $FLEET is stopped and removed"
}

case "${1:-}" in
  up)
    [ $# -eq 2 ] || usage
    up "$2"
    ;;
  down)
    [ $# -eq 1 ] || usage
    [ "$(id -u)" = 0 ] || die "run as root (it stops what up started as root)"
    down_all restart
    ;;
  *) usage ;;
esac
