"""SpecDiff-2 self-selection: K drafts drawn from one diffusion drafter pass, verified together in one forward."""

from __future__ import annotations

from typing import Optional

import torch
from transformers import DynamicCache, PreTrainedModel

from align.config import RecipeError
from align.decoding.acceptance import accept_multi_candidate
from align.decoding.generation import GenerationStats, Sampling
from align.decoding.speculative import Decoding, Draft, Step, speculative_generate
from align.drafters import drafter_for
from align.drafters.spec import DrafterSpec


class SelectionStep(Step):
    """The K candidates are sampled position by position from the drafter's marginals at `draft_temperature`
    (SpecDiff-2 samples hot, ~1.5-2, for diversity), batched over the verifier's cached prefix, and accepted by
    recursive rejection sampling, which is lossless for independently sampled candidates.

    At temperature 0 candidate 0 is the drafter's argmax draft: greedy acceptance only keeps tokens equal to the
    verifier's argmax, so any candidate set is lossless there, and the argmax one makes τ at least SpecDiff's.
    """

    def __init__(self, verifier: PreTrainedModel, drafter: PreTrainedModel, spec: DrafterSpec, decoding: Decoding,
                 num_candidates: int, draft_temperature: float, generator: Optional[torch.Generator] = None) -> None:
        drafting = drafter_for(drafter, spec)
        # A DFlash drafter's refusal: the candidates' hidden states would need the block batched over the context.
        if "specdiff2_select" in drafting.refused_methods:
            raise RecipeError("specdiff2_select does not run a DFlash drafter")
        self.verifier, self.drafter, self.decoding, self.generator = verifier, drafting, decoding, generator
        self.num_candidates, self.draft_sampling = num_candidates, Sampling(temperature=draft_temperature)

    def begin(self, cache: DynamicCache) -> None:
        self.drafter.begin()

    def propose(self, context: torch.Tensor, room: int) -> Draft:
        draft_len = min(self.decoding.gamma, room)
        draft_logits = self.drafter.propose(self.verifier, context, draft_len)  # (γ, V)
        draft_probs = self.draft_sampling.probs(draft_logits)
        candidates = torch.multinomial(draft_probs, self.num_candidates, replacement=True,
                                       generator=self.generator).T  # (K, γ)
        if self.decoding.sampling.temperature == 0:
            candidates[0] = draft_logits.argmax(-1)
        return Draft(candidates, draft_probs, draft_len)

    def verify(self, draft: Draft, context: torch.Tensor, cache: DynamicCache) -> tuple[list[int], int]:
        candidates, (num_candidates, draft_len) = draft.tokens, draft.tokens.shape
        cached = cache.get_seq_length()
        cache.batch_repeat_interleave(num_candidates)
        inputs = torch.cat([context[:, -1:].expand(num_candidates, 1), candidates], dim=1)  # (K, γ + 1)
        positions = torch.arange(cached, cached + draft_len + 1, device=inputs.device).expand(num_candidates, -1)
        verify_logits = self.verifier(input_ids=inputs, position_ids=positions, cache=cache, use_cache=True).logits
        num_accepted, next_token, chosen = accept_multi_candidate(
            candidates, draft.probs, self.decoding.sampling.probs(verify_logits), self.generator
        )
        cache.batch_select_indices(torch.tensor([chosen], device=inputs.device))
        cache.crop(-(draft_len - num_accepted))
        return candidates[chosen, :num_accepted].tolist(), next_token


def specdiff2_select_generate(
    verifier: PreTrainedModel,
    drafter: PreTrainedModel,
    spec: DrafterSpec,
    prompt_ids: torch.Tensor,
    gamma: int,
    max_new_tokens: int,
    num_candidates: int,
    draft_temperature: float,
    sampling: Sampling = Sampling(),
    eos_ids: frozenset[int] = frozenset(),
    generator: Optional[torch.Generator] = None,
) -> tuple[list[int], GenerationStats]:
    """Self-selection (`SelectionStep`). prompt_ids: (1, n)."""
    decoding = Decoding(gamma, max_new_tokens, sampling, eos_ids)
    step = SelectionStep(verifier, drafter, spec, decoding, num_candidates, draft_temperature, generator)
    return speculative_generate(verifier, prompt_ids, step, decoding, generator)
