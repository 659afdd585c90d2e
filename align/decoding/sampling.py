"""Turning logits into the distribution actually sampled from, and sampling it.

Shared by trajectory generation and the runtime, so that the distribution a token was drawn from is always the one
the acceptance rules are given (speculative sampling is lossless only against the distribution really sampled).
"""

from __future__ import annotations

from typing import Optional

import torch


def logits_to_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k and top-p (nucleus) truncation.

    temperature 0 is greedy: a one-hot distribution on the argmax, so that the same acceptance code serves greedy and
    sampled decoding, and greedy acceptance is exactly "draft token == verifier argmax".
    """
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: a token is dropped if the mass before it already does.
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """(..., V) probabilities -> (...) sampled token ids."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def residual(verifier_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(verifier_probs - draft_probs, 0)): what to sample from after a rejection. (..., V) -> (..., V).

    If the two distributions are equal the residual is empty, but then a rejection has probability 0; fall back to
    the verifier's distribution so that floating-point ties never produce NaNs.
    """
    diff = (verifier_probs - draft_probs).clamp_min(0)
    mass = diff.sum(-1, keepdim=True)
    return torch.where(mass > 0, diff / mass.clamp_min(1e-30), verifier_probs)
