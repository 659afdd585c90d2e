"""Draft trees (align/decoding/tree.py): the tree forward scores every node exactly as a plain forward over its path
does, for each verifier family (a sliding window included); greedy decoding with a tree is token-identical to AR
greedy for every drafter kind and node budget; sampling with a tree follows the verifier's distribution (spread-out
distributions, a power-tested chi-square: test_sampling_lossless)."""

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from align.config import DrafterSection, ModelSection, RecipeError
from align.decoding.ar import ar_generate
from align.decoding.path_search import PathSearch, TrigramModel
from align.decoding.tree import (TREE_MASK_READ, DraftTree, build_consistent_draft_tree, build_draft_tree, keep_path,
                                 specdiff_tree_generate, tree_forward)
from align.drafters.dflash import DFlashDrafter, config_for_verifier
from align.drafters.loading import load_drafter
from align.drafters.spec import DrafterSpec, drafter_spec_from_config
from align.models import load_tokenizer, load_verifier, rollback_cache
from test_sampling_lossless import (ALPHA, DECODES, NEW_TOKENS, SEED, TABLE_PROMPT, TEMPERATURE, exact_joint,
                                    first_tokens, lossless_pvalue, transformer_setup)
from test_diffusion_gemma import SLIDING_WINDOW as GEMMA_WINDOW, tiny_diffusion_gemma, tiny_gemma4_verifier
from test_verifier_families import COMMON, MASK, VOCAB, families

SLIDING_WINDOW = 8
PROXY = TrigramModel.fit(np.random.default_rng(0).integers(0, VOCAB, 400), VOCAB)  # the CPS proxy of the trees tested
FAMILIES = families(SLIDING_WINDOW)  # a window the tests' sequences go past
ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_thread")


def build(family, seed, sharpen=4.0, bidirectional=False):
    torch.manual_seed(seed)
    model = FAMILIES[family]()
    if bidirectional:
        model.config.is_causal = False
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)  # marked preferences: some drafts are accepted
    return model.eval()


def test_best_first_tree_takes_the_best_paths_and_orders_parents_first():
    # Depth 1 prefers 5 (0.6) over 6 (0.3); depth 2 prefers 7 (0.9). Paths: 5 (.6), 5-7 (.54), 6 (.3), 6-7 (.27), ...
    probs = torch.full((2, 10), 0.01 / 8)
    probs[0, 5], probs[0, 6], probs[1, 7], probs[1, 8] = 0.6, 0.3, 0.9, 0.05
    probs = probs / probs.sum(-1, keepdim=True)
    tree = build_draft_tree(probs.log(), 4)
    assert tree.tokens == [5, 7, 6, 7] and tree.parents == [-1, 0, -1, 2] and tree.depths == [1, 2, 1, 2]
    assert all(p < i for i, p in enumerate(tree.parents))
    assert tree.scores == sorted(tree.scores, reverse=True)
    assert tree.children() == [[0, 2], [1], [], [3], []]
    # An end-of-sequence node gets no children: what follows it is thrown away.
    assert build_draft_tree(probs.log(), 4, eos_ids=frozenset({5})).tokens == [5, 6, 7, 8]


