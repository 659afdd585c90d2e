"""The verifier states `align states` precomputed for every trajectory, read by `align train` (states.out).

A DFlash drafter reads the verifier's hidden states at a few layers for every position of its training rows; the
verifier is frozen, so they are the same in every epoch. speculators and SpecForge compute them once, before training,
so that training ranks hold no verifier and spend no step on it; so does this. The folder holds chunks of rows in the
trajectories' own row order, each a raw file of fixed-width values in the verifier's dtype (row after row, each its own
length) and a chunk.json with the rows it holds and the file's sha256, computed as the file was written; manifest.json
says what the states are of (the settings below): training refuses states of another verifier, other trajectories,
other layers or another length cap in one line, before launching.

Why raw files rather than Arrow or safetensors: a row is read by offset in every step, from any rank, with no copy of
the chunk in memory (np.memmap), in a dtype numpy lacks (bfloat16, stored as same-width integers and viewed back).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Optional

import numpy as np

from align.config import Recipe, RecipeError
from align.disk import file_sha256
from align.drafters.states_cache import RAW_DTYPES

STATES_MANIFEST, CHUNK_RECORD, CHUNK_FILE = "manifest.json", "chunk.json", "states.bin"


def aux_layer_ids(recipe: Recipe) -> list[int]:
    """The verifier layers the recipe's DFlash drafter reads: a new one's (dflash.aux_layer_ids, else its default
    spread), or drafter.path's config's."""
    from align.drafters.dflash import default_aux_layers
    from align.preflight import load_model_config

    if recipe.dflash is not None:
        if recipe.dflash.aux_layer_ids:
            return list(recipe.dflash.aux_layer_ids)
        config = load_model_config("verifier.path", recipe.verifier)
        return default_aux_layers(config.get_text_config().num_hidden_layers)
    return list(load_model_config("drafter.path", recipe.drafter).aux_hidden_state_layer_ids)


def row_lengths(recipe: Recipe, rows: Any) -> list[int]:
    """The tokens of each trajectory a training step reads (prompt + completion, cut at train.max_sequence_length)."""
    cap = recipe.train.max_sequence_length or math.inf
    return [int(min(len(p) + len(c), cap)) for p, c in zip(rows["prompt_ids"], rows["completion_ids"])]


def states_settings(recipe: Recipe, trajectories_manifest: dict[str, Any]) -> dict[str, Any]:
    """What a folder of states is of: the verifier (its path, the sha256 of its weights, the dtype it runs in), the
    trajectories (their settings and their chunks' digests), the layers read and whether the final states are kept
    (a KD loss's verifier logits come from them), and the length cap. Read from configs and manifests only."""
    from align.checkpoint import weights_sha256_of
    from align.models import resolve_device, resolve_dtype

    v = recipe.verifier
    dtype = resolve_dtype(v.dtype, resolve_device(v.device), v.path, v.trust_remote_code)
    chunks = json.dumps(trajectories_manifest.get("chunks"), sort_keys=True).encode()
    return {"verifier": v.path, "verifier_sha256": weights_sha256_of(v.path), "dtype": str(dtype).removeprefix("torch."),
            "aux_layer_ids": aux_layer_ids(recipe), "final_states": recipe.train.reads_verifier_distributions(),
            "max_sequence_length": recipe.train.max_sequence_length,
            "trajectories": trajectories_manifest.get("settings_hash"),
            "trajectory_chunks_sha256": hashlib.sha256(chunks).hexdigest()}


def settings_hash(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def chunk_plan(lengths: list[int], token_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Consecutive [first, end) row ranges of at most chunk_bytes each (one row at least), in row order."""
    plan, first, size = [], 0, 0
    for row, length in enumerate(lengths):
        if row > first and size + length * token_bytes > chunk_bytes:
            plan.append((first, row))
            first, size = row, 0
        size += length * token_bytes
    if lengths:
        plan.append((first, len(lengths)))
    return plan


def read_states_manifest(folder: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads((folder / STATES_MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def check_states(recipe: Recipe, trajectories_manifest: dict[str, Any], verify: bool) -> dict[str, Any]:
    """The manifest of states.out, refused (RecipeError, one line) unless it is complete and of what this recipe
    trains on: the same verifier weights and dtype, the same trajectories, layers and cap, and the final states where
    a loss reads the verifier's logits (states made with them serve a recipe that needs none). verify: also check each
    chunk's file against its sha256 (once per machine: the launcher's check, or local rank 0's)."""
    folder = Path(recipe.states.out)
    manifest = read_states_manifest(folder)
    if manifest is None:
        raise RecipeError(f"states.out: {folder} holds no complete verifier states (no {STATES_MANIFEST}); run "
                          "align states with this recipe first, or unset states.out to compute them in every step")
    made, wanted = manifest.get("settings", {}), states_settings(recipe, trajectories_manifest)
    for key, value in wanted.items():
        if key == "final_states" and (made.get(key) or not value):
            continue
        if made.get(key) != value:
            raise RecipeError(f"states.out: {folder} holds states with {key} {made.get(key)!r}, and this recipe "
                              f"needs {value!r}; rerun align states with this recipe (into another states.out, or "
                              "after deleting this one)")
    for name, chunk in manifest["chunks"].items():
        path = folder / "chunks" / name / CHUNK_FILE
        size = path.stat().st_size if path.is_file() else -1
        if size != chunk["bytes"] or (verify and file_sha256(path) != chunk["sha256"]):
            raise RecipeError(f"states.out: {path} is missing or corrupted ({'size' if size != chunk['bytes'] else 'checksum'}"
                              f" mismatch); delete {path.parent} and rerun align states to compute it again")
    return manifest


class StatesStore:
    """Per trajectory row, the verifier states (length, width) `align states` computed: every chunk's file mapped
    (np.memmap: pages are read as rows are asked for, shared by the ranks of one machine through its page cache)."""

    def __init__(self, folder: Path, manifest: dict[str, Any], width: int, dtype: Any) -> None:
        import torch

        self.folder, self.width, self.dtype = Path(folder), width, dtype
        self.stored_width = manifest["width"]
        if width > self.stored_width:
            raise RecipeError(f"states.out: {folder} holds {self.stored_width} values a token; the drafter reads "
                              f"{width}: rerun align states with this recipe")
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.raw, self.raw_torch = RAW_DTYPES[itemsize]
        lengths = np.asarray(manifest["lengths"], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])  # global token offset of each row
        self.chunk_of = np.empty(len(lengths), dtype=np.int64)
        self.maps: list[np.memmap] = []
        self.chunk_start: list[int] = []  # global token offset of each chunk's first row
        for c, (name, chunk) in enumerate(sorted(manifest["chunks"].items())):
            first, end = chunk["rows"]
            self.chunk_of[first:end] = c
            self.chunk_start.append(int(self.offsets[first]))
            tokens = int(self.offsets[end] - self.offsets[first])
            self.maps.append(np.memmap(self.folder / "chunks" / name / CHUNK_FILE, dtype=self.raw, mode="r",
                                       shape=(tokens, self.stored_width)))

    def get(self, row: int) -> Any:
        """(length, width) states of trajectory row `row`, a copy in the verifier's dtype."""
        import torch

        c = int(self.chunk_of[row])
        start = int(self.offsets[row]) - self.chunk_start[c]
        raw = np.array(self.maps[c][start : start + int(self.offsets[row + 1] - self.offsets[row]), : self.width])
        return torch.from_numpy(raw).view(self.dtype)

    def put(self, row: int, states: Any) -> None:
        raise AssertionError("states.out is read-only in training: every row's states are in it")

    def remove(self) -> None:
        """Kept: the states are an input of the run, not its scratch (train.cache_verifier_states' are)."""

