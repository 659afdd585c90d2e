#!/usr/bin/env bash
# The DFlash-style drafter end to end on a laptop CPU (issue #13): train it from scratch against the shipped tiny
# verifier (recipes/tiny/dflash.yaml), print its τ and speedup beside the shipped standalone drafter's, export it in
# the speculators format and check that vLLM serves it as align runs it (align serve-check: identical greedy outputs,
# acceptance within 10% of align's τ, vLLM tokens/s with and without it). Extra key=value arguments override the
# recipe. Needs vLLM's environment for the last step: `bash launch/setup_vllm.sh` (run here when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
bash launch/setup_vllm.sh
export HF_HUB_OFFLINE=1
recipe=recipes/tiny/dflash.yaml
# A bad override stops the job here (one line, exit 2), before any work.
out=$(.venv/bin/align validate "$recipe" "$@" --get train.out)
export_dir=$(.venv/bin/align validate "$recipe" "$@" --get export.out)
.venv/bin/align trajectories "$recipe" --num_gpus 2 "$@"  # compare_losses.sh's 800 greedy ones (reused if made)
.venv/bin/align train "$recipe" --num_gpus 2 "$@"
step=$(.venv/bin/align latest "$out")
# One interleaved run: specdiff with the shipped standalone drafter (drafter-base) and with the DFlash drafter
# (specdiff@dflash) against the same AR baselines.
.venv/bin/align eval "$recipe" eval.num_prompts=16 "eval.compare_drafters={dflash: $step}" eval.out="$out/eval" "$@"
.venv/bin/align export "$recipe" drafter.path="$step" export.format=speculators export.eval="$out/eval/eval.json" "$@"
# vLLM without and with the exported drafter, beside align's runtime, on the same 16 prompts.
.venv/bin/align serve-check "$recipe" serve_check.drafter="$export_dir" eval.num_prompts=16 \
  serve_check.out="$out/serve-check" "$@"