def test_a_consistent_tree_ranks_each_nodes_children_by_the_path_score():
    # Depth 1: 5 (0.5) and 6 (0.49); depth 2 prefers 7 to 8 whatever comes before. The proxy has seen "2 5 8" and
    # "2 6 7" only, so the path score puts 8 under 5 and 7 under 6, where the marginals put 7 under both.
    probs = torch.full((2, 10), 0.01 / 8)
    probs[0, 5], probs[0, 6], probs[1, 7], probs[1, 8] = 0.5, 0.49, 0.5, 0.45
    draft_log_probs = (probs / probs.sum(-1, keepdim=True)).log()
    proxy = TrigramModel.fit(np.array([2, 5, 8] * 50 + [2, 6, 7] * 50), 10)
    tree = build_consistent_draft_tree(draft_log_probs, 4, [1, 2], (PathSearch(max_candidates=4), proxy))
    assert tree.tokens == [5, 6, 7, 8] and tree.parents == [-1, -1, 1, 0]
    drafter = draft_log_probs.tolist()
    assert tree.scores == pytest.approx([drafter[0][5], drafter[0][6], drafter[0][6] + drafter[1][7],
                                         drafter[0][5] + drafter[1][8]])  # the drafter's log-probabilities, as ever
    plain = build_draft_tree(draft_log_probs, 4)
    assert plain.tokens == [5, 6, 7, 7] and plain.parents == [-1, -1, 0, 1]
    # With the drafter's weight at 1 the score is the drafter's alone: the same tree as build_draft_tree's.
    generator = torch.Generator().manual_seed(0)
    draft_log_probs = torch.log_softmax(torch.randn(4, 10, generator=generator) * 2, -1)
    plain = build_draft_tree(draft_log_probs, 20)
    alone = build_consistent_draft_tree(draft_log_probs, 20, [3], (PathSearch(max_candidates=10, weight=1.0), proxy))
    assert (alone.tokens, alone.parents, alone.depths) == (plain.tokens, plain.parents, plain.depths)
    assert alone.scores == pytest.approx(plain.scores)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tree_forward_scores_each_node_as_a_plain_forward_over_its_path(family):
    verifier = build(family, 1)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (1, 13), generator=generator)  # past the sliding window of 8
    draft_log_probs = torch.log_softmax(torch.randn(4, VOCAB, generator=generator) * 3, -1)
    tree = build_draft_tree(draft_log_probs, 12)
    assert max(tree.depths) >= 3 and len(set(tree.parents)) > 2  # deep and branching
    with torch.no_grad():
        cache = rollback_cache(verifier)
        verifier(input_ids=prompt[:, :-1], cache=cache, use_cache=True)
        logits = tree_forward(verifier, prompt[:, -1:], tree, cache)  # (N + 1, V)
        assert cache.get_seq_length() == prompt.shape[1] + len(tree)
        for row in range(len(tree) + 1):
            path, node = [], row - 1
            while node >= 0:
                path.insert(0, tree.tokens[node])
                node = tree.parents[node]
            plain = verifier(input_ids=torch.cat([prompt, torch.tensor([path], dtype=prompt.dtype)], 1)).logits[0, -1]
            torch.testing.assert_close(logits[row], plain, atol=1e-4, rtol=1e-4)
        # Keeping one path leaves exactly the cache of a plain forward over prefix ⊕ root ⊕ path.
        path = [i for i, p in enumerate(tree.parents) if p == -1][:1]
        path += [i for i, p in enumerate(tree.parents) if p == path[0]][:1]
        keep_path(cache, tree, path)
        assert cache.get_seq_length() == prompt.shape[1] + len(path)
        following = torch.tensor([[7]])
        positions = torch.tensor([[cache.get_seq_length()]])
        after = verifier(input_ids=following, position_ids=positions, cache=cache, use_cache=True).logits[0, -1]
        ids = torch.cat([prompt, torch.tensor([[tree.tokens[n] for n in path]]), following], 1)
        torch.testing.assert_close(after, verifier(input_ids=ids).logits[0, -1], atol=1e-4, rtol=1e-4)


