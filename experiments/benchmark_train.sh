#!/usr/bin/env bash
# Training throughput on this machine, 1 vs 2 processes (a benchmark, not a test: timings vary by machine).
#   bash experiments/benchmark_train.sh [key=value ...]        # STEPS=30 by default; needs `align trajectories` first
# Runs recipes/tiny/align.yaml for STEPS steps as: 1 process with 1 thread, 1 process with 2 threads (both cores to
# one rank), 2 processes with 1 thread each; reports median tokens/s per rank over the steps after the first 5, and in
# all. Reports land in checkpoints/bench-train/report.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
export HF_HUB_OFFLINE=1
steps=${STEPS:-30}
root=checkpoints/bench-train
rm -rf "$root"
run() {  # name processes threads
  OMP_NUM_THREADS=$3 .venv/bin/align train recipes/tiny/align.yaml --num_gpus "$2" train.out="$root/$1" \
    train.max_steps="$steps" train.save_every="$steps" train.eval_every="$steps" train.final_eval_prompts=0 "${@:4}"
}
run p1-t1 1 1 "$@"
run p1-t2 1 2 "$@"
run p2-t1 2 1 "$@"
{
  echo "# Training throughput ($steps steps of recipes/tiny/align.yaml, median after 5 warm-up steps)"
  echo
  echo "Machine: $(uname -m), $(nproc) cores"
  echo
  .venv/bin/align throughput "$root/p1-t1" "$root/p1-t2" "$root/p2-t1"
} > "$root/report.md"
echo
cat "$root/report.md"
