"""DiffuSpec's CPS and ADL against hand-computed cases from the paper's definitions."""

import math

import numpy as np
import pytest
import torch

from align.decoding.adaptive_length import AdaptiveLength
from align.decoding.path_search import PathSearch, TrigramModel, candidate_sets, causal_path_search

EOS = 3


def test_candidate_sets_keep_the_smallest_top_m_reaching_the_threshold_plus_eos():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.9, 0.05, 0.03, 0.02], [0.4, 0.25, 0.2, 0.15]])
    assert candidate_sets(probs, 0.8, 15, frozenset()) == [[0, 1], [0], [0, 1, 2]]
    assert candidate_sets(probs, 0.8, 2, frozenset()) == [[0, 1], [0], [0, 1]]  # capped at max_candidates
    assert candidate_sets(probs, 0.8, 15, frozenset({EOS})) == [[0, 1, 3], [0, 3], [0, 1, 2, 3]]


def test_trigram_probabilities_by_hand():
    # Stream: 0 1 2 0 1 0. Trigram (0,1)->2 once and (0,1)->0 once; bigram 1->2 once, 1->0 once; 6 tokens, V = 4.
    model = TrigramModel.fit(np.array([0, 1, 2, 0, 1, 0]), 4)
    got = np.exp(model.log_probs(0, 1, np.array([2, 0, 3])))
    uni = lambda c: (np.bincount([0, 1, 2, 0, 1, 0], minlength=4)[c] + 1) / (6 + 4)  # noqa: E731
    expected = [0.6 * 0.5 + 0.3 * 0.5 + 0.1 * uni(2), 0.6 * 0.5 + 0.3 * 0.5 + 0.1 * uni(0), 0.1 * uni(3)]
    assert np.allclose(got, expected)
    # One token of context: no trigram term.
    assert np.allclose(np.exp(model.log_probs(-1, 1, np.array([2]))), 0.3 * 0.5 + 0.1 * uni(2))
    # Ids past the vocabulary (a model's padded rows) are unseen tokens; 4·1 + 6 would alias the key of bigram 2 -> 2.
    assert np.allclose(np.exp(model.log_probs(0, 1, np.array([6, 3, 2]))), [0.1 / 10, 0.1 * uni(3), expected[0]])
    # A padded id in the context (a tree node's parent) is an unseen context. As the last token, 6 would index past
    # the bigram counts, and its trigram prefix 0·4 + 6 is the key of the context (1, 2), followed by 0 in the stream.
    assert np.allclose(np.exp(model.log_probs(0, 6, np.array([0, 2]))), [0.1 * uni(0), 0.1 * uni(2)])
    # As the first token only the trigram term goes: bigram 0 -> 1 twice out of 2.
    assert np.allclose(np.exp(model.log_probs(4, 0, np.array([1]))), 0.3 * 1.0 + 0.1 * uni(1))
    # Unseen contexts: no bigram or trigram evidence, only the smoothed unigram.
    assert np.allclose(np.exp(model.log_probs(2, 3, np.array([0]))), 0.1 * uni(0))


def test_trigram_round_trips(tmp_path):
    model = TrigramModel.fit(np.random.default_rng(0).integers(0, 9, 500), 9)
    model.save(tmp_path)
    again = TrigramModel.load(tmp_path)
    assert np.array_equal(model.log_probs(1, 2, np.arange(9)), again.log_probs(1, 2, np.arange(9)))


def test_a_proxy_cached_in_a_data_dir_of_its_own_leaves_it_usable_by_the_next_stage(tmp_path):
    """The CPS proxy's cache in a fresh data.dir (the SmolLM2 eval's data/smollm2/cache): the next stage that names
    that folder must not refuse it as a folder align did not write."""
    import json
    from pathlib import Path

    from align.disk import check_output_owner
    from align.methods import trigram_proxy
    from align.models import load_tokenizer

    source = tmp_path / "text.jsonl"
    source.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(20)))
    tokenizer = load_tokenizer(str(Path(__file__).resolve().parents[2] / "checkpoints/tiny/tokenizer"))
    data_dir = tmp_path / "cache"
    fitted = trigram_proxy(source, str(data_dir), tokenizer)
    check_output_owner("data.dir", data_dir, "data")  # raised RecipeError before trigram/ was marked
    cached = trigram_proxy(source, str(data_dir), tokenizer)  # read from the cache
    tokens = np.arange(len(tokenizer))
    assert np.array_equal(fitted.log_probs(5, 6, tokens), cached.log_probs(5, 6, tokens))


def proxy_preferring(path_after, vocab=6):
    """A trigram model fitted on text that always continues the context token 5 with `path_after`."""
    return TrigramModel.fit(np.array(([5, *path_after] * 50)), vocab)


