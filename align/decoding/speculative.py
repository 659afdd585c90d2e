"""The decode step every speculative method shares, gpt-fast's ladder: propose a draft, verify it in one verifier
forward, accept a prefix of it by the rule that matches how it was drafted, and go on from the accepted tokens.

A method is a `Step`: how it proposes (one diffusion pass drafting a path, a tree or K candidates; an AR drafter's γ
forwards) and how the verifier checks that proposal. The loop (`speculative_generate`) owns what they all share: the
prefill, the stopping rule, never drafting past max_new_tokens, the draft/verify clocks and the stats.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from transformers import DynamicCache, PreTrainedModel

from align.decoding.acceptance import accept_draft
from align.decoding.generation import GenerationStats, Sampling, finish, finished, start, verifier_forward
from align.drafters.base import HiddenTap


@dataclass(frozen=True)
class Decoding:
    """The settings of one generation that every speculative method reads (the recipe's decode section holds their
    defaults): γ, the most tokens a draft holds per depth; the new tokens; how the verifier samples; what ends it."""

    gamma: int
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    eos_ids: frozenset[int] = frozenset()


@dataclass
class Draft:
    """One proposal. tokens: a path (γ,), K candidates (K, γ) or a DraftTree; probs: the (γ, V) distributions they
    were sampled from, None for a deterministic draft (argmax, path search, a tree's top tokens), which is a point
    mass. length: the positions drafted (stats.draft_lengths); forwards: the drafter forwards it took; nodes: a tree's
    size (stats.tree_nodes), 0 for other drafts."""

    tokens: Any
    probs: Optional[torch.Tensor] = None
    length: int = 0
    forwards: int = 1
    nodes: int = 0


class Step:
    """A method's propose and verify. A step lives for one generation: it may keep state between iterations (a
    drafter's cache or context, an adaptive length, a cost-aware size)."""

    #: what the step's drafter reads of every verifier forward (`Drafter.verifier_states`), which each one fills
    verifier_states: Optional[HiddenTap] = None

    def begin(self, cache: DynamicCache) -> None:
        """After the prefill, which covered the prompt (and filled `verifier_states`)."""

    def propose(self, context: torch.Tensor, room: int) -> Draft:
        """A draft after context (1, n) of at most `room` tokens per path (more would be thrown away)."""
        raise NotImplementedError

    def verify(self, draft: Draft, context: torch.Tensor, cache: DynamicCache) -> tuple[list[int], int]:
        """One verifier forward over the draft, whose cache covers context but its newest token; afterwards it covers
        context and the accepted tokens. Returns (accepted draft tokens, the verifier's next token)."""
        raise NotImplementedError

    def update(self, num_accepted: int) -> None:
        """After a verified step: what informs later proposals (outside the verify clock)."""


@torch.inference_mode()
def speculative_generate(
    verifier: PreTrainedModel, prompt_ids: torch.Tensor, step: Step, decoding: Decoding,
    generator: Optional[torch.Generator] = None,
) -> tuple[list[int], GenerationStats]:
    """Speculative decoding with `step` proposing and verifying. prompt_ids: (1, n). Lossless whatever the step, as
    long as its acceptance rule matches how it drafts: greedy outputs equal AR greedy's token for token."""
    # Invariant: the verifier's cache covers every token but the newest one.
    stats, cache, tokens = start(verifier, prompt_ids, decoding.sampling, generator, step.verifier_states)
    step.begin(cache)
    while not finished(tokens, decoding.max_new_tokens, decoding.eos_ids):
        context = torch.cat([prompt_ids, prompt_ids.new_tensor([tokens])], dim=1)

        t_draft = time.perf_counter()
        draft = step.propose(context, decoding.max_new_tokens - len(tokens))
        stats.drafter_forwards += draft.forwards
        stats.draft_s += time.perf_counter() - t_draft

        t_verify = time.perf_counter()
        accepted, next_token = step.verify(draft, context, cache)
        stats.verify_s += time.perf_counter() - t_verify
        stats.record(len(accepted), draft.length)
        if draft.nodes:
            stats.tree_nodes.append(draft.nodes)
        step.update(len(accepted))
        tokens += [*accepted, next_token]
    return finish(stats, tokens, decoding.max_new_tokens, decoding.eos_ids)


def verify_path(
    verifier: PreTrainedModel, context: torch.Tensor, draft: torch.Tensor, draft_probs: Optional[torch.Tensor],
    cache: DynamicCache, sampling: Sampling, generator: Optional[torch.Generator], tap: Optional[HiddenTap] = None,
) -> tuple[int, int]:
    """A path draft (γ,) checked in one cached forward over the newest token and the draft: the rule follows how the
    draft was made (`accept_draft`: sampled from draft_probs, or a point mass when None). The rejected drafts leave the
    cache; the kept ones are exact. Returns (num_accepted, next_token)."""
    verify_logits = verifier_forward(verifier, torch.cat([context[:, -1:], draft[None]], dim=1), cache, tap)
    num_accepted, next_token = accept_draft(draft, draft_probs, verify_logits, sampling, generator)
    cache.crop(-(len(draft) - num_accepted))  # rejected drafts leave the cache; the kept ones are exact
    return num_accepted, next_token
