"""Every decoding method samples exactly the verifier's distribution at temperature > 0 (DESIGN §9), end to end.

A tiny random verifier over 8 tokens, made peaky so that its next-token distribution depends strongly on the prefix,
decodes the first 4 new tokens of one prompt many times. Their empirical joint is compared with the exact AR sampling
distribution p(t1) p(t2 | t1) p(t3 | t1, t2) p(t4 | t1, t2, t3), computed from the verifier's probabilities, by a
chi-square test.

t1 comes from the prefill. With γ = 1 the first iteration drafts t2 and, when it is accepted, t3 is the bonus token;
ADL starts at its maximum length, 2, so there t4 is the bonus. The bonus, the correction after a rejection and the
next iteration all land in the table: a bonus drawn from the wrong position fails (see the last test)"""

from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import align.decoding.acceptance as acceptance_module
from align.config import DecodeSection
from align.decoding.acceptance import accept_sampled
from align.decoding.cps import TrigramModel
from align.decoding.generation import Sampling
from align.decoding.sd_ar import sd_ar_generate
from align.methods import METHODS, Setup
from align.models import DrafterSpec

VOCAB, MASK, NEW_TOKENS, TRIALS = 8, 7, 4, 600
PROMPT = torch.tensor([[1, 5, 2]])
SAMPLING = Sampling(temperature=0.8, top_k=5)  # truncation too: the runtime must sample what it accepts against
# What our runtime implements; the HF baselines (hf_generate, hf_assisted, prompt_lookup) are HF's own sampling.
RUNTIME_METHODS = ["ar", "sd_ar", "specdiff", "specdiff2_select", "specdiff_cps", "specdiff_adl", "specdiff_cps_adl",
                   "specdiff_tree", "specdiff_cost", "specdiff_cps_cost", "specdiff_tree_cost",
                   "specdiff_cps_tree", "specdiff_cps_tree_cost"]


def peaky(seed):
    """A random 1-layer Llama whose logits are scaled up: a few likely tokens per prefix, different per prefix."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model


@pytest.fixture(scope="module")
def setup():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads cost more than they give
    decode = DecodeSection(gamma=1, max_new_tokens=NEW_TOKENS, temperature=SAMPLING.temperature,
                           top_k=SAMPLING.top_k, num_candidates=3, draft_temperature=1.5,
                           adl_min_len=1, adl_max_len=2, adl_delta=1)
    verifier = peaky(0)
    # CPS's causal proxy fitted on the verifier's own continuations (as eval does with trajectories), so that its
    # paths are often accepted whole and the bonus token shows in the table.
    with torch.inference_mode():
        stream = verifier.generate(PROMPT.expand(64, -1), max_new_tokens=32, do_sample=True, pad_token_id=0)
    proxy = TrigramModel.fit(stream.flatten().numpy(), VOCAB)
    # The cost-aware methods' costs fixed (a rising curve, so that they verify some nodes and not others): their
    # choices then depend on no clock.
    yield Setup(verifier=verifier, drafter=peaky(1), spec=DrafterSpec(MASK, 1, "block_causal"),
                ar_drafter=peaky(2), tokenizer=None, eos_ids=frozenset(), decode=decode, proxy=proxy,
                verify_costs=[1.0 + 0.3 * n for n in range(decode.tree_nodes + 1)], draft_cost=0.5)
    torch.set_num_threads(threads)


@torch.inference_mode()
def exact_joint(verifier, prompt, sampling):
    """(V,) * NEW_TOKENS: P(t1, ..., tL) when AR decoding samples from `sampling` applied to the verifier's logits."""
    n = prompt.shape[1]
    sequences = torch.cartesian_prod(*[torch.arange(VOCAB)] * NEW_TOKENS)  # every continuation, row-major
    ids = torch.cat([prompt.expand(len(sequences), -1), sequences], dim=1)
    probs = sampling.probs(verifier(input_ids=ids).logits)  # (V^L, n + L, V)
    joint = torch.ones(())
    for k in range(NEW_TOKENS):
        # p(t_k+1 | t_1..t_k) is read where t_k+1 is predicted; the tokens after it do not matter: take them as 0.
        step = probs[:, n - 1 + k].view(*[VOCAB] * NEW_TOKENS, VOCAB)[(slice(None),) * k + (0,) * (NEW_TOKENS - k)]
        joint = joint[..., None] * step
    return joint


