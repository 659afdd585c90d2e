"""Honest timing: the interleaved loop every evaluation uses, forward counting, and cached verifier latency.

Methods are compared in the same process, after warm-up, with the order rotated per prompt so that no method always
runs first (caches, allocator, CPU frequency), and a prompt's time is the median of its repeats.
"""

from __future__ import annotations

import json
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from tqdm.auto import tqdm

from align.checkpoint import latest_step
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


@dataclass
class Run:
    tokens: list[list[int]]
    stats: list[Any]  # a method's stats per prompt (GenerationStats, DllmStats)
    wall_s: list[float]


def interleaved(methods: dict[str, Callable[[int, torch.Tensor], tuple[list[int], Any]]], prompts: list[torch.Tensor],
                warmup: int, repeats: int, desc: str) -> dict[str, Run]:
    """Every method, fn(prompt index, prompt_ids (1, n)) -> (tokens, stats), on every prompt after `warmup` prompts of
    warm-up. The method order rotates per prompt so that no method always runs first; a prompt's wall time is the
    median of `repeats` runs."""
    names = list(methods)
    for name in names:
        for i, ids in enumerate(prompts[:warmup]):
            methods[name](i, ids)
    runs = {name: Run([], [], []) for name in names}
    bar = tqdm(total=len(prompts) * len(names) * repeats, desc=desc, unit="gen", dynamic_ncols=True)
    for i, ids in enumerate(prompts):
        order = names[i % len(names):] + names[: i % len(names)]
        walls: dict[str, list[float]] = {n: [] for n in names}
        last: dict[str, tuple[list[int], Any]] = {}
        for _ in range(repeats):
            for name in order:
                synchronize(ids.device)
                t0 = time.perf_counter()
                last[name] = methods[name](i, ids)
                synchronize(ids.device)
                walls[name].append(time.perf_counter() - t0)
                bar.update()
        for name in names:
            runs[name].tokens.append(last[name][0])
            runs[name].stats.append(last[name][1])
            runs[name].wall_s.append(statistics.median(walls[name]))
    bar.close()
    return runs


def throughput_table(run_dirs: list[Path], warmup_steps: int = 5) -> str:
    """A markdown table of training throughput, one row per `align train` run folder: processes and threads per
    process (from its last checkpoint's meta.json), median tokens/s per rank over the steps after `warmup_steps`."""
    lines = ["| run | processes | threads each | tokens/s per rank | tokens/s in all |", "|---|---|---|---|---|"]
    for run in run_dirs:
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        speeds = [r["tokens_per_s_per_rank"] for r in records if "tokens_per_s_per_rank" in r][warmup_steps:]
        meta = json.loads((latest_step(run) / "meta.json").read_text())
        per_rank = statistics.median(speeds) if speeds else float("nan")
        lines.append(f"| {run.name} | {meta['world_size']} | {meta['threads_per_rank']} | {per_rank:.0f} | "
                     f"{per_rank * meta['world_size']:.0f} |")
    return "\n".join(lines)
