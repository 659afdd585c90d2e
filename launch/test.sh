#!/usr/bin/env bash
# The test command: install what is missing, then run the whole suite offline on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
# vLLM's own environment (.venv-vllm): tests/stages/test_vllm.py drives it through align/vllm_worker.py.
bash launch/setup_vllm.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q "$@"
