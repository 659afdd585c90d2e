#!/usr/bin/env bash
# Several machines from an MPI-style hostfile ("host slots=GPUS" per line):
#   HOSTFILE=hosts bash launch/multi_node.sh recipes/x.yaml [key=value ...]
# By default DeepSpeed's runner reaches the other hosts over passwordless ssh (pdsh) from this one. Without ssh,
# start this script once per host with NODE_RANK=0..N-1 and MASTER_ADDR=<first host>: each starts its own ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
deepspeed=${DEEPSPEED:-$( [ -x .venv/bin/deepspeed ] && echo .venv/bin/deepspeed || echo deepspeed )}
hostfile=${HOSTFILE:?set HOSTFILE to an MPI-style hostfile}
master=${MASTER_ADDR:-$(head -n 1 "$hostfile" | cut -d' ' -f1)}
args=(--hostfile "$hostfile" --num_nodes "$(grep -c . "$hostfile")" --master_addr "$master" --master_port "${MASTER_PORT:-29500}")
if [ -n "${NODE_RANK:-}" ]; then
  args+=(--no_ssh --node_rank "$NODE_RANK")
fi
exec "$deepspeed" "${args[@]}" align/train.py "$@"
