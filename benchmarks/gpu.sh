#!/usr/bin/env bash
# One command for a GPU machine without network (torch, nvcc, scikit-build-core/cmake/ninja and
# pytest already installed): build the CUDA extension in place, then run stages in order:
#   bash benchmarks/gpu.sh OUT [STAGES] [benchmark -k expression]
#   STAGES  a comma-separated list of (default all, in this order):
#           tests   the cuda-marked tests and the build's own tests
#           zoo1    the model zoo on one GPU, NCCL world 1
#           bench   the GPU benchmarks (AMP step, H2D, DDP world 1, end to end), the scaling
#                   projection and the H2D sweep (the -k expression, if given, picks among the
#                   pytest benchmarks)
#           zoo2    the model zoo with two processes sharing the GPU (gloo on CUDA tensors)
#           all     tests,zoo1,bench,zoo2
# FASTDDP_GPU_DEADLINE_S (default 570) bounds the whole run, build included: each stage's pytest
# stops at its own limit or at the deadline, whichever comes first, so that one call ends
# within the 10 minutes a lent GPU machine gives a command; stages the deadline leaves no time
# for are skipped with a line saying so. A stage cut short says so in its log; run it again
# with a -k expression for the rest. build/gpu is incremental: a machine still warm from the
# last call compiles nothing.
# OUT receives results.tar.gz (the JSON results, the logs, the GPU and build facts), written
# again after every stage so that a run stopped from outside still returns what was done.
# Unpack it, then `python benchmarks/merge_results.py DIR/results && python benchmarks/report.py`.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash benchmarks/gpu.sh OUT_DIR [tests,zoo1,bench,zoo2|all] [benchmark -k expression]}
stages=${2:-all}
[ "$stages" = all ] && stages=tests,zoo1,bench,zoo2
kexpr=${3:-}
for stage in ${stages//,/ }; do
  case "$stage" in
    tests|bench|zoo1|zoo2) ;;
    *) echo "gpu.sh: unknown stage '$stage' (tests, zoo1, bench, zoo2 or all)"; exit 2 ;;
  esac
done
deadline=$((SECONDS + ${FASTDDP_GPU_DEADLINE_S:-570}))
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)  # logs and results, packed into $out/results.tar.gz after every stage
trap 'rm -rf "$work"' EXIT
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
nvidia-smi -L | tee "$work/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$work/gpu.txt"
start=$SECONDS
if ! scripts/dev_build.sh build/gpu >"$work/build.log" 2>&1; then
  tail -50 "$work/build.log"; echo "gpu.sh: build failed"; tar -czf "$out/results.tar.gz" -C "$work" .
  exit 1
fi
echo "build: $((SECONDS - start)) s" | tee -a "$work/gpu.txt"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import fastddp, json; print(json.dumps(fastddp.build_info()))" | tee -a "$work/gpu.txt"
results="$work/results"
mkdir -p "$results"
rc=0

# Seconds a step may take: its own limit $1, or what is left before the deadline (at least 1:
# `timeout 0` would mean no limit at all).
limit() {
  local left=$((deadline - SECONDS))
  (( left < 1 )) && left=1
  echo $(( left < $1 ? left : $1 ))
}

# Runs pytest over the given arguments with the benchmarks' results going to $results, within
# $1 seconds (or the deadline), its output in $work/$2.log.
bench() {
  local secs log=$2
  secs=$(limit "$1")
  shift 2
  FASTDDP_BENCH_RESULTS="$results" timeout "$secs" python3 -m pytest -q -s -p no:cacheprovider \
    --benchmark-disable "$@" 2>&1 | tee "$work/$log.log" || rc=1
}

for stage in ${stages//,/ }; do
  if [ "$(limit 9999)" -lt 30 ]; then
    echo "gpu.sh: stage $stage skipped: the deadline leaves under 30 s" | tee -a "$work/gpu.txt"
    rc=1
    continue
  fi
  start=$SECONDS
  case "$stage" in
    tests)
      # The cuda-marked tests, and the build's tests, whose C++ error messages guard the
      # build against the libstdc++ mix-up above.
      timeout "$(limit 150)" python3 -m pytest tests -q -p no:cacheprovider \
        -m "cuda or not slow" -k "cuda or test_build" 2>&1 | tee "$work/tests.log" || rc=1 ;;
    zoo1) bench 240 zoo1 benchmarks/zoo/bench_zoo.py -m cuda -k nccl_world1 ;;
    zoo2) bench 240 zoo2 benchmarks/zoo/bench_zoo.py -m cuda -k shared_gloo_world2 ;;
    bench)
      # GPU benchmarks only (the CPU ones are CI's and this machine's time is scarce).
      bench 240 bench benchmarks --ignore=benchmarks/zoo -m "cuda or e2e" ${kexpr:+-k "$kexpr"}
      FASTDDP_BENCH_RESULTS="$results" timeout "$(limit 60)" python3 benchmarks/scaling.py \
        --busbw 370 2>&1 | tee "$work/scaling.log" || rc=1
      # where the direct H2D path's time goes (threads x ring slots x batch rows; ~20 s)
      timeout "$(limit 90)" python3 benchmarks/h2d_sweep.py 2>&1 | tee "$work/h2d_sweep.log" || rc=1 ;;
  esac
  echo "stage $stage: $((SECONDS - start)) s" | tee -a "$work/gpu.txt"
  tar -czf "$out/results.tar.gz" -C "$work" .
done
exit $rc
