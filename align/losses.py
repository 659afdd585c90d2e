"""Losses as pure functions of logits (fp32 inside), and the name -> function table recipes refer to.

Every loss takes an explicit token count to divide by, so that gradient accumulation over micro-batches of different
sizes gives exactly the gradient of the whole batch.

The window losses reduce every position's (V,) logits to a few numbers (log q(x), a KL, an α) before anything
else, so they are computed in chunks of positions (`rowwise`): over a 150k–262k vocabulary, an fp32 copy of
[windows × γ × V] logits (and log_softmax's saved output, the KL terms, ...) would otherwise be the largest tensors of
the step. Only one chunk's fp32 intermediates are live at a time, in the forward and in the backward (which
recomputes the chunk instead of keeping its softmax): the loss adds the logits' own gradient and a bounded amount.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import torch

from align.recipe_fields import LOSSES


# --------------------------------------------------------------------------------------------------------------------
# chunked per-position reductions over the vocabulary
# --------------------------------------------------------------------------------------------------------------------
#: the most logits (positions × vocabulary) one chunk works on: each fp32 intermediate of a chunk is at most 16 MiB,
#: whatever the number of windows. An implementation bound, not a recipe setting: results do not depend on it.
LOSS_CHUNK_ELEMENTS = 2**22


class _RowwiseChunked(torch.autograd.Function):
    """fn applied to chunks of rows; the backward recomputes each chunk's forward and back-propagates it alone, so
    that no chunk's intermediates are kept between forward and backward (autograd over a chunked forward would keep
    every chunk's softmax until the backward: as much memory as no chunking)."""

    @staticmethod
    def forward(ctx, fn: Callable[..., torch.Tensor], rows_per_chunk: int, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.rows_per_chunk = fn, rows_per_chunk
        ctx.save_for_backward(*inputs)  # references, not copies: the logits are live anyway
        n = inputs[0].shape[0]
        return torch.cat([fn(*(x[i : i + rows_per_chunk] for x in inputs)) for i in range(0, n, rows_per_chunk)])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        inputs, r = ctx.saved_tensors, ctx.rows_per_chunk
        wanted = [k for k, x in enumerate(inputs) if ctx.needs_input_grad[2 + k]]
        grads: list[Optional[torch.Tensor]] = [None] * len(inputs)
        for k in wanted:  # in the inputs' own dtype: what autograd would hand the logits without chunking
            grads[k] = torch.empty_like(inputs[k])
        for i in range(0, inputs[0].shape[0], r):
            chunk = [x[i : i + r].detach().requires_grad_(k in wanted) for k, x in enumerate(inputs)]
            with torch.enable_grad():
                out = ctx.fn(*chunk)
            chunk_grads = torch.autograd.grad(out, [chunk[k] for k in wanted], grad_out[i : i + r])
            for k, g in zip(wanted, chunk_grads):
                grads[k][i : i + r] = g
        return (None, None, *grads)


def rowwise(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """fn over (..., V) logits (and same-shaped (...) or (..., V) companions) -> (...) values, computed chunk by chunk.

    inputs: tensors sharing their leading dimensions (...); the first holds (..., V) logits. fn maps (n, ...) row
    tensors to (n,) values, row by row (a row's value must not depend on another row), and is differentiable.
    """
    lead = inputs[0].shape[:-1]
    vocab = inputs[0].shape[-1]
    flat = [x.reshape(-1, *x.shape[len(lead):]) for x in inputs]
    rows_per_chunk = max(1, LOSS_CHUNK_ELEMENTS // max(1, vocab))
    if flat[0].shape[0] == 0:  # no rows (a selection that kept none): no values, still a graph back to the logits
        return flat[0].float().sum(-1).view(lead)
    return _RowwiseChunked.apply(fn, rows_per_chunk, *flat).view(lead)


def _row_target_log_prob(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(n, V) logits, (n,) token ids -> (n,) log q(target) in fp32."""
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _row_alpha(draft_logits: torch.Tensor, verifier_logits: torch.Tensor) -> torch.Tensor:
    """(n, V) x2 -> (n,) α = Σ_v min(p(v), q(v)), the chance a sampled draft token is accepted."""
    q = torch.softmax(draft_logits.float(), dim=-1)
    p = torch.softmax(verifier_logits.float(), dim=-1)
    return torch.minimum(p, q).sum(-1)


def _row_fkl(draft_logits: torch.Tensor, verifier_logits: torch.Tensor) -> torch.Tensor:
    return _kl(torch.log_softmax(verifier_logits.float(), -1), torch.log_softmax(draft_logits.float(), -1))


def _row_rkl(draft_logits: torch.Tensor, verifier_logits: torch.Tensor) -> torch.Tensor:
    log_p = torch.log_softmax(verifier_logits.float(), -1)
    log_q = torch.log_softmax(draft_logits.float().masked_fill(log_p == float("-inf"), float("-inf")), -1)
    return _kl(log_q, log_p)


def _row_tvd(draft_logits: torch.Tensor, verifier_logits: torch.Tensor) -> torch.Tensor:
    q = torch.softmax(draft_logits.float(), -1)
    p = torch.softmax(verifier_logits.float(), -1)
    return 0.5 * (p - q).abs().sum(-1)


def _row_jsd(draft_logits: torch.Tensor, verifier_logits: torch.Tensor, beta: float) -> torch.Tensor:
    log_q = torch.log_softmax(draft_logits.float(), -1)
    log_p = torch.log_softmax(verifier_logits.float(), -1)
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log(1 - beta))
    return beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)

def mdlm(
    draft_logits: torch.Tensor,
    targets: torch.Tensor,
    masked: torch.Tensor,
    mask_ratio: torch.Tensor,
    *,
    num_tokens: int,
) -> torch.Tensor:
    """Masked-diffusion (MDLM, linear schedule) negative ELBO: Σ over masked positions of −log q(x) / t, / num_tokens.

    draft_logits: (B, L, V) predictions for every position; targets: (B, L) clean tokens; masked: (B, L) bool, which
    positions were masked; mask_ratio: (B, L) the masking probability t each position was corrupted with.
    The 1/t weight makes this an upper bound on the data's negative log-likelihood (nats/token), so the drafter's
    loss can be compared across masking levels.
    """
    ce = -rowwise(_row_target_log_prob, draft_logits, targets)
    return (ce * masked / mask_ratio).sum() / num_tokens


def next_token(logits: torch.Tensor, targets: torch.Tensor, *, num_tokens: int) -> torch.Tensor:
    """Autoregressive cross-entropy: logits (B, L, V) at position t predict targets (B, L) at t (already shifted)."""
    return -rowwise(_row_target_log_prob, logits, targets).sum() / num_tokens


# --------------------------------------------------------------------------------------------------------------------
# acceptance-aware losses on drafter windows
#
# Shapes: draft_logits (B, γ, V) the drafter's predictions for the γ window positions; targets (B, γ) the verifier's
# tokens; verifier_logits (B, γ, V) the verifier's predictions at the same positions given the true prefix;
# mask (B, γ) bool, False on padding (padding only ever follows the valid positions of a window).
# --------------------------------------------------------------------------------------------------------------------
def _target_log_probs(draft_logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, γ) log q(x_i), with -inf at padding so that no streak runs through it."""
    return rowwise(_row_target_log_prob, draft_logits, targets).masked_fill(~mask, float("-inf"))


def streak(draft_logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, *, num_windows: int) -> torch.Tensor:
    """SpecDiff-2 streak distillation: −Σ_j Π_{i≤j} q(x_i), per window, / num_windows.

    The expected number of draft tokens a greedy verifier keeps when it agrees with x. Products are cumulative sums
    of log q, exponentiated, so γ = 32 does not underflow where the naive product would.
    """
    prefix = torch.cumsum(_target_log_probs(draft_logits, targets, mask), dim=-1)
    return -torch.exp(prefix).sum() / num_windows


def ce_streak(draft_logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, *, num_windows: int) -> torch.Tensor:
    """−Σ_j w_j log q(x_j), w_j = Π_{i<j} q(x_i) detached: cross-entropy weighted by the chance to reach position j.

    Its gradient points where streak's does but does not vanish when q(x_j) is small, so it trains from far away.
    """
    log_q = _target_log_probs(draft_logits, targets, mask).masked_fill(~mask, 0.0)  # padding contributes nothing
    reach = torch.exp(torch.cumsum(log_q, dim=-1) - log_q).detach()  # Π_{i<j} q(x_i), an exclusive product
    return -(reach * log_q).sum() / num_windows


def streak_tv(draft_logits: torch.Tensor, verifier_logits: torch.Tensor, mask: torch.Tensor, *,
              num_windows: int) -> torch.Tensor:
    """Expected accepted length under speculative *sampling*: −Σ_j Π_{i≤j} α_i, α_i = Σ_v min(p_i(v), q_i(v)).

    α_i = 1 − TV(p_i, q_i) is the probability that position i is accepted; p_i is the verifier's distribution at
    window position i given the true prefix.
    """
    alpha = rowwise(_row_alpha, draft_logits, verifier_logits).clamp_min(1e-30)  # (B, γ)
    prefix = torch.cumsum(torch.log(alpha).masked_fill(~mask, float("-inf")), dim=-1)
    return -torch.exp(prefix).sum() / num_windows


# --------------------------------------------------------------------------------------------------------------------
# newer per-position weightings of the cross-entropy (2026): each is −Σ_j w_j log q(x_j) / num_windows with weights
# w_j that do not carry gradient, so they train every position from the start as ce_streak does and differ only in
# where they put the weight. Their constants are the published defaults, part of each loss's definition.
# --------------------------------------------------------------------------------------------------------------------
# speculators' defaults for its DFlash trainer (speculators/train/config/schema.py: dflash_decay_gamma, dpace_alpha).
DFLASH_DECAY = 4.0
DPACE_SMOOTHING = 0.5
FOCAL_FOCUSING = 2.0  # focal loss's usual focusing exponent (Lin et al. 2017)


def _weighted_ce(draft_logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor,
                 num_windows: int) -> torch.Tensor:
    """−Σ w_j log q(x_j) / num_windows over the valid positions; weights (B, γ) or (γ,) are treated as constants."""
    log_q = _target_log_probs(draft_logits, targets, mask).masked_fill(~mask, 0.0)
    return -(weights.detach() * log_q).sum() / num_windows


def position_decay_ce(draft_logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, *,
                      num_windows: int) -> torch.Tensor:
    """DFlash's position-decay cross-entropy: w_j = exp(−j / 4) for window position j = 0, 1, … (position 0 is the
    first drafted token, as in speculators' `dflash_loss_decay` with `sample_from_anchor`)."""
    positions = torch.arange(draft_logits.shape[1], device=draft_logits.device, dtype=torch.float32)
    return _weighted_ce(draft_logits, targets, mask, torch.exp(-positions / DFLASH_DECAY), num_windows)


def dpace(draft_logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, *, num_windows: int) -> torch.Tensor:
    """D-PACE (the default DFlash loss in speculators): w_j = Σ_{k≥j} Π_{i≤k} s_i with s_i = ½ q(x_i) + ½.

    w_j is how many accepted-length terms position j sits in, with the drafter's own confidence smoothed toward 1 so
    that early in training far positions still get weight; it is the streak objective's gradient weighting with
    smoothed confidences (speculators' `dpace_loss_decay`).
    """
    with torch.no_grad():
        q = _target_log_probs(draft_logits, targets, mask).exp()  # 0 at padding
        smooth = torch.where(mask, (1.0 - DPACE_SMOOTHING) * q + DPACE_SMOOTHING, torch.ones_like(q))
        reach = torch.cumprod(smooth, dim=-1) * mask
        weights = torch.flip(torch.cumsum(torch.flip(reach, dims=[-1]), dim=-1), dims=[-1]) * mask
    return _weighted_ce(draft_logits, targets, mask, weights, num_windows)


def positional_ce(draft_logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, *,
                  num_windows: int) -> torch.Tensor:
    """Left-to-Right's token positional weighting (arXiv 2606.11552): earlier positions weigh more, because a
    verifier reads left to right and a position is only worth what reaching it is worth. Our form: w_j = 1 − j/γ
    (linear, 1 at the first position, 1/γ at the last); the paper's exact schedule was not available to us."""
    gamma = draft_logits.shape[1]
    positions = torch.arange(gamma, device=draft_logits.device, dtype=torch.float32)
    return _weighted_ce(draft_logits, targets, mask, 1.0 - positions / gamma, num_windows)


def first_error_focal(draft_logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, *,
                      num_windows: int) -> torch.Tensor:
    """Left-to-Right's first-error focal loss (arXiv 2606.11552): in each window, only the first position where the
    drafter's argmax differs from the verifier's token (the one that ends greedy acceptance) is trained, by focal
    cross-entropy −(1 − q(x))² log q(x). Windows the drafter already gets right contribute nothing."""
    log_q = _target_log_probs(draft_logits, targets, mask)
    wrong = (draft_logits.argmax(-1) != targets) & mask
    first = wrong & (torch.cumsum(wrong.int(), dim=-1) == 1)  # (B, γ): at most one True per window
    focus = (1.0 - log_q.exp()).pow(FOCAL_FOCUSING)
    return -(focus * log_q).masked_fill(~first, 0.0).sum() / num_windows


def chain(draft_logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, *, num_windows: int) -> torch.Tensor:
    """Left-to-Right's chain loss (arXiv 2606.11552), a differentiable surrogate of the expected accepted length,
    in our form −log(1 + Σ_j Π_{i≤j} q(x_i)) per window: the log of τ under greedy verification, so windows with a
    short expected streak are not drowned out by long ones as in the plain streak sum."""
    prefix = torch.cumsum(_target_log_probs(draft_logits, targets, mask), dim=-1)
    expected = torch.exp(prefix).sum(-1)  # (B,)
    return -torch.log1p(expected).sum() / num_windows


# Draft-OPD's position decay on the reverse KL (verl's examples/on_policy_distillation_trainer/
# run_qwen_gsm8k_forward-ins.sh).
OPD_DECAY = 0.8


def ce(draft_logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, *, num_tokens: int) -> torch.Tensor:
    """Plain cross-entropy on the verifier's tokens, −Σ log q(x_j) / num_tokens, every position alike: the CE term of
    DSpark's 0.1·CE + 0.9·L1(q − p) (DeepSpec), which is `train.losses={tvd: 1.8, ce: 0.1}` since L1 = 2·TV."""
    log_q = _target_log_probs(draft_logits, targets, mask).masked_fill(~mask, 0.0)
    return -log_q.sum() / num_tokens


def draft_opd(draft_logits: torch.Tensor, verifier_logits: torch.Tensor, mask: torch.Tensor, *,
              num_windows: int) -> torch.Tensor:
    """Draft-OPD (arXiv 2605.29343), per window: forward KL(p‖q) at every position greedy verification sees (the
    drafts it keeps and the one it rejects), plus 0.8^r · reverse KL(q‖p) at the rejected position r.

    The rejected position is the first one where the drafter's argmax is not the verifier's (greedy verification's
    rule), found here rather than taken from the data, so that the loss means the same in every data mode: with
    train.data_mode=rejections every window ends in one; in a teacher-forced window the positions after the first
    rejection, which verification never reaches, are left out. The reverse KL pushes the drafter's mass off the token
    it wrongly drafted; the forward KL keeps the kept drafts where they were. (B, γ, V) logits, (B, γ) mask.
    """
    with torch.no_grad():
        wrong = (draft_logits.argmax(-1) != verifier_logits.argmax(-1)) & mask
        before = torch.cumsum(wrong.int(), dim=-1) - wrong.int()  # rejections strictly before each position
        seen = mask & (before == 0)
        rejected = wrong & (before == 0)  # (B, γ): at most one True a window
        decay = OPD_DECAY ** torch.arange(draft_logits.shape[1], device=draft_logits.device, dtype=torch.float32)
        reverse_weight = decay * rejected
    # One chunked pass for both terms (selecting the rows instead would copy them: as much memory as the logits).
    return rowwise(_row_opd, draft_logits, verifier_logits, seen.float(), reverse_weight).sum() / num_windows


def _row_opd(draft_logits: torch.Tensor, verifier_logits: torch.Tensor, forward_weight: torch.Tensor,
             reverse_weight: torch.Tensor) -> torch.Tensor:
    """(n, V) x2, (n,) x2 -> (n,) forward_weight·KL(p‖q) + reverse_weight·KL(q‖p)."""
    return (forward_weight * _row_fkl(draft_logits, verifier_logits)
            + reverse_weight * _row_rkl(draft_logits, verifier_logits))


def _per_position(values: torch.Tensor, mask: torch.Tensor, num_tokens: int) -> torch.Tensor:
    return (values * mask).sum() / num_tokens


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """(..., V) log-distributions -> (...) Σ_v a(v)·(log a(v) − log b(v)), with 0·log 0 = 0.

    Offline verifier logits are −inf outside the stored top-k: a term where a(v) = 0 is dropped outright (masked, not
    multiplied by 0), so that neither the value nor the gradient sees 0·(−inf).
    """
    a = log_a.exp()
    return (a * (log_a - log_b).masked_fill(a == 0, 0.0)).sum(-1)


def fkl(draft_logits: torch.Tensor, verifier_logits: torch.Tensor, mask: torch.Tensor, *, num_tokens: int) -> torch.Tensor:
    """Forward KL(p ‖ q): mass-covering distillation. Tokens with p = 0 (outside a stored top-k) contribute 0."""
    return _per_position(rowwise(_row_fkl, draft_logits, verifier_logits), mask, num_tokens)


def rkl(draft_logits: torch.Tensor, verifier_logits: torch.Tensor, mask: torch.Tensor, *, num_tokens: int) -> torch.Tensor:
    """Reverse KL(q ‖ p): mode-seeking distillation, on the support of p with q renormalised there.

    KL(q ‖ p) is infinite as soon as p has zeros (a stored top-k) and q does not; restricted to p's support it is
    finite and is the plain reverse KL whenever p has full support.
    """
    return _per_position(rowwise(_row_rkl, draft_logits, verifier_logits), mask, num_tokens)


def tvd(draft_logits: torch.Tensor, verifier_logits: torch.Tensor, mask: torch.Tensor, *, num_tokens: int) -> torch.Tensor:
    """Total variation ½Σ|p − q| = 1 − α: DistillSpec's direct proxy for the rejection probability."""
    return _per_position(rowwise(_row_tvd, draft_logits, verifier_logits), mask, num_tokens)


def jsd(draft_logits: torch.Tensor, verifier_logits: torch.Tensor, mask: torch.Tensor, *, num_tokens: int,
        beta: float = 0.5) -> torch.Tensor:
    """Generalised Jensen-Shannon (GKD): β·KL(p ‖ m) + (1−β)·KL(q ‖ m), m = β·p + (1−β)·q, 0 < β < 1."""
    if not 0 < beta < 1:
        raise ValueError(f"jsd needs 0 < beta < 1, got {beta}")
    row_jsd = functools.partial(_row_jsd, beta=beta)
    return _per_position(rowwise(row_jsd, draft_logits, verifier_logits), mask, num_tokens)


def _loss_function(name: str) -> Callable[..., torch.Tensor]:
    """The function of the loss `name` that config.LOSSES declares: this module's function of that name."""
    function = globals().get(name)
    if not callable(function):
        raise ImportError(f"config.LOSSES declares the loss {name!r}; align/losses.py has no function of that name")
    return function


# name -> (loss, what it is computed against), from the one declaration of each loss and what it reads
# (config.LOSSES): read it through LOSS_NAMES, needs_verifier_distributions and normalisation.
WINDOW_LOSSES: dict[str, tuple] = {name: (_loss_function(name), declared.reads) for name, declared in LOSSES.items()}

LOSS_NAMES: tuple[str, ...] = tuple(WINDOW_LOSSES)


def needs_verifier_distributions(name: str) -> bool:
    """Whether loss `name` is computed against the verifier's distributions (online, or stored top-k log-probs)
    rather than its tokens alone: what decides if training needs a verifier forward or stored top-k."""
    if name not in WINDOW_LOSSES:
        raise ValueError(f"unknown loss {name!r}; known: {', '.join(LOSS_NAMES)}")
    return WINDOW_LOSSES[name][1] == "verifier_logits"


def normalisation(name: str, num_windows: int, num_tokens: int) -> dict[str, int]:
    """The keyword loss `name` is normalised by, as config.LOSSES declares it: {"num_windows": ...} or
    {"num_tokens": ...}, from the step's counts."""
    return {"num_windows": num_windows} if LOSSES[name].normalised_by == "windows" else {"num_tokens": num_tokens}
