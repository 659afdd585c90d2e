"""Align a diffusion drafter to a verifier under DeepSpeed, readable top to bottom.

    deepspeed --num_gpus 2 align/train.py recipes/tiny/align.yaml [key=value ...]
    OMP_NUM_THREADS=1 deepspeed --num_gpus 2 align/train.py recipes/tiny/align.yaml     # 2 CPU processes (gloo)
    python align/train.py recipes/tiny/align.yaml                                        # 1 process, no launcher

Reads trajectories written by `align trajectories`, trains on windows with the recipe's weighted losses, and writes
`<train.out>/step_<N>/` (a merged HF folder loadable by transformers alone, with meta.json), `ds_state/` (DeepSpeed
state for exact resume), `metrics.jsonl` and TensorBoard events. A re-run resumes from the last checkpoint and
reproduces the losses an uninterrupted run would have had: every batch is a function of (seed, step, rank).
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _single_process_env() -> None:
    """Outside a launcher, pretend to be rank 0 of 1 (DeepSpeed would otherwise look for MPI)."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def deepspeed_config(recipe: Any) -> dict[str, Any]:
    """The DeepSpeed config, derived from the recipe (never hand-maintained beside it)."""
    t = recipe.train
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": t.bf16},
        "steps_per_print": 10**9,  # our own logging; DeepSpeed's would interleave with the progress bar
        "wall_clock_breakdown": False,
    }


def stream_position(step: int, micro: int, rank: int, world: int, recipe: Any) -> int:
    """Where a micro-batch starts in the stream of training rows. Steps, micro-batches and ranks interleave so that
    the same global batch holds the same rows whatever the split into processes and accumulation steps."""
    t = recipe.train
    return ((step * t.gradient_accumulation_steps + micro) * world + rank) * t.micro_batch_size


@functools.lru_cache(maxsize=4)
def epoch_order(seed: int, epoch: int, n_rows: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n_rows)


