#!/usr/bin/env bash
# Builds, then runs every test file under dist/ with node's test runner.
# Usage: scripts/run-tests.sh [FILTER]   (FILTER: a substring of the test file's path)
set -euo pipefail
cd "$(dirname "$0")/.."
npx tsc -p tsconfig.json
# The CLI the tests spawn (bin/dormant) is the bundle users run: rebuilt from the new output.
node scripts/build-cli.mjs >/dev/null
mapfile -t files < <(find dist -name '*.test.js' | sort | grep -- "${1:-}")
if [ ${#files[@]} -eq 0 ]; then echo "no test files match '${1:-}'" >&2; exit 1; fi
# Tests that drive real CRIU and runc share the machine's cgroups and ports; one file at a
# time keeps their timings honest on a 2-core machine.
exec node --test --test-concurrency=1 --test-reporter=spec "${files[@]}"
