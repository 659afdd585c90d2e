"""`align states`: the verifier's hidden states a DFlash drafter reads, computed once for every trajectory.

Training with states.out set reads them instead of running the verifier in every step, and its ranks load only the
verifier's embeddings and LM head (align/drafters/states_store.py says why and how they are stored). Chunks of rows
are spread over ranks (launched with several processes, each takes every WORLD_SIZE-th chunk), each written
atomically with the sha256 of its file taken as it is written, and skipped when already done: an interrupted run
resumes where it stopped. Rank 0 writes the manifest once every chunk is on disk.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from align.config import Recipe, RecipeError
from align.data import load_checked_trajectories, read_trajectory_manifest, verify_trajectory_files
from align.disk import atomic_folder, hashes_inputs, mark_folder, write_hashed, write_text_atomic
from align.dist import check_shared_folder, end_ranks, rank_and_world, wait_for_every_rank
from align.drafters.dflash import verifier_states
from align.drafters.kind import TrainedDrafter, reads_verifier_states
from align.drafters.states_cache import RAW_DTYPES
from align.drafters.states_store import (CHUNK_FILE, CHUNK_RECORD, STATES_MANIFEST, chunk_plan,
                                         read_states_manifest, row_lengths, settings_hash, states_settings)
from align.models import load_verifier
from align.preflight import check_inputs


def models(recipe: Recipe) -> tuple[str, ...]:
    return ("verifier.path",) if TrainedDrafter.of(recipe).is_new_dflash else ("verifier.path", "drafter.path")


def check(recipe: Recipe) -> None:
    """A DFlash drafter to compute states for, a folder to write them to, trajectories to compute them of."""
    if recipe.states.out is None:
        raise RecipeError("states.out: set the folder to write the verifier states to (align train reads them "
                          "from there)")
    if not reads_verifier_states(recipe):
        raise RecipeError(f"states.out: only a DFlash drafter reads the verifier's hidden states; "
                          f"{recipe.drafter.path} drafts alone (nothing to precompute)")
    read_trajectory_manifest(recipe.trajectories.out)
    if hashes_inputs():  # before launching: the ranks then read them unhashed
        verify_trajectory_files(recipe.trajectories.out)


@torch.inference_mode()
def chunk_states(verifier: Any, rows: Any, lengths: list[int], layer_ids: list[int], final: bool, batch_size: int,
                 pad_id: int, raw: torch.dtype) -> np.ndarray:
    """(tokens, width) raw values of a chunk's rows back to back, row order: rows of alike lengths are batched
    (right-padded, which a causal verifier's earlier positions never see) in forwards of `batch_size` rows. raw: the
    integer dtype of the verifier's width the values are stored as (states_cache.RAW_DTYPES)."""
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    out = None
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        width = lengths[batch[0]]
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        for b, i in enumerate(batch):
            row = rows[i]
            ids[b, : lengths[i]] = torch.tensor((row["prompt_ids"] + row["completion_ids"])[: lengths[i]])
        states = verifier_states(verifier, ids.to(verifier.device), layer_ids, with_last=final)  # (b, L, width)
        values = states.to(verifier.dtype).contiguous().view(raw).cpu().numpy()
        if out is None:
            out = np.empty((int(offsets[-1]), values.shape[-1]), dtype=values.dtype)
        for b, i in enumerate(batch):
            out[offsets[i] : offsets[i + 1]] = values[b, : lengths[i]]
    return out


def main(recipe: Recipe, command: str) -> None:
    check_inputs(recipe, model_keys=models(recipe))
    out = Path(recipe.states.out)
    trajectories = read_trajectory_manifest(recipe.trajectories.out)
    rows = load_checked_trajectories(recipe)
    settings = states_settings(recipe, trajectories)
    digest = settings_hash(settings)
    old = read_states_manifest(out)
    if old is not None and old.get("settings_hash") != digest:
        raise RecipeError(f"states.out: {out} holds verifier states made with other settings; choose another "
                          "folder or delete it")
    rank, world = rank_and_world()
    check_shared_folder(out, "states.out", rank, world)  # rank 0 reads every rank's chunks
    mark_folder(out, "states")  # every check passed
    verifier = load_verifier(recipe.verifier)
    text = verifier.config.get_text_config()
    layer_ids, final = settings["aux_layer_ids"], settings["final_states"]
    width = (len(layer_ids) + final) * text.hidden_size
    itemsize = torch.empty((), dtype=verifier.dtype).element_size()
    raw = RAW_DTYPES[itemsize][1]
    lengths = row_lengths(recipe, rows)
    plan = chunk_plan(lengths, width * itemsize, int(recipe.states.chunk_mib * 2**20))
    pad_id = text.pad_token_id if getattr(text, "pad_token_id", None) is not None else 0  # never read: right padding
    mine = [c for c in range(len(plan)) if c % world == rank]
    todo = [c for c in mine if not chunk_done(out / "chunks" / f"chunk-{c:05d}", digest, plan[c])]
    t0 = time.perf_counter()
    for c in tqdm(todo, desc=f"states (rank {rank})", unit="chunk", disable=rank != 0, dynamic_ncols=True,
                  initial=len(mine) - len(todo), total=len(mine)):
        first, end = plan[c]
        values = chunk_states(verifier, rows.select(range(first, end)), lengths[first:end], layer_ids, final,
                              recipe.states.batch_size, pad_id, raw)
        with atomic_folder(out / "chunks" / f"chunk-{c:05d}", "states") as tmp:
            sha256 = write_hashed(tmp / CHUNK_FILE, values)
            (tmp / CHUNK_RECORD).write_text(json.dumps({"settings": digest, "rows": [first, end],
                                                        "bytes": values.nbytes, "sha256": sha256}))
    seconds = time.perf_counter() - t0
    wait_for_every_rank(world)  # every rank's chunks are on disk before rank 0 writes the manifest
    if rank == 0:
        chunks = {f"chunk-{c:05d}": json.loads((out / "chunks" / f"chunk-{c:05d}" / CHUNK_RECORD).read_text())
                  for c in range(len(plan))}
        manifest = {"settings_hash": digest, "settings": settings, "command": command, "width": width,
                    "rows": len(lengths), "tokens": int(sum(lengths)), "lengths": lengths,
                    "chunks": {name: {k: c[k] for k in ("rows", "bytes", "sha256")} for name, c in chunks.items()},
                    "seconds_this_run": round(seconds, 1)}
        write_text_atomic(out / STATES_MANIFEST, json.dumps(manifest))
        made = sum(lengths[i] for c in todo for i in range(*plan[c]))
        rate = f", {made / seconds:.0f} tokens/s this run" if made and world == 1 else ""
        print(f"states: {len(lengths)} trajectories, {sum(lengths)} tokens, {width} values a token "
              f"({sum(c['bytes'] for c in chunks.values()) / 2**30:.2f} GiB{rate}) -> {out}")
    end_ranks(world)


def chunk_done(folder: Path, digest: str, rows: tuple[int, int]) -> bool:
    """Whether the chunk of `rows` is written, of these settings (a chunk cut at another states.chunk_mib is not)."""
    try:
        record = json.loads((folder / CHUNK_RECORD).read_text())
        return (record["settings"] == digest and tuple(record["rows"]) == tuple(rows)
                and (folder / CHUNK_FILE).stat().st_size == record["bytes"])
    except (OSError, ValueError, KeyError):
        return False
