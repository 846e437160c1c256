#!/usr/bin/env bash
# One command for a GPU machine without network (torch, nvcc, scikit-build-core/cmake/ninja and
# pytest already installed): build the CUDA extension in place, then run one stage:
#   bash benchmarks/gpu.sh OUT [STAGE] [pytest -k expression]
#   STAGE  tests    the cuda-marked tests and the quick CPU suites
#          bench    the GPU benchmarks (sampler, loader, AMP, DDP, end to end) and the scaling projection
#          zoo1     the model zoo on one GPU, NCCL world 1
#          zoo2     the model zoo with two processes sharing the GPU (gloo on CUDA tensors)
#          all      every stage above, in that order (the default)
# Each of tests, bench, zoo1 and zoo2 stops its pytest run within 5-7 minutes, so that with a
# build on a fresh machine it ends within the 10 minutes a lent GPU machine gives one command
# (build/gpu is incremental: a machine still warm from the last call compiles nothing). A stage
# its timeout cut short says so in its log; run it again with a -k expression for the rest
# (e.g. `zoo1 fp32`, then `zoo1 "bf16 or fp16"`). OUT receives the stage's logs and
# results-STAGE.tar.gz (the JSON results and the logs). Unpack it, then
# `python benchmarks/merge_results.py DIR/results && python benchmarks/report.py`.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash benchmarks/gpu.sh OUT_DIR [tests|bench|zoo1|zoo2|all] [benchmark -k expression]}
stage=${2:-all}
kexpr=${3:-}
case "$stage" in
  tests|bench|zoo1|zoo2|all) ;;
  *) echo "gpu.sh: unknown stage '$stage' (tests, bench, zoo1, zoo2 or all)"; exit 2 ;;
esac
mkdir -p "$out"
out=$(cd "$out" && pwd)
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
results="$out/results"
mkdir -p "$results"
rc=0

# Runs pytest over the given arguments with the benchmarks' results going to $results, within
# $1 seconds, its output in $out/$2.log.
bench() {
  local limit=$1 log=$2
  shift 2
  FASTDDP_BENCH_RESULTS="$results" timeout "$limit" python3 -m pytest -q -s -p no:cacheprovider \
    --benchmark-disable "$@" 2>&1 | tee "$out/$log.log" || rc=1
}

if [ "$stage" = tests ] || [ "$stage" = all ]; then
  # The cuda-marked tests, plus the quick CPU suites whose C++ error messages guard the build
  # against the libstdc++ mix-up above.
  timeout "${FASTDDP_GPU_TEST_TIMEOUT:-300}" python3 -m pytest tests -q -p no:cacheprovider \
    -m "cuda or not slow" -k "cuda or test_loader or test_sampler or test_build" \
    2>&1 | tee "$out/tests.log" || rc=1
fi
if [ "$stage" = bench ] || [ "$stage" = all ]; then
  # GPU benchmarks only (the CPU ones are CI's and this machine's time is scarce): the
  # cuda-marked comparisons plus the end-to-end run, which trains on the GPU when there is one.
  bench 330 bench benchmarks --ignore=benchmarks/zoo -m "cuda or e2e" ${kexpr:+-k "$kexpr"}
  FASTDDP_BENCH_RESULTS="$results" timeout 60 python3 benchmarks/scaling.py --busbw 370 \
    2>&1 | tee "$out/scaling.log" || rc=1
fi
if [ "$stage" = zoo1 ] || [ "$stage" = all ]; then
  bench 390 zoo1 benchmarks/zoo/bench_zoo.py -m cuda -k "nccl_world1${kexpr:+ and ($kexpr)}"
fi
if [ "$stage" = zoo2 ] || [ "$stage" = all ]; then
  bench 390 zoo2 benchmarks/zoo/bench_zoo.py -m cuda -k "shared_gloo_world2${kexpr:+ and ($kexpr)}"
fi
tar -czf "$out/results-$stage.tar.gz" -C "$out" results $(cd "$out" && ls ./*.log ./*.txt 2>/dev/null)
rm -rf "$results"
exit $rc
