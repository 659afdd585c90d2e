"""Pretraining on the CPU, shared by `align bootstrap` (the tiny family) and `align derive` (a diffusion drafter cut
from a real verifier): the MDLM step of a block-causal drafter, the next-token step of an AR model, and a resumable
AdamW loop over a budget of wall-clock minutes or of steps.

A building block, not a stage: both stages import it (a stage never imports another). The loop saves a resumable
state (weights, optimiser, step) atomically every few minutes and at its last step, and draws every batch and mask
from (seed, step), so a killed run resumed from its state sees the data it would have seen.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from align.disk import atomic_file, set_aside
from align.losses import mdlm, next_token
from align.masks import attention_masks, block_diffusion_allowed

# The small epsilon keeps 1/t finite; MDLM samples t in [eps, 1].
MIN_MASK_RATIO = 1e-3
# step_fn(model, window (B, L+1), generator, step) -> the loss of that window
StepFn = Callable[[torch.nn.Module, torch.Tensor, torch.Generator, int], torch.Tensor]


def use_bf16(precision: str) -> bool:
    """Whether pretraining autocasts to bf16. Pretraining runs on the CPU, also where there is a GPU, so "auto" asks
    whether this CPU has native bf16 (emulated bf16 is many times slower), not whether a GPU does."""
    if precision != "auto":
        return precision == "bf16"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def random_windows(stream: np.ndarray, batch_size: int, seq_len: int, rng: np.random.Generator) -> torch.Tensor:
    """(B, L+1) windows of a token stream at random offsets."""
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch_size)
    return torch.from_numpy(np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64))


def leading_windows(stream: np.ndarray, seq_len: int, max_tokens: int, batch_size: int) -> list[torch.Tensor]:
    """The stream's first `max_tokens` tokens as consecutive (≤B, L+1) windows: a fixed validation set."""
    n_windows = max(1, min(max_tokens, len(stream) - 1) // seq_len)
    rows = [stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n_windows)]
    return [torch.from_numpy(np.stack(rows[i : i + batch_size]).astype(np.int64))
            for i in range(0, n_windows, batch_size)]


