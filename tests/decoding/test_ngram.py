"""Model-free drafts (align/decoding/ngram.py, align/decoding/suffix.py) and the union tree (align/decoding/tree.py):
the n-gram match, SuffixDecoding's index, merging candidates into a drafter's tree, ordering a tree by expected
acceptance, and greedy decoding token-identical to AR with drafts that are actually proposed and kept. Their sampled
losslessness is in test_sampling_lossless.py."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from align.config import DecodeSection, RecipeError
from align.decoding.ar import ar_generate
from align.decoding.generation import Sampling
from align.decoding.ngram import NgramLookup
from align.decoding.suffix import SuffixIndex, suffix_array
from align.decoding.tree import DraftTree, add_tree, chain, leading, order_by_gain
from align.drafters.spec import DrafterSpec
from align.methods import METHODS, Setup

VOCAB, MASK, NEW_TOKENS = 64, 63, 40


def continuation(tokens: list[int], num_tokens: int = 3, lookup: NgramLookup = NgramLookup()) -> list[int]:
    return lookup.continuation(np.array(tokens), num_tokens)


def test_the_longest_suffix_that_occurs_is_matched_at_its_most_recent_occurrence():
    # "1 2 3" occurs once (-> 4 5), "3" alone more recently (-> 9): the longer match wins.
    assert continuation([1, 2, 3, 4, 5, 3, 9, 7, 1, 2, 3]) == [4, 5, 3]
    # Two occurrences of the longest suffix: the later one's continuation.
    assert continuation([5, 6, 1, 5, 6, 2, 8, 5, 6]) == [2, 8, 5]
    # A continuation running into the end of the context is shorter; a repeated run continues itself.
    assert continuation([7, 8, 9, 7, 8], num_tokens=5) == [9, 7, 8]
    assert continuation([4, 4, 4], num_tokens=5) == [4]


def test_nothing_matching_drafts_nothing():
    assert continuation([1, 2, 3, 4]) == []
    assert continuation([3]) == []
    # A match shorter than min_match does not count.
    assert continuation([1, 2, 9, 2], lookup=NgramLookup(max_match=4, min_match=2)) == []
    assert continuation([1, 2, 9, 1, 2], lookup=NgramLookup(max_match=4, min_match=2)) == [9, 1, 2]


def tree_of(tokens, parents, scores) -> DraftTree:
    depths = []
    for parent in parents:
        depths.append(depths[parent] + 1 if parent >= 0 else 1)
    return DraftTree(list(tokens), list(parents), depths, list(scores))


def test_candidates_merge_into_the_tree_at_their_shared_prefix():
    # Root children 10 (node 0), 11 (node 1); 10 -> 12 (node 2).
    tree = tree_of([10, 11, 12], [-1, -1, 0], [-0.1, -0.5, -0.3])
    merged, nodes = add_tree(tree, chain([10, 12, 13, 14]))
    assert nodes == [0, 2, 3, 4]  # 10 and 12 were there; 13 and 14 are new, appended after their parents
    assert merged.tokens == [10, 11, 12, 13, 14] and merged.parents == [-1, -1, 0, 2, 3]
    assert merged.depths == [1, 1, 2, 3, 4] and merged.scores[3:] == [float("-inf")] * 2
    assert tree.tokens == [10, 11, 12]  # the drafter's tree is not changed
    merged, nodes = add_tree(tree, chain([13, 2, 5]), eos_ids=frozenset({2}))  # a new branch, ended by an end token
    assert nodes == [3, 4, -1] and merged.parents[3:] == [-1, 3]
    assert add_tree(tree, chain([])) == (tree, [])
    # A tree of candidates (SuffixDecoding's): 11 -> {12, 13}, 10 -> 12; shared nodes found, the rest appended.
    candidates = tree_of([11, 10, 12, 13, 12], [-1, -1, 0, 0, 1], [-0.2, -0.9, -0.5, -1.6, -1.0])
    merged, nodes = add_tree(tree, candidates)
    assert nodes == [1, 0, 3, 4, 2] and merged.tokens[3:] == [12, 13] and merged.parents[3:] == [1, 1]


def test_ordered_by_gain_every_prefix_is_a_tree():
    tree = tree_of([10, 11, 12, 13, 14], [-1, -1, 0, 2, 3], [0.0] * 5)
    # Node 4's own gain is above its parents': capped at theirs, it still comes after them.
    ordered, gains, where = order_by_gain(tree, [0.3, 0.6, 0.2, 0.9, 0.95])
    assert ordered.tokens == [11, 10, 12, 13, 14] and gains == [0.6, 0.3, 0.2, 0.2, 0.2]
    assert ordered.parents == [-1, -1, 1, 2, 3] and where == [1, 0, 2, 3, 4]
    for size in range(len(ordered) + 1):
        prefix = ordered.prefix(size)
        assert all(parent < node for node, parent in enumerate(prefix.parents))


def test_leading_counts_the_accepted_nodes_of_one_source():
    assert leading([0, 2, 3, 4], {0, 2, 5}) == 2 and leading([1], {0}) == 0 and leading([], {0}) == 0


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(1)
    verifier = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()
    torch.manual_seed(9)
    drafter = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()
    with torch.no_grad():  # peaked, so that the verifier repeats itself (what an n-gram draft copies) and keeps drafts
        verifier.get_output_embeddings().weight.mul_(4.0)
        drafter.get_output_embeddings().weight.mul_(4.0)
    decode = DecodeSection(gamma=4, max_new_tokens=NEW_TOKENS, tree_nodes=6)
    return Setup(verifier, drafter, DrafterSpec(MASK, 1, "block_causal"), None, None, frozenset(), decode,
                 verify_costs=[1.0 + 0.3 * n for n in range(decode.tree_nodes + decode.gamma + 1)], draft_cost=0.5)


@pytest.mark.parametrize("method", ["ngram", "ngram_cost", "specdiff_ngram_tree", "specdiff_ngram_tree_cost"])
def test_greedy_outputs_equal_ar_and_the_continuation_is_kept(setup, method):
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    expected = ar_generate(setup.verifier, prompt, NEW_TOKENS)[0]
    tokens, stats = METHODS[method](setup, prompt, Sampling(), None)
    assert tokens == expected
    assert sum(stats.accept_counts) > 0 and stats.tau > 1.0, stats.accept_counts
    if method.startswith("ngram"):
        assert stats.drafter_forwards == 0 and 0 in stats.draft_lengths  # a miss is a plain step


# --------------------------------------------------------------------------------------------------------------------
# SuffixDecoding's index (align/decoding/suffix.py)
# --------------------------------------------------------------------------------------------------------------------
def test_the_suffix_array_sorts_every_suffix():
    rng = np.random.default_rng(0)
    for length in (1, 2, 7, 300):
        text = rng.integers(-1, 3, length)  # few distinct tokens: long shared prefixes, the doubling's hard case
        assert suffix_array(text).tolist() == sorted(range(length), key=lambda i: tuple(text[i:].tolist()))


def test_the_longest_suffix_that_occurs_is_matched_and_its_continuations_counted():
    index = SuffixIndex.build([[1, 2, 3, 4, 5], [9, 2, 3, 4, 7], [2, 3, 4, 5, 6], [3, 4, 5]])
    assert index.longest_match(np.array([8, 2, 3, 4]), max_match=8)[0] == 3  # "2 3 4", not just "3 4"
    assert index.longest_match(np.array([8, 2, 3, 4]), max_match=2)[0] == 2
    assert index.longest_match(np.array([8]), max_match=8) == (0, 0, 0)
    tokens, parents, shares = index.continuations(np.array([8, 2, 3, 4]), depth=3, num_nodes=10)
    # After "2 3 4": 5 twice (then 6 once, then the end of its document), 7 once (then the end of its document).
    assert tokens == [5, 7, 6] and parents == [-1, -1, 0] and shares == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert index.continuations(np.array([8, 2, 3, 4]), depth=3, num_nodes=10, min_share=0.5)[0] == [5]
    assert index.continuations(np.array([8, 2, 3, 4]), depth=3, num_nodes=1)[0] == [5]


def test_a_saved_suffix_index_loads_as_it_was_and_a_damaged_one_is_refused(tmp_path):
    index = SuffixIndex.build([[1, 2, 3, 4, 5], [9, 2, 3, 4, 7]])
    index.save(tmp_path)
    loaded = SuffixIndex.load(tmp_path)
    assert np.array_equal(loaded.tokens, index.tokens) and np.array_equal(loaded.suffixes, index.suffixes)
    saved = tmp_path / "suffix_index.npz"
    np.savez(saved, tokens=index.tokens, suffixes=index.suffixes[::-1][:-1])  # a suffix array of the wrong length
    with pytest.raises(ValueError, match="not a suffix index") as refused:
        SuffixIndex.load(tmp_path)
    assert "\n" not in str(refused.value)
    saved.write_bytes(saved.read_bytes()[:40])  # cut short
    with pytest.raises(ValueError, match="not a suffix index"):
        SuffixIndex.load(tmp_path)


@pytest.mark.parametrize("method", ["suffix", "suffix_ngram_cost", "specdiff_ngram_suffix_tree_cost"])
def test_greedy_suffix_decoding_equals_ar_and_its_candidates_are_kept(setup, method):
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    expected = ar_generate(setup.verifier, prompt, NEW_TOKENS)[0]
    # The verifier's own earlier answers, as a trajectories folder holds them (another prompt's, and this one's).
    other = torch.tensor([[3, 1, 4, 1, 5]])
    documents = [[*p[0].tolist(), *ar_generate(setup.verifier, p, NEW_TOKENS)[0]] for p in (other, prompt)]
    with_index = replace(setup, suffix=SuffixIndex.build(documents))
    tokens, stats = METHODS[method](with_index, prompt, Sampling(), None)
    assert tokens == expected
    assert stats.tau > 2.0, stats.accept_counts  # this very answer is in the index
    if method.startswith("specdiff"):  # with its answer in the index, the union learns to skip the drafter pass
        assert 0 < stats.drafter_forwards < stats.verifier_forwards, (stats.drafter_forwards, stats.verifier_forwards)
    with pytest.raises(RecipeError, match="decode.suffix_corpus"):
        METHODS[method](setup, prompt, Sampling(), None)


def test_what_a_union_learns_carries_to_the_next_prompt_and_a_repeat_starts_where_its_first_run_did(setup):
    from align.stages.evaluate.speculative import run_all

    method = "specdiff_ngram_tree_cost"
    union = replace(setup, learned={})
    prompts = [torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]), torch.tensor([[9, 3, 9, 3, 9, 3, 4]]),
               torch.tensor([[1, 2, 3, 1, 2, 3, 1]])]
    METHODS[method](union, prompts[0], Sampling(), None)
    learned = dict(union.learned)
    assert set(learned) == {(method, role) for role in ("gate", "draft", "source 0")} and learned[(method, "gate")].rates
    tokens, _ = METHODS[method](union, prompts[1], Sampling(), None)
    assert tokens == ar_generate(setup.verifier, prompts[1], NEW_TOKENS)[0]
    assert all(union.learned[key] is value for key, value in learned.items())  # the same choosers, taught on
    union.forget()
    assert union.learned == {}

    def choices(warmup: int, repeats: int) -> list[tuple[list[int], list[int], int]]:
        runs = run_all({method: union}, prompts, Sampling(), warmup, repeats, 0, "test")
        return [(s.accept_counts, s.tree_nodes, s.drafter_forwards) for s in runs[method].stats]

    once = choices(0, 1)
    # A repeat decodes from what the prompt's first run started with, and nothing the warm-up taught is kept.
    assert choices(1, 2) == once
    # What is learnt does change the choices: each prompt decoded fresh is another run.
    fresh = []
    for ids in prompts:
        union.forget()
        stats = METHODS[method](union, ids, Sampling(), None)[1]
        fresh.append((stats.accept_counts, stats.tree_nodes, stats.drafter_forwards))
    assert fresh != once
