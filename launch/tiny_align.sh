#!/usr/bin/env bash
# The main job on a laptop CPU: align the shipped tiny drafter to the shipped verifier with 2 DeepSpeed processes,
# then print τ and speedup before and after. Extra key=value arguments override recipes/tiny/align.yaml.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
# Multi-process stages give each rank one thread themselves; single-process eval keeps every core.
export HF_HUB_OFFLINE=1
recipe=recipes/tiny/align.yaml
resolved=$(.venv/bin/align validate "$recipe" "$@")  # a bad override stops the job here (exit 2), before any work
{ read -r out; read -r trajectories; } < <(.venv/bin/python -c \
  "import sys, yaml; r = yaml.safe_load(sys.stdin); print(r['train']['out']); print(r['trajectories']['out'])" \
  <<< "$resolved")
.venv/bin/align trajectories "$recipe" --num_gpus 2 "$@"
.venv/bin/align train "$recipe" --num_gpus 2 "$@"
step=$(ls -d "$out"/step_* | sort -V | tail -n 1)
# One interleaved run: the drafter-base and the aligned drafter against the same AR baselines. CPS's trigram proxy is
# fitted on the verifier's own continuations (the trajectories), which suits both drafters better than the corpus.
.venv/bin/align eval recipes/tiny/eval.yaml eval.methods=[specdiff,specdiff_cps_adl] \
  eval.num_prompts=16 eval.sampling_temperature=0 "eval.compare_drafters={aligned: $step}" eval.out="$out/eval" \
  decode.cps_proxy_corpus="$trajectories"
.venv/bin/python - "$out/eval/eval.json" <<'PY'
import json, sys
methods = json.load(open(sys.argv[1]))["methods"]
print(f"\n{'method':<18} {'tau before':>10} {'tau after':>10} {'ratio':>6} {'speedup before':>15} {'speedup after':>14}")
for name, before in methods.items():
    after = methods.get(f"{name}@aligned")
    if after:
        print(f"{name:<18} {before['tau']:>10.2f} {after['tau']:>10.2f} {after['tau'] / before['tau']:>5.2f}x "
              f"{before['speedup']:>14.2f}x {after['speedup']:>13.2f}x")
PY