def mdlm_step(model: torch.nn.Module, window: torch.Tensor, gen: torch.Generator, mask_id: int, block_size: int,
              logits_shift: int = 0) -> torch.Tensor:
    """MDLM loss of a block-causal drafter on a (B, L+1) window: every block of the sequence is noised and denoised in
    one pass, as `clean ⊕ noised` (block_diffusion_allowed): the clean copy plays the cached context.

    logits_shift 0: noised position t is predicted at its own output. 1 (a drafter cut from an AR model, as Dream and
    DiffuCoder are): at t-1's, so a block's first position is predicted by the last clean token before the block
    (what the cached context's last logits give when drafting) and the others by the noised block's previous position
    (align/drafters/masked.py reads a drafter the same way).
    """
    clean = window[:, :-1]
    batch, seq_len = clean.shape
    ratio = torch.rand(batch, seq_len // block_size, generator=gen) * (1 - MIN_MASK_RATIO) + MIN_MASK_RATIO
    ratio = ratio.repeat_interleave(block_size, dim=1)  # (B, L): one masking level per block
    masked = torch.rand(batch, seq_len, generator=gen) < ratio
    if logits_shift:
        masked[:, 0] = False  # nothing before the sequence's first token predicts it
    noised = torch.where(masked, torch.full_like(clean, mask_id), clean)
    ids = torch.cat([clean, noised], dim=1)
    positions = torch.arange(seq_len).repeat(2)  # the noised copy sits at its clean positions
    masks = attention_masks(model, block_diffusion_allowed(seq_len, block_size), positions)
    hidden = model.get_decoder()(input_ids=ids, position_ids=positions[None], attention_mask=masks).last_hidden_state
    clean_hidden, noised_hidden = hidden[:, :seq_len], hidden[:, seq_len:]
    if logits_shift:
        first = (torch.arange(seq_len) % block_size == 0)[None, :, None]  # (1, L, 1): a block's first position
        # roll(1): position t reads t-1 (position 0 wraps around, and is never masked)
        scored = torch.where(first, clean_hidden.roll(1, dims=1), noised_hidden.roll(1, dims=1))
    else:
        scored = noised_hidden
    # Only masked positions count in the loss, so the LM head (most of a small model's cost at a large vocabulary)
    # runs on them alone: (1, M, V) for the M masked positions of the batch.
    logits = model.get_output_embeddings()(scored[masked])[None]
    return mdlm(logits, clean[masked][None], masked[masked][None], ratio[masked][None], num_tokens=clean.numel())


def next_token_step(model: torch.nn.Module, window: torch.Tensor) -> torch.Tensor:
    """Next-token loss (nats/token) of an AR model on a (B, L+1) window."""
    inputs, targets = window[:, :-1], window[:, 1:]
    return next_token(model(input_ids=inputs).logits, targets, num_tokens=targets.numel())


@dataclass(frozen=True)
class Schedule:
    """How a model pretrains: AdamW (betas 0.9, 0.95; no decay on vectors), linear warm-up by steps, then cosine decay
    to lr × min_lr_ratio over the budget: wall-clock minutes (bootstrap: the tiny family's sizes fit a machine's
    time) or optimiser steps (derive: deterministic, the same run on any machine). Exactly one budget is set."""

    lr: float
    warmup_steps: int
    min_lr_ratio: float
    weight_decay: float
    save_every_minutes: float
    budget_minutes: Optional[float] = None
    max_steps: Optional[int] = None

    def __post_init__(self) -> None:
        if (self.budget_minutes is None) == (self.max_steps is None):
            raise ValueError("a Schedule has one budget: budget_minutes or max_steps")

    def lr_at(self, step: int, progress: float) -> float:
        """The rate of `step`, `progress` (0..1) through the budget."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)


def saved_state(part: str, state_path: Path, config_hash: str) -> Optional[dict[str, Any]]:
    """The state a killed run of these settings left at `state_path`, to resume from; None for a fresh start. A state
    that cannot be read (a damaged disk: align writes it atomically) or one saved by a run with other settings is set
    aside under another name and said, never resumed from silently nor overwritten by this run's saves:
    `state.damaged.pt`, `state-<its settings hash>.pt` (the work folder goes when a run in it finishes)."""
    if not state_path.is_file():
        return None
    try:
        state = torch.load(state_path, weights_only=False)
        saved_hash = state["config_hash"]
    except Exception as error:  # noqa: BLE001 (torch.load raises what its unpickler and zip reader raise)
        aside = set_aside(state_path, "state.damaged.pt")
        print(f"[{part}] {state_path} cannot be read ({type(error).__name__}); kept as {aside.name}, starting at step 0")
        return None
    if saved_hash != config_hash:
        aside = set_aside(state_path, f"state-{str(saved_hash)[:12]}.pt")
        print(f"[{part}] {state_path} was saved by a run with other settings (step {state.get('step')}); kept as "
              f"{aside.name}, starting at step 0 with these")
        return None
    return state


def train_loop(part: str, model: torch.nn.Module, step_fn: StepFn, window_at: Callable[[np.random.Generator], torch.Tensor],
               schedule: Schedule, work: Path, config_hash: str, seed: int, bf16: bool) -> dict[str, Any]:
    """Train `model`'s trainable parameters until the budget is spent, resuming from `work/state.pt` if a killed run
    of the same `config_hash` left one. `window_at(rng)` draws a (B, L+1) batch. Returns steps, tokens_seen,
    train_loss (the last step's) and wall_time_s (of every run that made these steps)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": schedule.weight_decay},
         {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}],
        lr=schedule.lr, betas=(0.9, 0.95),
    )
    step, elapsed, tokens_seen, last_loss = 0, 0.0, 0, float("nan")
    state_path = work / "state.pt"
    state = saved_state(part, state_path, config_hash)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, elapsed, tokens_seen = state["step"], state["elapsed"], state["tokens_seen"]
        last_loss = state.get("train_loss", last_loss)
        print(f"[{part}] resuming at step {step} ({elapsed / 60:.1f} min spent)")
    by_steps = schedule.max_steps is not None
    budget = schedule.max_steps if by_steps else schedule.budget_minutes * 60

    def spent() -> float:
        return step if by_steps else elapsed

    model.train()
    bar = tqdm(total=round(budget), initial=round(spent()), unit="step" if by_steps else "s", desc=part,
               dynamic_ncols=True)
    last_save = elapsed
    while spent() < budget:
        t0 = time.perf_counter()
        # Batches and masks depend only on (seed, step): a resumed run sees the data it would have seen.
        rng = np.random.default_rng([seed, step])
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        window = window_at(rng)
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step, spent() / budget)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = step_fn(model, window, gen, step)
        if not torch.isfinite(loss):
            raise RuntimeError(f"[{part}] loss is {loss.item()} at step {step}; the last saved state is in {work}")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step, tokens_seen, last_loss = step + 1, tokens_seen + window[:, :-1].numel(), loss.item()
        dt = time.perf_counter() - t0
        elapsed += dt
        bar.update(min(round(spent()) - bar.n, round(budget) - bar.n))
        bar.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{window[:, :-1].numel() / dt:.0f}", step=step)
        # The last step is always saved: a run that is re-entered after its budget is spent resumes as finished.
        if elapsed - last_save >= schedule.save_every_minutes * 60 or spent() >= budget:
            work.mkdir(parents=True, exist_ok=True)
            with atomic_file(state_path) as tmp:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                            "elapsed": elapsed, "tokens_seen": tokens_seen, "train_loss": last_loss,
                            "config_hash": config_hash}, tmp)
            last_save = elapsed
    bar.close()
    return {"steps": step, "tokens_seen": tokens_seen, "train_loss": last_loss, "wall_time_s": round(elapsed, 1)}


@torch.no_grad()
def mean_loss(model: torch.nn.Module, step_fn: StepFn, windows: list[torch.Tensor], bf16: bool,
              seed: int = 1234) -> float:
    """Mean of `step_fn`'s loss over fixed windows (nats/token), with a fixed masking seed: comparable across runs."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    total, rows = 0.0, 0
    for k, window in enumerate(windows):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            total += step_fn(model, window, gen, k).item() * len(window)
        rows += len(window)
    model.train(was_training)
    return total / rows
