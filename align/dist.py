"""Distributed start-up and the DeepSpeed config, for `align train` (align/stages/train.py): each rank's process group
(gloo on the CPU, NCCL with each rank on cuda:LOCAL_RANK), the collectives' timeout sized from the drafter, and the
DeepSpeed config derived from the recipe with a user's own file merged under it.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from align.config import Recipe, RecipeError, first_line
from align.deepspeed_json import check_deepspeed_json
from align.hub import hub_snapshot
from align.launch import free_port


def warn_stale_build_locks(max_age_s: float = 600.0) -> list[Path]:
    """Warn (one line each) about torch extension builds whose lock file is older than any build takes; returns them.

    DeepSpeed compiles its CPU ops (deepspeed_shm_comm) on first use under torch's extension folder, holding a `lock`
    file meanwhile. A build that was killed (Ctrl-C during a first run) leaves the file, and every later run then
    waits on it forever without a word (torch's FileBaton): better said before that wait."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")  # <root>/<extension>/lock; by default one folder per Python/build
    locks = Path(root).glob("*/lock") if root else Path(get_default_build_root()).glob("*/*/lock")
    ages = {lock: time.time() - lock.stat().st_mtime for lock in locks}
    stale = [lock for lock, age in ages.items() if age > max_age_s]
    for lock in stale:
        print(f"align train: warning: {lock} is {ages[lock] / 60:.0f} min old, left by a killed build; DeepSpeed will "
              f"wait on it forever: delete {lock.parent} if nothing is building it", file=sys.stderr, flush=True)
    return stale


def build_deepspeed_ops() -> Optional[str]:
    """Build DeepSpeed's CPU communication op (deepspeed_shm_comm) now, once per machine, and return its file; None
    where the accelerator has no such op (a GPU). DeepSpeed otherwise compiles it (about a minute) inside the first
    run's ranks, under a lock file that a killed build leaves for every later start to wait on forever
    (`warn_stale_build_locks`): `align build-ops`, which launch/setup.sh runs, builds it before any launcher."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not builder.is_compatible():
        return None
    return builder.load(verbose=False).__file__


# How fast rank 0 is taken to write a checkpoint while the other ranks wait in their next collective, and what a save
# writes per byte of drafter weights on disk (bf16: the weights 2 bytes a parameter, DeepSpeed's fp32 master copy and
# Adam's two moments 12 more): a conservative disk rate, not a measured one. (Each file is hashed as it is written,
# by its writer; this bound dates from when rank 0 read every rank's files back, and still covers a whole
# unpartitioned state written by rank 0 alone.)
SAVE_BYTES_PER_SECOND = 200e6
SAVED_PER_WEIGHT_BYTE = 8


def collective_timeout(recipe: Recipe) -> timedelta:
    """How long a rank waits in a collective for the others before the run fails: DeepSpeed's default (10 minutes)
    is shorter than rank 0's save of a large drafter (a 26B one writes ~52 GB of weights, and up to ~416 GB of
    DeepSpeed state where nothing partitions it, while the other ranks wait), so align sizes it from the drafter's
    weights on disk: 30 minutes, plus the time to write its checkpoint at SAVE_BYTES_PER_SECOND. $DEEPSPEED_TIMEOUT
    (minutes) overrides it."""
    if os.environ.get("DEEPSPEED_TIMEOUT"):
        return timedelta(minutes=int(os.environ["DEEPSPEED_TIMEOUT"]))
    folder = Path(recipe.drafter.path) if Path(recipe.drafter.path).is_dir() else hub_snapshot(recipe.drafter.path)
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder is not None else 0
    return timedelta(minutes=30 + math.ceil(SAVED_PER_WEIGHT_BYTE * weights / SAVE_BYTES_PER_SECOND / 60))


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of processes, from the launcher's environment (1 process without one)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def spans_machines(world: int) -> bool:
    """Whether the `world` ranks of this launch are on more than one machine: fewer of them here than in all.
    DeepSpeed's launcher says how many are here as LOCAL_SIZE, torchrun's as LOCAL_WORLD_SIZE."""
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
    return local is not None and int(local) != world


# What rank 0 writes for the others to read back, named as align's temporary files are (never a user's file to keep)
SHARED_PROBE = ".shared-probe.tmp"


def check_shared_folder(folder: str | os.PathLike, key: str, rank: int, world: int) -> None:
    """Refuse (RecipeError on every rank, the same line) a run over several machines whose ranks do not all see
    `folder` as one folder: align's ranks write one run folder (checkpoints, chunks) that rank 0 commits and every
    rank resumes from, so that node-local folders would lose node 1's shards and refuse the resume. Rank 0 writes a
    random token there; every rank reads it back. A collective: every rank calls it, before any work. One machine
    (every rank local) passes without a word."""
    import secrets

    from align.disk import write_text_atomic

    if not spans_machines(world):
        return
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    probe = Path(folder) / SHARED_PROBE
    token = [secrets.token_hex(16) if rank == 0 else None]
    if rank == 0:
        Path(folder).mkdir(parents=True, exist_ok=True)
        write_text_atomic(probe, token[0])
    dist.broadcast_object_list(token, src=0)
    try:
        seen = probe.read_text() == token[0]
    except OSError:
        seen = False
    views: list[Any] = [None] * world
    dist.all_gather_object(views, (seen, socket.gethostname()))
    if rank == 0:
        probe.unlink(missing_ok=True)
    blind = [f"rank {r} ({host})" for r, (ok, host) in enumerate(views) if not ok]
    if blind:
        raise RecipeError(f"{key}: {folder} is not one folder for every node: {', '.join(blind[:4])}"
                          f"{' and more' if len(blind) > 4 else ''} cannot see what rank 0 wrote there; align's ranks "
                          "write and resume one run folder, so it must be on a filesystem every node mounts at the "
                          "same path (NFS, Lustre, a cluster's shared home)")


# How often a rank says it is alive, and the exit status of ranks stopped because a peer fell silent (as a failed run's)
BEAT_S = 5.0
EXIT_PEER_LOST = 1


def watch_peers(rank: int, world: int, silence_s: float) -> threading.Event:
    """Over several machines, a thread that says every BEAT_S that this rank is alive (a counter per rank in the
    launch's key-value store, on rank 0's host) and reads the others' counters, and a thread that watches them: when
    a peer's has not moved for `silence_s` (its node lost, frozen or cut off), or the store has not answered that long
    (rank 0's node lost), it says so in one line and ends this process. Without it, the other nodes' ranks would wait
    in their next collective for the whole timeout (collective_timeout: 30 minutes and more), since NCCL and gloo
    notice a peer that stopped answering only then; on one machine the launcher already stops every rank when one
    dies. Counters, not times: the machines' clocks need not agree. Returns an event to set once this rank's work is
    done (before the ranks leave at their own pace), which ends the watch."""
    done = threading.Event()
    if not spans_machines(world):
        return done
    # A client of its own to the store rank 0 serves (MASTER_ADDR:MASTER_PORT, as env:// set it up): the process
    # group's client belongs to the main thread's collectives.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=max(silence_s, BEAT_S)))
    host = socket.gethostname()
    store.set(f"align/host/{rank}", host)
    hosts = {peer: store.get(f"align/host/{peer}").decode() for peer in range(world)}  # waits for every rank's

    heard = {"store": time.monotonic()}  # when this rank last reached the store, and last saw each peer's counter move
    counts: dict[int, int] = {}

    def beat() -> None:  # blocking calls: a frozen store host never answers, so the watch below times them
        while not done.is_set():
            try:
                store.add(f"align/beat/{rank}", 1)
                for peer in range(world):
                    if peer != rank:
                        beats = store.add(f"align/beat/{peer}", 0)
                        if counts.get(peer) != beats:
                            counts[peer], heard[peer] = beats, time.monotonic()
                heard["store"] = time.monotonic()
            except (RuntimeError, OSError):  # (DistStoreError is a RuntimeError) the store is gone: the watch says it
                pass
            done.wait(BEAT_S)

    def watch() -> None:
        start = time.monotonic()
        while not done.wait(BEAT_S):
            now = time.monotonic()
            if now - heard["store"] > silence_s:
                stop(f"the launch's store on rank 0's host ({os.environ['MASTER_ADDR']}) has not answered for "
                     f"{now - heard['store']:.0f} s (train.peer_silence_s)")
            for peer in (peer for peer in range(world) if peer != rank):
                since = heard.get(peer, start)
                if now - since > silence_s:
                    stop(f"rank {peer} ({hosts.get(peer, '?')}) has not been heard from for {now - since:.0f} s "
                         "(train.peer_silence_s)")

    def stop(why: str) -> None:
        # (on a line of its own: rank 0's progress bar may hold the one it is on)
        print(f"\nalign train: error: rank {rank} ({host}): {why}; its node stopped or was cut off: stopping this "
              "rank now rather than at the collectives' timeout (the last committed checkpoint is intact: rerun the "
              "same command to resume from it)", file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_LOST)

    for target in (beat, watch):
        threading.Thread(target=target, name=f"align-peer-{target.__name__}", daemon=True).start()
    return done


def wait_for_every_rank(world: int) -> None:
    """For a stage whose ranks each write their own chunks (trajectories, states): return once every rank has, so
    that rank 0 may write the manifest. A gloo group (no tensor crosses it), made here where the stage has none."""
    if world > 1:
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        dist.barrier()


def end_ranks(world: int) -> None:
    """After wait_for_every_rank and rank 0's manifest: every rank leaves once it is written."""
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def init_distributed(timeout: timedelta) -> tuple[int, int]:
    """(rank, world size). Outside a launcher this process is rank 0 of 1 (DeepSpeed would otherwise look for MPI).
    timeout: how long a collective waits for every rank (`collective_timeout`)."""
    import deepspeed

    if os.environ.get("LOCAL_RANK", "0") == "0":
        warn_stale_build_locks()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if torch.cuda.is_available():  # each rank owns its GPU before any model is built
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # DeepSpeed's CPU backend, when every rank is on this host (LOCAL_SIZE = the world size), maps a 67 MB buffer per
    # rank in /dev/shm for its inference_all_reduce, which align never calls, and never unlinks it: every run, clean or
    # killed, leaves its buffers in RAM (a test suite's launches filled 18 GB of a 24 GB machine), and its set-up waits
    # without limit for a peer's buffer that a dead peer never makes. Without LOCAL_SIZE it makes none.
    local_size = os.environ.pop("LOCAL_SIZE", None)
    try:
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", timeout=timeout)
    finally:
        if local_size is not None:
            os.environ["LOCAL_SIZE"] = local_size
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def deepspeed_config(recipe: Recipe) -> dict[str, Any]:
    """The DeepSpeed config: what align derives from the recipe (never hand-maintained beside it), with the user's
    own file (train.deepspeed_config) merged in under it (`merge_deepspeed_config`)."""
    t = recipe.train
    # bf16 gradients summed over many micro-batches lose the small ones: fp32 where DeepSpeed accumulates so (ZeRO
    # stages 1-3; at stage 0 it has no such mode for bf16 weights and accumulates in their dtype).
    accumulate = t.grad_accum_dtype or ("fp32" if t.zero_stage > 0 else None)
    derived = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": t.bf16},
        **({"data_types": {"grad_accum_dtype": accumulate}} if t.bf16 and accumulate else {}),
        "steps_per_print": 10**9,  # our own logging; DeepSpeed's would interleave with the progress bar
        "wall_clock_breakdown": False,
    }
    if t.deepspeed_config is None:
        return derived
    given = read_deepspeed_config(t.deepspeed_config)
    merged = merge_deepspeed_config(derived, given)
    check_deepspeed_json(given, merged, t.deepspeed_config)  # types, names, offloads: as DeepSpeed reads them
    if "offload_optimizer" in merged["zero_optimization"] and "zero_force_ds_cpu_optimizer" not in given:
        # align's optimizer is a torch AdamW (no C++ build), which DeepSpeed refuses to offload unless told: it steps
        # the offloaded fp32 state on the CPU as its own CPU Adam would, more slowly.
        merged["zero_force_ds_cpu_optimizer"] = False
    return merged


