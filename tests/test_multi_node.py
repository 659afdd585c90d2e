"""Several nodes, for real, on one machine: two DeepSpeed launchers as two nodes (no ssh, one rank each, the master on
the loopback) started by launch/multi_node.sh as a user starts it, and by launch/slurm.sbatch in a simulated SLURM
allocation; each trains a tiny recipe under ZeRO-3 (gloo, CPU) and must give the losses and the weights of one node
running the same 2 ranks, bit for bit. Bad settings are refused in one line, exit 2, before any launcher starts."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import TOY_TRAJECTORIES, checkout_env

from align.cli import build_parser
from align.config import RecipeError
from align.launch import check_launch, deepspeed_command

ROOT = Path(__file__).resolve().parents[1]
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")
STEPS = 3
RUN_S = 600  # a rank waiting for a peer that never comes waits for the process group's timeout (30 minutes)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra: str) -> dict[str, str]:
    # The ranks run this checkout's align/train.py, which must import this checkout's align (checkout_env); the
    # scripts' PYTHON is this interpreter. One thread a rank: two ranks share this machine's cores.
    return checkout_env(PYTHON=sys.executable, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **extra)


def run_all(commands: list[tuple[list[str], dict[str, str]]]) -> list[tuple[int, str]]:
    """Start every (command, environment) at once, as nodes start; (exit status, output) of each. A run that hangs
    is killed, group and all, and fails the test."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for cmd, e in commands]
    results = []
    try:
        for proc in procs:
            results.append((proc.wait(timeout=RUN_S), proc.stdout.read()))
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"a node did not finish in {RUN_S} s: " + " | ".join(p.communicate()[0][-1500:] for p in procs))
    return results


def recipe_args(trajectories, out: Path) -> list[str]:
    root, traj = trajectories
    return ["recipes/tiny/align.yaml", f"drafter.path={root / 'ck' / 'drafter-base'}",
            f"verifier.path={root / 'ck' / 'verifier'}", f"trajectories.out={traj}", *TOY_TRAJECTORIES,
            f"train.out={out}", "train.gamma=4", "train.windows_per_sequence=2", "train.lr=3e-3",
            "train.warmup_steps=0", "train.eval_every=100", "train.final_eval_prompts=0", f"train.max_steps={STEPS}",
            "train.micro_batch_size=2", "train.zero_stage=3"]


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(run: Path, reference: Path) -> None:
    """`run` trained exactly as `reference` did: the same loss at every step and the same saved weights, bitwise."""
    assert len(losses(reference)) == STEPS
    assert losses(run) == losses(reference)
    assert json.loads((run / f"step_{STEPS}" / "meta.json").read_text())["world_size"] == 2
    weights, expected = (load_file(r / f"step_{STEPS}" / "model.safetensors") for r in (run, reference))
    assert weights.keys() == expected.keys()
    different = [name for name in expected if not torch.equal(weights[name], expected[name])]
    assert not different, different


@pytest.fixture(scope="module")
def one_node(toy_trajectories, tmp_path_factory) -> Path:
    """The reference: one node, one launcher, 2 ranks, ZeRO-3 (DeepSpeed's own command, as docs/training.md has)."""
    out = tmp_path_factory.mktemp("one-node") / "run"
    cmd = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "align/train.py",
           *recipe_args(toy_trajectories, out)]
    [(status, log)] = run_all([(cmd, env())])
    assert status == 0, log[-3000:]
    return out


