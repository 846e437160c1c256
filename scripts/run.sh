#!/usr/bin/env bash
# Sets up fastddp (scripts/setup.sh) and runs the main job: training the built-in HAR task on
# the embedded synthetic data, single process (GPU if there is one, else CPU).
# Extra arguments go to fastddp.train, e.g. `bash scripts/run.sh --epochs 10 --mode conv1d`.
# Results go to runs/har; running it again continues that run (or says it is complete), and
# `bash scripts/run.sh --resume none` starts it over.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
echo "==> python -m fastddp.train $*"
"$PY" -m fastddp.train --save-dir runs/har "$@"
