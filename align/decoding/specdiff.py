"""SpecDiff: a diffusion drafter proposes γ tokens in one pass, the verifier checks them in one cached forward."""

from __future__ import annotations

import time
from typing import Optional, Union

import torch
from transformers import PreTrainedModel

from align.decoding.acceptance import accept_draft
from align.decoding.adaptive_length import AdaptiveLength
from align.decoding.generation import GenerationStats, Sampling, finish, finished, start, verifier_forward
from align.decoding.path_search import PathSearch, TrigramModel, causal_path_search
from align.decoding.sizing import CostAwareSize
from align.dflash import DFlashContext, HiddenTap, dflash_block_logits
from align.models import DrafterContext, DrafterSpec, block_logits


class DraftPass:
    """A diffusion drafter across one generation, whatever its kind: the one pass that drafts a block, and what it
    keeps between passes. A block-causal drafter keeps an exact context cache that only ever grows (drafts never enter
    it); a DFlash drafter reads the verifier's hidden states, which every verifier forward hands over through `tap`,
    and its context is those states for the tokens the verifier has seen (all but the newest)."""

    def __init__(self, drafter: PreTrainedModel, spec: DrafterSpec) -> None:
        self.drafter, self.spec = drafter, spec
        self.tap = HiddenTap(drafter.config.aux_hidden_state_layer_ids) if spec.kind == "dflash" else None
        self.state: Optional[DrafterContext] = (DrafterContext.empty(drafter)
                                                if spec.attention == "block_causal" and self.tap is None else None)
        self.conditioned = DFlashContext()

    def prefilled(self) -> None:
        """After the verifier's prefill (which filled `tap`): the prompt's states are a DFlash drafter's context."""
        if self.tap is not None:
            self.conditioned.extend(self.drafter, self.tap.last)

    def block_logits(self, verifier: PreTrainedModel, context: torch.Tensor, length: int) -> torch.Tensor:
        """The drafter's logits for the `length` tokens after context (1, n): (length, V)."""
        if self.tap is not None:
            return dflash_block_logits(self.drafter, verifier, context[:, -1:], length, self.conditioned)[0]
        block = context.new_full((1, length), self.spec.mask_token_id)
        return block_logits(self.drafter, self.spec, context, block, self.state)[0]

    def verified(self, rows: Union[slice, torch.Tensor]) -> None:
        """After a verifier forward: its input rows `rows` (the newest token and the accepted drafts) are verified
        now, and their states join a DFlash drafter's context."""
        if self.tap is not None:
            self.conditioned.extend(self.drafter, self.tap.last[:, rows])


