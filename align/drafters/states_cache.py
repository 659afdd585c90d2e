"""A DFlash run's verifier hidden states, kept on disk after each trajectory's first step (train.cache_verifier_states).

Every DFlash training step runs the verifier over its rows for the hidden states the drafter reads; on SmolLM2 that
forward was 0.44 s of a 0.67 s step (one process, bf16, pruned head). The states of a row never change during a run
(the verifier is frozen), so a row's later epochs can read them instead: speculators and SpecForge precompute them
offline for the same reason. Here they are filled as the run goes, so a run shorter than an epoch pays nothing extra.

One file holds every row's states back to back (row r at `offsets[r]`, its own length), as fixed-width raw values in
the verifier's dtype, and a second file one byte per row saying whether it is filled. Every rank maps both: a row one
rank computed is read by any other later (the epochs are fresh permutations, so a row rarely returns to its rank).
Ranks must share the machine (one page cache): ranks on several machines are refused. The files are made for each
launch (a resumed run starts empty: the verifier behind a path may have changed) and removed at the end of the run
(a killed run leaves them until its next launch replaces them); the space is reserved when they are made, so a full
disk is a clear error then, not a crash mid-run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from align.config import RecipeError

STATES_FILE, FILLED_FILE = "verifier-states.cache", "verifier-states.filled"
# Raw storage per element size: numpy has no bfloat16, so values are stored as same-width integers and viewed back.
RAW_DTYPES = {2: (np.int16, torch.int16), 4: (np.int32, torch.int32)}  # (numpy, torch)


class StatesCache:
    """Per dataset row, the verifier states (length, width) of its first `length` tokens, once a step computed them."""

    def __init__(self, folder: Path, lengths: Sequence[int], width: int, dtype: torch.dtype) -> None:
        self.folder, self.width, self.dtype = Path(folder), width, dtype
        self.offsets = np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))])
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.raw, self.raw_torch = RAW_DTYPES[self.itemsize]
        self.states: Optional[np.memmap] = None
        self.filled: Optional[np.memmap] = None

    def create(self) -> None:
        """Make both files empty, with their space reserved (rank 0, before any rank opens them)."""
        rows = len(self.offsets) - 1
        for name, nbytes in ((STATES_FILE, int(self.offsets[-1]) * self.width * self.itemsize), (FILLED_FILE, rows)):
            path = self.folder / name
            path.unlink(missing_ok=True)
            with open(path, "wb") as f:
                try:
                    os.posix_fallocate(f.fileno(), 0, max(1, nbytes))
                except OSError as e:
                    path.unlink(missing_ok=True)
                    raise RecipeError(f"train.cache_verifier_states: {path} needs {nbytes / 2**30:.1f} GiB "
                                      f"({e.strerror}); free the space or set it to false") from None

    def open(self) -> "StatesCache":
        """Map the files `create` made (every rank)."""
        self.states = np.memmap(self.folder / STATES_FILE, dtype=self.raw, mode="r+",
                                shape=(int(self.offsets[-1]), self.width))
        self.filled = np.memmap(self.folder / FILLED_FILE, dtype=np.uint8, mode="r+", shape=(len(self.offsets) - 1,))
        return self

    def get(self, row: int) -> Optional[torch.Tensor]:
        """(length, width) states of dataset row `row`, or None when no step has computed them yet."""
        if not self.filled[row]:
            return None
        raw = np.array(self.states[self.offsets[row]:self.offsets[row + 1]])  # a copy: the map stays the cache's
        return torch.from_numpy(raw).view(self.dtype)

    def put(self, row: int, states: torch.Tensor) -> None:
        """Keep (length, width) states of row `row`; the filled mark goes after the values (same page cache)."""
        raw = states.detach().to(self.dtype).contiguous().view(self.raw_torch)
        self.states[self.offsets[row]:self.offsets[row + 1]] = raw.cpu().numpy()
        self.filled[row] = 1

    def remove(self) -> None:
        for name in (STATES_FILE, FILLED_FILE):
            (self.folder / name).unlink(missing_ok=True)


def batch_states(cache: StatesCache, rows: Sequence[int], clean_ids: torch.Tensor,
                 compute: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """(B, L, width) states for a batch of dataset `rows` whose tokens are clean_ids (B, L), right-padded: read where
    cached, else from one forward over the rows missing (compute(clean_ids) -> (b, L, width)), which are then kept.
    Padding positions hold zeros (no window reads them: a block sees only positions before its anchor)."""
    B, L = clean_ids.shape
    out = torch.zeros(B, L, cache.width, dtype=cache.dtype, device=clean_ids.device)
    missing = []
    for b, row in enumerate(rows):
        states = cache.get(row)
        if states is None:
            missing.append(b)
        else:
            out[b, : len(states)] = states.to(clean_ids.device)
    if missing:
        computed = compute(clean_ids[missing]).to(cache.dtype)
        for i, b in enumerate(missing):
            length = int(cache.offsets[rows[b] + 1] - cache.offsets[rows[b]])
            out[b, :length] = computed[i, :length]
            cache.put(rows[b], computed[i, :length])
    return out
