"""SD-AR: standard speculative decoding with a small autoregressive drafter (γ drafter forwards per iteration)."""

from __future__ import annotations

from typing import Optional

import torch
from transformers import DynamicCache, PreTrainedModel

from align.decoding.generation import GenerationStats, Sampling, verifier_forward
from align.decoding.speculative import Decoding, Draft, Step, speculative_generate, verify_path
from align.models import rollback_cache


@torch.inference_mode()
def draft_autoregressive(
    drafter: PreTrainedModel, context: torch.Tensor, cache: DynamicCache, draft_len: int,
    sampling: Sampling, generator: Optional[torch.Generator],
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Draft `draft_len` tokens one by one. context: (1, C), of which the cache already covers a prefix.

    Returns draft (γ,) and, when sampling, the (γ, V) distributions they were drawn from (None for an argmax draft).
    The cache ends up covering context ⊕ draft[:-1].
    """
    new = context[:, cache.get_seq_length():]
    tokens, probs = [], []
    for _ in range(draft_len):
        logits = verifier_forward(drafter, new, cache)[-1]  # any causal LM: the same cached forward
        if sampling.temperature == 0:
            token = logits.argmax()
        else:
            probs.append(sampling.probs(logits))
            token = torch.multinomial(probs[-1], 1, generator=generator)[0]
        tokens.append(token)
        new = token.view(1, 1)
    return torch.stack(tokens), (torch.stack(probs) if probs else None)


class ARDraftStep(Step):
    """An AR drafter drafts γ tokens one forward each. `draft_sampling` is how it drafts: temperature 0 gives argmax
    drafts, accepted by the point-mass rule when the verifier samples; otherwise drafts are sampled and accepted
    against the distributions they were drawn from. Either way the output is distributed as the verifier's."""

    def __init__(self, verifier: PreTrainedModel, drafter: PreTrainedModel, decoding: Decoding,
                 draft_sampling: Sampling, generator: Optional[torch.Generator] = None) -> None:
        self.verifier, self.drafter, self.decoding, self.generator = verifier, drafter, decoding, generator
        self.draft_sampling, self.draft_cache = draft_sampling, rollback_cache(drafter)

    def propose(self, context: torch.Tensor, room: int) -> Draft:
        draft_len = min(self.decoding.gamma, room)
        draft, draft_probs = draft_autoregressive(self.drafter, context, self.draft_cache, draft_len,
                                                  self.draft_sampling, self.generator)
        return Draft(draft, draft_probs, draft_len, forwards=draft_len)

    def verify(self, draft: Draft, context: torch.Tensor, cache: DynamicCache) -> tuple[list[int], int]:
        # The rule follows how the draft was made: an argmax draft is a point mass even when the verifier samples.
        num_accepted, next_token = verify_path(self.verifier, context, draft.tokens, draft.probs, cache,
                                               self.decoding.sampling, self.generator)
        # The drafter's cache covers context ⊕ draft[:-1]; keep only what was accepted.
        self.draft_cache.crop(-max(0, draft.length - 1 - num_accepted))
        return draft.tokens[:num_accepted].tolist(), next_token


def sd_ar_generate(
    verifier: PreTrainedModel,
    drafter: PreTrainedModel,
    prompt_ids: torch.Tensor,
    gamma: int,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    draft_sampling: Optional[Sampling] = None,
    eos_ids: frozenset[int] = frozenset(),
    generator: Optional[torch.Generator] = None,
) -> tuple[list[int], GenerationStats]:
    """Speculative decoding with an AR drafter (`ARDraftStep`; `draft_sampling` defaults to the verifier's settings).
    prompt_ids: (1, n). Greedy output equals AR greedy exactly."""
    decoding = Decoding(gamma, max_new_tokens, sampling, eos_ids)
    step = ARDraftStep(verifier, drafter, decoding, draft_sampling or sampling, generator)
    return speculative_generate(verifier, prompt_ids, step, decoding, generator)
