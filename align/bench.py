"""The evaluation harness: the interleaved loop every evaluation uses, eval.json's layout, the training throughput
table, and the verifier cost-curve benchmark. The timers the runtime itself needs (forward counting, cached verifier
latency) are align/decoding/timers.py; the machine a run was measured on is align/machine.py.

Methods are compared in the same process, after warm-up, with the order rotated per prompt so that no method always
runs first (caches, allocator, CPU frequency), and a prompt's time is the median of its repeats.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from align.checkpoint import latest_step
from align.decoding.timers import synchronize
from align.disk import read_log
from align.machine import machine


def _flat(value: Any) -> bool:
    """A scalar, or a list of scalars: what report_json writes on one line."""
    scalar = (str, int, float, bool, type(None))
    return isinstance(value, scalar) or (isinstance(value, list) and all(isinstance(v, scalar) for v in value))


def report_json(value: Any) -> str:
    """A report (eval.json) as JSON indented by 2 like json.dumps(indent=2), except that a list of numbers stays on one
    line, and a list of records (dicts of such values) has one record per line: per-prompt records of a few hundred
    prompts stay a readable file rather than one number per line."""
    def render(v: Any, pad: str) -> str:
        inner = pad + "  "
        if isinstance(v, dict) and v:
            return "{\n" + ",\n".join(f"{inner}{json.dumps(k)}: {render(x, inner)}" for k, x in v.items()) + \
                f"\n{pad}}}"
        if isinstance(v, list) and v and not _flat(v):
            records = all(isinstance(x, dict) and all(_flat(y) for y in x.values()) for x in v)
            items = [json.dumps(x) if records else render(x, inner) for x in v]
            return "[\n" + ",\n".join(inner + item for item in items) + f"\n{pad}]"
        return json.dumps(v)

    return render(value, "") + "\n"


@dataclass
class Run:
    tokens: list[list[int]]
    stats: list[Any]  # a method's stats per prompt (GenerationStats, DllmStats)
    wall_s: list[float]


def interleaved(methods: dict[str, Callable[[int, torch.Tensor], tuple[list[int], Any]]], prompts: list[torch.Tensor],
                warmup: int, repeats: int, desc: str, after_warmup: Callable[[], None] = lambda: None
                ) -> dict[str, Run]:
    """Every method, fn(prompt index, prompt_ids (1, n)) -> (tokens, stats), on every prompt after `warmup` prompts of
    warm-up (then `after_warmup` is called). The method order rotates per prompt so that no method always runs first;
    a prompt's wall time is the median of `repeats` runs."""
    names = list(methods)
    # Warm-up has its bar too: with a real model it is minutes of generations before the first timed one. None
    # without warm-up (an empty bar would print "0it").
    warmups = len(names) * len(prompts[:warmup])
    with tqdm(total=warmups, desc=f"{desc}, warm-up", unit="gen", dynamic_ncols=True, disable=not warmups) as bar:
        for name in names:
            for i, ids in enumerate(prompts[:warmup]):
                methods[name](i, ids)
                bar.update()
    after_warmup()
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
        records = read_log(run / "metrics.jsonl", "align throughput")  # a cut last line is dropped, and said
        measured = [r["tokens_per_s_per_rank"] for r in records if "tokens_per_s_per_rank" in r]
        speeds = measured[warmup_steps:]
        meta = json.loads((latest_step(run) / "meta.json").read_text())
        if not speeds:  # said in the table, not a NaN: a short run has only warm-up steps
            missing = f"— ({len(measured)} steps logged, none past the {warmup_steps} warm-up steps)"
            lines.append(f"| {run.name} | {meta['world_size']} | {meta['threads_per_rank']} | {missing} | — |")
            continue
        per_rank = statistics.median(speeds)
        lines.append(f"| {run.name} | {meta['world_size']} | {meta['threads_per_rank']} | {per_rank:.0f} | "
                     f"{per_rank * meta['world_size']:.0f} |")
    return "\n".join(lines)


def model_configs(models: list[str]) -> dict[str, Any]:
    """name -> config, for names of align.drafters.spec.VERIFIER_ARCHITECTURES or folders / Hub ids with a config.json;
    raises ValueError naming the first that is neither."""
    from transformers import AutoConfig

    from align.drafters.spec import VERIFIER_ARCHITECTURES as NAMED

    configs = {}
    for name in models:
        try:
            configs[name] = (AutoConfig.for_model(NAMED[name][0], **NAMED[name][1]) if name in NAMED
                             else AutoConfig.from_pretrained(name))
        except (OSError, ValueError) as error:
            raise ValueError(f"{name}: neither a named architecture ({', '.join(NAMED)}) nor a folder or Hub id with "
                             f"a config.json ({type(error).__name__})") from None
    return configs


def verify_cost_curves(configs: dict[str, Any], context_len: int, max_tokens: int, dtype: torch.dtype,
                       device: torch.device, rounds: int = 7) -> dict[str, Any]:
    """Each config's cost curve (seconds of one cached forward over 1..max_tokens new tokens, `measure_verify_costs`)
    with random weights, built in `dtype` on `device`: a forward's cost does not depend on the weights' values, so no
    weights are downloaded. Returns {context_len, machine, models: {name: {parameters, verify_s}}}."""
    from transformers import AutoModelForCausalLM

    from align.decoding.sizing import measure_verify_costs

    report: dict[str, Any] = {"context_len": context_len, "machine": machine(device, dtype), "models": {}}
    for name, config in configs.items():
        with torch.device(device):  # built in the run's dtype on its device: no float32 copy of a 7B model first
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        with torch.no_grad():
            costs = measure_verify_costs(model, context_len, max_tokens, rounds=rounds)
        report["models"][name] = {"parameters": sum(p.numel() for p in model.parameters()), "verify_s": costs}
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return report
