"""Losses against hand computations and identities."""

import math

import pytest
import torch

from align.recipe_fields import LOSS_NAMES
from align import losses
from align.losses import (WINDOW_LOSSES, ce, ce_streak, chain, dpace, first_error_focal, fkl, jsd, mdlm,
                          position_decay_ce, positional_ce, rkl, streak, streak_tv, tvd)


def logits_for(probs):
    """Logits whose softmax is `probs` (B, γ, V)."""
    return torch.log(torch.as_tensor(probs, dtype=torch.float32))


# One window of γ = 3 over V = 3; the verifier's tokens are 0, 1, 2 with drafter probabilities 0.5, 0.4, 0.9.
Q = [[[0.5, 0.3, 0.2], [0.3, 0.4, 0.3], [0.05, 0.05, 0.9]]]
TARGETS = torch.tensor([[0, 1, 2]])
ALL = torch.ones(1, 3, dtype=torch.bool)


def test_table_matches_the_schema():
    assert tuple(WINDOW_LOSSES) == LOSS_NAMES


def test_which_losses_need_verifier_distributions_is_read_from_the_table():
    assert losses.LOSS_NAMES == tuple(WINDOW_LOSSES)
    for name, (_, against) in WINDOW_LOSSES.items():
        assert losses.needs_verifier_distributions(name) == (against == "verifier_logits"), name
    # Only the streak losses get by with the verifier's tokens.
    assert [n for n in losses.LOSS_NAMES if not losses.needs_verifier_distributions(n)] == [
        "streak", "ce_streak", "position_decay_ce", "dpace", "positional_ce", "first_error_focal", "chain", "ce"]
    with pytest.raises(ValueError, match="unknown loss"):
        losses.needs_verifier_distributions("kl")


def test_streak_by_hand():
    # 0.5 + 0.5·0.4 + 0.5·0.4·0.9 = 0.88
    assert streak(logits_for(Q), TARGETS, ALL, num_windows=1).item() == pytest.approx(-0.88, abs=1e-6)
    # Padding at the last position ends the streak there: 0.5 + 0.2.
    mask = torch.tensor([[True, True, False]])
    assert streak(logits_for(Q), TARGETS, mask, num_windows=1).item() == pytest.approx(-0.70, abs=1e-6)
    # Normalisation is by the number of windows given, not by the batch.
    assert streak(logits_for(Q), TARGETS, ALL, num_windows=4).item() == pytest.approx(-0.22, abs=1e-6)


