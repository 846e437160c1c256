#!/usr/bin/env bash
# Development build: compiles fastddp._C into python/fastddp/ so that
#   PYTHONPATH=python pytest tests
# runs against the working tree without reinstalling. Incremental (ninja).
# Usage: scripts/dev_build.sh [build-dir]   (FASTDDP_WITH_CUDA=0|1|auto respected)
set -euo pipefail
cd "$(dirname "$0")/.."
bdir=${1:-build/dev}
cmake -S . -B "$bdir" -G Ninja -DFASTDDP_INPLACE=ON \
  -DPython_EXECUTABLE="$(command -v python3)" \
  -DFASTDDP_WITH_CUDA="${FASTDDP_WITH_CUDA:-0}" \
  -DFASTDDP_CUDA_ARCHS="${FASTDDP_CUDA_ARCHS:-80;90}" \
  -DFASTDDP_SANITIZE="${FASTDDP_SANITIZE:-}" \
  -DFASTDDP_UNITY_BUILD="${FASTDDP_UNITY_BUILD:-ON}" >/dev/null
cmake --build "$bdir" -j "${FASTDDP_BUILD_JOBS:-2}"
# The POST_BUILD copy runs only when the module is relinked; copy again so that switching
# between build dirs (e.g. after scripts/sanitize.sh) always leaves this build's module in place.
cp "$bdir"/_C*.so "$bdir"/_build_info.py python/fastddp/
