#!/usr/bin/env bash
# Sets up fastddp (scripts/setup.sh) and runs the test suite plus a smoke run of the benchmarks.
# Fails when any test fails, and when pytest collects no test at all (its exit code 5).
# Arguments go to the tests' pytest: `bash scripts/test.sh --run-slow` adds the tests marked
# slow (the 10,000-step soaks, the clean-clone pip installs); every test has a timeout
# (pytest-timeout, 600 s unless the test says otherwise).
# The smoke run goes beside the tests at a lower CPU priority (nice 10): the suite leaves the
# cores idle about a third of its time (waits on peers and timeouts, process start-ups), which
# the smoke run takes; its output is printed after the tests'.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
smoke_pid=""
if [ -d benchmarks ] && ls benchmarks/bench_*.py >/dev/null 2>&1; then
  smoke_log=$(mktemp)
  trap 'rm -f "$smoke_log"' EXIT
  (renice -n 10 -p "$BASHPID" >/dev/null || true
   FASTDDP_BENCH_SMOKE=1 "$PY" -m pytest benchmarks -q -p no:cacheprovider --benchmark-disable) \
    >"$smoke_log" 2>&1 &
  smoke_pid=$!
fi
echo "==> tests"
tests_rc=0
"$PY" -m pytest tests -q -p no:cacheprovider "$@" || tests_rc=$?
if [ -n "$smoke_pid" ]; then
  smoke_rc=0
  wait "$smoke_pid" || smoke_rc=$?
  echo "==> benchmark smoke run (tiny sizes, run beside the tests; speed is not judged here)"
  cat "$smoke_log"
  if [ "$smoke_rc" -ne 0 ]; then
    echo "scripts/test.sh: the benchmark smoke run failed (exit $smoke_rc)"
    exit "$smoke_rc"
  fi
fi
exit "$tests_rc"
