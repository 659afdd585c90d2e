"""Training batches built ahead of the step that reads them.

A step's micro-batches are a function of (seed, step, rank) alone: the rows come from align/data.py's stream order
and each micro-batch's windows from a generator seeded by its stream position. So they can be built before the step
that needs them, while the step before it runs on the device. A torch DataLoader does it, rather than a thread of our
own: its worker is a process, clear of the training loop's GIL, and its pin-memory thread puts each batch in
page-locked memory, from which the step copies it to the GPU without waiting (non_blocking). Precomputed verifier
states (states.out, a read-only np.memmap) are read in the worker too: for a 7B verifier they are the largest tensor
of a batch, hundreds of MB. States filled as the run goes (train.cache_verifier_states) are read by the step, which
computes the missing ones with the verifier.

train.batch_workers sets the workers of each rank; 0 builds every batch in the loop, when the step asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from align.config import Recipe
from align.data import rows_at, stream_position
from align.drafters.states_cache import batch_states
from align.drafters.states_store import StatesStore
from align.windows import WindowBatch


@dataclass
class StepBatches:
    """One optimiser step's micro-batches, on the CPU (in pinned memory where a GPU reads them)."""

    positions: list[int]  # each micro-batch's start in the stream of training rows (and its windows' seed)
    row_ids: list[list[int]]  # the dataset rows of each micro-batch
    rows: list[list[dict[str, Any]]]  # those rows, as the losses and the rejections stage read them
    batches: list[WindowBatch]

    def pin_memory(self) -> "StepBatches":
        """The DataLoader's pin-memory thread calls this (its hook for a type of one's own)."""
        return StepBatches(self.positions, self.row_ids, self.rows, [b.pin_memory() for b in self.batches])


def step_batches(data: Any, recipe: Recipe, build: Callable[..., WindowBatch], spec: Any, pad_id: int, rank: int,
                 world: int, store: Optional[StatesStore], step: int) -> StepBatches:
    """The micro-batches of optimiser step `step` on this rank. data: align.stages.train.TrainData; store: the
    precomputed verifier states, attached here (None: the step attaches what it needs)."""
    t = recipe.train
    positions = [stream_position(step, m, rank, world, recipe) for m in range(t.gradient_accumulation_steps)]
    row_ids = [[data.train_rows[i] for i in rows_at(p, t.micro_batch_size, t.seed, len(data.train_rows))]
               for p in positions]
    rows = [[data.rows[i] for i in ids] for ids in row_ids]
    # Windows are drawn by stream position too: a row gets the same windows in any process layout.
    batches = [build(micro, spec, t.gamma, t.windows_per_sequence, pad_id, np.random.default_rng([t.seed, p]),
                     max_len=t.max_sequence_length) for p, micro in zip(positions, rows)]
    if store is not None:
        for ids, batch in zip(row_ids, batches):
            batch.verifier_states = batch_states(store, ids, batch.clean_ids, _stored_only)
    return StepBatches(positions, row_ids, rows, batches)


def _stored_only(clean_ids: torch.Tensor) -> torch.Tensor:
    # check_states matched states.out to the trajectories before training: a row it lacks is a bug, not a miss.
    raise RuntimeError("states.out lacks a training row's verifier states")


class _Steps(IterableDataset):
    def __init__(self, make: Callable[[int], StepBatches], start: int, stop: int) -> None:
        self.make, self.start, self.stop = make, start, stop

    def __iter__(self) -> Iterator[StepBatches]:
        # Worker k of n builds steps start + k, start + k + n, ...: the loader takes their outputs round-robin, in
        # step order.
        worker = get_worker_info()
        k, n = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        return (self.make(step) for step in range(self.start + k, self.stop, n))


def _as_built(item: StepBatches) -> StepBatches:
    return item  # one item is one step's batches already: nothing to collate


def batch_stream(make: Callable[[int], StepBatches], start: int, stop: int, workers: int, pin: bool
                 ) -> Iterator[StepBatches]:
    """Steps start..stop-1's batches in order: built by `workers` processes ahead of the loop (two steps each at
    most), or by the loop itself with none. pin: page-locked, for a copy to a GPU that does not wait."""
    loader = DataLoader(_Steps(make, start, stop), batch_size=None, collate_fn=_as_built, num_workers=workers,
                        pin_memory=pin, prefetch_factor=2 if workers else None,
                        # fork: a worker shares the trajectories and the memmapped states with the rank, unpickled
                        multiprocessing_context="fork" if workers else None)
    return iter(loader)
