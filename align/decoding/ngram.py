"""Model-free drafts: the n-gram continuation of the context (prompt lookup done as vLLM's n-gram speculator does it).

The context's last n tokens, for n from `max_match` down to `min_match`, are looked up among its earlier tokens; at the
longest n that occurs, the tokens that followed its most recent earlier occurrence are the draft. Nothing matching,
there is no draft and the step is a plain verifier step (one token, as AR decoding), so a miss costs almost nothing.
HF's prompt lookup instead matches at most 2 tokens and always proposes its 10. Copying wins exactly where a drafter is
weak: numbers and names from the question, repeated code, a list's structure.

A draft chosen without the verifier's randomness is a point mass: accepted with the verifier's probability of each
token (`accept_point_mass`, and `accept_tree` for its nodes), never with a drafter's q, which it was not drawn from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from align.decoding.sizing import CostAwareSize
from align.decoding.speculative import Decoding, Draft, Step, verify_path


@dataclass(frozen=True)
class NgramLookup:
    """The settings of the n-gram match: the longest and the shortest suffix of the context looked up."""

    max_match: int = 4
    min_match: int = 1

    def continuation(self, context: np.ndarray, num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens after the most recent earlier occurrence of the longest suffix of `context` (1-D
        token ids) of max_match..min_match tokens; [] when none occurs. An occurrence may overlap the suffix (a
        repeated run: "a b a b a" continues "b a ..."), so the continuation may be shorter than num_tokens."""
        length = len(context)
        for n in range(min(self.max_match, length - 1), self.min_match - 1, -1):
            # windows[i] = context[i : i + n] for the starts i ≤ length - n - 1: every occurrence but the suffix itself
            windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)
            hits = np.flatnonzero((windows == context[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the most recent occurrence: nearby text predicts best
                return context[start:start + num_tokens].tolist()
        return []


class NgramStep(Step):
    """The n-gram continuation as a path, verified in one forward (`verify_path`, point-mass rule). sizing: the
    cost-aware length, each position's chance taken from this source's acceptance so far (a continuation has no
    probabilities of its own); None: the whole continuation, at most γ."""

    def __init__(self, verifier: PreTrainedModel, decoding: Decoding, lookup: NgramLookup,
                 generator: Optional[torch.Generator] = None, sizing: Optional[CostAwareSize] = None) -> None:
        self.verifier, self.decoding, self.lookup = verifier, decoding, lookup
        self.generator, self.sizing = generator, sizing
        self.proposed = 0

    def propose(self, context: torch.Tensor, room: int) -> Draft:
        started = time.perf_counter()
        tokens = self.lookup.continuation(context[0].cpu().numpy(), min(self.decoding.gamma, room))
        if tokens and self.sizing is not None:
            flat = [0.0] * len(tokens)  # log 1: the calibration is then the measured per-position acceptance
            tokens = tokens[:self.sizing.choose(flat, range(1, len(tokens) + 1), time.perf_counter() - started)]
        self.proposed = len(tokens)
        draft = torch.tensor(tokens, dtype=context.dtype, device=context.device)
        return Draft(draft, None, len(tokens), forwards=0)

    def verify(self, draft: Draft, context: torch.Tensor, cache: DynamicCache) -> tuple[list[int], int]:
        num_accepted, next_token = verify_path(self.verifier, context, draft.tokens, draft.probs, cache,
                                               self.decoding.sampling, self.generator)
        return draft.tokens[:num_accepted].tolist(), next_token

    def update(self, num_accepted: int) -> None:
        if self.sizing is not None and self.proposed:
            self.sizing.update([0.0] * self.proposed, range(1, self.proposed + 1), num_accepted)
