#!/usr/bin/env bash
# Benchmark every decoding method on the shipped tiny family (a benchmark, not a test: timings vary by machine).
#   bash experiments/benchmark_eval.sh [extra key=value overrides]
# Runs the tiny test split, then HumanEval's prompts when a copy of the benchmark file is at
# $HUMANEVAL (default ../shared/benchmarks/humaneval.jsonl), NUM_PROMPTS of each (default 24; every method runs at
# temperature 0 and at eval.sampling_temperature). Reports land in checkpoints/bench-*/report.md. Compare an aligned
# drafter in the same runs with "eval.compare_drafters={aligned: checkpoints/tiny-align/step_600}".
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
humaneval=${HUMANEVAL:-../shared/benchmarks/humaneval.jsonl}
n=eval.num_prompts=${NUM_PROMPTS:-24}
.venv/bin/align eval recipes/tiny/eval.yaml "$n" eval.out=checkpoints/bench-tiny-test "$@"
if [ -f "$humaneval" ]; then
  .venv/bin/align eval recipes/tiny/eval.yaml "$n" eval.prompts="$humaneval" eval.out=checkpoints/bench-humaneval "$@"
else
  echo "no $humaneval: HumanEval run skipped"
fi
