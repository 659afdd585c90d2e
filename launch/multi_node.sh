#!/usr/bin/env bash
# Several machines from an MPI-style hostfile ("host slots=GPUS" per line), the same file on every machine:
#   HOSTFILE=hosts bash launch/multi_node.sh recipes/x.yaml [key=value ...]
# reaches the other hosts from this one over passwordless ssh (DeepSpeed's pdsh runner; pdsh must be installed).
# Without ssh, start it once on each host, each with its own line of the hostfile as NODE_RANK (0..N-1):
#   HOSTFILE=hosts NODE_RANK=1 MASTER_ADDR=node1 bash launch/multi_node.sh recipes/x.yaml [key=value ...]
# MASTER_ADDR (rank 0's address; default the hostfile's first host) and MASTER_PORT (default 29500) must be the same
# on every host. PYTHON chooses the interpreter (default .venv/bin/python, else python on PATH).
# It runs `align train ... --hostfile --node_rank ...`, which checks the recipe and these settings (one line, exit 2)
# before DeepSpeed's launcher starts. docs/gpus.md#several-nodes says what has run this way.
set -euo pipefail
cd "$(dirname "$0")/.."
fail() { echo "multi_node.sh: error: $*" >&2; exit 2; }
python=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
[ -n "${HOSTFILE:-}" ] || fail "set HOSTFILE to an MPI-style hostfile ('host slots=N' per line)"
args=(--hostfile "$HOSTFILE" --master_port "${MASTER_PORT:-29500}")
if [ -n "${MASTER_ADDR:-}" ]; then
  args+=(--master_addr "$MASTER_ADDR")
fi
if [ -n "${NODE_RANK+set}" ]; then
  [ -n "$NODE_RANK" ] || fail "NODE_RANK is empty; set it to this host's line of $HOSTFILE, from 0"
  args+=(--node_rank "$NODE_RANK")
fi
exec "$python" -m align.cli train "$@" "${args[@]}"