def test_streak_in_log_space_equals_the_naive_product_and_survives_long_windows():
    torch.manual_seed(0)
    logits = torch.randn(2, 8, 11)
    targets = torch.randint(0, 11, (2, 8))
    q = torch.softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    naive = -torch.cumprod(q, -1).sum() / 2
    assert streak(logits, targets, torch.ones(2, 8, dtype=torch.bool), num_windows=2).item() == pytest.approx(naive.item(), rel=1e-5)
    # γ = 32 with confident agreement: every term stays finite and the gradient is usable.
    logits = torch.full((1, 32, 5), -4.0, requires_grad=True)
    with torch.no_grad():
        logits[..., 0] = 4.0
    loss = streak(logits, torch.zeros(1, 32, dtype=torch.long), torch.ones(1, 32, dtype=torch.bool), num_windows=1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


def test_ce_by_hand_weighs_every_position_alike_and_skips_padding():
    expected = -(math.log(0.5) + math.log(0.4) + math.log(0.9)) / 3
    assert ce(logits_for(Q), TARGETS, ALL, num_tokens=3).item() == pytest.approx(expected, abs=1e-6)
    mask = torch.tensor([[True, True, False]])
    assert ce(logits_for(Q), TARGETS, mask, num_tokens=2).item() == pytest.approx(
        -(math.log(0.5) + math.log(0.4)) / 2, abs=1e-6)


def test_ce_streak_by_hand():
    expected = -(1.0 * math.log(0.5) + 0.5 * math.log(0.4) + 0.2 * math.log(0.9))
    assert ce_streak(logits_for(Q), TARGETS, ALL, num_windows=1).item() == pytest.approx(expected, abs=1e-5)
    # Padding at the end drops its term and stays finite (a padded window once produced NaN here).
    mask = torch.tensor([[True, True, False]])
    padded = ce_streak(logits_for(Q), TARGETS, mask, num_windows=1)
    assert torch.isfinite(padded) and padded.item() == pytest.approx(-(math.log(0.5) + 0.5 * math.log(0.4)), abs=1e-5)
    # The weights are constants: the gradient at position 1 is that of 0.5·(−log q), not of the product.
    logits = logits_for(Q).requires_grad_()
    ce_streak(logits, TARGETS, ALL, num_windows=1).backward()
    grad_pos0 = logits.grad[0, 0]
    q0 = torch.tensor(Q[0][0])
    assert torch.allclose(grad_pos0, -(torch.tensor([1.0, 0, 0]) - q0), atol=1e-5)  # only position 0's own CE term


LOG_Q = [math.log(0.5), math.log(0.4), math.log(0.9)]


def test_position_decay_ce_by_hand():
    expected = -sum(math.exp(-j / 4.0) * LOG_Q[j] for j in range(3))
    assert position_decay_ce(logits_for(Q), TARGETS, ALL, num_windows=1).item() == pytest.approx(expected, abs=1e-5)


def test_dpace_by_hand():
    # smoothed confidences s = ½q + ½ = 0.75, 0.7, 0.95; reach = 0.75, 0.525, 0.49875; weights = suffix sums.
    reach = [0.75, 0.75 * 0.7, 0.75 * 0.7 * 0.95]
    weights = [sum(reach[j:]) for j in range(3)]
    expected = -sum(w * lq for w, lq in zip(weights, LOG_Q))
    assert dpace(logits_for(Q), TARGETS, ALL, num_windows=1).item() == pytest.approx(expected, abs=1e-5)
    # Padding: the last position is neither trained nor counted in the earlier positions' weights.
    mask = torch.tensor([[True, True, False]])
    expected = -((0.75 + 0.525) * LOG_Q[0] + 0.525 * LOG_Q[1])
    assert dpace(logits_for(Q), TARGETS, mask, num_windows=1).item() == pytest.approx(expected, abs=1e-5)


def test_positional_ce_by_hand():
    expected = -(1.0 * LOG_Q[0] + (2 / 3) * LOG_Q[1] + (1 / 3) * LOG_Q[2])
    assert positional_ce(logits_for(Q), TARGETS, ALL, num_windows=2).item() == pytest.approx(expected / 2, abs=1e-5)


def test_first_error_focal_trains_only_the_first_wrong_position():
    # Every argmax of Q is right: nothing to train.
    assert first_error_focal(logits_for(Q), TARGETS, ALL, num_windows=1).item() == 0.0
    # Targets 0, 2, 0: position 1 is the first wrong argmax (q = 0.3); position 2 is wrong too but never reached.
    targets = torch.tensor([[0, 2, 0]])
    expected = -((1 - 0.3) ** 2) * math.log(0.3)
    logits = logits_for(Q).requires_grad_()
    loss = first_error_focal(logits, targets, ALL, num_windows=1)
    assert loss.item() == pytest.approx(expected, abs=1e-5)
    loss.backward()
    assert logits.grad[0, 0].abs().sum() == 0 and logits.grad[0, 2].abs().sum() == 0 and logits.grad[0, 1].abs().sum() > 0
    # A wrong position in the padding is not an error.
    assert first_error_focal(logits_for(Q), torch.tensor([[0, 1, 0]]), torch.tensor([[True, True, False]]),
                             num_windows=1).item() == 0.0


def test_chain_by_hand():
    assert chain(logits_for(Q), TARGETS, ALL, num_windows=1).item() == pytest.approx(-math.log(1.88), abs=1e-6)
    mask = torch.tensor([[True, True, False]])
    assert chain(logits_for(Q), TARGETS, mask, num_windows=1).item() == pytest.approx(-math.log(1.7), abs=1e-6)


def test_weighted_losses_point_every_position_toward_its_target():
    """Their weights are constants: the gradient at each valid position is w_j · (q − onehot), never zero while
    q(x_j) < 1 (unlike streak's far positions)."""
    for fn in (position_decay_ce, dpace, positional_ce):
        logits = logits_for(Q).requires_grad_()
        fn(logits, TARGETS, ALL, num_windows=1).backward()
        for j in range(3):
            grad = logits.grad[0, j]
            assert grad[TARGETS[0, j]] < 0 and (grad.sum().abs() < 1e-5), (fn.__name__, j)


def test_streak_tv_by_hand():
    P = [[[0.5, 0.5, 0.0], [0.4, 0.4, 0.2], [0.0, 0.1, 0.9]]]
    # α = Σ min(p, q): 0.5 + 0.3 + 0 = 0.8; 0.3 + 0.4 + 0.2 = 0.9; 0 + 0.05 + 0.9 = 0.95
    expected = -(0.8 + 0.8 * 0.9 + 0.8 * 0.9 * 0.95)
    got = streak_tv(logits_for(Q), torch.log(torch.tensor(P) + 1e-12), ALL, num_windows=1).item()
    assert got == pytest.approx(expected, abs=1e-5)


def test_kd_identities():
    torch.manual_seed(1)
    q_logits, p_logits = torch.randn(2, 4, 7), torch.randn(2, 4, 7)
    mask = torch.ones(2, 4, dtype=torch.bool)
    for loss in (fkl, rkl, tvd, jsd):
        assert loss(p_logits, p_logits, mask, num_tokens=8).item() == pytest.approx(0.0, abs=1e-6)
        assert loss(q_logits, p_logits, mask, num_tokens=8).item() > 0
    reference = torch.nn.functional.kl_div(torch.log_softmax(q_logits, -1), torch.log_softmax(p_logits, -1),
                                           log_target=True, reduction="sum") / 8
    assert fkl(q_logits, p_logits, mask, num_tokens=8).item() == pytest.approx(reference.item(), rel=1e-5)
    assert rkl(q_logits, p_logits, mask, num_tokens=8).item() == pytest.approx(fkl(p_logits, q_logits, mask, num_tokens=8).item(), rel=1e-5)
    assert jsd(q_logits, p_logits, mask, num_tokens=8).item() == pytest.approx(jsd(p_logits, q_logits, mask, num_tokens=8).item(), rel=1e-5)
    assert jsd(q_logits, p_logits, mask, num_tokens=8).item() <= math.log(2) + 1e-6
    assert tvd(q_logits, p_logits, mask, num_tokens=8).item() <= 1.0
    # Masked positions do not count.
    half = mask.clone()
    half[:, 2:] = False
    assert fkl(q_logits, p_logits, half, num_tokens=4).item() == pytest.approx(fkl(q_logits[:, :2], p_logits[:, :2], mask[:, :2], num_tokens=4).item(), rel=1e-5)


def test_mdlm_by_hand():
    logits = logits_for([[[0.5, 0.5], [0.25, 0.75]]])
    targets = torch.tensor([[0, 1]])
    masked = torch.tensor([[True, False]])
    ratio = torch.tensor([[0.5, 0.5]])
    # Only position 0 is masked: −log 0.5 / 0.5, over 2 tokens.
    assert mdlm(logits, targets, masked, ratio, num_tokens=2).item() == pytest.approx(math.log(2), abs=1e-6)


def test_kd_losses_on_stored_top_k_are_finite_and_match_the_dense_values():
    # Offline KD reads the verifier from stored top-k log-probs: −inf outside the top-k (align/windows.py).
    torch.manual_seed(2)
    q_logits = torch.randn(2, 4, 7)
    p_top = torch.randn(2, 4, 3)  # the verifier's logits on tokens 0-2, its stored top-k
    outside = torch.full((2, 4, 4), float("-inf"))
    p_logits = torch.cat([p_top, outside], -1)
    mask = torch.ones(2, 4, dtype=torch.bool)
    for loss in (fkl, rkl, tvd, jsd, streak_tv):
        draft = q_logits.clone().requires_grad_()
        verifier = p_logits.clone().requires_grad_()
        kwargs = {"num_windows": 2} if loss is streak_tv else {"num_tokens": 8}
        value = loss(draft, verifier, mask, **kwargs)
        value.backward()
        assert torch.isfinite(value), loss.__name__
        assert torch.isfinite(draft.grad).all() and draft.grad.abs().sum() > 0, loss.__name__
        assert torch.isfinite(verifier.grad).all(), loss.__name__
    # Where p vanishes, so do its terms: the same values as with logits so low that p underflows to exactly 0.
    p_dense = torch.cat([p_top, outside.clamp_min(-1e4)], -1)
    for loss in (fkl, tvd, jsd):
        assert loss(q_logits, p_logits, mask, num_tokens=8).item() == pytest.approx(
            loss(q_logits, p_dense, mask, num_tokens=8).item(), rel=1e-5), loss.__name__
    # KL(q ‖ p) is infinite when q has mass where p has none: compared on p's support, both renormalised there.
    assert rkl(q_logits, p_logits, mask, num_tokens=8).item() == pytest.approx(
        rkl(q_logits[..., :3], p_top, mask, num_tokens=8).item(), rel=1e-5)
    # A drafter with no mass outside the top-k makes that the dense value.
    q_inside = torch.cat([q_logits[..., :3], outside.clamp_min(-1e4)], -1)
    assert rkl(q_inside, p_logits, mask, num_tokens=8).item() == pytest.approx(
        rkl(q_inside, p_dense, mask, num_tokens=8).item(), rel=1e-5)
