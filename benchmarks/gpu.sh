#!/usr/bin/env bash
# One command for a GPU machine without network (torch, nvcc, scikit-build-core/cmake/ninja and
# pytest already installed): build the CUDA extension in place, run the cuda-marked tests, then
# the benchmarks; logs and JSON results go to the folder given as argument.
#   bash benchmarks/gpu.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash benchmarks/gpu.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 FASTDDP_WITH_CUDA=1 FASTDDP_BUILD_JOBS=${FASTDDP_BUILD_JOBS:-16}
nvidia-smi -L | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
if ! scripts/dev_build.sh build/gpu >"$out/build.log" 2>&1; then
  tail -50 "$out/build.log"; echo "gpu.sh: build failed (log: $out/build.log)"; exit 1
fi
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import fastddp, json; print(json.dumps(fastddp.build_info()))" | tee -a "$out/gpu.txt"
rc=0
python3 -m pytest tests -q -m cuda -p no:cacheprovider 2>&1 | tee "$out/tests.log" || rc=1
FASTDDP_BENCH_RESULTS="$out" python3 -m pytest benchmarks -q -p no:cacheprovider \
  --benchmark-disable 2>&1 | tee "$out/bench.log" || rc=1
exit $rc
