#!/usr/bin/env bash
# The test command: install what is missing, then run the whole suite offline on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
# vLLM's own environment (.venv-vllm): tests/stages/test_vllm.py drives it through align/vllm_worker.py.
bash launch/setup_vllm.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The Dream and LLaDA family tests run on the upstream files where a checkout has them beside it (../shared/realcode,
# unmodified, as the Hub ships them), else on the stand-ins in tests/fixtures (a user's clone): tests/fixtures/README.md
if [[ -z "${ALIGN_REMOTE_CODE:-}" && -d ../shared/realcode/dream && -d ../shared/realcode/llada ]]; then
    export ALIGN_REMOTE_CODE=$(cd ../shared/realcode && pwd)
fi
# A pytest-xdist worker per core, at most 4: much of the suite runs one thread at a time (2,884 s in one process on a
# 2-core VM, 1,938 s on two workers). A module whose tests share a module-scoped fixture stays on one worker
# (--dist loadgroup; tests/conftest.py groups them). ALIGN_TEST_WORKERS=0 runs it in this process.
workers=${ALIGN_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}
# A test that hangs (a rank waiting on a peer that died, say) fails after ALIGN_TEST_TIMEOUT seconds with every
# thread's stack, instead of holding the suite until CI's limit: the slowest test takes about 4 minutes here.
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadgroup --timeout "${ALIGN_TEST_TIMEOUT:-900}" "$@"