# The recipe key each derived DeepSpeed setting comes from: a user's file may repeat it, not change it.
DERIVED_FROM = {"train_micro_batch_size_per_gpu": "train.micro_batch_size",
                "gradient_accumulation_steps": "train.gradient_accumulation_steps",
                "gradient_clipping": "train.grad_clip", "zero_optimization.stage": "train.zero_stage",
                "bf16.enabled": "train.bf16", "data_types.grad_accum_dtype": "train.grad_accum_dtype"}
# align's own preferences, which a user's file may change (DeepSpeed's printing).
YOURS_TO_CHANGE = {"steps_per_print", "wall_clock_breakdown"}
# What align builds itself (a torch AdamW and the warm-up cosine schedule, from train.lr and train.warmup_steps), the
# batch size it computes from the ranks, and a precision it does not train in.
NOT_YOURS = {"optimizer": "align builds AdamW from train.lr and train.weight_decay",
             "scheduler": "align builds the warm-up cosine schedule from train.warmup_steps and train.max_steps",
             "train_batch_size": "it is train.micro_batch_size × train.gradient_accumulation_steps × the ranks",
             "fp16": "align trains in bf16 (train.bf16) or fp32"}


def read_deepspeed_config(path: str) -> dict[str, Any]:
    """train.deepspeed_config read as a JSON object; RecipeError (one line) for a missing or unreadable file."""
    try:
        config = json.loads(Path(path).expanduser().read_text())
    except OSError as e:
        raise RecipeError(f"train.deepspeed_config: {path} cannot be read ({e.strerror or type(e).__name__})") from None
    except ValueError as e:
        raise RecipeError(f"train.deepspeed_config: {path} is not JSON ({first_line(str(e))})") from None
    if not isinstance(config, dict):
        raise RecipeError(f"train.deepspeed_config: {path} is not a JSON object")
    return config


