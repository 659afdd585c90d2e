#!/usr/bin/env bash
# The main job on a laptop CPU: align the shipped tiny drafter to the shipped verifier with 2 DeepSpeed processes,
# then print τ and speedup before and after. Extra key=value arguments override recipes/tiny/align.yaml.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
# Multi-process stages give each rank one thread themselves; single-process eval keeps every core.
export HF_HUB_OFFLINE=1
recipe=recipes/tiny/align.yaml
# A bad override stops the job here (one line, exit 2), before any work.
out=$(.venv/bin/align validate "$recipe" "$@" --get train.out)
trajectories=$(.venv/bin/align validate "$recipe" "$@" --get trajectories.out)
.venv/bin/align trajectories "$recipe" --num_gpus 2 "$@"
.venv/bin/align train "$recipe" --num_gpus 2 "$@"
step=$(.venv/bin/align latest "$out")
# One interleaved run: the drafter-base and the aligned drafter against the same AR baselines; its report ends with
# the before/after table. CPS's trigram proxy is fitted on the verifier's own continuations (the trajectories), which
# suits both drafters better than the corpus.
.venv/bin/align eval recipes/tiny/eval.yaml eval.methods=[specdiff,specdiff_cps_adl,specdiff_tree,specdiff_cps_tree] \
  eval.num_prompts=16 eval.sampling_temperature=0 "eval.compare_drafters={aligned: $step}" eval.out="$out/eval" \
  decode.cps_proxy_corpus="$trajectories"
