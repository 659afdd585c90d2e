#!/usr/bin/env bash
# The main job on a laptop CPU: align the shipped tiny drafter to the shipped verifier with 2 DeepSpeed processes,
# then print τ and speedup before and after. Extra key=value arguments override recipes/tiny/align.yaml.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
recipe=recipes/tiny/align.yaml
out=$(.venv/bin/align validate "$recipe" "$@" | .venv/bin/python -c "import sys, yaml; print(yaml.safe_load(sys.stdin)['train']['out'])")
.venv/bin/align trajectories "$recipe" --num_gpus 2 "$@"
.venv/bin/align train "$recipe" --num_gpus 2 "$@"
step=$(ls -d "$out"/step_* | sort -V | tail -n 1)
eval_args=(eval.methods=[specdiff,specdiff2_select,specdiff_cps_adl] eval.num_prompts=24 eval.sampling_temperature=0)
.venv/bin/align eval recipes/tiny/eval.yaml "${eval_args[@]}" eval.out="$out/eval-before"
.venv/bin/align eval recipes/tiny/eval.yaml "${eval_args[@]}" drafter.path="$step" eval.out="$out/eval-after"
.venv/bin/python - "$out" <<'PY'
import json, sys
out = sys.argv[1]
before, after = (json.load(open(f"{out}/eval-{k}/eval.json"))["methods"] for k in ("before", "after"))
print(f"\n{'method':<18} {'tau before':>10} {'tau after':>10} {'speedup before':>15} {'speedup after':>14}")
for name in before:
    if name.startswith("specdiff"):
        b, a = before[name], after[name]
        print(f"{name:<18} {b['tau']:>10.2f} {a['tau']:>10.2f} {b['speedup']:>14.2f}x {a['speedup']:>13.2f}x")
PY
