"""Verifiers of the families users serve (Llama, Qwen2, Qwen3, Gemma 4 text, Mistral, Phi-3), tiny and random, built
in the test: every speculative method's greedy output is token-identical to AR greedy and to HF `generate()`, also
past a sliding window, in each of the three ways a config sets one: `layer_types` (Gemma 4 alternates sliding and
full attention), `sliding_window` alone (Mistral-7B-v0.1, Phi-3-mini: every layer slides) and Qwen2's
`use_sliding_window` (layers from `max_window_layers` on slide); and so are they with a block-causal drafter whose own
layers slide."""

from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from transformers import (Gemma4ForCausalLM, Gemma4TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Phi3Config, Phi3ForCausalLM, PreTrainedModel, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from align.config import DecodeSection
from align.decoding.ar import ar_generate
from align.decoding.generation import Sampling
from align.decoding.path_search import TrigramModel
from align.drafters.spec import DrafterSpec
from align.methods import METHODS, Setup
from align.models import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
VOCAB, MASK, NEW_TOKENS, SLIDING_WINDOW = 64, 63, 40, 16
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


def families(sliding_window: int) -> dict[str, Callable[[], PreTrainedModel]]:
    """A tiny random model of each verifier family, built when called; those named after a sliding window use this
    one (Gemma 4 and Qwen2's second layer slide, Mistral's and Phi-3's every layer, set by `sliding_window` alone)."""
    return {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),
        "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=8)),
        # Per-layer input sizes set small: their defaults make a 136M model.
        "gemma4": lambda: Gemma4ForCausalLM(Gemma4TextConfig(
            **COMMON, head_dim=8, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
            sliding_window=sliding_window, layer_types=["sliding_attention", "full_attention"])),
        "mistral_sliding": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=sliding_window)),
        # Phi-3's default special tokens (32000) lie outside this vocabulary.
        "phi3_sliding": lambda: Phi3ForCausalLM(Phi3Config(**COMMON, sliding_window=sliding_window, pad_token_id=None,
                                                           bos_token_id=None, eos_token_id=None)),
        "qwen2_sliding": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON, use_sliding_window=True,
                                                              sliding_window=sliding_window, max_window_layers=1)),
    }


FAMILIES = families(SLIDING_WINDOW)
# The families added for the ways a config sets a window run the second prompt only (the one on which Phi-3's tree
# decoding went wrong): the methods' code is the other families', only the masks differ, and tests/decoding/test_tree.py
# checks those node by node.
WINDOW_FAMILIES = {"mistral_sliding", "phi3_sliding", "qwen2_sliding"}
PROMPTS = (torch.tensor([[1, 2, 3, 4, 5]]), torch.tensor([[7, 8, 9]]))
SPECULATIVE = ["sd_ar", "specdiff", "specdiff2_select", "specdiff_cps", "specdiff_adl", "specdiff_cps_adl",
               "specdiff_tree", "specdiff_cost", "specdiff_cps_cost", "specdiff_tree_cost", "specdiff_cps_tree",
               "specdiff_cps_tree_cost", "ngram", "ngram_cost", "specdiff_ngram_tree", "specdiff_ngram_tree_cost",
               "specdiff_cps_ngram_tree_cost"]


def peaky(build, seed):
    torch.manual_seed(seed)
    model = build().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)  # structured preferences, so that some drafts are accepted
    return model


