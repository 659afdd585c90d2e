"""Losses as pure functions of logits (fp32 inside), and the name -> function table recipes refer to.

Every loss takes an explicit token count to divide by, so that gradient accumulation over micro-batches of different
sizes gives exactly the gradient of the whole batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mdlm(
    draft_logits: torch.Tensor,
    targets: torch.Tensor,
    masked: torch.Tensor,
    mask_ratio: torch.Tensor,
    *,
    num_tokens: int,
) -> torch.Tensor:
    """Masked-diffusion (MDLM, linear schedule) negative ELBO: Σ over masked positions of −log q(x) / t, / num_tokens.

    draft_logits: (B, L, V) predictions for every position; targets: (B, L) clean tokens; masked: (B, L) bool, which
    positions were masked; mask_ratio: (B, L) the masking probability t each position was corrupted with.
    The 1/t weight makes this an upper bound on the data's negative log-likelihood (nats/token), so the drafter's
    loss can be compared across masking levels.
    """
    ce = F.cross_entropy(draft_logits.float().flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
    return (ce * masked / mask_ratio).sum() / num_tokens


def next_token(logits: torch.Tensor, targets: torch.Tensor, *, num_tokens: int) -> torch.Tensor:
    """Autoregressive cross-entropy: logits (B, L, V) at position t predict targets (B, L) at t (already shifted)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum") / num_tokens
