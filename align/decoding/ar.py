"""The AR baseline: a KV-cached decoding loop, one verifier forward per token."""

from __future__ import annotations

from typing import Optional

import torch
from transformers import PreTrainedModel

from align.decoding.generation import GenerationStats, Sampling, finish, finished, start, verifier_forward


@torch.inference_mode()
def ar_generate(
    verifier: PreTrainedModel,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos_ids: frozenset[int] = frozenset(),
    generator: Optional[torch.Generator] = None,
) -> tuple[list[int], GenerationStats]:
    """The baseline: one verifier forward per token, KV-cached. prompt_ids: (1, n). Returns new tokens and stats."""
    stats, cache, tokens = start(verifier, prompt_ids, sampling, generator)
    while not finished(tokens, max_new_tokens, eos_ids):
        logits = verifier_forward(verifier, prompt_ids.new_tensor([[tokens[-1]]]), cache)[-1]
        stats.record(0, 0)
        tokens.append(sampling.pick(logits, generator))
    tokens, stats = finish(stats, tokens, max_new_tokens, eos_ids)
    stats.verify_s = stats.wall_s - stats.prefill_s
    return tokens, stats
