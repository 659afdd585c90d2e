"""Training windows read exactly what the runtime's drafting helper reads for the same prefix."""

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from align.drafters.masked import block_logits
from align.drafters.spec import DrafterSpec
from align.windows import WINDOW_BUILDERS, topk_window_logits, verifier_window_logits, window_logits

VOCAB, MASK, PAD, GAMMA = 40, 39, 38, 4
ROWS = [
    {"prompt_ids": [1, 2, 3], "completion_ids": [4, 5, 6, 7, 8, 9, 10]},
    {"prompt_ids": [11, 12], "completion_ids": [13, 14, 15]},
]


def tiny(bidirectional: bool, sliding: bool = False):
    """A Llama, or with `sliding` a Qwen2 whose second layer slides over a window of 3 (shorter than the prefixes)."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    config = (Qwen2Config(**sizes, use_sliding_window=True, sliding_window=3, max_window_layers=1) if sliding
              else LlamaConfig(**sizes))
    if bidirectional:
        config.is_causal = False
    return (Qwen2ForCausalLM if sliding else LlamaForCausalLM)(config).eval()


@pytest.mark.parametrize("sliding", [False, True])
@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
@pytest.mark.parametrize("shift", [0, 1])
def test_window_logits_match_the_drafting_helper(attention, shift, sliding):
    model = tiny(attention == "bidirectional", sliding)
    spec = DrafterSpec(MASK, shift, attention)
    batch = WINDOW_BUILDERS[attention](ROWS, spec, GAMMA, 3, PAD, np.random.default_rng(0))
    with torch.no_grad():
        got = window_logits(model, spec, batch)
    checked = 0
    for b in range(batch.targets.shape[0]):
        for w in range(batch.targets.shape[1]):
            if not batch.target_mask[b, w, 0]:
                continue
            start = int(batch.starts[b, w])
            prefix = batch.clean_ids[b, :start][None]
            with torch.no_grad():
                expected = block_logits(model, spec, prefix, torch.full((1, GAMMA), MASK))[0]
            assert torch.allclose(got[b, w], expected, atol=1e-4), (attention, shift, b, w)
            # Labels are the tokens that follow the prefix.
            n = int(batch.target_mask[b, w].sum())
            assert batch.targets[b, w, :n].tolist() == batch.clean_ids[b, start : start + n].tolist()
            checked += 1
    assert checked == 6  # 3 windows of the long row, 3 of the short one (its completion has 3 tokens)


def test_windows_past_the_completion_are_masked():
    spec = DrafterSpec(MASK, 0, "block_causal")
    batch = WINDOW_BUILDERS["block_causal"](ROWS, spec, GAMMA, 3, PAD, np.random.default_rng(1))
    for w in range(3):
        start, n = int(batch.starts[1, w]), int(batch.target_mask[1, w].sum())
        assert n == min(GAMMA, 5 - start)  # the short row has 5 tokens in all
    assert batch.num_windows == 6


def test_verifier_and_topk_window_logits():
    verifier = tiny(False)
    spec = DrafterSpec(MASK, 0, "block_causal")
    batch = WINDOW_BUILDERS["block_causal"](ROWS, spec, GAMMA, 2, PAD, np.random.default_rng(2))
    with torch.no_grad():
        full = verifier(input_ids=batch.clean_ids).logits
        got = verifier_window_logits(verifier, batch)
    start = int(batch.starts[0, 0])
    assert torch.allclose(got[0, 0, 1], full[0, start])  # position start+1 is predicted at start
    # Stored top-k rebuilds a distribution on those tokens only.
    rows = [dict(r, topk_ids=[[t, (t + 1) % VOCAB] for t in r["completion_ids"]],
                 topk_logprobs=[[-0.1, -2.5]] * len(r["completion_ids"])) for r in ROWS]
    dense = topk_window_logits(rows, batch, VOCAB)
    k = start - 3
    assert dense[0, 0, 0, ROWS[0]["completion_ids"][k]] == pytest.approx(-0.1)
    assert torch.isinf(dense[0, 0, 0]).sum() == VOCAB - 2


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_stored_top_k_lands_on_each_windows_own_trajectory(attention):
    # A bidirectional batch has a row per window: each must read the top-k of the trajectory it was cut from, at the
    # completion position it labels (its first top-k token is the label itself here).
    rows = [dict(r, topk_ids=[[t, (t + 1) % VOCAB] for t in r["completion_ids"]],
                 topk_logprobs=[[-0.1, -2.5]] * len(r["completion_ids"])) for r in ROWS]
    batch = WINDOW_BUILDERS[attention](rows, DrafterSpec(MASK, 0, attention), GAMMA, 2, PAD, np.random.default_rng(2))
    dense = topk_window_logits(rows, batch, VOCAB)
    assert batch.target_mask.any()
    for b, w, i in batch.target_mask.nonzero().tolist():
        assert int(dense[b, w, i].argmax()) == int(batch.targets[b, w, i])
        assert torch.isfinite(dense[b, w, i]).sum() == 2


def test_verifier_logits_along_drafted_windows():
    from align.windows import verifier_path_logits

    verifier = tiny(False)
    spec = DrafterSpec(MASK, 0, "block_causal")
    batch = WINDOW_BUILDERS["block_causal"](ROWS, spec, GAMMA, 2, PAD, np.random.default_rng(3))
    drafts = torch.randint(0, 30, batch.targets.shape)
    with torch.no_grad():
        got = verifier_path_logits(verifier, batch, drafts, PAD)
        start = int(batch.starts[0, 1])
        manual = verifier(input_ids=torch.cat([batch.clean_ids[0, :start], drafts[0, 1]])[None]).logits[0]
    # Position start+i is predicted after prefix ⊕ draft[:i].
    for i in range(GAMMA):
        assert torch.allclose(got[0, 1, i], manual[start - 1 + i], atol=1e-5)
