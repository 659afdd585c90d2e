"""SpecDiff-2 self-selection: K drafts drawn from one diffusion drafter pass, verified together in one forward."""

from __future__ import annotations

import time
from typing import Optional

import torch
from transformers import PreTrainedModel

from align.decoding.acceptance import accept_multi_candidate
from align.decoding.generation import GenerationStats, Sampling, finish, finished, start
from align.models import DrafterContext, DrafterSpec, block_logits


@torch.inference_mode()
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
    """prompt_ids: (1, n). The K candidates are sampled position by position from the drafter's marginals at
    `draft_temperature` (SpecDiff-2 samples hot, ~1.5-2, for diversity), batched over the verifier's cached prefix,
    and accepted by recursive rejection sampling, which is lossless for independently sampled candidates.

    At temperature 0 candidate 0 is the drafter's argmax draft: greedy acceptance only keeps tokens equal to the
    verifier's argmax, so any candidate set is lossless there, and the argmax one makes τ at least SpecDiff's.
    """
    draft_sampling = Sampling(temperature=draft_temperature)
    # Invariant: the verifier's cache covers every token but the newest one.
    stats, cache, tokens = start(verifier, prompt_ids, sampling, generator)
    state: Optional[DrafterContext] = DrafterContext.empty(drafter) if spec.attention == "block_causal" else None
    while not finished(tokens, max_new_tokens, eos_ids):
        draft_len = min(gamma, max_new_tokens - len(tokens))
        context = torch.cat([prompt_ids, prompt_ids.new_tensor([tokens])], dim=1)

        t_draft = time.perf_counter()
        block = prompt_ids.new_full((1, draft_len), spec.mask_token_id)
        draft_logits = block_logits(drafter, spec, context, block, state)[0]  # (γ, V)
        draft_probs = draft_sampling.probs(draft_logits)
        candidates = torch.multinomial(draft_probs, num_candidates, replacement=True, generator=generator).T  # (K, γ)
        if sampling.temperature == 0:
            candidates[0] = draft_logits.argmax(-1)
        stats.drafter_forwards += 1
        stats.draft_s += time.perf_counter() - t_draft

        t_verify = time.perf_counter()
        cached = cache.get_seq_length()
        cache.batch_repeat_interleave(num_candidates)
        inputs = torch.cat([context[:, -1:].expand(num_candidates, 1), candidates], dim=1)  # (K, γ + 1)
        positions = torch.arange(cached, cached + draft_len + 1, device=inputs.device).expand(num_candidates, -1)
        verify_logits = verifier(input_ids=inputs, position_ids=positions, cache=cache, use_cache=True).logits
        num_accepted, next_token, chosen = accept_multi_candidate(
            candidates, draft_probs, sampling.probs(verify_logits), generator
        )
        cache.batch_select_indices(torch.tensor([chosen], device=inputs.device))
        cache.crop(-(draft_len - num_accepted))
        stats.verify_s += time.perf_counter() - t_verify
        stats.record(num_accepted, draft_len)
        tokens += [*candidates[chosen, :num_accepted].tolist(), next_token]
    return finish(stats, tokens, max_new_tokens, eos_ids)
