"""Acceptance rules: which draft tokens to keep, and the token the verifier adds. Every rule is lossless.

Shapes are for one sequence: a draft of γ tokens, the verifier's distributions at the γ + 1 positions it scored in
one forward (the γ draft positions and the bonus position after them). Each rule returns (num_accepted, next_token):
the first `num_accepted` draft tokens are kept and `next_token` follows them (the correction at the first rejection,
or the bonus token when everything was accepted), so an iteration always emits num_accepted + 1 tokens.
"""

from __future__ import annotations

from typing import Optional

import torch

from align.decoding.generation import Sampling
from align.decoding.sampling import residual, sample


def accept_greedy(draft_tokens: torch.Tensor, verifier_logits: torch.Tensor) -> tuple[int, int]:
    """Temperature 0: keep draft tokens while they equal the verifier's argmax; the output is AR greedy's, exactly.

    draft_tokens: (γ,); verifier_logits: (γ + 1, V).
    """
    verifier_tokens = verifier_logits.argmax(-1)  # (γ + 1,)
    matches = (draft_tokens == verifier_tokens[:-1]).int().cumprod(0)
    num_accepted = int(matches.sum())
    return num_accepted, int(verifier_tokens[num_accepted])


def accept_sampled(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    verifier_probs: torch.Tensor,
    generator: Optional[torch.Generator] = None,
) -> tuple[int, int]:
    """Speculative sampling: keep draft token x_i with probability min(1, verifier_probs_i(x_i) / draft_probs_i(x_i));
    at the first rejection sample from norm(max(verifier_probs_i - draft_probs_i, 0)).

    draft_tokens: (γ,) sampled from draft_probs: (γ, V), the distribution *actually sampled from* (after temperature
    and truncation). verifier_probs: (γ + 1, V). Emitted tokens are distributed exactly as the verifier's.
    """
    gamma = draft_tokens.shape[0]
    positions = torch.arange(gamma, device=draft_tokens.device)
    verifier_p = verifier_probs[positions, draft_tokens]
    draft_p = draft_probs[positions, draft_tokens]
    u = torch.rand(gamma, generator=generator, device=draft_tokens.device)
    # u < p/q  <=>  u * q < p, which needs no division by a q that underflowed to 0.
    accepted = (u * draft_p < verifier_p).int().cumprod(0)
    num_accepted = int(accepted.sum())
    if num_accepted == gamma:
        return gamma, int(sample(verifier_probs[gamma], generator))
    fallback = residual(verifier_probs[num_accepted], draft_probs[num_accepted])
    return num_accepted, int(sample(fallback, generator))


def accept_point_mass(
    draft_tokens: torch.Tensor, verifier_probs: torch.Tensor, generator: Optional[torch.Generator] = None
) -> tuple[int, int]:
    """Deterministic drafts (argmax, beam search) under sampling: the rule for a point-mass draft distribution.

    Keep x_i with probability verifier_probs_i(x_i); on rejection sample from the verifier's distribution with x_i
    removed. Never pretend a deterministic token was sampled from the drafter's softmax: that would not be lossless.
    """
    point_mass = torch.nn.functional.one_hot(draft_tokens, verifier_probs.shape[-1]).to(verifier_probs.dtype)
    return accept_sampled(draft_tokens, point_mass, verifier_probs, generator)


def accept_draft(
    draft_tokens: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    verifier_logits: torch.Tensor,
    sampling: Sampling,
    generator: Optional[torch.Generator] = None,
) -> tuple[int, int]:
    """The rule that matches how the draft was produced, for a single draft.

    draft_tokens: (γ,); verifier_logits: (γ + 1, V); draft_probs: the (γ, V) distributions the draft was sampled
    from, or None for a deterministic draft (argmax, beam search), which is a point mass whatever temperature the
    drafter's settings name. A greedy verifier keeps the tokens equal to its argmax, however they were drafted.
    """
    if sampling.temperature == 0:
        return accept_greedy(draft_tokens, verifier_logits)
    verifier_probs = sampling.probs(verifier_logits)
    if draft_probs is None:
        return accept_point_mass(draft_tokens, verifier_probs, generator)
    return accept_sampled(draft_tokens, draft_probs, verifier_probs, generator)