def test_a_verifier_that_drops_the_mask_it_is_handed_is_refused_by_the_tree_methods():
    """Remote code that builds its own causal mask would score each node as if the nodes before it in the forward
    were its ancestors: the tree's output would differ from AR greedy with no word said (issue 33). The tree methods
    ask the verifier itself, once, and refuse it in one line."""
    verifier, drafter = build("llama", 1), build("llama", 2)
    spec, prompt = DrafterSpec(MASK, 1, "block_causal"), torch.tensor([[1, 2, 3, 4, 5]])
    reads = specdiff_tree_generate(verifier, drafter, spec, prompt, 4, 6, 12)[0]
    assert reads == ar_generate(verifier, prompt, 12)[0] and getattr(verifier, TREE_MASK_READ)

    dropping = build("llama", 1)
    forward = dropping.forward
    dropping.forward = lambda *args, attention_mask=None, **kwargs: forward(*args, **kwargs)  # a causal mask of its own
    with pytest.raises(RecipeError, match="ignores the 4-D attention mask") as refused:
        specdiff_tree_generate(dropping, drafter, spec, prompt, 4, 6, 12)
    assert "\n" not in str(refused.value) and not getattr(dropping, TREE_MASK_READ, False)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tree_decoding_is_identical_to_ar_for_every_verifier_family(family):
    verifier, drafter = build(family, 1), build("llama", 2)
    spec = DrafterSpec(MASK, 1, "block_causal")
    accepted = 0
    for prompt in (torch.tensor([[1, 2, 3, 4, 5]]), torch.tensor([[7, 8, 9]])):
        expected = ar_generate(verifier, prompt, 30)[0]
        for nodes in (1, 6, 20):
            tokens, stats = specdiff_tree_generate(verifier, drafter, spec, prompt, 4, nodes, 30)
            assert tokens == expected, (family, nodes)
            assert stats.tree_nodes and max(stats.tree_nodes) <= nodes
            accepted += sum(stats.accept_counts)
    assert accepted > 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_greedy_tree_decoding_is_identical_to_ar_for_every_drafter_kind(arch, shift, attention):
    verifier = build("llama", 0, sharpen=3.0)
    drafter = build(arch, 1, sharpen=3.0, bidirectional=attention == "bidirectional")
    spec = DrafterSpec(MASK, shift, attention)
    for prompt in (torch.tensor([[3, 9, 4, 1, 7]]), torch.tensor([[5] * 12])):
        expected = ar_generate(verifier, prompt, 24)[0]
        for gamma, nodes in ((1, 3), (4, 1), (4, 10), (7, 24)):
            tokens, stats = specdiff_tree_generate(verifier, drafter, spec, prompt, gamma, nodes, 24)
            assert tokens == expected, (prompt.tolist(), gamma, nodes)
            consistent = specdiff_tree_generate(verifier, drafter, spec, prompt, gamma, nodes, 24,
                                                path_search=(PathSearch(), PROXY))[0]
            assert consistent == expected, ("path search", prompt.tolist(), gamma, nodes)
            assert stats.drafter_forwards == stats.verifier_forwards == len(stats.accept_counts)
            assert all(0 <= n <= g for n, g in zip(stats.accept_counts, stats.draft_lengths))


def test_a_drafter_that_agrees_has_its_first_draft_token_accepted_every_time():
    # The verifier itself, read as a shifted block-causal drafter, always gets its first draft token right: the tree
    # holds it (the best node) and the greedy walk takes it.
    verifier = build("llama", 0)
    spec = DrafterSpec(MASK, 1, "block_causal")
    prompt = torch.tensor([[3, 9, 4, 1, 7]])
    expected = ar_generate(verifier, prompt, 30)[0]
    tokens, stats = specdiff_tree_generate(verifier, verifier, spec, prompt, 4, 16, 30)
    assert tokens == expected and min(stats.accept_counts) >= 1


def test_greedy_tree_decoding_with_a_dflash_drafter_is_identical_to_ar():
    torch.manual_seed(0)
    verifier = LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_hidden_layers": 4})).eval()
    torch.manual_seed(1)
    drafter = DFlashDrafter(config_for_verifier(verifier.config, MASK, num_layers=2, intermediate_size=48)).eval()
    spec = drafter_spec_from_config(drafter.config)
    for seed in range(2):
        prompt = torch.randint(0, MASK, (1, 5), generator=torch.Generator().manual_seed(seed))
        expected = ar_generate(verifier, prompt, 20)[0]
        for nodes in (1, 8):
            assert specdiff_tree_generate(verifier, drafter, spec, prompt, 3, nodes, 20)[0] == expected


