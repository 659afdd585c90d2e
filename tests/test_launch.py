"""Launching at scale: the SLURM script on a simulated 2-node allocation (two launchers on this machine, no ssh)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TOY_TRAJECTORIES, checkout_env

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this file out; CI runs it

ROOT = Path(__file__).resolve().parents[1]


def stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


def test_slurm_script_on_two_simulated_nodes(toy_trajectories, tmp_path):
    root, traj = toy_trajectories
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # scontrol lists the allocation's nodes (two names for this machine); srun starts the command once per node.
    stub(bin_dir, "scontrol", 'printf "localhost\\n127.0.0.1\\n"\n')
    stub(bin_dir, "srun", 'echo "srun $*" >> "$SRUN_LOG"\nshift\n'
                          'for n in 0 1; do SLURM_NODEID=$n "$@" > "$SRUN_LOG.node$n" 2>&1 & done\nwait\n')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    # checkout_env: the ranks run this checkout's align/train.py, which must import this checkout's align.
    env = checkout_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node[1-2]", SLURM_JOB_ID="42",
                       SLURM_SUBMIT_DIR=str(ROOT), GPUS_PER_NODE="1", MASTER_PORT=str(port),
                       ALIGN_HOSTFILE=str(tmp_path / "hostfile"), SRUN_LOG=str(tmp_path / "srun.log"),
                       DEEPSPEED=str(Path(sys.executable).parent / "deepspeed"), OMP_NUM_THREADS="1",
                       HF_HUB_OFFLINE="1")
    result = subprocess.run(
        ["bash", "launch/slurm.sbatch", "recipes/tiny/align.yaml", f"drafter.path={root / 'ck' / 'drafter-base'}",
         f"verifier.path={root / 'ck' / 'verifier'}", f"trajectories.out={traj}", *TOY_TRAJECTORIES, f"train.out={out}", "train.max_steps=2", "train.micro_batch_size=2",
         "train.gamma=4"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    logs = "".join(p.read_text() for p in tmp_path.glob("srun.log*"))
    assert result.returncode == 0, result.stdout + result.stderr + logs[-3000:]
    assert (tmp_path / "hostfile").read_text() == "localhost slots=1\n127.0.0.1 slots=1\n"
    launch = (tmp_path / "srun.log").read_text()
    assert "--ntasks-per-node=1" in launch and "--no_ssh" in launch and "--num_nodes 2" in launch
    assert "--master_addr localhost" in launch and "--node_rank $SLURM_NODEID" in launch
    meta = json.loads((out / "step_2" / "meta.json").read_text())
    assert meta["world_size"] == 2  # one rank on each simulated node
