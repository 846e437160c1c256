#!/usr/bin/env bash
# fastddp.train's samples/s with --host-memory release and keep, alternating, 3 rounds of 1 and
# 2 processes (gloo) at batch 64 and 512, 3 epochs of the embedded data each: one line per run,
# "round processes batch host-memory samples/s". docs/benchmarks.md, "The allocator".
#   bash benchmarks/host_memory_ab.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
SAVE=$(mktemp -d)
trap 'rm -rf "$SAVE"' EXIT
for round in 1 2 3; do
  for nproc in 1 2; do
    for bs in 64 512; do
      for hm in release keep; do
        if [ $nproc = 1 ]; then cmd="python -m fastddp.train"; else cmd="torchrun --nproc_per_node=2 -m fastddp.train --multi-gpu ddp"; fi
        r=$($cmd --save-dir "$SAVE/run" --epochs 3 --batch-size $bs --resume none --no-progress --host-memory $hm 2>&1 | grep "^done" | sed 's/.*s, \([0-9]*\) samples\/s.*/\1/')
        echo "$round $nproc $bs $hm $r"
      done
    done
  done
done
