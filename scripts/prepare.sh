#!/usr/bin/env bash
# What the README's commands do first, as root on Debian: prepares the machine (idempotent),
# installs the project's dependencies when the lock file is newer, and builds.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ ! -d node_modules ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
  npm ci --no-audit --no-fund
fi
npm run --silent build