@pytest.mark.slow  # three 2-rank DeepSpeed runs (the reference's and this one's two launchers)
def test_two_nodes_by_multi_node_sh_train_as_one_node_does(toy_trajectories, one_node, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")  # names only: both "hosts" are this machine
    out = tmp_path / "run"
    common = dict(HOSTFILE=str(hostfile), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    nodes = run_all([(["bash", "launch/multi_node.sh", *recipe_args(toy_trajectories, out)],
                      env(NODE_RANK=str(rank), **common)) for rank in (0, 1)])
    for rank, (status, log) in enumerate(nodes):
        assert status == 0, f"node {rank}: {log[-3000:]}"
        # each launcher started its own node's one rank, without ssh, and the two made one world of 2
        assert f"--no_ssh --node_rank {rank}" in log and "dist_world_size=2" in log, log[-3000:]
        assert "'node-a': [0], 'node-b': [1]" in log, log[-3000:]  # global rank mapping: node-a has rank 0
    assert_same_run(out, one_node)


def test_the_env_file_carries_each_value_through_deepspeeds_pdsh_export_to_the_remote_shell(tmp_path, monkeypatch):
    """align's env file, read line by line as DeepSpeed's runner reads it and exported by its PDSHRunner as the
    remote shell's command does: every forwarded value arrives as it was (JSON, spaces, $ ` \\ and quotes), the
    user's own .deepspeed_env wins where it names a variable too, and nothing else is forwarded."""
    import argparse

    from deepspeed.launcher.multinode_runner import PDSHRunner

    from align.launch import remote_env_file

    sent = {"ALIGN_HELD_LOCKS": json.dumps({"/runs/my run": 123}), "DEEPSPEED_TIMEOUT": "7",
            "ALIGN_ODD": 'a$b`c\\d"e f', "HF_HOME": "/ours", "UNRELATED": "left here"}
    monkeypatch.setattr(Path, "home", lambda: tmp_path / "home")
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".deepspeed_env").write_text("HF_HOME=/theirs\n")
    file = remote_env_file(sent)
    runner = PDSHRunner(argparse.Namespace(user_args=[], user_script="align/train.py"), "")
    for line in file.read_text().splitlines():
        key, value = line.split("=", maxsplit=1)
        runner.add_export(key, value)
    file.unlink()
    exports = "".join(f"export {key}={value}; " for key, value in runner.exports.items())  # as PDSHRunner.get_cmd
    shown = subprocess.run(["env", "-i", "bash", "-c", exports + f"{sys.executable} -c 'import json, os; "
                            "print(json.dumps(dict(os.environ)))'"], capture_output=True, text=True, check=True)
    received = json.loads(shown.stdout)
    assert {key: received.get(key) for key in sent} == {**sent, "HF_HOME": "/theirs", "UNRELATED": None}


# pdsh as DeepSpeed's runner calls it (pdsh -S -f N -w host1,host2 <command>): each host's command runs in a shell that,
# as an ssh login does, has none of the caller's environment, its %n the host's index in the list.
FAKE_PDSH = r"""#!/usr/bin/env bash
while [ $# -gt 0 ]; do case "$1" in -S) shift ;; -f) shift 2 ;; -w) hosts=$2; shift 2 ;; *) break ;; esac; done
n=0; pids=""
for host in $(echo "$hosts" | tr , ' '); do
  env -i HOME="$HOME" PATH=/usr/bin:/bin bash -c "$(echo "$*" | sed "s/%n/$n/g")" & pids="$pids $!"; n=$((n + 1))
done
status=0; for pid in $pids; do wait $pid || status=1; done; exit $status
"""


@pytest.mark.slow  # a 2-rank DeepSpeed run
def test_ranks_reached_over_pdsh_get_the_environment_align_reads(toy_trajectories, one_node, tmp_path):
    """A hostfile's hosts are reached by pdsh over ssh, whose shell has none of the launching environment (issue 51):
    here a pdsh that runs each host's command under `env -i`, and an ssh that answers the runner's reachability
    check. DEEPSPEED_TIMEOUT reaches rank 0 (which says the timeout it read), the lock align's launcher holds for the
    ranks (ALIGN_HELD_LOCKS) reaches both, and the run trains as one node does."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for name, text in (("pdsh", FAKE_PDSH), ("ssh", "#!/bin/sh\nexit 0\n")):
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "align.cli", "train", *recipe_args(toy_trajectories, out), "--hostfile",
           str(hostfile), "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    [(status, log)] = run_all([(cmd, env(DEEPSPEED_TIMEOUT="7", PATH=f"{tools}:{os.environ['PATH']}"))])
    assert status == 0, log[-3000:]
    assert "pdsh" in log and "a rank waits up to 7 min" in log, log[-3000:]
    assert_same_run(out, one_node)
    # the runner read align's env file for the launch, which is removed after it
    [env_file] = set(re.findall(r"deepspeed_env file = (\S+)", log))
    assert "align-deepspeed-env-" in env_file and not Path(env_file).exists()


@pytest.mark.slow  # a 1-rank DeepSpeed run
def test_exclude_leaves_out_the_slots_it_names(toy_trajectories, tmp_path):
    """`align train --exclude localhost:0` hands DeepSpeed's runner its filter: on a host of two slots (LOCAL_SIZE=2,
    as a 2-GPU host has two) one rank runs, on slot 1, and trains the run."""
    out = tmp_path / "run"
    [(status, log)] = run_all([([str(Path(sys.executable).parent / "align"), "train",
                                 *recipe_args(toy_trajectories, out), "train.zero_stage=0", "--exclude", "localhost:0"],
                                env(LOCAL_SIZE="2"))])
    assert status == 0, log[-3000:]
    assert "--exclude localhost:0" in log and "'localhost': [1]" in log, log[-3000:]
    assert json.loads((out / f"step_{STEPS}" / "meta.json").read_text())["world_size"] == 1
    assert len(losses(out)) == STEPS


def srun_stub(folder: Path) -> Path:
    """srun, as SLURM starts a job step of one task per node: the command once per node of the allocation, with that
    node's SLURM_NODEID and SLURM_PROCID, the environment passed on; its status is the worst of the tasks'. Its
    arguments are logged."""
    folder.mkdir()
    srun = folder / "srun"
    srun.write_text('#!/usr/bin/env bash\necho "srun $*" >> "$SRUN_LOG"\nwhile [[ "$1" == --* ]]; do shift; done\n'
                    'pids=()\nfor ((n = 0; n < SLURM_NNODES; n++)); do\n'
                    '  SLURM_NODEID=$n SLURM_PROCID=$n "$@" > "$SRUN_LOG.node$n" 2>&1 & pids+=($!)\ndone\n'
                    'status=0\nfor p in "${pids[@]}"; do wait "$p" || status=$?; done\nexit $status\n')
    srun.chmod(0o755)
    return folder


def slurm_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The batch step's environment in a 2-node allocation (what sbatch sets), with this machine as both nodes: the
    node names are not resolvable here, so the master is the loopback."""
    bin_dir = srun_stub(tmp_path / "bin")
    return env(**{"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[01-02]",
                  "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_GPUS_ON_NODE": "1",
                  "ALIGN_HOSTFILE": str(tmp_path / "hostfile"), "SRUN_LOG": str(tmp_path / "srun.log"),
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **extra})


