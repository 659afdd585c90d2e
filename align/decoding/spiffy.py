"""Spiffy: lossless self-speculative decoding of a diffusion LM with a calibrated draft graph.

Each forward evaluates the real block state and every draft state of the graph together (each draft block sees the
context as the real block does, never the real block, at the same positions). The real transition is computed exactly
as vanilla decoding would; when the new state equals a draft state, that draft's distribution gives the next
transition without another forward, and so on down the graph. Outputs are those of `dllm_generate`.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers import PreTrainedModel

from align.decoding.dllm import DllmStats, StepRanks, block_probs, decode_blocks, unmask
from align.draft_graph import DraftGraph, apply_formula, prune, ranked_positions
from align.drafters import Drafter
from align.drafters.spec import DrafterSpec


def draft_states(block: torch.Tensor, previous: torch.Tensor, prev_probs: torch.Tensor, graph: DraftGraph,
                 mask_id: int, active: Optional[int] = None) -> list[torch.Tensor]:
    """The graph's guesses of future states of `block` (b,); `previous` (b,) is the state before it and prev_probs
    (b, V) the distribution that produced it (the newest one known before the forward at `block`). With `active`,
    only that many of them (dynamic pruning)."""
    ranks = StepRanks.of(prev_probs, graph.max_token_rank)
    positions = ranked_positions(block, ranks, mask_id, graph.position_order, previous)
    nodes = graph.nodes if active is None else prune(graph, ranks, positions, active)
    drafts = (apply_formula(block, ranks, node, mask_id, positions) for node in nodes)
    return [d for d in drafts if d is not None]


@torch.inference_mode()
def spiffy_generate(
    model: PreTrainedModel,
    spec: DrafterSpec,
    prompt_ids: torch.Tensor,
    graph: DraftGraph,
    max_new_tokens: int,
    threshold: Optional[float] = None,
    eos_ids: frozenset[int] = frozenset(),
    active: Optional[int] = None,
) -> tuple[list[int], DllmStats]:
    """prompt_ids: (1, n). Same arguments and outputs as `dllm_generate`, with fewer forwards. `active`: evaluate
    only that many of the graph's drafts per forward, the most likely ones (Spiffy v4's dynamic pruning: fewer
    draft rows per forward, which is what costs on a CPU)."""
    mask_id = spec.mask_token_id

    def spiffy_block(block: torch.Tensor, context: torch.Tensor, drafter: Drafter, stats: DllmStats) -> torch.Tensor:
        previous: Optional[torch.Tensor] = None  # the state before `block`
        prev_probs: Optional[torch.Tensor] = None  # the distribution (at `previous`) that produced `block`
        probs: Optional[torch.Tensor] = None  # `block`'s own distribution, when a matched draft gave it for free
        while bool((block == mask_id).any()):
            if probs is None:
                # The first state of a block has no previous distribution to rank from: a plain forward.
                drafts = [] if prev_probs is None else draft_states(block, previous, prev_probs, graph, mask_id,
                                                                    active)
                all_probs = block_probs(drafter, context, torch.stack([block, *drafts]))
                stats.nfe += 1
                probs = all_probs[0]
            else:
                stats.accepted_drafts += 1
            next_block = unmask(block, probs, mask_id, graph.tokens_per_step, threshold)
            stats.steps += 1
            # Exact state match: that draft's distribution is the new state's distribution.
            match = next((k for k, d in enumerate(drafts) if torch.equal(d, next_block)), None)
            previous, prev_probs, block = block, probs, next_block
            probs = None if match is None else all_probs[match + 1]
        return block

    return decode_blocks(model, spec, prompt_ids, max_new_tokens, graph.block_length, eos_ids, spiffy_block)
