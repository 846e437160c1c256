#!/usr/bin/env bash
# Installs fastddp and what it needs into the current Python, from a fresh machine.
#   FASTDDP_TORCH      torch requirement to install (default: torch==2.14.1, the CUDA build)
#   FASTDDP_WITH_CUDA  auto|1|0 (default auto: CUDA kernels when torch has CUDA and nvcc exists)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
torch_req=${FASTDDP_TORCH:-torch==2.14.1}
echo "==> installing ${torch_req} and build/test tools"
"$PY" -m pip install -q "$torch_req" "scikit-build-core>=0.10" ninja "cmake>=3.26" numpy tqdm pyyaml matplotlib tensorboard \
  pytest pytest-benchmark pytest-timeout expecttest
echo "==> building fastddp (FASTDDP_WITH_CUDA=${FASTDDP_WITH_CUDA:-auto})"
"$PY" -m pip install -q --no-build-isolation --no-deps --force-reinstall .
"$PY" -c "import fastddp, json; print(json.dumps(fastddp.build_info()))"