def chi_square_pvalue(samples, joint):
    """samples: lists of NEW_TOKENS tokens; joint: their exact probabilities, (V,) * NEW_TOKENS."""
    counts = torch.zeros(joint.numel(), dtype=torch.float64)
    for tokens in samples:
        counts[sum(t * VOCAB ** (NEW_TOKENS - 1 - i) for i, t in enumerate(tokens))] += 1
    expected = joint.flatten().double() * len(samples)
    if counts[expected == 0].sum() > 0:
        return 0.0  # a sequence the verifier never samples was emitted
    small = expected < 5  # merge sparse cells so that the chi-square approximation holds
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    return float(torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2.0), stat / 2))


def first_tokens(decode, seed=0):
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(TRIALS):
        tokens, _ = decode(generator)
        assert len(tokens) == NEW_TOKENS
        samples.append(tokens)
    return samples


@pytest.mark.parametrize("method", RUNTIME_METHODS)
def test_every_method_samples_the_verifier_distribution(setup, method):
    samples = first_tokens(lambda g: METHODS[method](setup, PROMPT, SAMPLING, g))
    assert chi_square_pvalue(samples, exact_joint(setup.verifier, PROMPT, SAMPLING)) > 1e-3


def test_sd_ar_with_a_greedy_draft_and_a_sampling_verifier_is_lossless(setup):
    # The draft is the drafter's argmax (a point mass), whatever the verifier samples at.
    samples = first_tokens(lambda g: sd_ar_generate(setup.verifier, setup.ar_drafter, PROMPT, 1, NEW_TOKENS,
                                                    SAMPLING, draft_sampling=Sampling(), generator=g))
    assert chi_square_pvalue(samples, exact_joint(setup.verifier, PROMPT, SAMPLING)) > 1e-3


@pytest.mark.parametrize("method", ["specdiff_cost", "specdiff_cps_cost"])
def test_cost_aware_draft_lengths_are_lossless_when_sampling(setup, method):
    # γ = 3 with a curve on which each token costs a quarter of the first: the chosen length varies with the drafter's
    # confidence, so sampled drafts are cut (with their probabilities) to lengths chosen before the verifier's draw.
    sized = replace(setup, decode=setup.decode.model_copy(update={"gamma": 3}),
                    verify_costs=[1.0 + 0.25 * n for n in range(setup.decode.tree_nodes + 1)], draft_cost=0.0)
    lengths = set()

    def decode(generator):
        tokens, stats = METHODS[method](sized, PROMPT, SAMPLING, generator)
        lengths.update(stats.draft_lengths)
        return tokens, stats

    samples = first_tokens(decode)
    assert len(lengths) > 1  # the test sees drafts of several lengths
    assert chi_square_pvalue(samples, exact_joint(setup.verifier, PROMPT, SAMPLING)) > 1e-3


@pytest.mark.parametrize("method", ["specdiff", "specdiff_adl"])
def test_argmax_diffusion_drafts_are_lossless_when_sampling(setup, method):
    # decode.draft_choice=argmax: the drafter's most likely tokens, a point mass, accepted by the point-mass rule.
    argmax = replace(setup, decode=setup.decode.model_copy(update={"draft_choice": "argmax"}))
    samples = first_tokens(lambda g: METHODS[method](argmax, PROMPT, SAMPLING, g))
    assert chi_square_pvalue(samples, exact_joint(setup.verifier, PROMPT, SAMPLING)) > 1e-3


def test_a_bonus_from_the_wrong_position_fails(setup, monkeypatch):
    # The test has the power to see the bonus token: draw it from the last draft position's distribution instead.
    def wrong_bonus(draft_tokens, draft_probs, verifier_probs, generator=None):
        num_accepted, next_token = accept_sampled(draft_tokens, draft_probs, verifier_probs, generator)
        if num_accepted == len(draft_tokens):
            next_token = int(torch.multinomial(verifier_probs[num_accepted - 1], 1, generator=generator))
        return num_accepted, next_token

    monkeypatch.setattr(acceptance_module, "accept_sampled", wrong_bonus)
    samples = first_tokens(lambda g: METHODS["specdiff"](setup, PROMPT, SAMPLING, g))
    assert chi_square_pvalue(samples, exact_joint(setup.verifier, PROMPT, SAMPLING)) < 1e-6
