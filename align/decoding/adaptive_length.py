"""DiffuSpec's adaptive draft length (ADL): follow how long the drafter's drafts run before EOS, and how much of
them the verifier accepts, with exponential moving averages."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class AdaptiveLength:
    """k_{t+1} = clip(L̃_gen + δ·1[L̃_acc ≥ L̃_gen], k_min, k_max), starting at k_max with both EMAs at 0.

    L_gen is the raw draft's length up to its first EOS (the whole draft when it has none); L_acc the accepted length.
    When the verifier keeps up with what the drafter generates, the length grows by δ; otherwise it follows L̃_gen.

    The raw draft is the drafter's argmax over a proposal at the *maximum* length k_max (one drafter pass either way;
    the first k_t tokens are the draft that is verified). DiffuSpec measures L_gen on the k_t-long draft, which caps it
    at k_t: with EMAs from 0 the first update halves k and L̃_gen can then never exceed it, so k locks in unless every
    draft token is accepted. Measured at k_max, L_gen says how far the drafter would go before EOS, whatever k_t is.
    """

    min_len: int
    max_len: int
    delta: int
    rho: float = 0.5
    gen_ema: float = 0.0
    acc_ema: float = 0.0
    current: int = field(init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        self.current = self.max_len

    def update(self, raw_draft: torch.Tensor, num_accepted: int, eos_ids: frozenset[int]) -> int:
        """Fold in one iteration; returns k_{t+1}. raw_draft: (k_max,) the drafter's argmax over the maximum-length
        proposal, before any path search (shorter only where max_new_tokens leaves less room)."""
        tokens = raw_draft.tolist()
        generated = next((i for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
        self.gen_ema = (1 - self.rho) * self.gen_ema + self.rho * generated
        self.acc_ema = (1 - self.rho) * self.acc_ema + self.rho * num_accepted
        target = self.gen_ema + self.delta * (self.acc_ema >= self.gen_ema)
        self.current = min(self.max_len, max(self.min_len, math.floor(target + 0.5)))
        return self.current
