#!/usr/bin/env bash
# The README's "bring dormant up" command: prepares the machine (idempotent), installs the
# project's dependencies, builds, and checks this node with `dormant doctor`.
# The daemon and the demo sandbox join here when `dormant serve` lands (issue 4); until then
# this stops at a working doctor.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ ! -d node_modules ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
  npm ci --no-audit --no-fund
fi
npm run --silent build
./bin/dormant doctor
