#!/usr/bin/env bash
# Builds the extension with AddressSanitizer + UndefinedBehaviorSanitizer into build/asan and
# runs the C++-heavy tests (sampler, loader threads, AMP kernels, reducer) under it.
#   bash scripts/sanitize.sh [pytest args]
# Python and torch are not instrumented, so the ASan runtime is preloaded; leak detection is
# off (CPython and torch keep allocations alive until exit by design, which LeakSanitizer
# reports as leaks that are not ours).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
FASTDDP_SANITIZE=address FASTDDP_WITH_CUDA=0 scripts/dev_build.sh build/asan
asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
export LD_PRELOAD="$asan:$ubsan"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
status=0
PYTHONPATH=python "$PY" -m pytest tests/test_sampler.py tests/test_loader.py tests/test_amp.py \
  tests/test_ddp.py -q -p no:cacheprovider "$@" || status=$?
echo "sanitize.sh: rebuild the normal extension with scripts/dev_build.sh before other tests"
exit $status