def merge_deepspeed_config(derived: dict[str, Any], given: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`given` (a user's DeepSpeed config) merged under `derived` (align's): nested objects are merged key by key;
    a key of both must hold the same value. RecipeError naming the key otherwise, or for a key align sets up itself
    (NOT_YOURS; `fp16` only when enabled)."""
    merged = dict(derived)
    for key, value in given.items():
        dotted = prefix + key
        why = NOT_YOURS.get(dotted)
        if why and not (dotted == "fp16" and isinstance(value, dict) and not value.get("enabled", False)):
            raise RecipeError(f"train.deepspeed_config: {dotted} is not taken from your file: {why}")
        if key not in derived or dotted in YOURS_TO_CHANGE:
            merged[key] = value
        elif isinstance(derived[key], dict) and isinstance(value, dict):
            merged[key] = merge_deepspeed_config(derived[key], value, dotted + ".")
        elif value != derived[key]:
            # (an object align derives given as a plain value, "bf16": true, names the keys inside it)
            source = DERIVED_FROM.get(dotted) or ", ".join(
                recipe_key for derived_key, recipe_key in DERIVED_FROM.items() if derived_key.startswith(dotted + "."))
            raise RecipeError(f"train.deepspeed_config: {dotted} is {value!r} in your file, but align sets it from "
                              f"{source} ({derived[key]!r}); set {source} instead, or leave it out of the file")
    return merged




def all_ranks(flag: Union[bool, torch.Tensor], world: int, device: torch.device) -> bool:
    """True when `flag` (a bool, or a 0-d bool tensor, read without a sync of its own) holds on every rank (every
    rank must take the same branch after a collective decision)."""
    # NCCL reduces GPU tensors only
    value = (flag.to(device=device, dtype=torch.float32).reshape(1) if isinstance(flag, torch.Tensor)
             else torch.tensor([float(flag)], device=device))
    if world > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())
