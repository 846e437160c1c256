#!/usr/bin/env bash
# One command for a GPU machine without network (torch, nvcc, scikit-build-core/cmake/ninja and
# pytest already installed): build the CUDA extension in place, run the cuda-marked tests, then
# the benchmarks and the scaling projection; logs and JSON results go to the folder given as
# argument (copy its *.json into benchmarks/results/ and run `python benchmarks/report.py`).
#   bash benchmarks/gpu.sh OUT_DIR [pytest -k expression for the benchmarks]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash benchmarks/gpu.sh OUT_DIR [benchmark -k expression]}
kexpr=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 FASTDDP_WITH_CUDA=1 FASTDDP_BUILD_JOBS=${FASTDDP_BUILD_JOBS:-16}
# The GPU image sets CXX=/opt/gcc/bin/g++, a GCC that links its own libstdc++ into the
# extension statically; mixed with the shared libstdc++ torch uses, the first C++ error message
# that formatted an integer crashed (segfault in std::ostream). Build with the system compiler,
# whose libstdc++ is the one loaded at run time.
if [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ]; then
  export CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++
fi
# Build only for the GPU at hand unless told otherwise (a full 80;90 build is what CI compiles).
cap=$(python3 -c "import torch; print('%d%d' % torch.cuda.get_device_capability())" 2>/dev/null)
export FASTDDP_CUDA_ARCHS=${FASTDDP_CUDA_ARCHS:-${cap:-90}}
nvidia-smi -L | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
start=$SECONDS
if ! scripts/dev_build.sh build/gpu >"$out/build.log" 2>&1; then
  tail -50 "$out/build.log"; echo "gpu.sh: build failed (log: $out/build.log)"; exit 1
fi
echo "build: $((SECONDS - start)) s" | tee -a "$out/gpu.txt"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import fastddp, json; print(json.dumps(fastddp.build_info()))" | tee -a "$out/gpu.txt"
rc=0
# The cuda-marked tests, plus the quick CPU suites whose C++ error messages guard the build
# against the libstdc++ mix-up above.
timeout "${FASTDDP_GPU_TEST_TIMEOUT:-300}" python3 -m pytest tests -q -p no:cacheprovider \
  -m "cuda or not slow" -k "cuda or test_loader or test_sampler or test_build" \
  2>&1 | tee "$out/tests.log" || rc=1
# GPU benchmarks only (the CPU ones are CI's and this machine's time is scarce): the cuda-marked
# comparisons plus the end-to-end run, which trains on the GPU when there is one.
FASTDDP_BENCH_RESULTS="$out" timeout "${FASTDDP_GPU_BENCH_TIMEOUT:-900}" python3 -m pytest \
  benchmarks -q -s -p no:cacheprovider --benchmark-disable -m "cuda or e2e" ${kexpr:+-k "$kexpr"} \
  2>&1 | tee "$out/bench.log" || rc=1
FASTDDP_BENCH_RESULTS="$out" timeout 300 python3 benchmarks/scaling.py --busbw 370 \
  2>&1 | tee "$out/scaling.log" || rc=1
exit $rc
