"""Vanilla decoding of a diffusion LM: semi-autoregressive blocks, confidence-ordered unmasking (the target process
Spiffy accelerates, and the reference its outputs must equal)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from transformers import PreTrainedModel

from align.decoding.generation import truncate
from align.drafters import Drafter, drafter_for
from align.drafters.spec import DrafterSpec


@dataclass
class DllmStats:
    nfe: int = 0  # model forwards, every one of them
    context_forwards: int = 0  # of those, an encoder-decoder's context encodings (one per block)
    steps: int = 0  # state transitions (vanilla: one per block forward; Spiffy: more)
    accepted_drafts: int = 0
    new_tokens: int = 0
    wall_s: float = 0.0


@dataclass(frozen=True)
class StepRanks:
    """What Spiffy's formulas read from one step's distribution (b, V): each position's top-1 probability and its
    most likely tokens, best first. Traces keep these rather than distributions, which for a real dLLM would not fit
    in memory (LLaDA-8B, 30 prompts of 256 tokens: ~120 GB of float32 distributions)."""

    top_probs: torch.Tensor  # (b, k)
    top_tokens: torch.Tensor  # (b, k)

    @classmethod
    def of(cls, probs: torch.Tensor, top_k: int) -> "StepRanks":
        """probs: (b, V)."""
        return cls(*probs.topk(min(top_k, probs.shape[-1]), dim=-1))

    @property
    def confidence(self) -> torch.Tensor:
        """(b,) each position's top-1 probability."""
        return self.top_probs[:, 0]


@dataclass
class BlockTrace:
    """One block's vanilla trajectory: states[k] (b,) and ranks[k], from the distribution computed at states[k]
    that produced states[k + 1]. Calibration reads these."""

    states: list[torch.Tensor] = field(default_factory=list)
    ranks: list[StepRanks] = field(default_factory=list)


def unmask(block: torch.Tensor, probs: torch.Tensor, mask_id: int, tokens_per_step: int,
           threshold: Optional[float] = None) -> torch.Tensor:
    """One vanilla transition: unmask the most confident masked positions with their most likely tokens.

    block: (b,), probs: (b, V). Fixed mode unmasks `tokens_per_step` positions; threshold mode (Fast-dLLM) every
    position whose confidence reaches `threshold`, and at least the most confident one. Ties go to the leftmost
    position (a stable sort), so the rule is deterministic.
    """
    masked = block == mask_id
    confidence, tokens = probs.max(-1)
    confidence = confidence.masked_fill(~masked, -1.0)
    order = torch.sort(confidence, descending=True, stable=True).indices[: int(masked.sum())]
    if threshold is None:
        chosen = order[:tokens_per_step]
    else:
        chosen = order[confidence[order] >= threshold]
        chosen = chosen if len(chosen) else order[:1]
    new = block.clone()
    new[chosen] = tokens[chosen]
    return new


def block_probs(drafter: Drafter, context: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """(K, b) blocks after one context (1, n) -> (K, b, V) float32 distributions, one forward.

    The mask token gets probability 0: unmasking a position to it would make no progress (an undertrained model can
    rank it first, and the decoding loop then never ends), and a dLLM's output never contains it.
    """
    logits = drafter.block_logits(context, blocks).float()
    return torch.softmax(logits.index_fill(-1, torch.tensor([drafter.spec.mask_token_id], device=logits.device),
                                           float("-inf")), dim=-1)


def decode_blocks(model: PreTrainedModel, spec: DrafterSpec, prompt_ids: torch.Tensor, max_new_tokens: int,
                  block_length: int, eos_ids: frozenset[int],
                  decode_block: Callable[[torch.Tensor, torch.Tensor, Drafter, DllmStats], torch.Tensor],
                  ) -> tuple[list[int], DllmStats]:
    """The semi-autoregressive outer loop every dLLM decoder shares: blocks of masks, each turned into tokens by
    `decode_block(block, context, drafter, stats)` and appended to the context, until max_new_tokens or an EOS.

    A block-causal model keeps an exact context cache; a bidirectional one re-reads context ⊕ block each step
    (blocks after the current one are not shown to it, as in block-diffusion decoding). A block-causal LM brings that
    cache up to date (the prompt, then each decoded block) in its block's first forward, as one more causal span of the
    same model call; an encoder-decoder (DiffusionGemma) needs an encoder forward of its own, counted in stats.nfe
    like every other forward and in stats.context_forwards.
    """
    stats = DllmStats()
    t0 = time.perf_counter()
    context = prompt_ids
    drafter = drafter_for(model, spec)
    drafter.begin()
    tokens: list[int] = []
    while len(tokens) < max_new_tokens and eos_ids.isdisjoint(tokens):
        extended = drafter.encode(context)  # an encoder's forward that brought the cache up to date, if any
        stats.nfe += extended
        stats.context_forwards += extended
        block = decode_block(prompt_ids.new_full((block_length,), spec.mask_token_id), context, drafter, stats)
        tokens += block.tolist()
        context = torch.cat([context, block[None]], dim=1)
    tokens = truncate(tokens, max_new_tokens, eos_ids)
    stats.new_tokens = len(tokens)
    stats.wall_s = time.perf_counter() - t0
    return tokens, stats


@torch.inference_mode()
def dllm_generate(
    model: PreTrainedModel,
    spec: DrafterSpec,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    block_length: int,
    tokens_per_step: int = 1,
    threshold: Optional[float] = None,
    eos_ids: frozenset[int] = frozenset(),
    trace: Optional[list[BlockTrace]] = None,
    trace_token_rank: int = 8,
) -> tuple[list[int], DllmStats]:
    """Decode block after block, one forward per transition. prompt_ids: (1, n). Greedy tokens. With `trace`, each
    block's states and step ranks (the `trace_token_rank` most likely tokens per position) are appended to it."""

    def vanilla_block(block: torch.Tensor, context: torch.Tensor, drafter: Drafter, stats: DllmStats) -> torch.Tensor:
        record = BlockTrace() if trace is not None else None
        while bool((block == spec.mask_token_id).any()):
            probs = block_probs(drafter, context, block[None])[0]
            stats.nfe += 1
            if record is not None:
                record.states.append(block)
                record.ranks.append(StepRanks.of(probs, trace_token_rank))
            block = unmask(block, probs, spec.mask_token_id, tokens_per_step, threshold)
            stats.steps += 1
        if record is not None:
            record.states.append(block)
            trace.append(record)
        return block

    return decode_blocks(model, spec, prompt_ids, max_new_tokens, block_length, eos_ids, vanilla_block)
