"""The runtime's greedy outputs are token-identical to AR greedy decoding, for every drafter kind."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import numpy as np

from align.decoding.adaptive_length import AdaptiveLength
from align.decoding.ar import ar_generate
from align.decoding.generation import Sampling
from align.decoding.path_search import PathSearch, TrigramModel
from align.decoding.sd_ar import sd_ar_generate
from align.decoding.self_selection import specdiff2_select_generate
from align.decoding.specdiff import specdiff_generate
from align.drafters.spec import DrafterSpec

VOCAB, MASK = 48, 47
ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def tiny(arch="llama", seed=0, hidden=32, bidirectional=False):
    config_class, model_class = ARCHS[arch]
    torch.manual_seed(seed)
    config = config_class(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if bidirectional:
        config.is_causal = False
    return model_class(config).eval()


@pytest.fixture(scope="module")
def verifier():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads cost more than they give
    yield tiny("llama", seed=0, hidden=64)
    torch.set_num_threads(threads)


PROMPTS = [torch.tensor([[3, 9, 4, 1, 7]]), torch.tensor([[11, 2]]), torch.tensor([[5] * 12])]


def test_ar_loop_matches_hf_generate(verifier):
    for prompt in PROMPTS:
        ours, stats = ar_generate(verifier, prompt, 24)
        theirs = verifier.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)[0, prompt.shape[1]:]
        assert ours == theirs.tolist()
        assert stats.new_tokens == 24 and stats.verifier_forwards == 23 and stats.tau == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_specdiff_greedy_is_identical_to_ar(verifier, arch, shift, attention):
    drafter = tiny(arch, seed=1, bidirectional=attention == "bidirectional")
    spec = DrafterSpec(MASK, shift, attention)
    for prompt in PROMPTS:
        expected, _ = ar_generate(verifier, prompt, 30)
        for gamma in (1, 4, 7):
            tokens, stats = specdiff_generate(verifier, drafter, spec, prompt, gamma, 30)
            assert tokens == expected, (prompt.tolist(), gamma)
            assert stats.drafter_forwards == stats.verifier_forwards == len(stats.accept_counts)
            assert all(0 <= n <= g for n, g in zip(stats.accept_counts, stats.draft_lengths))


def test_specdiff_with_a_drafter_that_agrees_accepts_whole_drafts(verifier):
    # The verifier itself, read as a shifted block-causal drafter, always gets its first draft token right.
    spec = DrafterSpec(MASK, 1, "block_causal")
    prompt = PROMPTS[0]
    expected, _ = ar_generate(verifier, prompt, 40)
    tokens, stats = specdiff_generate(verifier, verifier, spec, prompt, 4, 40)
    assert tokens == expected
    assert min(stats.accept_counts) >= 1 and stats.tau >= 2.0
    alphas = stats.per_position_acceptance(4)
    assert alphas[0] == 1.0


def test_end_of_sequence_stops_both_alike(verifier):
    prompt = PROMPTS[1]
    free, _ = ar_generate(verifier, prompt, 30)
    eos = frozenset({free[10]})  # a token the verifier will emit: decoding must stop right after it
    expected, _ = ar_generate(verifier, prompt, 30, eos_ids=eos)
    assert expected[-1] in eos and len(expected) <= 11
    drafter = tiny("llama", seed=2)
    for gamma in (3, 8):
        tokens, _ = specdiff_generate(verifier, drafter, DrafterSpec(MASK, 0, "block_causal"), prompt, gamma, 30,
                                      eos_ids=eos)
        assert tokens == expected


def test_sampled_specdiff_runs_and_is_reproducible(verifier):
    drafter = tiny("llama", seed=1)
    spec = DrafterSpec(MASK, 0, "block_causal")
    sampling = Sampling(temperature=1.0)
    runs = [specdiff_generate(verifier, drafter, spec, PROMPTS[0], 4, 20, sampling,
                              generator=torch.Generator().manual_seed(7))[0] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 20


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sd_ar_greedy_is_identical_to_ar(verifier, arch):
    drafter = tiny(arch, seed=3)
    for prompt in PROMPTS:
        expected, _ = ar_generate(verifier, prompt, 30)
        for gamma in (1, 3, 6):
            tokens, stats = sd_ar_generate(verifier, drafter, prompt, gamma, 30)
            assert tokens == expected, (prompt.tolist(), gamma)
            assert stats.drafter_forwards == sum(stats.draft_lengths)


def test_sd_ar_with_the_verifier_as_drafter_accepts_everything(verifier):
    prompt = PROMPTS[2]
    expected, _ = ar_generate(verifier, prompt, 33)
    tokens, stats = sd_ar_generate(verifier, verifier, prompt, 4, 33)
    assert tokens == expected
    assert stats.accept_counts[:-1] == [4] * (len(stats.accept_counts) - 1) and stats.tau > 4.5


@pytest.mark.parametrize("shift, attention", [(0, "block_causal"), (1, "bidirectional")])
def test_self_selection_greedy_is_identical_to_ar(verifier, shift, attention):
    drafter = tiny("qwen2", seed=4, bidirectional=attention == "bidirectional")
    spec = DrafterSpec(MASK, shift, attention)
    for prompt in PROMPTS:
        expected, _ = ar_generate(verifier, prompt, 30)
        for k in (1, 4):
            tokens, stats = specdiff2_select_generate(verifier, drafter, spec, prompt, 5, 30, k, 1.5,
                                                      generator=torch.Generator().manual_seed(0))
            assert tokens == expected, (prompt.tolist(), k)
        assert stats.drafter_forwards == stats.verifier_forwards


def test_self_selection_sampling_is_reproducible(verifier):
    drafter = tiny("llama", seed=1)
    spec = DrafterSpec(MASK, 0, "block_causal")
    runs = [specdiff2_select_generate(verifier, drafter, spec, PROMPTS[0], 4, 20, 3, 1.5, Sampling(temperature=0.8),
                                      generator=torch.Generator().manual_seed(3))[0] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 20


@pytest.mark.parametrize("use_cps, use_adl", [(True, False), (False, True), (True, True)])
def test_cps_and_adl_greedy_are_identical_to_ar(verifier, use_cps, use_adl):
    drafter = tiny("llama", seed=5)
    spec = DrafterSpec(MASK, 0, "block_causal")
    proxy = TrigramModel.fit(np.random.default_rng(0).integers(0, VOCAB, 3000), VOCAB)
    eos = frozenset({VOCAB - 2})
    for prompt in PROMPTS:
        expected, _ = ar_generate(verifier, prompt, 30, eos_ids=eos)
        adl = AdaptiveLength(min_len=2, max_len=8, delta=2) if use_adl else None
        tokens, stats = specdiff_generate(verifier, drafter, spec, prompt, 6, 30, eos_ids=eos,
                                          path_search=(PathSearch(), proxy) if use_cps else None, adaptive=adl)
        assert tokens == expected
        if use_adl:
            assert max(stats.draft_lengths) <= 8


def test_cps_under_sampling_uses_the_point_mass_rule(verifier, monkeypatch):
    import align.decoding.acceptance as acceptance

    calls = []

    def recording_point_mass(draft_tokens, verifier_probs, generator=None):
        calls.append(draft_tokens.clone())
        return point_mass(draft_tokens, verifier_probs, generator)

    def recording_sampled(draft_tokens, draft_probs, verifier_probs, generator=None):
        # Reached only through the point-mass rule: the draft distribution is the one-hot of the draft itself.
        assert torch.equal(draft_probs, torch.nn.functional.one_hot(draft_tokens, VOCAB).to(draft_probs.dtype))
        return sampled(draft_tokens, draft_probs, verifier_probs, generator)

    point_mass, sampled = acceptance.accept_point_mass, acceptance.accept_sampled
    monkeypatch.setattr(acceptance, "accept_point_mass", recording_point_mass)
    monkeypatch.setattr(acceptance, "accept_sampled", recording_sampled)
    drafter = tiny("llama", seed=5)
    proxy = TrigramModel.fit(np.random.default_rng(0).integers(0, VOCAB, 3000), VOCAB)
    tokens, stats = specdiff_generate(verifier, drafter, DrafterSpec(MASK, 0, "block_causal"), PROMPTS[0], 4, 20,
                                      Sampling(temperature=1.0), path_search=(PathSearch(), proxy),
                                      generator=torch.Generator().manual_seed(0))
    assert len(tokens) == 20 and stats.verifier_forwards >= 5
    # Every iteration's CPS path went through the point-mass rule.
    assert len(calls) == stats.verifier_forwards
    assert [len(c) for c in calls] == stats.draft_lengths
