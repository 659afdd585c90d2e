"""What every decoding method shares: sampling settings, generation stats, the cached verifier forward, and how a
generation starts and stops."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from align.decoding.sampling import logits_to_probs, sample
from align.drafters.base import HiddenTap, aux_hidden
from align.models import rollback_cache


@dataclass
class Sampling:
    """How the verifier's tokens are chosen. temperature 0 is greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return logits_to_probs(logits, self.temperature, self.top_k, self.top_p)

    def pick(self, logits: torch.Tensor, generator: Optional[torch.Generator]) -> int:
        """One token from (V,) logits."""
        if self.temperature == 0:
            return int(logits.argmax())
        return int(sample(self.probs(logits), generator))


@dataclass
class GenerationStats:
    """What one generation cost and how drafts fared. τ counts tokens per verifier forward after the prefill."""

    new_tokens: int = 0
    verifier_forwards: int = 0  # decoding forwards, the prefill not counted
    drafter_forwards: int = 0
    accept_counts: list[int] = field(default_factory=list)  # draft tokens kept, per iteration
    draft_lengths: list[int] = field(default_factory=list)  # draft tokens proposed, per iteration
    tree_nodes: list[int] = field(default_factory=list)  # draft-tree methods: nodes verified, per iteration
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0
    started: float = 0.0  # perf_counter() when the generation began

    def record(self, num_accepted: int, draft_len: int) -> None:
        """One iteration: a verifier forward that kept `num_accepted` of `draft_len` draft tokens."""
        self.verifier_forwards += 1
        self.accept_counts.append(num_accepted)
        self.draft_lengths.append(draft_len)

    @property
    def tau(self) -> float:
        """Mean accepted length: tokens emitted per decoding verifier forward (mean_accepted_length)."""
        return mean_accepted_length([self])

    def per_position_acceptance(self, max_len: int) -> list[Optional[float]]:
        """α_i = P(draft position i accepted | positions < i accepted), i = 1..max_len (None: never reached)."""
        alphas: list[Optional[float]] = []
        for i in range(max_len):
            reached = sum(1 for n, g in zip(self.accept_counts, self.draft_lengths) if n >= i and g > i)
            kept = sum(1 for n, g in zip(self.accept_counts, self.draft_lengths) if n > i and g > i)
            alphas.append(kept / reached if reached else None)
        return alphas


def verifier_forward(
    verifier: PreTrainedModel, input_ids: torch.Tensor, cache: DynamicCache, tap: Optional[HiddenTap] = None
) -> torch.Tensor:
    """Run (1, k) new tokens through the verifier, extending its cache. Returns (k, V) logits.
    tap: a DFlash drafter's request for hidden states; the same forward fills `tap.last` with them."""
    start = cache.get_seq_length()
    positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    out = verifier(input_ids=input_ids, position_ids=positions, cache=cache, use_cache=True,
                   output_hidden_states=tap is not None)
    if tap is not None:
        tap.last = aux_hidden(out.hidden_states, tap.layer_ids)
    return out.logits[0]


def prefill(verifier: PreTrainedModel, prompt_ids: torch.Tensor,
            tap: Optional[HiddenTap] = None) -> tuple[torch.Tensor, DynamicCache]:
    """Encode the prompt (1, n): a cache covering it, and the (V,) logits predicting the first new token."""
    cache = rollback_cache(verifier)
    logits = verifier_forward(verifier, prompt_ids, cache, tap)
    return logits[-1], cache


def mean_accepted_length(stats: Sequence[GenerationStats]) -> float:
    """τ over generations, the one definition `align eval` and the Python API report: Σ (accepted drafts + 1) / Σ
    iterations for methods that record their iterations (the speculative ones); else Σ (new_tokens − 1) / Σ decoding
    verifier forwards, the tokens after the first (which the prefill gives) per forward: AR's, and HF's generate,
    assisted generation and prompt lookup, which report forward counts only. 1.0 when no decoding forward ran."""
    counts = [n for s in stats for n in s.accept_counts]
    if counts:
        return sum(n + 1 for n in counts) / len(counts)
    forwards = sum(s.verifier_forwards for s in stats)
    return sum(max(s.new_tokens - 1, 0) for s in stats) / forwards if forwards else 1.0


def start(verifier: PreTrainedModel, prompt_ids: torch.Tensor, sampling: Sampling,
          generator: Optional[torch.Generator], tap: Optional[HiddenTap] = None
          ) -> tuple[GenerationStats, DynamicCache, list[int]]:
    """What every method begins with: the prompt's prefill and the first new token. Starts the stats' clock."""
    stats = GenerationStats(started=time.perf_counter())
    logits, cache = prefill(verifier, prompt_ids, tap)
    stats.prefill_s = time.perf_counter() - stats.started
    return stats, cache, [sampling.pick(logits, generator)]


def finish(stats: GenerationStats, tokens: list[int], max_new_tokens: int,
           eos_ids: frozenset[int]) -> tuple[list[int], GenerationStats]:
    """What every method ends with: AR decoding's stopping rule applied to the tokens, and the clock stopped."""
    tokens = truncate(tokens, max_new_tokens, eos_ids)
    stats.new_tokens = len(tokens)
    stats.wall_s = time.perf_counter() - stats.started
    return tokens, stats


def finished(tokens: list[int], max_new_tokens: int, eos_ids: frozenset[int]) -> bool:
    """Enough tokens, or an end-of-sequence token anywhere (a method may emit several tokens past it at once)."""
    return len(tokens) >= max_new_tokens or not eos_ids.isdisjoint(tokens)


def truncate(tokens: list[int], max_new_tokens: int, eos_ids: frozenset[int]) -> list[int]:
    """Cut at max_new_tokens and just after the first end-of-sequence token, as AR decoding would stop."""
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens
