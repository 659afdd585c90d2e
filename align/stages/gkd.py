"""`align gkd`: the DistillSpec baseline, the AR drafter distilled from the verifier with TRL's GKD trainer.

It reads the same trajectories as `align train` (align/stages/train.py), so that an aligned diffusion drafter and an
aligned AR drafter are compared on equal data. TRL's trainer owns the loop (generalised JSD, on-policy samples with
probability lmbda); this module only adapts the trajectories to it and saves the result as a plain HF folder.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from align.checkpoint import save_merged
from align.config import Recipe
from align.recipe_files import get_key
from align.disk import mark_folder
from align.models import load_tokenizer
from align.preflight import check_inputs, check_new_tokens
from align.tracking import check_trackers, open_trackers, resolve


class TrajectoryCollator:
    """Trajectory rows -> the batch GKD expects: prompt ⊕ completion (labels on the completion only), plus the
    left-padded prompts it samples on-policy continuations from."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        seqs = [r["prompt_ids"] + r["completion_ids"] for r in rows]
        width, prompt_width = max(map(len, seqs)), max(len(r["prompt_ids"]) for r in rows)
        batch = {k: torch.full((len(rows), width), v, dtype=torch.long) for k, v in
                 (("input_ids", self.pad_id), ("attention_mask", 0), ("labels", -100))}
        prompts = torch.full((len(rows), prompt_width), self.pad_id, dtype=torch.long)
        prompt_mask = torch.zeros(len(rows), prompt_width, dtype=torch.long)
        for b, (seq, row) in enumerate(zip(seqs, rows)):
            p = len(row["prompt_ids"])
            batch["input_ids"][b, : len(seq)] = torch.tensor(seq)
            batch["attention_mask"][b, : len(seq)] = 1
            batch["labels"][b, p : len(seq)] = torch.tensor(row["completion_ids"])
            prompts[b, prompt_width - p :] = torch.tensor(row["prompt_ids"])  # left-padded: generation appends
            prompt_mask[b, prompt_width - p :] = 1
        return {**batch, "prompts": prompts, "prompt_attention_mask": prompt_mask}


def models(recipe: Recipe) -> tuple[str, ...]:
    return ("verifier.path", "ar_drafter.path")


def check(recipe: Recipe) -> None:
    """`align gkd`'s checks beyond its models' (the trajectories are checked by the stage, before any model loads)."""
    check_new_tokens(recipe, "gkd.max_new_tokens", ("verifier.path", "ar_drafter.path"))
    check_trackers("gkd.report_to", recipe.gkd.report_to, recipe.gkd.project)


def main(recipe: Recipe, command: str) -> None:
    from transformers import AutoModelForCausalLM

    from align.data import check_rows_fit, load_checked_trajectories

    check_inputs(recipe, model_keys=("verifier.path", "ar_drafter.path"))
    g = recipe.gkd
    # The trajectories align train would take, checked as it checks them (manifest against the recipe, checksums),
    # before any model loads: the two drafters are compared on equal data.
    data = load_checked_trajectories(recipe)
    # Student and teacher read each prompt with its completion (at most trajectories.max_new_tokens), and on-policy
    # steps sample gkd.max_new_tokens after the prompt.
    prompt_lengths = [len(p) for p in data["prompt_ids"]]
    for new_key in ("trajectories.max_new_tokens", "gkd.max_new_tokens"):
        check_rows_fit(recipe, prompt_lengths, new_key, get_key(recipe, new_key), ("verifier.path", "ar_drafter.path"))
    # TRL files its GKD trainer under trl.experimental and warns on import that such APIs may change; align's tests
    # cover the trainer it drives, and the warning, which a user cannot act on, would stand before any later line.
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    tokenizer = load_tokenizer(recipe.ar_drafter.path)
    student = AutoModelForCausalLM.from_pretrained(recipe.ar_drafter.path, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(recipe.verifier.path, dtype=torch.float32)
    out = mark_folder(g.out, "gkd")  # TRL's trainer writes into it from here on
    trackers, run_name = resolve(g.report_to), g.run_name or out.resolve().name
    # TRL's trainer reports to the trackers itself (tensorboard under <out>/runs). The wandb run is opened here, in the
    # run folder with the recipe as its config, and TRL's callback logs into it instead of starting one in the
    # working directory.
    wandb_run = open_trackers(["wandb"], out, g.project, run_name, recipe.to_dict()) if "wandb" in trackers else None
    args = GKDConfig(
        output_dir=str(out), max_steps=g.max_steps, learning_rate=g.lr, per_device_train_batch_size=g.batch_size,
        lmbda=g.lmbda, beta=g.beta, max_new_tokens=g.max_new_tokens, seed=g.seed, report_to=trackers,
        run_name=run_name, project=g.project, save_strategy="no", logging_steps=max(1, g.max_steps // 20),
        use_cpu=not torch.cuda.is_available(), bf16=False,
    )
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=data,
                         data_collator=TrajectoryCollator(tokenizer.pad_token_id), processing_class=tokenizer)
    trainer.train()
    if wandb_run is not None:
        wandb_run.close()
    final = out / "final"
    save_merged(trainer.model, tokenizer, final, {"meta.json": json.dumps(
        {"command": command, "recipe": recipe.to_dict(), "log": trainer.state.log_history}, indent=2)}, kind="gkd")
    print(f"gkd: distilled AR drafter -> {final}")
