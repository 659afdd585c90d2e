#!/usr/bin/env bash
# The peer toolkit as curves (issue 37, item 6): align's DFlash trainer and speculators' on the same trajectories,
# served acceptance (vLLM) and align tau against wall-clock minutes of training on this machine, both using all of
# it (align: 2 ranks x 1 thread; speculators: 1 process x OMP_NUM_THREADS=2, its CPU path is single-process).
#
#   BUDGETS="10 20 30" ALIGN_MAX_STEPS=1600 SPEC_MAX_STEPS=900 \
#       bash experiments/speculators_curves.sh [recipe] [key=value ...]
#
# Each trainer runs once, for the largest budget, with its learning-rate schedule sized to end there (*_MAX_STEPS:
# its measured steps in that many minutes), and keeps a checkpoint every minute or so with the time it was written;
# each budget serves the newest checkpoint written within it. The clock starts when the trainer's command starts
# (model loading included) and includes align's cache filling; speculators' conversion (its offline hidden states,
# which speculators makes with a vLLM server) is timed apart, in convert.log. Matched as in
# experiments/speculators_dflash.sh (data, draft layers and aux layers, gamma, blocks a step, lr, AdamW, warm-up),
# plus the pruned draft vocabulary (the same d2t/t2d maps for both) and bf16 autocast, and the draft layers' attention
# (full and bidirectional in both: speculators' snapshots get sliding_window_non_causal true before vLLM serves them).
# Neither validates on the way (align: train.eval_every at the end; speculators: --train-data-ratio 0.99, its smallest
# held-out split, validated once an epoch).
#
# With states.out set (an override), align trains on the verifier states `align states` computes first, timed apart
# as speculators' conversion is (states.log).
#
# Environment: as speculators_dflash.sh (ALIGN, ALIGN_VLLM_PYTHON); WORK (default checkpoints/speculators-curves);
# TRAINERS (default "spec align": the trainers run, e.g. "align" alone to add align's points to a WORK whose
# speculators side is done).
set -euo pipefail
cd "$(dirname "$0")/.."
recipe=${1:-recipes/smollm2/dflash.yaml}
shift || true
ALIGN=${ALIGN:-.venv/bin/align}
VLLM_PY=${ALIGN_VLLM_PYTHON:-.venv-vllm/bin/python}
ALIGN_PY=$(dirname "$(command -v "$ALIGN" || echo "$ALIGN")")/python
BUDGETS=${BUDGETS:-"10 20 30"}
TRAINERS=${TRAINERS:-"spec align"}
runs() { [[ " $TRAINERS " == *" $1 "* ]]; }
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
work=${WORK:-checkpoints/speculators-curves}
steps() { "$ALIGN_PY" experiments/speculators_steps.py "$@"; }

get() { "$ALIGN" validate "$recipe" "$@" --get "$key"; }
key=verifier.path; verifier=$(get "$@")
key=verifier.dtype; dtype=$(get "$@")
key=trajectories.out; trajectories=$(get "$@")
key=train.max_steps; recipe_steps=$(get "$@")
key=train.micro_batch_size; micro_batch=$(get "$@")
key=train.windows_per_sequence; windows=$(get "$@")
key=train.lr; lr=$(get "$@")
key=train.warmup_steps; warmup=$(get "$@")
key=decode.gamma; gamma=$(get "$@")
key=dflash.num_layers; num_layers=$(get "$@")
key=dflash.aux_layer_ids; layer_ids=$(get "$@" | tr -d '[] ')
key=dflash.draft_vocab_size; draft_vocab=$(get "$@")
key=states.out; states=$(get "$@")
ranks=2
# Every draft layer full (bidirectional) attention, as align's: speculators 0.9 makes the layers it is not told of
# sliding_attention, block-causal (see docs/dflash-and-vllm.md)
full_layers=($(seq 0 $((num_layers - 1))))
last_budget=$(echo "$BUDGETS" | tr ' ' '\n' | sort -n | tail -1)
ALIGN_MAX_STEPS=${ALIGN_MAX_STEPS:-$recipe_steps}
SPEC_MAX_STEPS=${SPEC_MAX_STEPS:-$recipe_steps}
mkdir -p "$work"
[ -f "$trajectories/manifest.json" ] || { echo "speculators_curves: $trajectories has no manifest.json (run: $ALIGN trajectories $recipe)" >&2; exit 2; }
vocab_flag=(); [ "$draft_vocab" != None ] && vocab_flag=(--draft-vocab-size "$draft_vocab")

