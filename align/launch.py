"""`align train` and `align trajectories` on several processes: validate the recipe, then run the stage under the
DeepSpeed launcher (a single local process runs in-process and needs no launcher). Training runs `align/train.py`,
the script users also give `deepspeed` themselves; other stages run as `python -m align.cli <stage>` on every rank."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

TRAIN_SCRIPT = Path(__file__).resolve().parent / "train.py"


def integer_in(low: int, high: Optional[int] = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (argparse refuses anything else in one line naming the option)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            wanted = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"{wanted} is expected, got {text!r}")
        return value

    return parse


def existing_file(text: str) -> str:
    """An argparse type: a file that exists (deepspeed would run locally, without a word, on a missing hostfile)."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


def add_launcher_arguments(parser: argparse.ArgumentParser) -> None:
    """The DeepSpeed launcher's options that `align train` and `align trajectories` forward, checked here: the runner
    takes --num_gpus 0 or a missing hostfile as "run here, on whatever there is"."""
    group = parser.add_argument_group("launcher (forwarded to the deepspeed runner)")
    group.add_argument("--num_gpus", type=integer_in(1), default=None, help="processes per node (CPU: ranks on gloo)")
    group.add_argument("--num_nodes", type=integer_in(1), default=None, help="nodes to use from the hostfile")
    group.add_argument("--hostfile", type=existing_file, default=None,
                       help="MPI-style hostfile: 'host slots=N' per line")
    group.add_argument("--master_addr", default=None, help="address of rank 0 (multi-node)")
    group.add_argument("--master_port", type=integer_in(1, 65535), default=None, help="port of rank 0")


def deepspeed_command(recipe: str, overrides: list[str], num_gpus: Optional[int] = None,
                      num_nodes: Optional[int] = None, hostfile: Optional[str] = None,
                      master_addr: Optional[str] = None, master_port: Optional[int] = None,
                      stage: str = "train") -> list[str]:
    """The deepspeed runner's command line for this stage and recipe; None options are left to the runner's
    defaults."""
    launcher = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
    cmd = [launcher]
    for flag, value in (("--num_gpus", num_gpus), ("--num_nodes", num_nodes), ("--hostfile", hostfile),
                        ("--master_addr", master_addr), ("--master_port", master_port)):
        if value is not None:
            cmd += [flag, str(value)]
    program = [str(TRAIN_SCRIPT)] if stage == "train" else ["--module", "align.cli", stage]
    return cmd + program + [recipe, *overrides]


def strip_launcher_args(argv: list[str]) -> list[str]:
    """The DeepSpeed launcher appends --local_rank=N to the script's arguments; ranks are read from the environment."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--local_rank":
            skip = True
        elif not arg.startswith("--local_rank="):
            out.append(arg)
    return out


def single_local_process(args: argparse.Namespace) -> bool:
    return (args.num_gpus in (None, 1)) and args.num_nodes in (None, 1) and args.hostfile is None


def run(args: argparse.Namespace) -> int:
    """Launch the stage on every rank; returns its exit status."""
    cmd = deepspeed_command(args.recipe, args.overrides, args.num_gpus, args.num_nodes, args.hostfile,
                            args.master_addr, args.master_port, stage=args.stage)
    print(f"align {args.stage}:", " ".join(cmd), flush=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # several ranks on one CPU host would otherwise fight over its cores
    return subprocess.call(cmd, env=env)