def accept_multi_candidate(
    candidates: torch.Tensor,
    draft_probs: torch.Tensor,
    verifier_probs: torch.Tensor,
    generator: Optional[torch.Generator] = None,
) -> tuple[int, int, int]:
    """Several drafts verified together (SpecDiff-2 self-selection): SpecInfer's recursive rejection sampling.

    candidates: (K, γ), each sampled independently position by position from draft_probs: (γ, V) (one diffusion
    drafter pass gives position-wise marginals). verifier_probs: (K, γ + 1, V), the verifier's distributions along
    each candidate. At each depth, the surviving candidates' tokens are tried in turn against the verifier's
    distribution, which after every rejection becomes the residual norm(max(p - q, 0)); this is lossless because
    those tokens are independent draws from q given the accepted prefix. At temperature 0 (one-hot verifier_probs)
    it keeps the longest prefix that matches the verifier's argmax among the candidates.

    Returns (num_accepted, next_token, candidate): `candidate` is a row whose first num_accepted tokens were kept.
    """
    num_candidates, gamma = candidates.shape
    alive = list(range(num_candidates))
    for depth in range(gamma):
        target = verifier_probs[alive[0], depth]  # every surviving candidate shares the prefix, hence this row
        chosen = None
        for k in alive:
            token = int(candidates[k, depth])
            u = float(torch.rand((), generator=generator, device=target.device))
            if u * float(draft_probs[depth, token]) < float(target[token]):
                chosen = token
                break
            target = residual(target, draft_probs[depth])
        if chosen is None:
            return depth, int(sample(target, generator)), alive[0]
        alive = [k for k in alive if int(candidates[k, depth]) == chosen]
    return gamma, int(sample(verifier_probs[alive[0], gamma], generator)), alive[0]


def accept_tree(
    node_tokens: list[int],
    children: list[list[int]],
    verifier_logits: torch.Tensor,
    sampling: Sampling,
    generator: Optional[torch.Generator] = None,
) -> tuple[list[int], int]:
    """A draft tree verified in one forward: walk from the root, accepting one child per step.

    node_tokens: each node's token; children: per row (0: the root, i + 1: node i) its child nodes in the order they
    are tried; verifier_logits: (N + 1, V), row r the verifier's logits after row r's path. Returns (path, next_token):
    the accepted nodes from the root down, and the verifier's token after them (correction or bonus).

    Temperature 0: the child whose token is the verifier's argmax, while there is one: AR greedy's output, exactly.
    Temperature > 0: the tree's children are deterministic (the drafter's top tokens, chosen before the verifier's
    randomness), not samples of q, so each child is tried with the point-mass rule: with p_res the verifier's
    distribution at the node, accept child x with probability p_res(x); on rejection p_res <- p_res with x removed,
    renormalised, and the next child is tried; after every child failed, sample from p_res. Lossless: one trial emits
    y with probability p_res(x)·[y = x] + (1 − p_res(x))·p_res(y)·[y ≠ x] / (1 − p_res(x)) = p_res(y), so by induction
    over the children the token leaving a node follows the verifier's p exactly; an accepted child's subtree then
    repeats this with p at that child, which is the verifier's next-token distribution given the path (the tree
    forward's logits equal a plain forward's). Sibling tokens are distinct, so a rejected token is never tried again.
    """
    path: list[int] = []
    row = 0
    if sampling.temperature == 0:
        verifier_tokens = verifier_logits.argmax(-1).tolist()  # (N + 1,)
        while True:
            target = verifier_tokens[row]
            chosen = next((node for node in children[row] if node_tokens[node] == target), None)
            if chosen is None:
                return path, target
            path.append(chosen)
            row = chosen + 1
    verifier_probs = sampling.probs(verifier_logits)  # (N + 1, V)
    while True:
        target = verifier_probs[row]
        chosen = None
        for node in children[row]:
            token = node_tokens[node]
            u = float(torch.rand((), generator=generator, device=target.device))
            if u < float(target[token]):
                chosen = node
                break
            target = target.clone()
            target[token] = 0
            target = target / target.sum()  # a rejection leaves mass elsewhere: p(x) < 1, as u ≥ p(x)
        if chosen is None:
            return path, int(sample(target, generator))
        path.append(chosen)
        row = chosen + 1
