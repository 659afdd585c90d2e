"""custom_generate's union tree (issue 37 item 2): the drafter's best-first tree, the n-gram continuation and
SuffixDecoding's candidates from the suffix_index.npz beside the drafter, merged and verified in one forward, from
transformers alone (`union=True`).

Greedy, it decodes what align's own union tree decodes (TreeStep with the n-gram and suffix sources, unsized): the same
tokens and the same accepted lengths, iteration by iteration, which are generate()'s greedy tokens; on every verifier
family, past a sliding window. Sampled, tests/test_custom_generate.py runs its chi-square tests through the union too
(every setting of generate(), and full-attention and sliding-window verifiers), and tests/decoding/test_acceptance.py
the walk's point-mass rule. What it cannot verify exactly is refused in one line, before any work."""

import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from align.decoding.ar import ar_generate
from align.decoding.ngram import NgramLookup
from align.decoding.speculative import Decoding, speculative_generate
from align.decoding.suffix import SuffixIndex
from align.decoding.tree import TreeStep, ngram_source, suffix_source
from align.drafters.spec import DrafterSpec
from test_custom_generate import PROMPTS, SHIPPED, TINY
from test_verifier_families import FAMILIES, MASK as FAMILY_MASK, SLIDING_WINDOW, peaky as family_model

GAMMA, MAX_NEW_TOKENS = 8, 32


def aligns_union(verifier, drafter, prompt, gamma, num_nodes, max_new_tokens, index=None):
    """align's runtime: the union tree of the drafter and the model-free sources, at a fixed size (custom_generate's
    defaults: n-gram 4..1, suffix 16 nodes, a match of up to 8 tokens, a share of at least 0.1)."""
    sources = [(ngram_source(NgramLookup(4, 1)), None)]
    if index is not None:
        sources.append((suffix_source(index, 16, 8, 0.1), None))
    eos = verifier.generation_config.eos_token_id
    decoding = Decoding(gamma, max_new_tokens, eos_ids=frozenset([] if eos is None else [eos]))
    step = TreeStep(verifier, drafter, DrafterSpec(**drafter.config.drafter_spec), decoding, num_nodes,
                    sources=sources)
    return speculative_generate(verifier, prompt, step, decoding)


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """The tiny drafter as an export: custom_generate and a suffix index over the verifier's own greedy answers to two
    of the prompts (what `align export` writes when decode.suffix_corpus is set)."""
    folder = tmp_path_factory.mktemp("union") / "drafter"
    shutil.copytree(TINY / "drafter-base", folder)
    (folder / "custom_generate").mkdir()
    shutil.copy2(SHIPPED, folder / "custom_generate" / "generate.py")
    verifier = AutoModelForCausalLM.from_pretrained(TINY / "verifier", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(TINY / "verifier")
    documents = []
    for text in PROMPTS[:2]:
        ids = tokenizer(text, return_tensors="pt").input_ids
        documents.append(ids[0].tolist() + ar_generate(verifier, ids, 40)[0])
    SuffixIndex.build(documents).save(folder)
    return folder


def test_union_decodes_as_aligns_union_tree(tiny_export):
    # Through verifier.generate(custom_generate=folder), which finds the suffix index beside the drafter itself. The
    # drafter's tree has 4 nodes, so a step keeping more than 4 tokens kept copied candidates.
    verifier = AutoModelForCausalLM.from_pretrained(TINY / "verifier", dtype=torch.float32)
    drafter = AutoModelForCausalLM.from_pretrained(tiny_export, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(TINY / "verifier")
    index = SuffixIndex.load(tiny_export)
    kept = []
    for text in PROMPTS[:4]:
        prompt = tokenizer(text, return_tensors="pt").input_ids
        out = verifier.generate(prompt, assistant_model=drafter, custom_generate=str(tiny_export),
                                trust_remote_code=True, union=True, tree_nodes=4, gamma=GAMMA,
                                max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True)
        tokens, stats = aligns_union(verifier, drafter, prompt, GAMMA, 4, MAX_NEW_TOKENS, index)
        assert out.sequences[0].tolist() == prompt[0].tolist() + tokens
        assert out.accept_counts == stats.accept_counts
        greedy = verifier.generate(prompt, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        assert tokens == greedy[0, prompt.shape[1]:].tolist()
        kept += out.accept_counts
    assert max(kept) > 4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_union_on_every_verifier_family(family):
    # Full attention, Gemma 4's alternating layers and the three ways a config sets a sliding window, decoded past it:
    # each node's window over the cached prefix, and the kept branch's keys moved in the cache, as align's runtime.
    from align.custom_generate import generate

    verifier, drafter = family_model(FAMILIES[family], 9), family_model(FAMILIES["llama"], 8)
    verifier.generation_config.eos_token_id = None
    drafter.config.drafter_spec = DrafterSpec(FAMILY_MASK, 1, "block_causal").to_dict()
    prompt = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3]])  # something for the n-gram to copy
    out = generate(verifier, prompt, assistant_model=drafter, max_new_tokens=40, gamma=4, tree_nodes=6, union=True,
                   return_dict_in_generate=True)
    tokens, stats = aligns_union(verifier, drafter, prompt, 4, 6, 40)
    assert prompt.shape[1] + len(tokens) > 2 * SLIDING_WINDOW
    assert tokens == ar_generate(verifier, prompt, 40)[0]
    assert out.sequences[0].tolist() == prompt[0].tolist() + tokens
    assert out.accept_counts == stats.accept_counts


class IgnoresMasks(LlamaForCausalLM):
    """A verifier whose forward drops the mask it is handed and builds its own causal one (as some remote code does)."""

    def forward(self, *args, attention_mask=None, **kwargs):
        return super().forward(*args, **kwargs)


def one_line_refusal(match: str, **kwargs) -> None:
    from align.custom_generate import generate

    verifier, drafter = kwargs.pop("verifier", None), family_model(FAMILIES["llama"], 8)
    verifier = verifier if verifier is not None else family_model(FAMILIES["llama"], 9)
    drafter.config.drafter_spec = DrafterSpec(FAMILY_MASK, 1, "block_causal").to_dict()
    calls = []
    hook = drafter.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(ValueError, match=match) as refused:
            generate(verifier, torch.tensor([[1, 2, 3]]), assistant_model=drafter, max_new_tokens=8, **kwargs)
    finally:
        hook.remove()
    assert "\n" not in str(refused.value)
    assert not calls, "refused after the drafter ran"


def test_what_the_union_cannot_verify_exactly_is_refused_before_any_work(tmp_path):
    one_line_refusal("tree_nodes", union=True, tree_nodes=0)
    one_line_refusal("tree_nodes", union=True, tree_nodes=True)
    one_line_refusal("pass union=True", suffix_index=str(tmp_path))
    one_line_refusal("does not exist", union=True, suffix_index=str(tmp_path))
    np.savez(tmp_path / "suffix_index.npz", tokens=np.arange(4), suffixes=np.arange(4))  # no document end
    one_line_refusal("not a suffix index", union=True, suffix_index=str(tmp_path))

    flex = family_model(FAMILIES["llama"], 9)
    flex.config._attn_implementation = "flex_attention"
    one_line_refusal("attn_implementation", union=True, verifier=flex)
    torch.manual_seed(9)
    ignoring = IgnoresMasks(FAMILIES["llama"]().config).eval()
    one_line_refusal("ignores the 4-D attention mask", union=True, verifier=ignoring)
    chunked = family_model(FAMILIES["qwen2"], 9)
    chunked.config.layer_types = ["chunked_attention"] * 2
    one_line_refusal("verifier has chunked_attention", union=True, verifier=chunked)