@pytest.mark.slow  # a 2-node run (and the reference's, shared with the test above)
def test_two_nodes_by_slurm_sbatch_train_as_one_node_does(toy_trajectories, one_node, tmp_path):
    out = tmp_path / "run"
    # scontrol is absent here: ALIGN_NODES, which the script documents, names the allocation's hosts.
    [(status, log)] = run_all([(["bash", "launch/slurm.sbatch", *recipe_args(toy_trajectories, out)],
                                slurm_env(tmp_path, ALIGN_NODES="gpu01 gpu02"))])
    nodes = [(tmp_path / f"srun.log.node{n}").read_text() for n in (0, 1) if (tmp_path / f"srun.log.node{n}").exists()]
    assert status == 0, log + "".join(n[-3000:] for n in nodes)
    assert (tmp_path / "hostfile").read_text() == "gpu01 slots=1\ngpu02 slots=1\n"
    srun = "srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash launch/slurm.sbatch"
    assert (tmp_path / "srun.log").read_text() == f"{srun} {' '.join(recipe_args(toy_trajectories, out))}\n"
    for rank, node_log in enumerate(nodes):
        assert f"--no_ssh --node_rank {rank}" in node_log and "dist_world_size=2" in node_log, node_log[-3000:]
    assert len(nodes) == 2
    assert_same_run(out, one_node)