@pytest.fixture(scope="module")
def drafters():
    proxy = TrigramModel.fit(np.random.default_rng(0).integers(0, VOCAB, 2000), VOCAB)
    return peaky(FAMILIES["llama"], 9), peaky(FAMILIES["llama"], 8), proxy


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_outputs_equal_ar_for_every_verifier_family(family, drafters):
    drafter, ar_drafter, proxy = drafters
    verifier = peaky(FAMILIES[family], 1)
    decode = DecodeSection(gamma=4, max_new_tokens=NEW_TOKENS, num_candidates=3)
    for shift in (0, 1):
        setup = Setup(verifier, drafter, DrafterSpec(MASK, shift, "block_causal"), ar_drafter, None, frozenset(),
                      decode, proxy, verify_costs=[1.0 + 0.3 * n for n in range(decode.tree_nodes + 1)], draft_cost=0.5)
        for prompt in PROMPTS[1:] if family in WINDOW_FAMILIES else PROMPTS:
            expected = ar_generate(verifier, prompt, NEW_TOKENS)[0]
            assert len(prompt[0]) + len(expected) > SLIDING_WINDOW
            hf = verifier.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[0, prompt.shape[1]:].tolist()
            assert hf == expected
            for name in SPECULATIVE:
                assert METHODS[name](setup, prompt, Sampling(), None)[0] == expected, (family, shift, name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_hf_baselines_equal_ar_for_every_verifier_family(family, drafters):
    # HF's generate, assisted generation (the AR drafter) and prompt lookup, as align eval runs them. The tiny
    # tokenizer's pad token is 1, which the first prompt holds: generate() infers an attention mask hiding it unless
    # it is given one, and decoded another prompt than the verifier's (issue 22: every method decodes as AR does).
    _, ar_drafter, proxy = drafters
    tokenizer = load_tokenizer(str(ROOT / "checkpoints" / "tiny" / "tokenizer"))
    assert tokenizer.pad_token_id in PROMPTS[0][0].tolist()
    verifier = peaky(FAMILIES[family], 1)
    new_tokens = SLIDING_WINDOW  # prompt and output past the window
    setup = Setup(verifier, None, DrafterSpec(MASK, 1, "block_causal"), ar_drafter, tokenizer, frozenset(),
                  DecodeSection(gamma=4, max_new_tokens=new_tokens), proxy)
    prompt = PROMPTS[0]
    expected = ar_generate(verifier, prompt, new_tokens)[0]
    for name in ("hf_generate", "hf_assisted", "prompt_lookup"):
        assert METHODS[name](setup, prompt, Sampling(), None)[0] == expected, (family, name)


def test_the_hf_baselines_decode_the_same_target_whatever_the_verifiers_generation_config(drafters):
    """Instruct models ship generation_config.json settings (Qwen2.5's a repetition penalty); transformers fills every
    setting a generate() call leaves unset from it, so HF's rows decoded another target than align's loops (issue 33).
    The baselines are handed none of them, eval.json lists them, and the model's own config is left as it was."""
    from align.methods import ignored_generation_settings

    _, ar_drafter, proxy = drafters
    tokenizer = load_tokenizer(str(ROOT / "checkpoints" / "tiny" / "tokenizer"))
    verifier = peaky(FAMILIES["llama"], 1)
    settings = dict(repetition_penalty=1.5, no_repeat_ngram_size=2, min_new_tokens=NEW_TOKENS)
    verifier.generation_config.update(**settings)
    prompt = PROMPTS[0]
    expected = ar_generate(verifier, prompt, NEW_TOKENS)[0]
    plain = verifier.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                              do_sample=False)[0, prompt.shape[1]:].tolist()
    assert plain != expected  # what generate() alone decodes under those settings: another target
    setup = Setup(verifier, None, DrafterSpec(MASK, 1, "block_causal"), ar_drafter, tokenizer, frozenset(),
                  DecodeSection(gamma=4, max_new_tokens=NEW_TOKENS), proxy)
    for name in ("hf_generate", "hf_assisted", "prompt_lookup"):
        assert METHODS[name](setup, prompt, Sampling(), None)[0] == expected, name
    assert ignored_generation_settings(verifier) == settings
    assert verifier.generation_config.repetition_penalty == 1.5  # restored after each call


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral_sliding", "qwen2_sliding"])
def test_greedy_outputs_equal_ar_with_a_sliding_window_drafter(family, drafters):
    # A block-causal drafter whose layers slide: once the context passes its window, its context cache hands its
    # sliding layers only the window's keys, and its block mask must be sized and windowed to match (it crashed).
    _, ar_drafter, proxy = drafters
    drafter, verifier = peaky(FAMILIES[family], 9), peaky(FAMILIES["llama"], 1)
    decode = DecodeSection(gamma=4, max_new_tokens=NEW_TOKENS, num_candidates=3)
    prompt = PROMPTS[0]
    expected = ar_generate(verifier, prompt, NEW_TOKENS)[0]
    assert len(prompt[0]) + len(expected) > SLIDING_WINDOW
    setup = Setup(verifier, drafter, DrafterSpec(MASK, 1, "block_causal"), ar_drafter, None, frozenset(), decode,
                  proxy, verify_costs=[1.0 + 0.3 * n for n in range(decode.tree_nodes + 1)], draft_cost=0.5)
    for name in SPECULATIVE:
        assert METHODS[name](setup, prompt, Sampling(), None)[0] == expected, (family, name)
