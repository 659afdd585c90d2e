#!/usr/bin/env bash
# Run an align stage, installing align into .venv first if needed:  bash launch/align.sh <stage> recipe.yaml [k=v ...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
exec .venv/bin/align "$@"
