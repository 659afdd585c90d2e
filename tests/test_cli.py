"""The `align` command: stages and their sections in --help; bad input is one line on stderr and exit code 2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from align.cli import STAGES
from align.launch import strip_launcher_args

ROOT = Path(__file__).resolve().parents[1]


def align(*args, cwd=ROOT):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "align", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_help_lists_stages():
    result = align("--help")
    assert result.returncode == 0
    for name in STAGES:
        assert name in result.stdout


def test_stage_help_lists_its_sections():
    result = align("bootstrap", "--help")
    assert result.returncode == 0
    assert "bootstrap.verifier" in result.stdout and "data.dir" in result.stdout
    assert "train.lr" not in result.stdout  # sections the stage does not read are not listed


@pytest.mark.parametrize("args, expected", [
    (["recipes/tiny/bootstrap.yaml", "bootstrap.vocab_sise=10"], "did you mean 'bootstrap.vocab_size'?"),
    (["recipes/tiny/bootstrap.yaml", "bootstrap.vocab_size=big"], "bootstrap.vocab_size: Input should be a valid integer"),
    (["recipes/tiny/bootstrap.yaml", "bootstrap.corpus_fraction=0"], "bootstrap.corpus_fraction: Input should be greater than 0"),
    (["recipes/tiny/missing.yaml"], "recipe not found: recipes/tiny/missing.yaml"),
    (["recipes/tiny/bootstrap.yaml", "decode.gamma"], "bad override 'decode.gamma'"),
])
def test_bad_input_is_one_line_and_exit_2(args, expected):
    result = align("bootstrap", *args)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("align bootstrap: error: ") and expected in result.stderr, result.stderr


def test_bad_input_touches_nothing(tmp_path):
    out = tmp_path / "family"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    result = align("bootstrap", "recipes/tiny/bootstrap.yaml", f"bootstrap.out={out}", f"data.dir={tmp_path / 'data'}",
                   "bootstrap.verifier.num_layers=0")
    assert result.returncode == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["family"]
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"


def test_validate_prints_the_resolved_recipe():
    import yaml

    result = align("validate", "recipes/tiny/eval.yaml", "decode.gamma=5")
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["decode"]["gamma"] == 5
    assert resolved["train"]["zero_stage"] == 0  # a default the recipe never names


def test_deepspeed_local_rank_is_ignored():
    assert strip_launcher_args(["r.yaml", "--local_rank=1", "a.b=1"]) == ["r.yaml", "a.b=1"]
    assert strip_launcher_args(["r.yaml", "--local_rank", "0", "a.b=1"]) == ["r.yaml", "a.b=1"]


def test_the_train_script_is_align_train():
    # `deepspeed align/train.py` runs this on every rank: the CLI's own parser and checks, not a copy of them.
    from conftest import checkout_env

    def script(*args):
        return subprocess.run([sys.executable, "align/train.py", *map(str, args)], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env=checkout_env(HF_HUB_OFFLINE="1"))

    shown = script("recipes/tiny/align.yaml", "--help")
    assert shown.returncode == 0 and shown.stdout == align("train", "--help").stdout
    for bad in (["--num_gpus", "0"],):  # a launcher option, parsed as the CLI parses it
        by_script, by_cli = script("recipes/tiny/align.yaml", *bad), align("train", "recipes/tiny/align.yaml", *bad)
        assert by_script.returncode == by_cli.returncode == 2, (bad, by_script.stderr)
        assert by_script.stderr == by_cli.stderr and by_script.stderr.count("\n") == 1, bad


def test_train_forwards_launcher_options():
    from align.launch import TRAIN_SCRIPT, deepspeed_command

    cmd = deepspeed_command("r.yaml", ["train.lr=1e-4"], num_gpus=8, num_nodes=2, hostfile="hosts",
                            master_addr="10.0.0.1", master_port=29600)
    assert cmd[0].endswith("deepspeed")
    assert cmd[1:] == ["--num_gpus", "8", "--num_nodes", "2", "--hostfile", "hosts", "--master_addr", "10.0.0.1",
                       "--master_port", "29600", str(TRAIN_SCRIPT), "r.yaml", "train.lr=1e-4"]
    assert deepspeed_command("r.yaml", [])[1:] == [str(TRAIN_SCRIPT), "r.yaml"]
    assert deepspeed_command("r.yaml", ["a.b=1"], num_gpus=2, stage="trajectories")[1:] == [
        "--num_gpus", "2", "--module", "align.cli", "trajectories", "r.yaml", "a.b=1"]
    result = align("train", "recipes/tiny/align.yaml", "train.zero_stage=5", "--num_gpus", "2")
    assert result.returncode == 2 and "train.zero_stage: Input should be 0, 1, 2 or 3" in result.stderr


def test_a_single_host_launch_takes_a_free_port_and_several_hosts_the_agreed_one():
    """Two `--num_gpus 2` runs on one host both took DeepSpeed's default port and the second died with EADDRINUSE
    after it launched (issue 35): on one host a port free now is chosen; across hosts every host must agree, so the
    runner's default (or --master_port) stays."""
    import argparse
    import socket

    from align.launch import launch_port

    def args(**given):
        return argparse.Namespace(**{"master_port": None, "hostfile": None, "num_nodes": None, "node_rank": None,
                                     **given})

    chosen = launch_port(args())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", chosen))  # it was free
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        assert launch_port(args()) != held.getsockname()[1]  # never a port a run already listens on
    assert launch_port(args(master_port=29600)) == 29600
    assert launch_port(args(hostfile="hosts")) is None and launch_port(args(num_nodes=2)) is None
    assert launch_port(args(node_rank=1)) is None


def test_version():
    from importlib.metadata import version

    result = align("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"align {version('align-drafters')}\n"


def test_argparse_errors_are_one_line():
    result = align("evl", "recipes/tiny/eval.yaml")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("align: error: argument <stage>: invalid choice")
    result = align("eval")
    assert result.returncode == 2
    assert result.stderr == "align eval: error: the following arguments are required: recipe (see align eval --help)\n"
