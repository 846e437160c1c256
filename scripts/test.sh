#!/usr/bin/env bash
# Sets up fastddp (scripts/setup.sh) and runs the test suite plus a smoke run of the benchmarks.
# Fails when any test fails, and when pytest collects no test at all (its exit code 5).
# Arguments go to the tests' pytest: `bash scripts/test.sh --run-slow` adds the tests marked
# slow (the 10,000-step soaks, the clean-clone pip installs); every test has a timeout
# (pytest-timeout, 600 s unless the test says otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
echo "==> tests"
"$PY" -m pytest tests -q -p no:cacheprovider "$@"
if [ -d benchmarks ] && ls benchmarks/bench_*.py >/dev/null 2>&1; then
  echo "==> benchmark smoke run (tiny sizes; speed is not judged here)"
  FASTDDP_BENCH_SMOKE=1 "$PY" -m pytest benchmarks -q -p no:cacheprovider --benchmark-disable
fi