def test_greedy_tree_decoding_with_a_diffusion_gemma_drafter_and_a_gemma4_verifier_is_identical_to_ar():
    drafter = tiny_diffusion_gemma(0)
    spec = drafter_spec_from_config(drafter.config, load_tokenizer(str(ROOT / "checkpoints" / "tiny" / "tokenizer")))
    verifier = tiny_gemma4_verifier(1)
    new_tokens = 2 * GEMMA_WINDOW  # prompt and output run past both models' sliding window
    accepted = 0
    for prompt in (torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[100, 200, 300]])):
        expected = ar_generate(verifier, prompt, new_tokens)[0]
        for nodes in (1, 12):
            tokens, stats = specdiff_tree_generate(verifier, drafter, spec, prompt, 4, nodes, new_tokens)
            assert tokens == expected, (prompt.tolist(), nodes)
            accepted += sum(stats.accept_counts)
    assert accepted > 0


@pytest.mark.slow
def test_greedy_tree_decoding_with_the_shipped_tiny_checkpoints_is_identical_to_ar():
    tiny = ROOT / "checkpoints" / "tiny"
    tokenizer = load_tokenizer(str(tiny / "tokenizer"))
    verifier = load_verifier(ModelSection(path=str(tiny / "verifier"), device="cpu"))
    drafter, spec = load_drafter(DrafterSection(path=str(tiny / "drafter-base"), device="cpu"), tokenizer)
    eos = frozenset({tokenizer.eos_token_id})
    for text in ("def add(a, b):\n    return", "for i in range(10):\n"):
        prompt = torch.tensor([tokenizer(text).input_ids])
        expected = ar_generate(verifier, prompt, 24, eos_ids=eos)[0]
        for nodes in (4, 16):
            assert specdiff_tree_generate(verifier, drafter, spec, prompt, 6, nodes, 24, eos_ids=eos)[0] == expected


@pytest.mark.slow
@pytest.mark.parametrize("path_search", [False, True], ids=["best-first", "path-score"])
def test_sampling_with_a_branching_tree_follows_the_verifier_distribution(path_search):
    """A transformer verifier (full attention, spread out: test_sampling_lossless.transformer_verifier) and the table
    drafter, γ 2 and 6 nodes over 5 tokens: siblings at both depths, and with t1 from the prefill, a whole accepted
    path (t2, t3) puts the bonus token t4 in the table. Ranked by the path score, the tree holds other branches; the
    acceptance rule keeps sampling exact. Temperature 0.9, 1,000 decodes: a marginal deviation of w ≥ 0.231 (a 0.093
    shift of a probability of 0.2) is detected at α = 1e-4 with power 0.99 (test_sampling_lossless's power test)."""
    setup = transformer_setup("llama")
    search = (PathSearch(max_candidates=3), setup.proxy) if path_search else None
    samples = first_tokens(lambda g: specdiff_tree_generate(setup.verifier, setup.drafter, setup.spec, TABLE_PROMPT, 2,
                                                            6, NEW_TOKENS, TEMPERATURE, generator=g,
                                                            path_search=search), seed=SEED, trials=DECODES)
    assert lossless_pvalue(samples, exact_joint(setup.verifier, TABLE_PROMPT, TEMPERATURE)) > ALPHA


def test_a_verifier_the_tree_mask_cannot_serve_is_refused():
    verifier = build("llama", 0)
    verifier.config._attn_implementation = "flex_attention"
    with pytest.raises(RecipeError, match="specdiff_tree"):
        specdiff_tree_generate(verifier, verifier, DrafterSpec(MASK, 1, "block_causal"), torch.tensor([[1, 2]]), 2, 4, 4)
    verifier = build("qwen2", 0)
    verifier.config.layer_types = ["chunked_attention"] * 2
    with pytest.raises(RecipeError, match="chunked_attention"):
        specdiff_tree_generate(verifier, verifier, DrafterSpec(MASK, 1, "block_causal"), torch.tensor([[1, 2]]), 2, 4, 4)


def test_draft_tree_ancestry():
    tree = DraftTree([1, 2, 3], [-1, 0, -1], [1, 2, 1], [0.0, 0.0, 0.0])
    assert tree.ancestors_allowed(torch.device("cpu")).int().tolist() == [
        [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]