def test_path_search_trades_drafter_and_proxy_scores():
    # The drafter's marginals favour 0 then 0 ("the the"), but 1 then 2 is close at both positions;
    # the causal proxy has only ever seen 5 -> 1 -> 2.
    log_q = torch.log(torch.tensor([[0.5, 0.4, 0.05, 0.05, 0.0, 0.0], [0.5, 0.05, 0.4, 0.05, 0.0, 0.0]]) + 1e-9)
    proxy = proxy_preferring([1, 2])
    assert causal_path_search(log_q, [5], proxy, PathSearch(weight=0.5), frozenset()) == [1, 2]
    # λ = 1 ignores the proxy: the drafter's argmax path.
    assert causal_path_search(log_q, [5], proxy, PathSearch(weight=1.0), frozenset()) == [0, 0]
    # Beam width 1 commits to the first position's best combined token, then continues from it.
    assert causal_path_search(log_q, [5], proxy, PathSearch(beam_width=1, weight=0.5), frozenset()) == [1, 2]


def test_path_search_stops_a_beam_at_eos():
    log_q = torch.log(torch.tensor([[0.1, 0.05, 0.05, 0.8, 0.0, 0.0], [0.9, 0.05, 0.03, 0.02, 0.0, 0.0]]) + 1e-9)
    proxy = proxy_preferring([EOS])
    path = causal_path_search(log_q, [5], proxy, PathSearch(), frozenset({EOS}))
    assert path == [EOS]


def test_adl_by_hand():
    adl = AdaptiveLength(min_len=2, max_len=8, delta=3, rho=0.5)
    assert adl.current == 8  # k_1 = k_max
    # Everything generated and accepted: EMAs 4 and 4, L̃_acc >= L̃_gen, so k = 4 + 3.
    assert adl.update(torch.tensor([0] * 8), 8, frozenset({EOS})) == 7
    # EOS at index 2 of the raw draft: L_gen = 2; 1 accepted. EMAs 3 and 2.5: k = round(3) = 3.
    assert adl.update(torch.tensor([0, 0, EOS, 0, 0, 0, 0]), 1, frozenset({EOS})) == 3
    assert (adl.gen_ema, adl.acc_ema) == (3.0, 2.5)
    # EOS first: L_gen = 0, nothing accepted. EMAs 1.5 and 1.25: k = clip(round(1.5) = 2, 2, 8).
    assert adl.update(torch.tensor([EOS, 0, 0]), 0, frozenset({EOS})) == 2
    with pytest.raises(ValueError):
        AdaptiveLength(min_len=5, max_len=4, delta=1)
    assert math.isclose(adl.gen_ema, 1.5)


def test_adl_follows_where_the_drafter_puts_eos_and_grows_when_acceptance_keeps_up():
    # Raw drafts at the maximum length 8 with EOS at index 3: short acceptance settles on L_gen = 3; acceptance that
    # keeps up with it (3 accepted) adds δ = 2.
    raw = torch.tensor([0, 0, 0, EOS, 0, 0, 0, 0])
    short, long = (AdaptiveLength(min_len=2, max_len=8, delta=2) for _ in range(2))
    short_trace = [short.update(raw, 1, frozenset({EOS})) for _ in range(8)]
    long_trace = [long.update(raw, 3, frozenset({EOS})) for _ in range(8)]
    assert short_trace[-3:] == [3, 3, 3] and long_trace[-3:] == [5, 5, 5]
    # No EOS anywhere in the proposal: the drafter would go on, so k climbs back to k_max after the first halving.
    free = AdaptiveLength(min_len=2, max_len=8, delta=2)
    assert [free.update(torch.zeros(8, dtype=torch.long), 1, frozenset({EOS})) for _ in range(5)] == [4, 6, 7, 8, 8]


def test_specdiff_adl_length_is_not_locked_by_its_own_drafts():
    # A random drafter against a random verifier: short acceptance, no EOS. The length used to halve at the first
    # update and stay there (L_gen measured on a k_t-long draft can never exceed k_t).
    from transformers import LlamaConfig, LlamaForCausalLM

    from align.decoding.specdiff import specdiff_generate
    from align.drafters.spec import DrafterSpec

    def tiny(seed):
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        return LlamaForCausalLM(config).eval()

    seen = []

    class Recording(AdaptiveLength):
        def update(self, raw_draft, num_accepted, eos_ids):
            seen.append(len(raw_draft))
            return super().update(raw_draft, num_accepted, eos_ids)

    adl = Recording(min_len=2, max_len=8, delta=2)
    _, stats = specdiff_generate(tiny(0), tiny(1), DrafterSpec(47, 0, "block_causal"), torch.tensor([[3, 9, 4]]),
                                 4, 24, adaptive=adl, eos_ids=frozenset({46}))
    assert max(stats.accept_counts) < 4  # acceptance is short throughout
    assert stats.draft_lengths[:2] == [8, 4] and 8 in stats.draft_lengths[2:]  # halved, then back at k_max
    assert seen[:10] == [8] * 10  # L_gen is read off a proposal at the maximum length
