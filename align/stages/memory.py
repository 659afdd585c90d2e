"""`align memory <recipe>`: the recipe's training peak per GPU, measured (align/memory_probe.py) and printed as a
table; written to memory.out as JSON when set.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from align.config import Recipe, RecipeError
from align.disk import write_text_atomic
from align.memory_probe import (Measured, PerGpu, Shape, Width, drafter_context, drafter_width, lora_parameters,
                                measure, micro_batch_shape, per_gpu, verifier_held)


def _gb(n: int) -> str:
    return f"{n / 1e9:8.2f} GB"


def report(recipe: Recipe, width: Width, shape: Shape, measured: Measured, gpu: PerGpu) -> str:
    t = recipe.train
    tokens = shape.rows * shape.tokens
    lines = [
        f"align memory: {recipe.name}: drafter {recipe.drafter.path} ({width.source})",
        f"  width: hidden {width.hidden_size}, MLP {width.intermediate_size}, {width.num_hidden_layers} layers, "
        f"{width.num_attention_heads}/{width.num_key_value_heads} heads, vocabulary {width.vocab_size:,}, "
        f"{width.parameters / 1e9:.2f}B parameters"
        + (f", LoRA r={t.lora_r} ({lora_parameters(width, t.lora_r) / 1e6:.1f}M trainable)" if t.lora_r else ""),
        f"  micro-batch ({width.attention}): {shape.rows} rows x {shape.tokens} tokens ({shape.trajectory_tokens} "
        f"trajectory tokens{', capped by train.max_sequence_length' if t.max_sequence_length else ''}), "
        f"{shape.windows} windows x gamma {shape.gamma}; {'bf16' if t.bf16 else 'fp32'}, activation checkpointing "
        f"{'on' if t.activation_checkpointing else 'off'}, losses {', '.join(t.losses)}",
        ("  measured on the CPU (one layer, forward + backward):" if recipe.memory.device == "cpu" else
         "  measured on cuda, torch.cuda.max_memory_allocated (one layer, forward + backward):"),
        f"    kept per layer          {_gb(measured.layer_kept)}  ({measured.layer_kept / tokens / 1024:.1f} KiB per "
        f"token)",
        f"    layer forward+backward  {_gb(measured.layer_peak)}",
        f"    LM head + losses        {_gb(measured.head_and_losses_peak)}",
        f"  per GPU, ZeRO-{t.zero_stage} over {recipe.memory.world_size} ranks:",
        f"    weights                 {_gb(gpu.weights)}",
        f"    gradients               {_gb(gpu.gradients)}",
        f"    optimizer (AdamW)       {_gb(gpu.optimizer)}",
        *([f"    ZeRO-3 gathered layer   {_gb(gpu.gathered)}"] if t.zero_stage == 3 else []),
        f"    activations             {_gb(gpu.activations)}  ({width.num_hidden_layers} layers)",
        *([f"    {'verifier (' + verifier_held(recipe) + ')':<24}{_gb(gpu.verifier)}  (outside DeepSpeed, on every rank)"]
          if gpu.verifier else []),
        f"    peak                    {_gb(gpu.total)}",
    ]
    return "\n".join(lines)


def written_by_memory(path: Path) -> bool:
    """Whether `path` holds what `align memory` writes (its JSON of figures), so that a rerun may replace it."""
    try:
        figures = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(figures, dict) and str(figures.get("command", "")).startswith("align memory") \
        and {"width", "shape", "per_gpu_bytes"} <= set(figures)


def check(recipe: Recipe) -> None:
    """What `align memory` reads, refused before it builds anything: the drafter's sizes, and a GPU to measure on
    where memory.device is cuda; and where it writes: memory.out replaces only a file `align memory` wrote (never a
    folder, the recipe or anything else that happens to have that name)."""
    shape, context = micro_batch_shape(recipe, drafter_width(recipe)), drafter_context(recipe)
    if context is not None and shape.tokens > context:
        raise RecipeError(f"memory.prompt_tokens: rows of {shape.tokens} tokens ({recipe.memory.prompt_tokens} prompt "
                          f"+ {recipe.trajectories.max_new_tokens} new + the windows' drafts) exceed the drafter's "
                          f"context ({context} tokens); lower it, or cap rows with train.max_sequence_length")
    if recipe.memory.device == "cuda" and not torch.cuda.is_available():
        raise RecipeError("memory.device: cuda was asked for, but no CUDA device is visible (use cpu)")
    out = recipe.memory.out
    above = next((folder for folder in Path(out).parents if folder.exists()), None) if out is not None else None
    if above is not None and not above.is_dir():
        raise RecipeError(f"memory.out: {above} is a file, so {out} cannot be written under it")
    if out is not None and Path(out).is_dir():
        raise RecipeError(f"memory.out: {out} is a folder; name the JSON file to write")
    if out is not None and Path(out).exists() and not written_by_memory(Path(out)):
        raise RecipeError(f"memory.out: {out} exists and align memory did not write it; name a new file (it is kept)")


def main(recipe: Recipe, command: str) -> int:
    width = drafter_width(recipe)
    shape = micro_batch_shape(recipe, width)
    measured = measure(recipe, width, shape)
    gpu = per_gpu(recipe, width, measured)
    print(report(recipe, width, shape, measured, gpu))
    if recipe.memory.out is not None:
        out = Path(recipe.memory.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out, json.dumps({"command": command, "width": asdict(width), "shape": asdict(shape),
                                           "measured_bytes": asdict(measured), "per_gpu_bytes": asdict(gpu)},
                                          indent=2))
        print(f"align memory: wrote {out}", file=sys.stderr)
    return 0