@torch.inference_mode()
def specdiff_generate(
    verifier: PreTrainedModel,
    drafter: PreTrainedModel,
    spec: DrafterSpec,
    prompt_ids: torch.Tensor,
    gamma: int,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    draft_sampling: Optional[Sampling] = None,
    eos_ids: frozenset[int] = frozenset(),
    generator: Optional[torch.Generator] = None,
    path_search: Optional[tuple[PathSearch, TrigramModel]] = None,
    adaptive: Optional[AdaptiveLength] = None,
    argmax_draft: bool = False,
    sizing: Optional[CostAwareSize] = None,
) -> tuple[list[int], GenerationStats]:
    """Speculative decoding with a one-pass diffusion draft. prompt_ids: (1, n). Lossless for any drafter.

    Temperature 0: the draft is the drafter's argmax and the output equals AR greedy decoding token for token.
    Temperature > 0: the draft is sampled from `draft_sampling` (default: the verifier's settings) applied to the
    drafter's logits, and accepted by speculative sampling against that very distribution; with `argmax_draft` it is
    the drafter's argmax, a point mass, accepted by the point-mass rule.
    path_search (DiffuSpec CPS): the draft is the beam-searched path instead; being deterministic, it is accepted by
    the point-mass rule when sampling. adaptive (DiffuSpec ADL): the draft length follows `adaptive` instead of γ; the
    drafter then proposes `adaptive.max_len` tokens in its one pass and the first `adaptive.current` are the draft.
    sizing (cost-aware length): the draft is cut to the prefix `sizing` chooses from the drafter's confidences, which
    for a sampled draft are fixed before it is drawn (see the scores below).
    """
    draft_sampling = draft_sampling or sampling
    drafting = DraftPass(drafter, spec)
    # Invariant: the verifier's cache covers every token but the newest one.
    stats, cache, tokens = start(verifier, prompt_ids, sampling, generator, drafting.tap)
    drafting.prefilled()
    while not finished(tokens, max_new_tokens, eos_ids):
        # Never draft past max_new_tokens: those tokens would be thrown away.
        draft_len = min(adaptive.current if adaptive else gamma, max_new_tokens - len(tokens))
        context = torch.cat([prompt_ids, prompt_ids.new_tensor([tokens])], dim=1)

        # ADL reads the drafter's length off a proposal at its maximum length (see AdaptiveLength); the first
        # draft_len positions of that same pass are the draft.
        proposal_len = min(adaptive.max_len, max_new_tokens - len(tokens)) if adaptive else draft_len

        t_draft = time.perf_counter()
        proposal_logits = drafting.block_logits(verifier, context, proposal_len)  # (proposal_len, V)
        raw_draft = proposal_logits.argmax(-1)
        draft_logits = proposal_logits[:draft_len]  # (γ, V)
        # CPS searches and the cost-aware size scores by the drafter's log-probabilities: computed once for both.
        draft_log_probs = (torch.log_softmax(draft_logits.float(), -1) if path_search is not None or sizing is not None
                           else None)
        draft_probs = None  # None: a deterministic draft
        if path_search is not None:
            settings, proxy = path_search
            draft = raw_draft.new_tensor(causal_path_search(
                draft_log_probs, context[0, -2:].tolist(), proxy, settings, eos_ids))
        elif sampling.temperature == 0 or argmax_draft:
            draft = raw_draft[:draft_len]
        else:
            draft_probs = draft_sampling.probs(draft_logits)
            draft = torch.multinomial(draft_probs, 1, generator=generator).squeeze(-1)
        if sizing is not None:
            # Each prefix's cumulative drafter log-probability: how likely the drafter thinks it is. A deterministic
            # draft is scored by its own tokens; a sampled one by q alone (its most likely tokens, the argmax draft's
            # scores), never by the tokens it drew: a length chosen from the sample keeps position i more often when
            # it drew a likely token, the kept tokens are then no draws from q, and accepting them against q is not
            # lossless (issue 22: P(token) 0.175 for the verifier's 0.125).
            scored = draft if draft_probs is None else raw_draft[:draft_len]
            scores = draft_log_probs.gather(-1, scored[:, None]).squeeze(-1).cumsum(0).tolist()
            keep = sizing.choose(scores, range(1, len(draft) + 1), time.perf_counter() - t_draft)
            draft, scores = draft[:keep], scores[:keep]
            draft_probs = None if draft_probs is None else draft_probs[:keep]
        stats.drafter_forwards += 1
        stats.draft_s += time.perf_counter() - t_draft

        t_verify = time.perf_counter()
        verify_logits = verifier_forward(verifier, torch.cat([context[:, -1:], draft[None]], dim=1), cache,
                                         drafting.tap)
        num_accepted, next_token = accept_draft(draft, draft_probs, verify_logits, sampling, generator)
        cache.crop(-(len(draft) - num_accepted))  # rejected drafts leave the cache; the kept ones are exact
        drafting.verified(slice(0, num_accepted + 1))  # the newest token and the accepted drafts
        stats.verify_s += time.perf_counter() - t_verify
        stats.record(num_accepted, len(draft))
        tokens += [*draft[:num_accepted].tolist(), next_token]
        if adaptive is not None:
            adaptive.update(raw_draft, num_accepted, eos_ids)
        if sizing is not None:
            sizing.update(scores, range(1, len(draft) + 1), num_accepted)
    return finish(stats, tokens, max_new_tokens, eos_ids)
