"""Rank 0's save of a ZeRO-3-partitioned drafter against its size: seconds and rank 0's peak host memory, for
align's streamed save and for DeepSpeed's consolidated state dict (what align used before), on this machine's CPU
ranks; then what the measured rates give for each GPU recipe's drafter. A benchmark, not a test: timings vary.

    OMP_NUM_THREADS=1 .venv/bin/deepspeed --num_gpus 2 experiments/benchmark_save.py [--out DIR]

Each size is a Qwen2-architecture model (vocabulary 32k) built partitioned (`deepspeed.zero.Init`), fp32, in an
engine as align train makes it, saved with shards of an eighth of its weights (a 26B bf16 drafter in align's 5 GB
shards makes 11). Peak memory is rank 0's resident set above what it held before the save (/proc's VmHWM, reset
first). The report (markdown) is printed by rank 0 and written to DIR/report.md.
"""

from __future__ import annotations

import argparse
import re
import shutil
import time
from pathlib import Path

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from align.checkpoint import STREAM_SHARD_BYTES, merged_model, save_merged, save_streamed, streamed_save_plan
from align.recipe_files import load_recipe
from align.checkpoint import gathering_for_a_save
from align.dist import collective_timeout, deepspeed_config, init_distributed

ROOT = Path(__file__).resolve().parents[1]
# (hidden size, layers): about 45M, 120M and 330M parameters.
SIZES = [(512, 8), (768, 14), (1024, 24)]
# The GPU recipe whose drafter ZeRO-3 partitions (the others train LoRA adapters under ZeRO-2, or do not train):
# parameters, bytes per weight (bf16) and its largest single weight (the tied 262k x 2304 embedding of transformers'
# DiffusionGemmaTextConfig defaults).
GPU_DRAFTERS = {"recipes/gemma4-diffusiongemma.yaml": (26e9, 2, 262_144 * 2304)}


def _status_kb(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _one_save(model, engine, tokenizer, folder: Path, streamed: bool, rank: int) -> tuple[float, float]:
    """(seconds, rank 0's peak resident bytes above its resident set before) of one save, every rank taking part."""
    dist.barrier()
    before = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    start = time.perf_counter()
    if streamed:
        plan = streamed_save_plan(model, sum(p.ds_numel * p.element_size() for p in model.parameters()) // 8)
        with gathering_for_a_save(engine):
            save_streamed(model, plan, tokenizer, folder, {}, writer=rank == 0)
    else:
        state = engine._zero3_consolidated_16bit_state_dict()
        if rank == 0:
            save_merged(merged_model(model, {k: v.clone() for k, v in state.items()}), tokenizer, folder, {})
        del state
    dist.barrier()
    return time.perf_counter() - start, (_status_kb("VmHWM") - before) * 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "checkpoints" / "bench-save"))
    args, _ = parser.parse_known_args()  # (the launcher adds --local_rank)
    out = Path(args.out)
    recipe = load_recipe(ROOT / "recipes/tiny/align.yaml", ["train.zero_stage=3", "train.bf16=false"])
    rank, world = init_distributed(collective_timeout(recipe))
    config = deepspeed_config(recipe)
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "checkpoints/tiny/tokenizer")
    rows = []
    for hidden, layers in SIZES:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32_000, hidden_size=hidden, intermediate_size=hidden * 3,
                                                 num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                                 num_key_value_heads=hidden // 128, tie_word_embeddings=False))
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.0),
                                          config=config)
        weight_bytes = sum(p.ds_numel * p.element_size() for p in model.parameters())
        timed = {}
        for streamed in (True, False, True, False):  # interleaved; the first of each warms up
            folder = out / f"h{hidden}"
            timed[streamed] = _one_save(model, engine, tokenizer, folder, streamed, rank)
            if rank == 0:
                shutil.rmtree(folder)
        if rank == 0:
            rows.append((sum(p.ds_numel for p in model.parameters()), weight_bytes, timed))
        del engine, model
    if rank == 0:
        report = _report(rows, world)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.md").write_text(report)
        print(report)
    dist.barrier()
    dist.destroy_process_group()


def _report(rows: list, world: int) -> str:
    lines = [f"# Rank 0's save of a ZeRO-3 drafter, {world} CPU ranks (gloo), fp32, shards of 1/8 of the weights", "",
             "| parameters | weights | streamed: s | streamed: peak above before | consolidated: s | "
             "consolidated: peak |", "|---|---|---|---|---|---|"]
    for params, weight_bytes, results in rows:
        (s_time, s_peak), (c_time, c_peak) = results[True], results[False]
        lines.append(f"| {params / 1e6:.0f}M | {weight_bytes / 1e9:.2f} GB | {s_time:.1f} | {s_peak / 1e9:.2f} GB "
                     f"({s_peak / weight_bytes:.2f}×) | {c_time:.1f} | {c_peak / 1e9:.2f} GB "
                     f"({c_peak / weight_bytes:.2f}×) |")
    # Seconds per weight byte of the streamed save (gather over gloo, write, sha256), fitted through the sizes.
    sizes = np.array([r[1] for r in rows], dtype=float)
    rate = np.polyfit(sizes, np.array([r[2][True][0] for r in rows]), 1)
    lines += ["", f"Streamed save: {rate[0] * 1e9:.1f} s per GB of weights (+{rate[1]:.1f} s), least squares.", "",
              "At these rates, rank 0 of each GPU recipe's drafter (bf16; the gathers run over NCCL there, not gloo, so "
              "the time is an upper bound where the disk writes as fast as this VM's):", "",
              "| recipe | weights | save, at this VM's rate | rank 0's peak host memory: streamed (5 GB shards) | "
              "consolidated |", "|---|---|---|---|---|"]
    for recipe, (params, width, largest) in GPU_DRAFTERS.items():
        weights = params * width
        lines.append(f"| {recipe} | {weights / 1e9:.0f} GB | {(rate[0] * weights + rate[1]) / 60:.0f} min | "
                     f"≤ {(STREAM_SHARD_BYTES + largest * width) / 1e9:.1f} GB | {weights / 1e9:.0f} GB |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
