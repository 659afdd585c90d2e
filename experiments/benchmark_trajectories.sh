#!/usr/bin/env bash
# Trajectory throughput of the two backends, HF generate and vLLM, on the same prompts with the same settings
# (a benchmark, not a test: timings vary by machine).
#   bash experiments/benchmark_trajectories.sh [key=value ...]     # overrides recipes/tiny/align.yaml's trajectories
# NUM_PROMPTS (default 128) prompts of the tiny train split, greedy, float32, 64 new tokens, batches of 32, one
# process; each backend writes into checkpoints/bench-trajectories/<backend> afresh. Prints each run's line
# (completions, tokens, engine, generation tokens/s with model loading left out) and checks that the greedy
# completions are identical.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
bash launch/setup_vllm.sh
export HF_HUB_OFFLINE=1
root=checkpoints/bench-trajectories
rm -rf "$root"
for backend in hf vllm; do
  start=$(date +%s)
  .venv/bin/align trajectories recipes/tiny/align.yaml trajectories.backend=$backend trajectories.out="$root/$backend" \
    trajectories.num_prompts="${NUM_PROMPTS:-128}" trajectories.temperature=0 trajectories.max_new_tokens=64 \
    trajectories.batch_size=32 verifier.dtype=float32 "$@" 2>&1 | grep '^trajectories:'
  echo "  ($backend: $(( $(date +%s) - start )) s in all, loading included)"
done
# Same rows, same Arrow bytes: greedy float32 completions are token-identical between the backends.
for chunk in "$root"/hf/chunks/*/*.arrow; do
  cmp -s "$chunk" "$root/vllm/${chunk#"$root"/hf/}" || { echo "differs: ${chunk#"$root"/hf/}"; exit 1; }
done
echo "every greedy completion identical between hf and vllm"
