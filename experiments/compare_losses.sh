#!/usr/bin/env bash
# Compare alignment losses on the same trajectories (a benchmark, not a test), with the DistillSpec-style GKD AR
# drafter beside them:
#   bash experiments/compare_losses.sh [key=value ...]     # LOSSES="streak ce_streak streak_tv fkl" by default;
#                                                     # LOSSES="ce_streak dpace ce_streak+first_error_focal" combines
# Trains one drafter per loss from recipes/tiny/align.yaml (2 processes; KD losses read the verifier online), distils
# the AR drafter with `align gkd`, then evaluates every drafter at temperature 0 in one interleaved `align eval` run
# (the drafter-base as `specdiff`, each loss as `specdiff@<loss>`) and the GKD drafter in a second one.
# Reports: checkpoints/losses/eval/report.md and checkpoints/losses/eval-gkd/report.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
# Multi-process stages give each rank one thread themselves; single-process eval keeps every core.
export HF_HUB_OFFLINE=1
recipe=recipes/tiny/align.yaml
root=checkpoints/losses
losses=${LOSSES:-streak ce_streak streak_tv fkl}
# The protocol of docs/results/2026-11-30-losses*.md: 800 prompts' trajectories and 150 steps per loss (the main job
# trains longer on more; key=value arguments still override these).
protocol=(trajectories.num_prompts=800 trajectories.out=data/tiny/trajectories-800 train.max_steps=150 train.save_every=50)
.venv/bin/align trajectories "$recipe" --num_gpus 2 "${protocol[@]}" "$@"
compare=()
for loss in $losses; do
  # online: losses that read the verifier's distributions get them from a verifier forward in the step; the others
  # train on the trajectories' tokens as offline. A finished run is left as it is (it resumes at its final step).
  weights="$(echo "$loss" | sed 's/+/: 1.0, /g'): 1.0"  # a+b: both losses, weight 1 each
  .venv/bin/align train "$recipe" --num_gpus 2 "train.losses={$weights}" train.data_mode=online \
    train.out="$root/$loss" train.final_eval_prompts=0 "${protocol[@]}" "$@"
  compare+=("${loss//+/-}: $(.venv/bin/align latest "$root/$loss")")  # a label has no +
done
[ -d "$root/gkd/final" ] || .venv/bin/align gkd "$recipe" gkd.out="$root/gkd" "$@"
joined=$(IFS=,; echo "${compare[*]}")
common=(eval.num_prompts=24 eval.sampling_temperature=0)
.venv/bin/align eval recipes/tiny/eval.yaml "${common[@]}" eval.methods=[specdiff,sd_ar] \
  "eval.compare_drafters={$joined}" eval.out="$root/eval"
.venv/bin/align eval recipes/tiny/eval.yaml "${common[@]}" eval.methods=[sd_ar] ar_drafter.path="$root/gkd/final" \
  eval.out="$root/eval-gkd"
