#!/usr/bin/env bash
# One machine, every GPU (or N CPU processes):  bash launch/single_node.sh recipes/x.yaml [key=value ...]
#   NUM_GPUS=8 bash launch/single_node.sh recipes/qwen2.5-7b-diffucoder.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
deepspeed=${DEEPSPEED:-$( [ -x .venv/bin/deepspeed ] && echo .venv/bin/deepspeed || echo deepspeed )}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
num=${NUM_GPUS:-$gpus}
if [ "$gpus" -eq 0 ]; then
  num=${NUM_GPUS:-1}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # CPU ranks would otherwise fight over the cores
fi
exec "$deepspeed" --num_gpus "$num" align/train.py "$@"
