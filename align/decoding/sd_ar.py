"""SD-AR: standard speculative decoding with a small autoregressive drafter (γ drafter forwards per iteration)."""

from __future__ import annotations

import time
from typing import Optional

import torch
from transformers import DynamicCache, PreTrainedModel

from align.decoding.acceptance import accept_draft
from align.decoding.generation import GenerationStats, Sampling, finish, finished, start, verifier_forward
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


@torch.inference_mode()
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
    """Speculative decoding with an AR drafter. prompt_ids: (1, n). Greedy output equals AR greedy exactly.

    `draft_sampling` (default: the verifier's settings) is how the drafter drafts: temperature 0 gives argmax drafts,
    accepted by the point-mass rule when the verifier samples; otherwise drafts are sampled and accepted against the
    distributions they were drawn from. Either way the output is distributed as the verifier's.
    """
    draft_sampling = draft_sampling or sampling
    stats, cache, tokens = start(verifier, prompt_ids, sampling, generator)
    draft_cache = rollback_cache(drafter)
    while not finished(tokens, max_new_tokens, eos_ids):
        draft_len = min(gamma, max_new_tokens - len(tokens))
        context = torch.cat([prompt_ids, prompt_ids.new_tensor([tokens])], dim=1)

        t_draft = time.perf_counter()
        draft, draft_probs = draft_autoregressive(drafter, context, draft_cache, draft_len, draft_sampling, generator)
        stats.drafter_forwards += draft_len
        stats.draft_s += time.perf_counter() - t_draft

        t_verify = time.perf_counter()
        verify_logits = verifier_forward(verifier, torch.cat([context[:, -1:], draft[None]], dim=1), cache)
        # The rule follows how the draft was made: an argmax draft is a point mass even when the verifier samples.
        num_accepted, next_token = accept_draft(draft, draft_probs, verify_logits, sampling, generator)
        cache.crop(-(draft_len - num_accepted))
        # The drafter's cache covers context ⊕ draft[:-1]; keep only what was accepted.
        draft_cache.crop(-max(0, draft_len - 1 - num_accepted))
        stats.verify_s += time.perf_counter() - t_verify
        stats.record(num_accepted, draft_len)
        tokens += [*draft[:num_accepted].tolist(), next_token]
    return finish(stats, tokens, max_new_tokens, eos_ids)
