"""Timers the runtime needs: forward counting, a GPU-safe clock, and the cached verifier latency that cost-aware draft
sizes (sizing.py) are measured with. The evaluation harness (align/bench.py) times whole methods with these too."""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from align.decoding.generation import prefill


@contextmanager
def count_forwards(model: torch.nn.Module) -> Iterator[list[int]]:
    """Count a model's forward calls (HF's generate() reports none of its own)."""
    calls = [0]
    handle = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        yield calls
    finally:
        handle.remove()


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work: without it a CUDA timing measures kernel launches, not the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def verifier_latency(verifier: Any, context_len: int, new_tokens: int, batch: int = 1, repeats: int = 7) -> float:
    """Median seconds of one cached verifier forward over `new_tokens` tokens (× batch) after `context_len` tokens."""
    device = verifier.device
    _, cache = prefill(verifier, torch.zeros(1, context_len, dtype=torch.long, device=device))
    if batch > 1:
        cache.batch_repeat_interleave(batch)
    block = torch.zeros(batch, new_tokens, dtype=torch.long, device=device)
    positions = torch.arange(context_len, context_len + new_tokens, device=device).expand(batch, -1)
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        verifier(input_ids=block, position_ids=positions, cache=cache, use_cache=True)
        synchronize(device)
        times.append(time.perf_counter() - t0)
        cache.crop(-new_tokens)
    return statistics.median(times)