def rows_at(position: int, count: int, seed: int, n_rows: int) -> list[int]:
    """`count` row indices from `position` on; each epoch is a fresh permutation of the rows."""
    return [int(epoch_order(seed, pos // n_rows, n_rows)[pos % n_rows]) for pos in range(position, position + count)]


def compute_losses(model: Any, spec: Any, batch: Any, rows: list[dict], recipe: Any, verifier: Any,
                   num_windows: int, num_tokens: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Each weighted loss of the recipe on one micro-batch, normalised by the whole step's window/token counts."""
    from align.losses import WINDOW_LOSSES
    from align.windows import topk_window_logits, verifier_window_logits, window_logits

    draft = window_logits(model, spec, batch).float().flatten(0, 1)  # (B·W, γ, V)
    targets, mask = batch.targets.flatten(0, 1), batch.target_mask.flatten(0, 1)
    verifier_logits = None
    if recipe.train.data_mode == "on_policy":
        # The drafter's own argmax drafts, labelled by the verifier along them: targets are the verifier's greedy
        # tokens there (what greedy verification would accept), distributions its distributions there.
        from align.windows import verifier_path_logits

        with torch.no_grad():
            drafts = draft.argmax(-1).view(batch.targets.shape)
            verifier_logits = verifier_path_logits(verifier, batch, drafts, pad_id).float().flatten(0, 1)
        targets = verifier_logits.argmax(-1)
    parts = {}
    for name, weight in recipe.train.losses.items():
        fn, needs = WINDOW_LOSSES[name]
        if needs == "targets":
            parts[name] = weight * fn(draft, targets, mask, num_windows=num_windows)
            continue
        if verifier_logits is None:
            with torch.no_grad():
                verifier_logits = (verifier_window_logits(verifier, batch) if verifier is not None
                                   else topk_window_logits(rows, batch, draft.shape[-1])).float().flatten(0, 1)
        if name == "streak_tv":
            parts[name] = weight * fn(draft, verifier_logits, mask, num_windows=num_windows)
        else:
            parts[name] = weight * fn(draft, verifier_logits, mask, num_tokens=num_tokens)
    return parts


@torch.no_grad()
def held_out_streak(model: Any, spec: Any, data: Any, indices: list[int], recipe: Any, rank: int, world: int,
                    build: Any, pad_id: int) -> dict[str, float]:
    """Simulated accepted length on held-out trajectories: the expected streak Σ_j Π_{i≤j} q(x_i), and the greedy
    streak (draft tokens matching x before the first miss), per window, averaged over every rank's share."""
    from align.windows import window_logits

    totals = torch.zeros(3)
    mine = indices[rank::world]
    for start in range(0, len(mine), recipe.train.micro_batch_size):
        rows = [data[i] for i in mine[start : start + recipe.train.micro_batch_size]]
        batch = build(rows, spec, recipe.train.gamma, recipe.train.windows_per_sequence, pad_id, np.random.default_rng([recipe.train.seed, start]))
        logits = window_logits(model, spec, batch).float()
        log_q = torch.log_softmax(logits, -1).gather(-1, batch.targets[..., None]).squeeze(-1)
        log_q = log_q.masked_fill(~batch.target_mask, float("-inf"))
        hits = (logits.argmax(-1) == batch.targets) & batch.target_mask
        valid = batch.target_mask[..., 0]
        totals += torch.tensor([torch.exp(torch.cumsum(log_q, -1)).sum(-1)[valid].sum().item(),
                                hits.int().cumprod(-1).sum(-1)[valid].sum().item(), valid.sum().item()])
    if world > 1:
        torch.distributed.all_reduce(totals)
    return {"expected_streak": totals[0].item() / max(totals[2].item(), 1),
            "greedy_streak": totals[1].item() / max(totals[2].item(), 1)}


def merged_model(module: Any, state: dict[str, torch.Tensor], recipe: Any) -> Any:
    """A fresh copy of the drafter holding `state`, with LoRA merged into the base weights."""
    from transformers import AutoModelForCausalLM

    base_config = (module.get_base_model() if hasattr(module, "get_base_model") else module).config
    model = AutoModelForCausalLM.from_config(base_config, trust_remote_code=recipe.drafter.trust_remote_code)
    if hasattr(module, "peft_config"):
        from peft import get_peft_model

        model = get_peft_model(model, module.peft_config["default"])
        model.load_state_dict(state)
        return model.merge_and_unload()
    model.load_state_dict(state)
    return model


def save_merged(engine: Any, out: Path, step: int, recipe: Any, tokenizer: Any, meta: dict[str, Any], rank: int) -> None:
    """`out/step_<N>/`: the drafter with LoRA merged, as a plain HF folder, written atomically by rank 0."""
    import deepspeed

    module = engine.module
    # Under ZeRO-3 each rank holds a shard: every rank enters the gather, rank 0 copies the full weights.
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None,
                                           enabled=recipe.train.zero_stage == 3):
        state = {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()} if rank == 0 else None
    if rank != 0:
        return
    model = merged_model(module, state, recipe)
    final, tmp = out / f"step_{step}", out / f".step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def final_tau(recipe: Any, checkpoint: Path, data: Any, held_out: list[int], count: int) -> dict[str, float]:
    """τ of SpecDiff greedy decoding (γ = train.gamma) with the saved checkpoint on held-out prompts."""
    from align.decoding.specdiff import specdiff_generate
    from align.models import load_drafter, load_tokenizer, load_verifier

    verifier = load_verifier(recipe.verifier)
    section = recipe.drafter.model_copy(update={"path": str(checkpoint)})
    drafter, spec = load_drafter(section, load_tokenizer(str(checkpoint)))
    prompts, seen = [], set()
    for i in held_out:
        if data[i]["prompt_index"] not in seen:
            seen.add(data[i]["prompt_index"])
            prompts.append(torch.tensor([data[i]["prompt_ids"]]))
    counts = []
    for ids in prompts[:count]:
        counts += specdiff_generate(verifier, drafter, spec, ids, recipe.train.gamma, 64)[1].accept_counts
    return {"final_tau": sum(n + 1 for n in counts) / max(len(counts), 1), "final_tau_prompts": len(prompts[:count])}


def main(argv: list[str] | None = None) -> int:
    # 1. recipe ----------------------------------------------------------------------------------------------------
    from align.cli import strip_launcher_args
    from align.config import RecipeError, check_inputs, load_recipe

    args = strip_launcher_args(sys.argv[1:] if argv is None else argv)
    _single_process_env()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        if not args:
            raise RecipeError("usage: deepspeed align/train.py recipe.yaml [key=value ...]")
        recipe = load_recipe(args[0], args[1:])
        check_inputs(recipe, model_keys=("drafter.path",))
        needs_verifier_logits = any(n not in ("streak", "ce_streak") for n in recipe.train.losses)
        on_policy = recipe.train.data_mode == "on_policy"
        online = on_policy or (recipe.train.data_mode == "online" and needs_verifier_logits)
        if online or recipe.train.final_eval_prompts:
            check_inputs(recipe, model_keys=("verifier.path",))
        from align.trajectories import load_trajectories

        data = load_trajectories(recipe.trajectories.out)
        if needs_verifier_logits and not online and "topk_ids" not in data.column_names:
            raise RecipeError("train.losses: KD losses need verifier distributions: set train.data_mode=online, or "
                              "trajectories.store_topk > 0 when making the trajectories")
    except RecipeError as e:
        if rank == 0:
            print(f"align train: error: {e}", file=sys.stderr)
        return 2

    import deepspeed
    import torch.distributed as dist
    from tqdm.auto import tqdm

    from align.models import load_drafter, load_tokenizer, load_verifier
    from align.windows import WINDOW_BUILDERS

    t = recipe.train
    out = Path(t.out)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(t.seed)

    # 2. models ----------------------------------------------------------------------------------------------------
    tokenizer = load_tokenizer(recipe.drafter.path, recipe.drafter.trust_remote_code)
    model, spec = load_drafter(recipe.drafter, tokenizer)
    model.train()
    if t.lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=t.lora_r, lora_alpha=t.lora_alpha, target_modules="all-linear"))
    else:
        model.requires_grad_(True)
    verifier = load_verifier(recipe.verifier) if online else None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    build = WINDOW_BUILDERS[spec.attention]

    # 3. data: 1 prompt in 20 held out for the simulated accepted length ------------------------------------------
    held_out = [i for i, p in enumerate(data["prompt_index"]) if p % 20 == 0]
    train_rows = [i for i, p in enumerate(data["prompt_index"]) if p % 20 != 0]

    # 4. engine ----------------------------------------------------------------------------------------------------
    # A torch AdamW rather than a DeepSpeed-config optimizer: no fused-Adam JIT build, and the same on CPU and GPU.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=t.lr,
                                  weight_decay=t.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, t.warmup_steps)) * (
        0.5 * (1 + math.cos(math.pi * min(1.0, s / t.max_steps)))))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule,
                                           config=deepspeed_config(recipe))

    # 5. resume ----------------------------------------------------------------------------------------------------
    start = 0
    if (out / "ds_state" / "latest").is_file():
        _, client = engine.load_checkpoint(str(out / "ds_state"))
        start = client["step"]
        if rank == 0:
            print(f"align train: resuming from step {start}")

    # 6. loop ------------------------------------------------------------------------------------------------------
    writer = None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(out / "tensorboard"))
    bar = tqdm(total=t.max_steps, initial=start, desc="align", unit="step", disable=rank != 0, dynamic_ncols=True)
    meta = {"recipe": recipe.to_dict(), "drafter_base": recipe.drafter.path, "verifier": recipe.verifier.path,
            "drafter_spec": spec.to_dict(), "world_size": world}
    status = 0
    for step in range(start, t.max_steps):
        t0 = time.perf_counter()
        positions = [stream_position(step, m, rank, world, recipe) for m in range(t.gradient_accumulation_steps)]
        micro_rows = [[data[train_rows[i]] for i in rows_at(p, t.micro_batch_size, t.seed, len(train_rows))]
                      for p in positions]
        # Windows are drawn by stream position too: a row gets the same windows in any process layout.
        batches = [build(rows, spec, t.gamma, t.windows_per_sequence, pad_id, np.random.default_rng([t.seed, p]))
                   for p, rows in zip(positions, micro_rows)]
        # Normalise by the whole step's counts over every rank, so accumulation and data parallelism change nothing.
        counts = torch.tensor([sum(b.num_windows for b in batches), sum(int(b.target_mask.sum()) for b in batches)],
                              dtype=torch.float64)
        if world > 1:
            dist.all_reduce(counts)
        scale = t.gradient_accumulation_steps * world  # DeepSpeed divides by both; undo it for an exact sum
        totals: dict[str, float] = {}
        finite = torch.ones(1)
        for rows, batch in zip(micro_rows, batches):
            parts = compute_losses(engine.module, spec, batch, rows, recipe, verifier, int(counts[0]), int(counts[1]),
                                   pad_id)
            loss = sum(parts.values())
            finite *= float(torch.isfinite(loss))
            if world > 1:
                dist.all_reduce(finite, op=dist.ReduceOp.MIN)
            if not finite.item():
                break
            engine.backward(loss * scale)
            engine.step()
            for name, value in parts.items():
                totals[name] = totals.get(name, 0.0) + value.item()
        if not finite.item():
            if rank == 0:
                print(f"align train: loss is not finite at step {step}; stopping with the last checkpoint intact",
                      file=sys.stderr)
            status = 3
            break
        summed = torch.tensor(list(totals.values()), dtype=torch.float64)
        if world > 1:
            dist.all_reduce(summed)
        record = {"step": step + 1, "loss": float(summed.sum()), **dict(zip(totals, summed.tolist())),
                  "lr": schedule.get_last_lr()[0], "windows": int(counts[0]),
                  "tokens_per_s_per_rank": float(sum(b.target_mask.sum() for b in batches)) / (time.perf_counter() - t0)}
        if (step + 1) % t.eval_every == 0 or step + 1 == t.max_steps:
            engine.eval()
            record.update(held_out_streak(engine.module, spec, data, held_out, recipe, rank, world, build, pad_id))
            engine.train()
        if rank == 0:
            with (out / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")
            for key, value in record.items():
                if key != "step":
                    writer.add_scalar(key, value, step + 1)
            bar.update()
            bar.set_postfix(loss=f"{record['loss']:.4f}")
        if (step + 1) % t.save_every == 0 or step + 1 == t.max_steps:
            save_merged(engine, out, step + 1, recipe, tokenizer, {**meta, "metrics": record}, rank)
            engine.save_checkpoint(str(out / "ds_state"), tag=f"step_{step + 1}", client_state={"step": step + 1})
    bar.close()

    # 7. real τ with the runtime (training accuracy alone misleads), from the final merged checkpoint ----------------
    if rank == 0 and status == 0 and t.final_eval_prompts:
        record = final_tau(recipe, out / f"step_{t.max_steps}", data, held_out, t.final_eval_prompts)
        with (out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": t.max_steps, **record}) + "\n")
        meta_path = out / f"step_{t.max_steps}" / "meta.json"
        meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), **record}, indent=2))
        print(f"align train: real τ on {t.final_eval_prompts} held-out prompts: {record['final_tau']:.3f}")

    # 8. shutdown --------------------------------------------------------------------------------------------------
    if writer is not None:
        writer.close()
    dist.barrier()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