@pytest.mark.slow  # a 2-node DeepSpeed launch (it stops before any model is loaded)
def test_nodes_that_do_not_share_the_run_folder_are_refused_before_any_work(toy_trajectories, tmp_path):
    # Two "nodes" of one machine, each with its own folder at train.out: as two hosts whose train.out is local disk.
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    common = dict(HOSTFILE=str(hostfile), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    outs = [tmp_path / "node-a" / "run", tmp_path / "node-b" / "run"]
    nodes = run_all([(["bash", "launch/multi_node.sh", *recipe_args(toy_trajectories, outs[rank])],
                      env(NODE_RANK=str(rank), **common)) for rank in (0, 1)])
    for rank, (status, log) in enumerate(nodes):
        assert status == 2, f"node {rank}: {log[-3000:]}"
    said = [line for line in nodes[0][1].splitlines() if line.startswith("align train: error:")]
    assert len(said) == 1 and f"train.out: {outs[0]} is not one folder for every node: rank 1 (" in said[0], said
    for out in outs:  # nothing trained, nothing left behind but rank 0's run record
        assert not list(out.glob("step_*")) and not (out / "ds_state").exists() and not (out / ".shared-probe.tmp").exists()


def process_groups(pid: int) -> list[int]:
    """The process groups of `pid` and all its descendants."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(os.getpgid(p))
        children = Path(f"/proc/{p}/task/{p}/children")
        todo += [int(c) for c in children.read_text().split()] if children.exists() else []
    return sorted(set(found))


@pytest.mark.slow  # a 2-node DeepSpeed launch, one node frozen mid-run
def test_a_frozen_node_stops_the_other_within_its_silence_window(toy_trajectories, tmp_path):
    # Node 1 is stopped (SIGSTOP: its connections stay open, as a hung host's or a partitioned one's do), so neither
    # gloo nor NCCL sees it gone before the collectives' timeout (here 30 minutes); node 0 must end by itself.
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    common = dict(HOSTFILE=str(hostfile), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    out = tmp_path / "run"
    args = [*recipe_args(toy_trajectories, out), "train.max_steps=100000", "train.peer_silence_s=10"]
    logs = [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    procs = [subprocess.Popen(["bash", "launch/multi_node.sh", *args], cwd=ROOT, env=env(NODE_RANK=str(rank), **common),
                              stdout=logs[rank].open("w"), stderr=subprocess.STDOUT, start_new_session=True)
             for rank in (0, 1)]
    try:
        deadline = time.monotonic() + RUN_S
        while not ((out / "metrics.jsonl").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline and procs[0].poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.5)
        for group in process_groups(procs[1].pid):  # align starts DeepSpeed's runner in a group of its own
            os.killpg(group, signal.SIGSTOP)
        status = procs[0].wait(timeout=RUN_S)
    finally:
        for proc in procs:
            for group in process_groups(proc.pid) if proc.poll() is None else ():
                os.killpg(group, signal.SIGKILL)
            proc.wait()
    log = logs[0].read_text()
    assert status == 1, log[-3000:]
    said = [line for line in log.split("\n") if "has not been heard from" in line]
    assert len(said) == 1 and said[0].startswith("align train: error: rank 0 (") and ": rank 1 (" in said[0], said
    assert "train.peer_silence_s" in said[0] and "rerun the same command to resume" in said[0]


# --------------------------------------------------------------------------------------------------------------------
# bad settings: one line, exit 2, and no launcher
# --------------------------------------------------------------------------------------------------------------------
def refused(cmd: list[str], environment: dict[str, str], says: str, tmp_path: Path) -> None:
    result = subprocess.run(cmd, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and says in result.stderr, result.stderr
    assert "deepspeed" not in result.stdout and "srun" not in result.stdout, result.stdout  # nothing was launched
    assert not (tmp_path / "never").exists()  # train.out: nothing was written


def two_hosts(tmp_path: Path) -> str:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two names for this machine\nnode-a slots=1\n\nnode-b slots=1\n")
    return str(hostfile)


@pytest.mark.parametrize("settings, says", [
    ({}, "multi_node.sh: error: set HOSTFILE"),
    ({"HOSTFILE": "{tmp}/missing"}, "argument --hostfile: no such file"),
    ({"HOSTFILE": "{hosts}", "NODE_RANK": ""}, "multi_node.sh: error: NODE_RANK is empty"),
    ({"HOSTFILE": "{hosts}", "NODE_RANK": "one"}, "argument --node_rank: an integer >= 0 is expected, got 'one'"),
    ({"HOSTFILE": "{hosts}", "NODE_RANK": "0", "MASTER_PORT": "http"}, "argument --master_port"),
])
def test_multi_node_sh_refuses_bad_settings(tmp_path, settings, says):
    hosts = two_hosts(tmp_path)
    given = {k: v.format(tmp=tmp_path, hosts=hosts) for k, v in settings.items()}
    environment = {k: v for k, v in env(**given).items() if k in given or k not in ("HOSTFILE", "NODE_RANK")}
    refused(["bash", "launch/multi_node.sh", "recipes/tiny/align.yaml", f"train.out={tmp_path / 'never'}"],
            environment, says, tmp_path)


@pytest.mark.skipif(shutil.which("pdsh") is not None, reason="pdsh is installed: the runner would try ssh")
def test_multi_node_sh_without_node_rank_or_pdsh_is_refused(tmp_path):
    environment = {k: v for k, v in env(HOSTFILE=two_hosts(tmp_path)).items() if k != "NODE_RANK"}
    refused(["bash", "launch/multi_node.sh", "recipes/tiny/align.yaml", f"train.out={tmp_path / 'never'}"],
            environment, "pdsh (which DeepSpeed's runner reaches them with over ssh) is not installed", tmp_path)


@pytest.mark.parametrize("settings, says", [
    ({"SLURM_NNODES": "3"}, "SLURM_NNODES is 3 but the node list names 2 nodes"),
    ({"GPUS_PER_NODE": "0"}, "GPUS_PER_NODE is '0'"),
    ({"ALIGN_NODES": "", "SLURM_JOB_NODELIST": ""}, "no SLURM_JOB_NODELIST"),
    ({"ALIGN_SLURM_STEP": "node", "SLURM_NODEID": ""}, "SLURM_NODEID is '', not a node number"),
    ({"ALIGN_SLURM_STEP": "node", "SLURM_NODEID": "0"}, "no hostfile"),
])
def test_slurm_sbatch_refuses_bad_settings(tmp_path, settings, says):
    environment = slurm_env(tmp_path, **{"ALIGN_NODES": "gpu01 gpu02", **settings})
    refused(["bash", "launch/slurm.sbatch", "recipes/tiny/align.yaml", f"train.out={tmp_path / 'never'}"],
            environment, says, tmp_path)
    assert not (tmp_path / "srun.log").exists()


@pytest.mark.skipif(shutil.which("scontrol") is not None, reason="scontrol is installed here")
def test_slurm_sbatch_without_scontrol_asks_for_align_nodes(tmp_path):
    environment = {k: v for k, v in slurm_env(tmp_path).items() if k != "ALIGN_NODES"}
    refused(["bash", "launch/slurm.sbatch", "recipes/tiny/align.yaml", f"train.out={tmp_path / 'never'}"],
            environment, "scontrol is not installed, so gpu[01-02] cannot be expanded; set ALIGN_NODES", tmp_path)


def test_a_bad_recipe_is_refused_before_the_node_launcher_starts(tmp_path):
    environment = env(HOSTFILE=two_hosts(tmp_path), NODE_RANK="1", MASTER_ADDR="127.0.0.1")
    refused(["bash", "launch/multi_node.sh", "recipes/tiny/align.yaml", f"train.out={tmp_path / 'never'}",
             "train.zero_stage=4"], environment, "align train: error: train.zero_stage", tmp_path)


# --------------------------------------------------------------------------------------------------------------------
# the launcher options, in align's own process
# --------------------------------------------------------------------------------------------------------------------
def launch_args(*argv: str):
    _, stages = build_parser()
    return stages["train"].parse_intermixed_args(["recipes/tiny/align.yaml", *argv])


def test_node_rank_is_deepspeeds_no_ssh_and_the_master_defaults_to_the_first_host(tmp_path):
    args = launch_args("--hostfile", two_hosts(tmp_path), "--node_rank", "1")
    check_launch(args)
    assert args.master_addr == "node-a"  # not an ssh question to the first host, as the runner would ask
    cmd = deepspeed_command(args.recipe, [], hostfile=args.hostfile, master_addr=args.master_addr, node_rank=1)
    assert cmd[1:7] == ["--hostfile", args.hostfile, "--master_addr", "node-a", "--no_ssh", "--node_rank"]
    assert cmd[7] == "1"
    args = launch_args("--hostfile", args.hostfile, "--node_rank", "0", "--exclude", "node-b")
    check_launch(args)
    assert deepspeed_command(args.recipe, [], hostfile=args.hostfile, exclude=args.exclude)[1:5] == [
        "--hostfile", args.hostfile, "--exclude", "node-b"]


@pytest.mark.parametrize("argv, says", [
    (["--node_rank", "0"], "--node_rank needs --hostfile"),
    (["--hostfile", "{hosts}", "--num_nodes", "3"], "--num_nodes 3: {hosts} names 2 host(s)"),
    (["--hostfile", "{hosts}", "--num_nodes", "1", "--node_rank", "1"], "--node_rank 1: the run has 1 node(s)"),
    (["--hostfile", "{bad}", "--node_rank", "0"], "{bad} line 1 is 'node-a 1'; each line is 'host slots=N'"),
    (["--hostfile", "{empty}", "--node_rank", "0"], "{empty} names no host"),
    (["--include", "localhost:0", "--exclude", "localhost:1"], "--include and --exclude do not go together"),
    (["--include", "localhost:0", "--num_gpus", "2"], "--num_gpus and --include do not go together"),
    (["--exclude", "localhost:0:1"], "--exclude 'localhost:0:1': 'localhost:0:1' is not host[:slot[,slot ...]]"),
    (["--include", "localhost:0,"], "'localhost:0,' is not host[:slot[,slot ...]]"),
    (["--include", "localhost@localhost:1"], "localhost is named twice"),
    (["--include", "localhost:2"], "--include: localhost has slots 0..1 (this host (no --hostfile)), not 2"),
    (["--include", "gpu-7"], "--include: gpu-7 is not a host of this host (no --hostfile); its hosts: localhost"),
    (["--hostfile", "{hosts}", "--exclude", "node-c:0"], "--exclude: node-c is not a host of {hosts}"),
    (["--hostfile", "{hosts}", "--include", "node-a@node-b:1"], "--include: node-b has slots 0..0 ({hosts}), not 1"),
    (["--num_nodes", "2"], "--num_nodes 2 needs --hostfile"),
    (["--num_gpus", "2"], "--num_gpus 2: this host has 1 visible GPU(s)"),
])
def test_launcher_options_that_do_not_go_together_are_refused(tmp_path, monkeypatch, argv, says):
    monkeypatch.setenv("LOCAL_SIZE", "2")  # this host's slots, as DeepSpeed's CPU accelerator counts them
    monkeypatch.setattr("align.launch.RUNNER_HOSTFILE", str(tmp_path / "no-job-hostfile"))
    monkeypatch.setattr("align.launch.visible_gpus", lambda: 1)  # a host with one GPU
    paths = {"hosts": two_hosts(tmp_path), "bad": tmp_path / "bad", "empty": tmp_path / "empty"}
    paths["bad"].write_text("node-a 1\n")
    paths["empty"].write_text("# nothing\n")
    with pytest.raises(RecipeError) as refusal:
        check_launch(launch_args(*(a.format(**paths) for a in argv)))
    assert says.format(**paths) in str(refusal.value)


def test_num_nodes_without_a_hostfile_is_refused_before_the_launcher_starts(tmp_path, monkeypatch, capsys):
    # issue 52: the runner started, then ended in its own ValueError traceback ("Num nodes is >1 but no extra nodes")
    import align.launch
    from align.cli import main

    monkeypatch.setattr(align.launch, "RUNNER_HOSTFILE", str(tmp_path / "no-job-hostfile"))
    monkeypatch.setattr(align.launch, "start_child", lambda *a, **k: pytest.fail("the launcher started"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    monkeypatch.chdir(ROOT)
    code = main(["trajectories", "recipes/tiny/align.yaml", f"data.train_prompts={prompts}",
                 f"trajectories.out={tmp_path / 'traj'}", "--num_nodes", "2", "--num_gpus", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("align trajectories: error: --num_nodes 2 needs --hostfile"), err
    assert not (tmp_path / "traj").exists()


@pytest.mark.slow  # a 2-rank DeepSpeed launch
def test_ranks_on_one_host_leave_no_shared_memory_behind(tmp_path):
    """DeepSpeed's CPU backend, given LOCAL_SIZE equal to the world size (its launcher sets it), maps a 67 MB buffer per
    rank in /dev/shm, named by the master's address and port, and never unlinks it: a machine running many jobs (this
    suite) fills its RAM with them. align's init_distributed makes none; the ranks still reach each other."""
    script = tmp_path / "ranks.py"
    script.write_text("import sys\nfrom datetime import timedelta\nimport torch, torch.distributed as dist\n"
                      "from align.dist import init_distributed\n"
                      "rank, world = init_distributed(timedelta(seconds=120))\n"
                      "total = torch.tensor([rank + 1.0]); dist.all_reduce(total)\n"
                      "import os; local = os.environ.get('LOCAL_SIZE')\n"
                      "open(f'{sys.argv[-1]}.{rank}', 'w').write(f'{world} {total.item()} {local}')\n")
    port = str(free_port())
    proc = subprocess.run([DEEPSPEED, "--num_gpus", "2", "--master_port", port, str(script), str(tmp_path / "report")],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=RUN_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the launcher told the ranks they are all on this host (what makes DeepSpeed map the buffers), and align gives
    # LOCAL_SIZE back once it has initialised
    assert [(tmp_path / f"report.{rank}").read_text() for rank in (0, 1)] == ["2 3.0 2", "2 3.0 2"]
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))
