"""Memory by measurement: peak CPU tensor memory of a piece of work, and (`align memory`) a recipe's peak per GPU.

Measured, not estimated: the CPU allocator reports every allocation and free to torch's profiler (profile_memory),
and the running sum of those reports is the bytes of tensor memory live at each moment; its maximum is the peak.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def peak_bytes(work: Callable[[], Any]) -> tuple[int, Any]:
    """(peak bytes of tensor memory allocated above what was live when work() started, work()'s result).

    Counts CPU tensors only (every tensor work() allocates, including autograd's saved tensors and gradients); the
    result is dropped only after the measurement, so what it holds counts while it is live.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = work()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak, result
