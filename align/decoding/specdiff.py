"""SpecDiff: a diffusion drafter proposes γ tokens in one pass, the verifier checks them in one cached forward."""

from __future__ import annotations

import time
from typing import Optional, Union

import torch
from transformers import DynamicCache, PreTrainedModel

from align.decoding.adaptive_length import AdaptiveLength
from align.decoding.generation import GenerationStats, Sampling
from align.decoding.path_search import PathSearch, TrigramModel, causal_path_search
from align.decoding.sizing import CostAwareSize
from align.decoding.speculative import Decoding, Draft, Step, speculative_generate, verify_path
from align.drafters import drafter_for
from align.drafters.spec import DrafterSpec


# --------------------------------------------------------------------------------------------------------------------
# what a path draft is, given the drafter's pass: one small strategy, chosen once per generation
# --------------------------------------------------------------------------------------------------------------------
class ArgmaxDraft:
    """The drafter's most likely tokens: a point mass (the verifier's greedy rule, or the point-mass rule when it
    samples)."""

    needs_log_probs = False

    def __call__(self, draft_logits: torch.Tensor, draft_log_probs: Optional[torch.Tensor], raw_draft: torch.Tensor,
                 context: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """draft_logits: (γ, V); raw_draft: the argmax of the whole proposal (≥ γ,). Returns (draft (γ,), None)."""
        return raw_draft[:len(draft_logits)], None


class SampledDraft:
    """Tokens drawn from `draft_sampling` applied to the drafter's logits, accepted by speculative sampling against
    that very distribution (the one really sampled from, after temperature and truncation)."""

    needs_log_probs = False

    def __init__(self, draft_sampling: Sampling, generator: Optional[torch.Generator]) -> None:
        self.draft_sampling, self.generator = draft_sampling, generator

    def __call__(self, draft_logits: torch.Tensor, draft_log_probs: Optional[torch.Tensor], raw_draft: torch.Tensor,
                 context: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Returns (draft (γ,), the (γ, V) distributions it was drawn from)."""
        draft_probs = self.draft_sampling.probs(draft_logits)
        draft = torch.multinomial(draft_probs, 1, generator=self.generator).squeeze(-1)
        return draft, draft_probs


class SearchedDraft:
    """DiffuSpec's causal-consistency path search (CPS) over the drafter's log-probabilities: deterministic, so a point
    mass (shorter than γ when the path ends with EOS)."""

    needs_log_probs = True

    def __init__(self, settings: PathSearch, proxy: TrigramModel, eos_ids: frozenset[int]) -> None:
        self.settings, self.proxy, self.eos_ids = settings, proxy, eos_ids

    def __call__(self, draft_logits: torch.Tensor, draft_log_probs: Optional[torch.Tensor], raw_draft: torch.Tensor,
                 context: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        path = causal_path_search(draft_log_probs, context[0, -2:].tolist(), self.proxy, self.settings, self.eos_ids)
        return raw_draft.new_tensor(path), None


DraftChoice = Union[ArgmaxDraft, SampledDraft, SearchedDraft]


def draft_choice(sampling: Sampling, generator: Optional[torch.Generator], draft_sampling: Optional[Sampling] = None,
                 argmax_draft: bool = False, path_search: Optional[tuple[PathSearch, TrigramModel]] = None,
                 eos_ids: frozenset[int] = frozenset()) -> DraftChoice:
    """Path search when given; the argmax at temperature 0 or when asked (decode.draft_choice=argmax); else a sample
    from `draft_sampling` (default: the verifier's settings)."""
    if path_search is not None:
        return SearchedDraft(*path_search, eos_ids)
    if sampling.temperature == 0 or argmax_draft:
        return ArgmaxDraft()
    return SampledDraft(draft_sampling or sampling, generator)


class PathStep(Step):
    """SpecDiff: one diffusion drafter pass proposes a path of γ tokens (chosen by `choose`), the verifier checks it in
    one cached forward. adaptive (DiffuSpec ADL): the draft length follows `adaptive` instead of γ; the drafter then
    proposes `adaptive.max_len` tokens in its one pass and the first `adaptive.current` are the draft. sizing
    (cost-aware length): the draft is cut to the prefix `sizing` chooses from the drafter's confidences, which for a
    sampled draft are fixed before it is drawn (see `sized`)."""

    def __init__(self, verifier: PreTrainedModel, drafter: PreTrainedModel, spec: DrafterSpec, decoding: Decoding,
                 choose: DraftChoice, generator: Optional[torch.Generator] = None,
                 adaptive: Optional[AdaptiveLength] = None, sizing: Optional[CostAwareSize] = None) -> None:
        self.verifier, self.drafter, self.decoding, self.choose = verifier, drafter_for(drafter, spec), decoding, choose
        self.generator, self.adaptive, self.sizing = generator, adaptive, sizing
        self.verifier_states = self.drafter.verifier_states
        # CPS searches and the cost-aware size scores by the drafter's log-probabilities: computed once for both.
        self.needs_log_probs = choose.needs_log_probs or sizing is not None
        self.raw_draft, self.scores = None, []

    def begin(self, cache: DynamicCache) -> None:
        self.drafter.begin()

    def propose(self, context: torch.Tensor, room: int) -> Draft:
        started, adaptive = time.perf_counter(), self.adaptive
        draft_len = min(adaptive.current if adaptive else self.decoding.gamma, room)
        # ADL reads the drafter's length off a proposal at its maximum length (see AdaptiveLength); the first
        # draft_len positions of that same pass are the draft.
        proposal_len = min(adaptive.max_len, room) if adaptive else draft_len
        proposal_logits = self.drafter.propose(self.verifier, context, proposal_len)  # (proposal_len, V)
        self.raw_draft = raw_draft = proposal_logits.argmax(-1)
        draft_logits = proposal_logits[:draft_len]  # (γ, V)
        draft_log_probs = torch.log_softmax(draft_logits.float(), -1) if self.needs_log_probs else None
        draft, draft_probs = self.choose(draft_logits, draft_log_probs, raw_draft, context)
        if self.sizing is not None:
            draft, draft_probs = self.sized(draft, draft_probs, draft_log_probs, raw_draft, draft_len, started)
        return Draft(draft, draft_probs, len(draft))

    def sized(self, draft: torch.Tensor, draft_probs: Optional[torch.Tensor], draft_log_probs: torch.Tensor,
              raw_draft: torch.Tensor, draft_len: int, started: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The prefix of the draft the cost-aware size keeps. Each prefix's cumulative drafter log-probability: how
        likely the drafter thinks it is. A deterministic draft is scored by its own tokens; a sampled one by q alone
        (its most likely tokens, the argmax draft's scores), never by the tokens it drew: a length chosen from the
        sample keeps position i more often when it drew a likely token, the kept tokens are then no draws from q, and
        accepting them against q is not lossless (issue 22: P(token) 0.175 for the verifier's 0.125)."""
        scored = draft if draft_probs is None else raw_draft[:draft_len]
        scores = draft_log_probs.gather(-1, scored[:, None]).squeeze(-1).cumsum(0).tolist()
        keep = self.sizing.choose(scores, range(1, len(draft) + 1), time.perf_counter() - started)
        self.scores = scores[:keep]
        return draft[:keep], None if draft_probs is None else draft_probs[:keep]

    def verify(self, draft: Draft, context: torch.Tensor, cache: DynamicCache) -> tuple[list[int], int]:
        num_accepted, next_token = verify_path(self.verifier, context, draft.tokens, draft.probs, cache,
                                               self.decoding.sampling, self.generator, self.verifier_states)
        self.drafter.verified(slice(0, num_accepted + 1))  # the newest token and the accepted drafts
        return draft.tokens[:num_accepted].tolist(), next_token

    def update(self, num_accepted: int) -> None:
        if self.adaptive is not None:
            self.adaptive.update(self.raw_draft, num_accepted, self.decoding.eos_ids)
        if self.sizing is not None:
            self.sizing.update(self.scores, range(1, len(self.scores) + 1), num_accepted)


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
    the drafter's argmax, a point mass, accepted by the point-mass rule. path_search (DiffuSpec CPS): the draft is the
    beam-searched path instead, accepted by the point-mass rule when sampling. adaptive, sizing: see `PathStep`.
    The keywords are this public entry's (train.py's, model cards'); methods build the `PathStep` themselves.
    """
    decoding = Decoding(gamma, max_new_tokens, sampling, eos_ids)
    choose = draft_choice(sampling, generator, draft_sampling, argmax_draft, path_search, eos_ids)
    step = PathStep(verifier, drafter, spec, decoding, choose, generator, adaptive, sizing)
    return speculative_generate(verifier, prompt_ids, step, decoding, generator)
