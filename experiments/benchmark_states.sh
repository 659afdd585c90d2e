#!/usr/bin/env bash
# A DFlash run's steps/s and peak memory per rank with the verifier states computed in every step, cached as the run
# goes (train.cache_verifier_states) and precomputed by `align states` (states.out): a benchmark, not a test.
#   bash experiments/benchmark_states.sh [recipe] [key=value ...]   # recipes/smollm2/dflash.yaml; STEPS=100, ROUNDS=2
# Each variant runs STEPS steps on 2 ranks of 1 thread (as the SmolLM2 command trains), the variants interleaved
# ROUNDS times; the report gives each run's median tokens/s after 5 warm-up steps (align throughput), its wall
# seconds and the largest rank's peak RSS (GNU time), and the time align states took. Needs its trajectories first.
# Reports land in checkpoints/bench-states/report.md.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
recipe=${1:-recipes/smollm2/dflash.yaml}
shift $(( $# > 0 ? 1 : 0 ))
steps=${STEPS:-100}
rounds=${ROUNDS:-2}
root=checkpoints/bench-states
rm -rf "$root"
mkdir -p "$root"
common=(train.max_steps="$steps" train.save_every="$steps" train.eval_every="$steps" train.final_eval_prompts=0
        train.report_to=none "$@")
start=$(date +%s.%N)
OMP_NUM_THREADS=2 /usr/bin/time -f "%M" -o "$root/states.rss" .venv/bin/align states "$recipe" states.out="$root/states" "${common[@]}"
states_s=$(echo "$(date +%s.%N) - $start" | bc)
declare -A variant=(
  [in-step]="train.cache_verifier_states=false"
  [cached]="train.cache_verifier_states=true"
  [precomputed]="train.cache_verifier_states=false states.out=$root/states"
)
runs=()
for round in $(seq 1 "$rounds"); do
  for name in in-step cached precomputed; do
    out="$root/$name-$round"
    start=$(date +%s.%N)
    # shellcheck disable=SC2086
    /usr/bin/time -f "%M" -o "$out.rss" .venv/bin/align train "$recipe" --num_gpus 2 train.out="$out" \
      "${common[@]}" ${variant[$name]}
    echo "$(echo "$(date +%s.%N) - $start" | bc)" > "$out.seconds"
    runs+=("$out")
  done
done
{
  echo "# DFlash training with the verifier states in the step, cached, and precomputed ($steps steps, $recipe)"
  echo
  echo "Machine: $(uname -m), $(nproc --all) cores; 2 ranks of 1 thread; variants interleaved $rounds times"
  echo
  .venv/bin/align throughput --warmup-steps 5 "${runs[@]}"
  echo
  echo "| run | wall s (launch to exit) | peak RSS of the largest rank, GiB |"
  echo "|---|---|---|"
  for out in "${runs[@]}"; do
    printf '| %s | %.1f | %.2f |\n' "$(basename "$out")" "$(cat "$out.seconds")" \
      "$(echo "$(cat "$out.rss") / 1048576" | bc -l)"
  done
  echo
  printf 'align states (1 process): %.1f s, peak RSS %.2f GiB\n' "$states_s" \
    "$(echo "$(cat "$root/states.rss") / 1048576" | bc -l)"
} > "$root/report.md"
echo
cat "$root/report.md"
