#!/usr/bin/env bash
# The peer toolkit on the same work (issue 26, item 6): speculators' own DFlash trainer on align's trajectories, with
# the step budget, draft length and per-step batch of align's DFlash recipe, then served in the same vLLM by
# `align serve-check` beside align's DFlash drafter trained by `align train` on the same trajectories.
#
#   bash experiments/speculators_dflash.sh [recipe] [key=value ...]
#       recipe: recipes/smollm2/dflash.yaml (default) or recipes/tiny/dflash.yaml; the keys go to every align command
#       (e.g. trajectories.out=... to train both on another trajectory set).
#
# What is matched, and how (speculators packs sequences into one row per step and samples anchors in it):
#   align train.max_steps            -> --max-steps (one optimizer step per packed batch in speculators)
#   align decode.gamma               -> --block-size gamma+1 (the anchor and gamma drafted tokens; vLLM serves gamma)
#   align dflash.num_layers, aux_layer_ids -> --num-layers, --target-layer-ids
#   align 2 ranks x micro_batch_size x windows_per_sequence windows a step -> --max-anchors (the same count of
#       drafted blocks a step), --total-seq-len 2 x micro_batch_size x the longest sequence (room for those sequences)
#   align train.lr, warmup_steps     -> --lr, --scheduler-warmup-steps, AdamW (speculators' default is Muon)
# Not matched: speculators' loss (D-PACE-weighted CE on the verifier's argmax, its DFlash default) is its own, as is
# its draft MLP width (the verifier's intermediate_size). speculators runs single-process on the CPU (its torchrun
# path needs an accelerator: speculators/train/distributed.py:151), through experiments/speculators_cpu_train.py.
#
# Environment: ALIGN (align's CLI, default .venv/bin/align), ALIGN_VLLM_PYTHON (vLLM's python, default
# .venv-vllm/bin/python), WORK (default checkpoints/speculators-dflash/<recipe name>, ignored by git), SKIP_ALIGN_TRAIN=1 to reuse align's
# latest checkpoint in train.out.
set -euo pipefail
cd "$(dirname "$0")/.."
recipe=${1:-recipes/smollm2/dflash.yaml}
shift || true
ALIGN=${ALIGN:-.venv/bin/align}
VLLM_PY=${ALIGN_VLLM_PYTHON:-.venv-vllm/bin/python}
ALIGN_PY=$(dirname "$(command -v "$ALIGN" || echo "$ALIGN")")/python
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

get() { "$ALIGN" validate "$recipe" "$@" --get "$key"; }
key=name; name=$(get "$@")
key=verifier.path; verifier=$(get "$@")
key=trajectories.out; trajectories=$(get "$@")
key=train.out; align_out=$(get "$@")
key=train.max_steps; max_steps=$(get "$@")
key=train.micro_batch_size; micro_batch=$(get "$@")
key=train.windows_per_sequence; windows=$(get "$@")
key=train.lr; lr=$(get "$@")
key=train.warmup_steps; warmup=$(get "$@")
key=decode.gamma; gamma=$(get "$@")
key=dflash.num_layers; num_layers=$(get "$@")
key=dflash.aux_layer_ids; layer_ids=$(get "$@" | tr -d '[] ')
ranks=2  # two ranks, as launch/ and experiments/ run align's training
# Every draft layer full (bidirectional) attention, as align's: speculators 0.9 makes the layers it is not told of
# sliding_attention, block-causal (see docs/dflash-and-vllm.md)
full_layers=($(seq 0 $((num_layers - 1))))
work=${WORK:-checkpoints/speculators-dflash/$name}
mkdir -p "$work"
[ -f "$trajectories/manifest.json" ] || { echo "speculators_dflash: $trajectories has no manifest.json (run: $ALIGN trajectories $recipe)" >&2; exit 2; }

# 1. align trajectories -> speculators' offline dataset (token ids, loss mask, the verifier's hidden states).
if [ ! -f "$work/data/align_conversion.json" ]; then
  rm -rf "$work/data"
  "$ALIGN_PY" -m align.speculators_data --trajectories "$trajectories" --verifier "$verifier" \
    --layer-ids "$layer_ids" --out "$work/data"
fi
max_len=$("$ALIGN_PY" experiments/speculators_steps.py max-len "$work/data/align_conversion.json")

# 2. speculators' trainer, the same budget. Its --max-steps ends an epoch but not the run (speculators 0.9.0,
# train/trainer.py:601-605 break the step loop, run_training at :734-739 starts the next epoch, which takes one more
# step and breaks again, forever; past max_steps the linear schedule's lr is 0, so the weights no longer change), so
# the script stops it once an epoch checkpoint records global_step >= max_steps, and serves that checkpoint.
step_folder() {  # the first epoch folder whose training_state.json has global_step >= $max_steps
  "$ALIGN_PY" experiments/speculators_steps.py step-folder "$work/train" "$max_steps"
}
if [ ! -f "$work/train/done" ]; then
  rm -rf "$work/train"
  mkdir -p "$work/train"
  "$VLLM_PY" experiments/speculators_cpu_train.py --speculator-type dflash --verifier-name-or-path "$verifier" \
    --data-path "$work/data" --save-path "$work/train" --log-dir "$work/logs" \
    --num-layers "$num_layers" --full-attention-indices "${full_layers[@]}" --target-layer-ids ${layer_ids//,/ } \
    --block-size $((gamma + 1)) \
    --max-anchors $((ranks * micro_batch * windows)) --total-seq-len $((ranks * micro_batch * max_len)) \
    --max-steps "$max_steps" --epochs 100000 --optimizer adamw --lr "$lr" --scheduler-warmup-steps "$warmup" \
    --num-workers 0 --hidden-states-dtype float32 --loss-implementation eager --draft-attn-impl sdpa \
    --train-data-ratio 0.95 > "$work/train.log" 2>&1 &
  trainer=$!
  while kill -0 $trainer 2>/dev/null && [ -z "$(step_folder)" ]; do sleep 10; done
  if [ -n "$(step_folder)" ]; then
    sleep 5; kill $trainer 2>/dev/null || true  # its checkpoint at max_steps is written; stop the extra epochs
    wait $trainer 2>/dev/null || true
  else
    wait $trainer || true
    echo "speculators_dflash: speculators train stopped before $max_steps steps (see $work/train.log)" >&2; exit 1
  fi
  touch "$work/train/done"
fi
spec_drafter=$(step_folder)
"$ALIGN_PY" experiments/speculators_steps.py bidirectional "$spec_drafter"
echo "speculators drafter: $spec_drafter ($(cat "$spec_drafter/training_state.json"))"

# 3. align's own DFlash drafter on the same trajectories, the same budget.
if [ "${SKIP_ALIGN_TRAIN:-0}" != 1 ]; then
  "$ALIGN" train "$recipe" --num_gpus $ranks "$@"
fi
align_drafter=$("$ALIGN" latest "$align_out")

# 4. Both served in the same vLLM (and run in align's runtime) on the same eval prompts.
for which in speculators align; do
  drafter=$spec_drafter; [ $which = align ] && drafter=$align_drafter
  "$ALIGN" serve-check "$recipe" serve_check.drafter="$drafter" serve_check.out="$work/serve-check-$which" "$@" || true
done
"$ALIGN_PY" experiments/speculators_steps.py table "$work"