# 1. Trajectories -> speculators' dataset, the verifier in the recipe's dtype, align's d2t/t2d beside it.
if runs spec && [ ! -f "$work/data/align_conversion.json" ]; then
  rm -rf "$work/data"
  { time OMP_NUM_THREADS=2 "$ALIGN_PY" -m align.speculators_data --trajectories "$trajectories" \
      --verifier "$verifier" --layer-ids "$layer_ids" --dtype "$dtype" "${vocab_flag[@]}" --out "$work/data"; } \
    > "$work/convert.log" 2>&1
fi
runs spec && max_len=$(steps max-len "$work/data/align_conversion.json")

# 2. speculators' trainer. It writes mid-epoch checkpoints over one folder per epoch, so each new one is copied
# aside with the seconds since the start (spec-times.tsv); it is stopped at the last budget.
if runs spec && [ ! -f "$work/spec-times.tsv" ]; then
  rm -rf "$work/spec-train" "$work/spec-snapshots"
  mkdir -p "$work/spec-snapshots"
  start=$(date +%s)
  OMP_NUM_THREADS=2 "$VLLM_PY" experiments/speculators_cpu_train.py --speculator-type dflash \
    --verifier-name-or-path "$verifier" --data-path "$work/data" --save-path "$work/spec-train" \
    --log-dir "$work/spec-logs" --num-layers "$num_layers" --full-attention-indices "${full_layers[@]}" \
    --target-layer-ids ${layer_ids//,/ } \
    --block-size $((gamma + 1)) --max-anchors $((ranks * micro_batch * windows)) \
    --total-seq-len $((ranks * micro_batch * max_len)) --max-steps "$SPEC_MAX_STEPS" --epochs 100000 \
    --optimizer adamw --lr "$lr" --scheduler-warmup-steps "$warmup" --num-workers 0 "${vocab_flag[@]}" \
    --hidden-states-dtype bfloat16 --loss-implementation eager --draft-attn-impl sdpa --checkpoint-freq 0.1 \
    --train-data-ratio 0.99 > "$work/spec-train.log" 2>&1 &
  trainer=$!
  seen=""
  while kill -0 $trainer 2>/dev/null && [ $(($(date +%s) - start)) -lt $((last_budget * 60)) ]; do
    sleep 5
    newest=$(steps newest-state "$work/spec-train")  # "FOLDER GLOBAL_STEP MTIME" or ""
    [ -z "$newest" ] && continue
    read -r folder step mtime <<< "$newest"
    [ "$step" = "$seen" ] && continue
    seen=$step
    cp -r "$folder" "$work/spec-snapshots/step_$step"
    printf '%s\t%s\n' $((mtime - start)) "$work/spec-snapshots/step_$step" >> "$work/spec-times.partial"
  done
  kill $trainer 2>/dev/null || true
  wait $trainer 2>/dev/null || true
  mv "$work/spec-times.partial" "$work/spec-times.tsv"
fi

# 3. align's trainer, the same way (a checkpoint every minute or so, none deleted, no held-out eval on the way).
if runs align && [ "$states" != None ] && [ ! -f "$states/manifest.json" ]; then
  { time "$ALIGN" states "$recipe" --num_gpus $ranks "$@"; } > "$work/states.log" 2>&1
fi
if runs align && [ ! -f "$work/align-times.tsv" ]; then
  rm -rf "$work/align-train"
  start=$(date +%s)
  OMP_NUM_THREADS=1 timeout -s INT $((last_budget * 60)) "$ALIGN" train "$recipe" --num_gpus $ranks \
    train.out="$work/align-train" train.max_steps="$ALIGN_MAX_STEPS" train.save_every=50 train.keep_last=null \
    train.eval_every="$ALIGN_MAX_STEPS" "$@" > "$work/align-train.log" 2>&1 || true
  steps align-times "$work/align-train" "$start" > "$work/align-times.tsv"
fi

# 4. Each budget's checkpoint of each trainer, served by vLLM (and decoded by align's runtime) on the same prompts.
for budget in $BUDGETS; do
  for which in $TRAINERS; do
    drafter=$(steps pick "$work/$which-times.tsv" $((budget * 60)))
    out="$work/serve-$which-$budget"
    [ -z "$drafter" ] && { echo "speculators_curves: no $which checkpoint within $budget minutes" >&2; continue; }
    [ $which = spec ] && steps bidirectional "$drafter"
    [ -f "$out/serve_check.json" ] || "$ALIGN" serve-check "$recipe" serve_check.drafter="$drafter" \
      serve_check.out="$out" "serve_check.concurrency=[1]" serve_check.ngram=false "$@" || true
  done
done
steps curves "$work" $BUDGETS
