#!/usr/bin/env bash
# The README's test command: prepares the machine (idempotent), installs the project's
# dependencies, checks lint and formatting, and runs the whole test suite against the real
# CRIU and runc. Run as root on Debian.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/prepare.sh
npm run --silent lint
exec bash scripts/run-tests.sh "$@"
