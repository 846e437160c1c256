#!/usr/bin/env bash
# Builds the extension with a sanitizer and runs the C++-heavy tests (sampler, loader threads,
# AMP kernels, reducer incl. multi-rank gloo runs) under it.
#   bash scripts/sanitize.sh [address|thread] [pytest args]      (default: address)
#
# address: AddressSanitizer + UndefinedBehaviorSanitizer, into build/asan. Leak detection is off
#   (CPython and torch keep allocations alive until exit by design, which LeakSanitizer reports
#   as leaks that are not ours).
# thread: ThreadSanitizer, into build/tsan. Needs a Python that starts under a preloaded
#   libtsan: the pyenv-built CPython here segfaults at start-up with it (before any fastddp
#   code), Debian's /usr/bin/python3 works. So: PYTHON=/path/to/venv/bin/python, a venv made from
#   /usr/bin/python3 with torch, numpy, pytest, cmake and ninja installed. Python and torch are
#   not instrumented: TSan sees fastddp's own threads and memory. scripts/tsan.supp suppresses
#   one race inside torch's gloo all_gather (every frame in libtorch; explained there).
# The runtime is preloaded because the interpreter itself is not linked against it.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=address
if [ $# -gt 0 ] && { [ "$1" = address ] || [ "$1" = thread ]; }; then mode=$1; shift; fi
PY=${PYTHON:-python3}
export PATH="$(dirname "$(command -v "$PY")"):$PATH"  # dev_build.sh builds for this Python
if [ "$mode" = address ]; then
  FASTDDP_SANITIZE=address FASTDDP_WITH_CUDA=0 scripts/dev_build.sh build/asan
  export LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
  export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1
  export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
else
  FASTDDP_SANITIZE=thread FASTDDP_WITH_CUDA=0 scripts/dev_build.sh build/tsan
  export LD_PRELOAD="$(gcc -print-file-name=libtsan.so)"
  export TSAN_OPTIONS="halt_on_error=1:exitcode=66:suppressions=$PWD/scripts/tsan.supp"
fi
status=0
PYTHONPATH=python "$PY" -m pytest tests/test_sampler.py tests/test_loader.py tests/test_loader_sources.py tests/test_amp.py tests/test_amp_ddp.py \
  tests/test_ddp.py tests/test_ddp_join.py tests/test_ddp_hooks.py tests/test_ddp_options.py \
  tests/test_shm_allreduce.py \
  -q -p no:cacheprovider "$@" || status=$?
echo "sanitize.sh ($mode): rebuild the normal extension with scripts/dev_build.sh before other tests"
exit $status
