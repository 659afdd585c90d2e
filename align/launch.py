"""`align train` and `align trajectories` on several processes: validate the recipe, then run the stage under the
DeepSpeed launcher (a single local process runs in-process and needs no launcher). Training runs `align/train.py`,
the script users also give `deepspeed` themselves (it runs `align train` on the rank); other stages run as
`python -m align.cli <stage>` on every rank.

Every process align starts (the launcher and its ranks, a vLLM worker and its engine) is started here, in a process
group of its own, so that an interrupt stops all of them: SIGINT or SIGTERM to align (Ctrl-C, `timeout`, a
scheduler) raises KeyboardInterrupt in align, which stops each group (SIGTERM, then SIGKILL after a grace period),
waits until none of its processes is left, and says one line. A terminal's Ctrl-C reaches only align's own group.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from align.disk import CHECKED_BY_LAUNCHER

TRAIN_SCRIPT = Path(__file__).resolve().parent / "train.py"
# How long an interrupted child may take to end on SIGTERM before it is killed (a rank dies at once; the DeepSpeed
# launcher and vLLM's engine wait for their own children).
STOP_GRACE_S = 15.0


class Interrupted(KeyboardInterrupt):
    """SIGTERM, raised where SIGINT raises KeyboardInterrupt, so that both take the same way out (temporary files
    removed, children stopped, one line)."""

    signum = signal.SIGTERM


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted()


def interrupt_signal(interrupt: KeyboardInterrupt) -> int:
    """The signal an interrupt came from: SIGTERM for Interrupted, SIGINT for a plain KeyboardInterrupt."""
    return getattr(interrupt, "signum", signal.SIGINT)


def launched_by_a_launcher() -> bool:
    """A rank started by the deepspeed (or torchrun) launcher, which sets LOCAL_RANK before the script starts."""
    return "LOCAL_RANK" in os.environ


def handle_interrupts() -> None:
    """Call first thing in a process align runs. In the process the user started: SIGTERM raises Interrupted (by
    default Python would die at once, leaving its children running). In a rank under a launcher: SIGINT ends the
    rank at once and silently, as SIGTERM does, rather than as a KeyboardInterrupt traceback from deep inside torch
    on every rank (a terminal's Ctrl-C reaches every process of a hand-started `deepspeed` command). Nothing a rank
    writes is torn by it: checkpoints are published atomically, `metrics.jsonl` is read tolerantly."""
    if launched_by_a_launcher():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    else:
        signal.signal(signal.SIGTERM, _raise_interrupted)


_children: list[subprocess.Popen] = []


def start_child(cmd: list[str], **popen: Any) -> subprocess.Popen:
    """subprocess.Popen in a session (and process group) of its own, remembered so that an interrupt stops it and
    everything it starts (stop_children). In a rank it stays in the rank's group, which align stops as a whole (a
    rank ends at once on SIGTERM, and would leave a child of its own session running)."""
    process = subprocess.Popen(cmd, start_new_session=not launched_by_a_launcher(), **popen)
    _children.append(process)
    return process


def forget_child(process: subprocess.Popen) -> None:
    """A child that has ended (its group's pid may be reused later)."""
    if process in _children:
        _children.remove(process)


def group_members(pgid: int) -> list[int]:
    """Processes of process group `pgid` that are still running (zombies, already dead, are left out)."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: ask the kernel whether anything of the group is left
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses, so split after its last ')'
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def stop_group(process: subprocess.Popen, grace_s: Optional[float] = None) -> None:
    """Stop `process` and every process of its group: SIGTERM, then SIGKILL for what is left after `grace_s`
    (STOP_GRACE_S); returns once none is left (the group's leader reaped)."""
    pgid = process.pid  # a session leader's group id is its pid
    try:
        own_group = os.getpgid(process.pid) == process.pid
    except ProcessLookupError:
        own_group = True  # the leader is gone; what is left of its group is still to stop
    for signum, wait_s in ((signal.SIGTERM, STOP_GRACE_S if grace_s is None else grace_s), (signal.SIGKILL, 10.0)):
        try:
            if own_group:
                os.killpg(pgid, signum)
            else:  # started by a rank, in the rank's group: the process alone
                process.send_signal(signum)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            process.poll()  # reap the leader, else it stays a zombie of this process
            if not group_members(pgid) and (own_group or process.returncode is not None):
                process.wait()
                return
            time.sleep(0.05)


def stop_children() -> int:
    """Stop every child process group still running (after an interrupt, or a failure that leaves them behind);
    returns how many were. Further SIGINT/SIGTERM are ignored meanwhile: a second Ctrl-C must not cut the cleanup
    short."""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    stopped = 0
    try:
        while _children:
            process = _children.pop()
            if process.poll() is None or group_members(process.pid):
                stop_group(process)
                stopped += 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return stopped


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
    """An argparse type: a file that exists (deepspeed would run locally, without a word, on a missing hostfile), ~
    its user's home as in every path of a recipe (the shell leaves it in `--hostfile=~/hosts`)."""
    path = os.path.expanduser(text)
    if not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return path


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
    # DeepSpeed's own resource filters, for the habit `deepspeed --include localhost:2,3 train.py` (e.g. two GPUs
    # of a shared node left to another job): NODE_SPEC[@NODE_SPEC ...], NODE_SPEC = host[:slot[,slot ...]].
    group.add_argument("--include", default=None, metavar="HOST[:SLOTS][@HOST...]",
                       help="the hosts and slots (GPUs) to run on, e.g. localhost:0,1 or worker-0@worker-1:0,2")
    group.add_argument("--exclude", default=None, metavar="HOST[:SLOTS][@HOST...]",
                       help="the hosts and slots (GPUs) not to run on, e.g. localhost:0")
    group.add_argument("--node_rank", type=integer_in(0), default=None,
                       help="this host's line of the hostfile, from 0, when every host starts align itself (no ssh): "
                            "the same --hostfile and --master_addr on every host")


def hostfile_hosts(path: str) -> list[tuple[str, int]]:
    """(host, slots) of each line of an MPI-style hostfile, in order, as DeepSpeed's runner reads it ('#' lines and
    blank ones skipped). Raises RecipeError, naming the line, where the runner would raise a ValueError traceback."""
    from align.config import RecipeError

    hosts: list[tuple[str, int]] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^(\S+)\s+slots=(\d+)", line)
        if match is None:
            raise RecipeError(f"--hostfile: {path} line {number} is {line!r}; each line is 'host slots=N'")
        if any(host == match.group(1) for host, _ in hosts):
            raise RecipeError(f"--hostfile: {path} line {number} names {match.group(1)} a second time")
        hosts.append((match.group(1), int(match.group(2))))
    if not hosts:
        raise RecipeError(f"--hostfile: {path} names no host ('host slots=N' per line)")
    return hosts


def resource_filter(flag: str, text: str) -> dict[str, list[int]]:
    """host -> its slots (empty: all of them) of an --include/--exclude value, parsed as DeepSpeed's runner parses
    it (parse_node_config_list), with a one-line RecipeError where the runner would raise a traceback."""
    from align.config import RecipeError

    hosts: dict[str, list[int]] = {}
    for spec in text.split("@"):
        host, _, slots = spec.partition(":")
        if not re.fullmatch(r"[^\s:@,]+", host) or (":" in spec and not re.fullmatch(r"\d+(,\d+)*", slots)):
            raise RecipeError(f"{flag} {text!r}: {spec!r} is not host[:slot[,slot ...]] (hosts joined by @, e.g. "
                              "localhost:0,1 or worker-0@worker-1:0,2)")
        if host in hosts:
            raise RecipeError(f"{flag} {text!r}: {host} is named twice")
        hosts[host] = [int(slot) for slot in slots.split(",")] if slots else []
    return hosts


def local_slots() -> int:
    """The slots DeepSpeed's runner finds on this host without a hostfile: its accelerator's device count (CUDA:
    the visible GPUs; CPU: LOCAL_SIZE, else one per NUMA node)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_count()


def check_filters(args: argparse.Namespace) -> None:
    """--include/--exclude against the hostfile's hosts and slots (or this host's, without one), and against the
    options DeepSpeed's runner refuses beside them."""
    from align.config import RecipeError

    include, exclude = getattr(args, "include", None), getattr(args, "exclude", None)
    if include is None and exclude is None:
        return
    if include is not None and exclude is not None:
        raise RecipeError("--include and --exclude do not go together (DeepSpeed takes one of them)")
    flag, text = ("--include", include) if include is not None else ("--exclude", exclude)
    for option in ("num_gpus", "num_nodes"):
        if getattr(args, option) is not None:
            raise RecipeError(f"--{option} and {flag} do not go together: {flag} names the hosts and slots itself")
    pool = dict(hostfile_hosts(args.hostfile)) if args.hostfile is not None else {"localhost": local_slots()}
    where = args.hostfile or "this host (no --hostfile)"
    for host, slots in resource_filter(flag, text).items():
        if host not in pool:
            raise RecipeError(f"{flag}: {host} is not a host of {where}; its hosts: {', '.join(pool)}")
        beyond = [slot for slot in slots if slot >= pool[host]]
        if beyond:
            raise RecipeError(f"{flag}: {host} has slots 0..{pool[host] - 1} ({where}), not {beyond[0]}")


# Where DeepSpeed's runner looks for a hostfile when it is given none (its DLTS_HOSTFILE): a file there is used.
RUNNER_HOSTFILE = "/job/hostfile"


def visible_gpus() -> Optional[int]:
    """The GPUs the runner would start ranks on without a hostfile; None on a host without CUDA (ranks on gloo, as
    many as asked)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else None


def check_launch(args: argparse.Namespace) -> None:
    """The launcher options together, checked before anything starts (RecipeError, one line): what DeepSpeed's runner
    would otherwise meet with an assertion, a traceback, or an ssh attempt. Fills in --master_addr for --node_rank."""
    from align.config import RecipeError

    check_filters(args)
    node_rank = getattr(args, "node_rank", None)
    if args.hostfile is None:
        if node_rank is not None:
            raise RecipeError("--node_rank needs --hostfile (every host's line, the same file on every host)")
        if args.num_nodes not in (None, 1) and not Path(RUNNER_HOSTFILE).is_file():
            # the runner would start, find this host alone, and end in its own ValueError traceback
            raise RecipeError(f"--num_nodes {args.num_nodes} needs --hostfile (the hosts to run on, 'host slots=N' "
                              "per line); without one DeepSpeed's runner finds this host alone")
        gpus = visible_gpus() if args.num_gpus is not None else None
        if gpus is not None and args.num_gpus > gpus:
            # the runner starts a rank per slot asked for; a rank past the visible GPUs dies at cuda:<rank>
            raise RecipeError(f"--num_gpus {args.num_gpus}: this host has {gpus} visible GPU(s)")
        return
    hosts = hostfile_hosts(args.hostfile)
    if args.num_nodes is not None and args.num_nodes > len(hosts):
        raise RecipeError(f"--num_nodes {args.num_nodes}: {args.hostfile} names {len(hosts)} host(s)")
    nodes = len(hosts) if args.num_nodes is None else args.num_nodes  # the runner uses the first num_nodes hosts
    if node_rank is not None:
        if node_rank >= nodes:
            raise RecipeError(f"--node_rank {node_rank}: the run has {nodes} node(s) ({args.hostfile}), "
                              f"so it is 0..{nodes - 1}")
        if args.master_addr is None:
            # Without it the runner asks the first host for its address over ssh, which --node_rank is there to avoid.
            args.master_addr = hosts[0][0]
    elif nodes > 1 and shutil.which("pdsh") is None:
        raise RecipeError(f"{args.hostfile} names {nodes} hosts and pdsh (which DeepSpeed's runner reaches them with "
                          "over ssh) is not installed; start align on each host with --node_rank 0.."
                          f"{nodes - 1} (NODE_RANK for launch/multi_node.sh) and the same --master_addr")


def deepspeed_command(recipe: str, overrides: list[str], num_gpus: Optional[int] = None,
                      num_nodes: Optional[int] = None, hostfile: Optional[str] = None,
                      master_addr: Optional[str] = None, master_port: Optional[int] = None,
                      stage: str = "train", node_rank: Optional[int] = None, include: Optional[str] = None,
                      exclude: Optional[str] = None) -> list[str]:
    """The deepspeed runner's command line for this stage and recipe; None options are left to the runner's
    defaults. `node_rank`: this host starts its own ranks only (the runner's --no_ssh)."""
    # This interpreter's own runner first: the one on PATH may belong to another environment (a venv run by its path,
    # not activated), and the runner starts the ranks with its own Python.
    beside = Path(sys.executable).parent / "deepspeed"
    launcher = str(beside) if beside.is_file() else shutil.which("deepspeed") or str(beside)
    cmd = [launcher]
    for flag, value in (("--num_gpus", num_gpus), ("--num_nodes", num_nodes), ("--hostfile", hostfile),
                        ("--include", include), ("--exclude", exclude), ("--master_addr", master_addr),
                        ("--master_port", master_port)):
        if value is not None:
            cmd += [flag, str(value)]
    if node_rank is not None:
        cmd += ["--no_ssh", "--node_rank", str(node_rank)]
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
    # --node_rank alone is refused by run (check_launch); --include/--exclude pick slots: the runner's to start
    return (args.num_gpus in (None, 1) and args.num_nodes in (None, 1) and args.hostfile is None
            and all(getattr(args, option, None) is None for option in ("node_rank", "include", "exclude")))


def launch_world(args: argparse.Namespace) -> Optional[int]:
    """How many ranks the launch will start, when the options say it (--num_gpus, times --num_nodes); None when a
    hostfile or --include/--exclude decide."""
    if args.hostfile is not None or args.num_gpus is None or any(getattr(args, option, None) is not None
                                                                  for option in ("include", "exclude")):
        return None
    return args.num_gpus * (args.num_nodes or 1)


def free_port() -> int:
    """A TCP port on this host that is free now (the OS picks it): a rendezvous of ranks on one host."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def launch_port(args: argparse.Namespace) -> Optional[int]:
    """The rank-0 port: --master_port when given; on one host, a port free now (DeepSpeed's default, 29500, is taken
    by any other run on the host: a second `--num_gpus 2` run died with EADDRINUSE after it launched); across hosts
    the runner's default, which every host must agree on."""
    if args.master_port is not None or args.hostfile is not None or args.num_nodes not in (None, 1) \
            or getattr(args, "node_rank", None) is not None:
        return args.master_port
    return free_port()


# The variables a rank of align reads (ALIGN_*, DEEPSPEED_TIMEOUT, its threads) and the Hugging Face libraries and
# trackers it drives read (offline mode, caches, tokens). DeepSpeed's pdsh runner gives a remote host's ranks only the
# NCCL/PYTHON/UCX/MV2/MLFLOW variables (and its accelerator's) of the launching shell; the rest must be in the env file
# it reads (its documented .deepspeed_env), which align writes for the launch.
FORWARDED_PREFIXES = ("ALIGN_", "DEEPSPEED_TIMEOUT", "OMP_NUM_THREADS", "HF_", "HUGGINGFACE_", "TRANSFORMERS_",
                      "TOKENIZERS_", "WANDB_", "TRACKIO_")
DS_ENV_FILE = ".deepspeed_env"  # DeepSpeed's name for it (its DS_ENV_FILE variable renames it)


def escaped_for_export(value: str) -> str:
    """A value as DeepSpeed's pdsh runner needs it in its env file: it writes `export KEY=value;` into the remote
    shell's command, in double quotes when the value has a character outside [\\w@%+=:,./-] (ALIGN_HELD_LOCKS is
    JSON), so \\ " $ ` are escaped for them (a value with none of those characters is unchanged)."""
    return re.sub(r'([\\"$`])', r"\\\1", value)


def remote_env_file(env: dict[str, str]) -> Path:
    """A DeepSpeed env file ('KEY=value' lines) of the launching environment's FORWARDED_PREFIXES variables, then the
    lines of the user's own .deepspeed_env files (home, then here, as DeepSpeed reads them: theirs win), since
    DS_ENV_FILE pointing at this file makes DeepSpeed read it in their place."""
    lines = [f"{key}={escaped_for_export(value)}" for key, value in sorted(env.items())
             if key.startswith(FORWARDED_PREFIXES) and "\n" not in value]
    name = env.get("DS_ENV_FILE", DS_ENV_FILE)
    for place in (Path.home(), Path.cwd()):
        own = place / name
        if own.is_file():
            lines += [line for line in own.read_text().splitlines() if "=" in line]
    fd, path = tempfile.mkstemp(prefix="align-deepspeed-env-", text=True)
    with os.fdopen(fd, "w") as f:
        f.write("".join(line + "\n" for line in lines))
    return Path(path)


def run(args: argparse.Namespace) -> int:
    """Launch the stage on every rank; returns its exit status. Raises RecipeError (before anything starts) for
    launcher options that do not go together."""
    check_launch(args)
    cmd = deepspeed_command(args.recipe, args.overrides, args.num_gpus, args.num_nodes, args.hostfile,
                            args.master_addr, launch_port(args), stage=args.stage, node_rank=args.node_rank,
                            include=args.include, exclude=args.exclude)
    print(f"align {args.stage}:", " ".join(cmd), flush=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # several ranks on one CPU host would otherwise fight over its cores
    env[CHECKED_BY_LAUNCHER] = "1"  # this process's check_stage has hashed what the ranks' checks would (disk.py)
    # Other hosts' ranks (a hostfile, reached by pdsh over ssh) start in a login shell without this environment.
    env_file = remote_env_file(env) if args.hostfile is not None and args.node_rank is None else None
    if env_file is not None:
        env["DS_ENV_FILE"] = str(env_file)  # an absolute path: DeepSpeed's join with its folders leaves it as it is
    try:
        process = start_child(cmd, env=env)
        status = process.wait()  # an interrupt meanwhile: cli stops the whole group (stop_children)
        forget_child(process)
    finally:
        if env_file is not None:
            env_file.unlink(missing_ok=True)
    return status
