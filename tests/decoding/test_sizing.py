"""Cost-aware draft sizes (align/decoding/sizing.py): the cost curve, the choice, the calibration, and the methods
that use them (specdiff_cost, specdiff_cps_cost, specdiff_tree_cost) staying exact."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from align.config import DecodeSection
from align.decoding.ar import ar_generate
from align.decoding.generation import Sampling
from align.decoding.path_search import TrigramModel
from align.decoding.sizing import CostAwareSize, DrafterGate, measure_verify_costs, non_decreasing
from align.drafters.spec import DrafterSpec
from align.methods import METHODS, Setup

VOCAB, MASK = 16, 15
COST_METHODS = ["specdiff_cost", "specdiff_cps_cost", "specdiff_tree_cost"]


def tiny(seed: int, scale: float = 4.0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)  # structured preferences, so that some drafts are accepted
    return model


def test_non_decreasing_pools_what_falls():
    assert non_decreasing([1.0, 3.0, 2.0, 2.0, 5.0, 4.0, 6.0]) == pytest.approx([1, 7 / 3, 7 / 3, 7 / 3, 4.5, 4.5, 6])
    assert non_decreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    # One slow outlier is averaged with its neighbours, not spread over every larger size.
    assert non_decreasing([1.0, 9.0, 1.1, 1.2, 1.3])[-1] < 5.0


def test_measured_curve_covers_every_size_and_never_falls():
    costs = measure_verify_costs(tiny(0), context_len=5, max_tokens=24, rounds=2)
    assert len(costs) == 24 and all(c > 0 for c in costs)
    assert all(b >= a for a, b in zip(costs, costs[1:]))


def test_a_flat_curve_verifies_every_likely_node_and_a_steep_one_few():
    scores = [math.log(0.9) * (k + 1) for k in range(8)]  # a path the drafter is sure of: 0.9, 0.81, ...
    depths = list(range(1, 9))
    flat = CostAwareSize([1.0] * 9, draft_s=0.5)
    assert flat.choose(scores, depths, draft_s=0.0) == 8  # more tokens cost nothing: verify all
    steep = CostAwareSize([float(n) for n in range(1, 10)], draft_s=0.0)  # every token costs as much as the first
    # (1 + Σ gains) / (n + 1) is best at n = 1 when every gain is below 1.
    assert steep.choose(scores, depths, draft_s=0.0) == 1
    unsure = CostAwareSize([1.0 + 0.5 * n for n in range(9)], draft_s=0.2)
    sure = unsure.choose(scores, depths, draft_s=0.0)
    assert 1 < sure < 8
    assert unsure.choose([math.log(0.2) * (k + 1) for k in range(8)], depths, draft_s=0.0) < sure
    # Each choice is recorded, and the fixed drafter cost is used over the measured one.
    assert len(unsure.chosen) == 2 and unsure.chosen[0] == sure and unsure.measured_draft_s == [0.0, 0.0]


def test_the_drafter_gate_takes_the_faster_arm_per_bucket_and_keeps_trying_the_other():
    gate = DrafterGate(explore_every=4)
    assert [gate.bucket(e) for e in (0.0, 0.3, 1.5, 5.0)] == [0, 1, 2, 3]
    assert gate.run_drafter(3)  # the drafter first,
    gate.record(3, True, 1.0)
    assert not gate.run_drafter(3)  # then once without it
    gate.record(3, False, 2.0)  # long candidates alone: twice the tokens per second
    assert [gate.run_drafter(3) for _ in range(8)] == [False, False, False, True] * 2
    gate.record(0, True, 1.5)
    gate.record(0, False, 1.0)  # no candidates: the drafter pays, and the other bucket does not change that
    assert [gate.run_drafter(0) for _ in range(4)] == [True, True, True, False]
    for _ in range(30):  # the arms' estimates follow the generation: the drafter has become the faster one
        gate.record(3, True, 3.0)
    assert gate.run_drafter(3)


def test_calibration_learns_an_overconfident_drafter():
    size = CostAwareSize([1.0 + 0.5 * n for n in range(9)], draft_s=0.2)
    scores, depths = [math.log(0.95) * (k + 1) for k in range(8)], list(range(1, 9))
    before = size.choose(scores, depths, 0.0)
    assert size.calibration(1) == pytest.approx(1.0)
    for _ in range(20):  # the drafter says 95 %, the verifier rejects the first token every time
        size.update(scores[:before], depths[:before], num_accepted=0)
    assert size.calibration(1) < 0.2 and size.calibration(5) < 0.2  # deeper depths follow the pooled ratio
    assert size.choose(scores, depths, 0.0) < before
    for _ in range(40):  # then it is right every time: the estimate recovers
        size.update(scores[:4], depths[:4], num_accepted=4)
    assert size.calibration(1) > 0.8


@pytest.fixture(scope="module")
def models():
    proxy = TrigramModel.fit(np.random.default_rng(0).integers(0, VOCAB, 2000), VOCAB)
    return tiny(1), tiny(2), proxy


@pytest.mark.slow
@pytest.mark.parametrize("name", COST_METHODS)
@pytest.mark.parametrize("curve", ["flat", "steep"])
def test_cost_aware_methods_equal_ar_greedy_and_follow_the_curve(models, name, curve):
    verifier, drafter, proxy = models
    decode = DecodeSection(gamma=4, max_new_tokens=24, tree_nodes=6)
    costs = [1.0] * 7 if curve == "flat" else [float(n) for n in range(1, 8)]
    setup = Setup(verifier, drafter, DrafterSpec(MASK, 1, "block_causal"), None, None, frozenset(), decode, proxy,
                  verify_costs=costs, draft_cost=0.0)
    for prompt in (torch.tensor([[1, 2, 3, 4, 5]]), torch.tensor([[7, 8, 9]])):
        tokens, stats = METHODS[name](setup, prompt, Sampling(), None)
        assert tokens == ar_generate(verifier, prompt, decode.max_new_tokens)[0], (name, curve)
        sizes = stats.tree_nodes or stats.draft_lengths
        if curve == "steep":  # every token costs as much as the first: one draft token per forward
            assert set(sizes) == {1}, (name, sizes)
        else:  # all the room there is (less only where max_new_tokens leaves less)
            assert max(sizes) == (6 if name.endswith("tree_cost") else 4), (name, sizes)


def test_the_cost_curve_is_measured_once_and_kept(models):
    verifier, drafter, proxy = models
    setup = Setup(verifier, drafter, DrafterSpec(MASK, 1, "block_causal"), None, None, frozenset(),
                  DecodeSection(gamma=3, max_new_tokens=6, tree_nodes=5), proxy)
    METHODS["specdiff_cost"](setup, torch.tensor([[1, 2, 3]]), Sampling(), None)
    curve = setup.verify_costs
    assert curve is not None and len(curve) == 6  # the larger of γ and the tree's nodes, and the root
    METHODS["specdiff_tree_cost"](setup, torch.tensor([[1, 2, 3]]), Sampling(), None)
    assert setup.verify_costs is curve
    bigger = replace(setup, decode=setup.decode.model_copy(update={"tree_nodes": 9}))
    METHODS["specdiff_tree_cost"](bigger, torch.tensor([[1, 2, 3]]), Sampling(), None)
    assert len(bigger.verify_costs) == 10  # a larger tree needs more of the curve: measured again



def test_verify_costs_writes_a_curve_per_model_and_refuses_an_unknown_one_in_one_line(tmp_path, capsys):
    """`align verify-costs` (what a GPU's curve looks like, for choosing tree sizes): one non-decreasing curve of
    --max-tokens sizes per model, with the machine; a name that is no architecture and no config is refused in one
    line, exit 2, before any model is built. Timings are not checked: they are the benchmark's output, not behaviour."""
    import json

    from align.cli import main

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    config.save_pretrained(tmp_path / "tiny")
    out = tmp_path / "costs.json"
    assert main(["verify-costs", str(tmp_path / "tiny"), "--context", "8", "--max-tokens", "5", "--rounds", "1",
                 "--dtype", "float32", "--device", "cpu", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    curve = report["models"][str(tmp_path / "tiny")]["verify_s"]
    assert len(curve) == 5 and curve == sorted(curve) and curve[0] > 0
    assert report["machine"]["device"] == "cpu" and report["context_len"] == 8
    assert f"{tmp_path / 'tiny'} (0 M parameters, float32, cpu) ms at n = 1: " in capsys.readouterr().out
    assert main(["verify-costs", "qwen2.5-7b", str(tmp_path / "nothing-here")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing-here: neither a named architecture (qwen2.5-1.5b, qwen2.5-7b" in err[0]
    for device in ("gpu0", *(() if torch.cuda.is_available() else ("cuda",))):
        assert main(["verify-costs", str(tmp_path / "tiny"), "--device", device]) == 2
        assert f"--device {device}: not a device this machine has" in capsys.readouterr().err


@pytest.mark.slow
def test_a_sampled_drafts_length_is_chosen_before_it_is_drawn():
    """Issue 22, defect 1: specdiff_cost with sampled drafts chose the length from the drafted tokens' own drafter
    probabilities, so on the adversarial construction of test_sampling_lossless (position 2 worth verifying only if
    it drew token A, which it does 6 times in 10) the first draft was 2 tokens long only when it held A there. Chosen
    from q alone, the length is the same whatever was drawn: 2, the argmax draft's (which holds A)."""
    from test_sampling_lossless import adversarial_cost_setup

    setup = adversarial_cost_setup()
    first_lengths = set()
    for seed in range(100):
        _, stats = METHODS["specdiff_cost"](setup, torch.tensor([[1, 2]]), Sampling(temperature=1.0),
                                            torch.Generator().manual_seed(seed))
        first_lengths.add(stats.draft_lengths[0])
    assert first_lengths == {2}
