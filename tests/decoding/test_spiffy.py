"""Spiffy: the draft graph's structure, calibration's search, and outputs identical to vanilla dLLM decoding."""

import json
import shutil
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from align.config import RecipeError
from align.decoding.dllm import dllm_generate, unmask, BlockTrace, StepRanks
from align.decoding.spiffy import spiffy_generate
from align.draft_graph import (DraftGraph, apply_formula, calibrate, count_formulas, exhaustive_select,
                               formula_between, objective, prune, ranked_positions, replayed_forwards,
                               select_nodes, trace_chains)
from align.drafters.spec import DrafterSpec

VOCAB, MASK = 40, 39
F = lambda *pairs: frozenset(pairs)  # noqa: E731


def test_parents_on_hand_made_cases():
    graph = DraftGraph((F((1, 1)), F((2, 1)), F((1, 1), (2, 1)), F((1, 2)), F((1, 1), (2, 1), (3, 1))), block_length=8)
    assert graph.parents(0) == [-1] and graph.parents(1) == [-1] and graph.parents(3) == [-1]
    assert graph.parents(2) == [0, 1]  # two parents: the order of unmasking is free
    assert graph.parents(4) == [2]


def test_objective_and_greedy_against_exhaustive():
    counts = Counter({F((1, 1)): 10, F((2, 1)): 6, F((1, 1), (2, 1)): 5, F((1, 2)): 4, F((1, 2), (2, 1)): 3,
                      F((1, 1), (2, 1), (3, 1)): 2, F((3, 1)): 1})
    # By hand: {(1,1)}, {(2,1)}, {(1,1),(2,1)}: 10 + 6 + (5 + 10 + 6) = 37.
    assert objective([F((1, 1)), F((2, 1)), F((1, 1), (2, 1))], counts, 1) == 37
    for budget in (1, 2, 3, 4, 5):
        chosen = select_nodes(counts, budget)
        assert len(chosen) == budget
        assert objective(chosen, counts, 1) == exhaustive_select(counts, budget)


def test_formulas_round_trip_states():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(6, VOCAB) * 3, -1)
    ranks = StepRanks.of(probs, 3)
    block = torch.tensor([MASK, 5, MASK, MASK, 7, MASK])
    formula = F((1, 1), (3, 2))
    later = apply_formula(block, ranks, formula, MASK)
    assert int((later == MASK).sum()) == 2
    confident = int(probs.max(-1).values.masked_fill(block != MASK, -1).argmax())
    assert later[confident] == probs[confident].argmax()  # (1, 1): the most confident position, its top token
    assert formula_between(block, later, ranks, MASK, 8, 3) == formula
    assert formula_between(block, later, ranks, MASK, 2, 3) is None  # position rank 3 is beyond the limit
    assert formula_between(block, later, ranks, MASK, 8, 1) is None  # token rank 2 is beyond the limit
    assert apply_formula(block, ranks, F((5, 1)), MASK) is None  # only 4 masked positions
    assert apply_formula(block, ranks, F((1, 4)), MASK) is None  # only 3 tokens ranked


def test_position_orders_on_a_hand_made_case():
    probs = torch.full((6, VOCAB), 0.01)
    probs[:, 0] = torch.tensor([0.2, 0.0, 0.9, 0.3, 0.0, 0.5])  # confidence of positions 0..5
    ranks = StepRanks.of(probs, 2)
    previous = torch.tensor([MASK, MASK, MASK, MASK, MASK, MASK])
    block = torch.tensor([MASK, 5, MASK, MASK, 7, MASK])  # the last step unmasked positions 1 and 4
    assert ranked_positions(block, ranks, MASK) == [2, 5, 3, 0]
    # Distance to the nearest newly unmasked position: 2 -> 1 (right of 1), 5 -> 1 (right of 4), 3 -> 1 (left of 4),
    # 0 -> 1 (left of 1); right before left, then leftmost.
    assert ranked_positions(block, ranks, MASK, "nearest", previous) == [2, 5, 0, 3]
    with pytest.raises(ValueError, match="previous state"):
        ranked_positions(block, ranks, MASK, "nearest")


def left_to_right_trace() -> BlockTrace:
    """A block of 4 decoded left to right, as a local dLLM does: at state k position k is the most confident (0.5 on
    token 10 + k); the other masked positions are less confident the further left they are."""
    states, ranks = [torch.tensor([MASK] * 4)], []
    for k in range(4):
        step = torch.full((4, VOCAB), 0.01)
        for pos in range(4):
            step[pos, 10 + pos] = 0.5 if pos == k else 0.1 + 0.05 * pos
        ranks.append(StepRanks.of(step, 8))
        states.append(unmask(states[-1], step, MASK, 1))
    assert states[-1].tolist() == [10, 11, 12, 13]
    return BlockTrace(states, ranks)


def test_replayed_forwards_on_a_hand_made_trace():
    trace = left_to_right_trace()
    # Nearest order: every later state is "the next positions to the right, their top-1 tokens".
    chains = trace_chains([trace], MASK, 3, 8, 3, "nearest")
    assert chains[0] == [[], [F((1, 1)), F((1, 1), (2, 1)), F((1, 1), (2, 1), (3, 1))],
                         [F((1, 1)), F((1, 1), (2, 1))], [F((1, 1))]]
    assert count_formulas(chains)[F((1, 1))] == 3
    assert replayed_forwards(chains, []) == 4  # vanilla: one forward per state
    assert replayed_forwards(chains, [F((1, 1))]) == 3  # forwards at states 0, 1 (2 is free) and 3
    assert replayed_forwards(chains, [F((1, 1)), F((1, 1), (2, 1))]) == 2  # states 2 and 3 free
    # Confidence order: the previous step ranks the rightmost position first, so the same moves get other formulas.
    assert trace_chains([trace], MASK, 3, 8, 3, "confidence")[0][1] == [F((3, 1)), F((3, 1), (2, 1)),
                                                                       F((3, 1), (2, 1), (1, 1))]
    # Calibration keeps the order that saves more forwards on the traces.
    for objective_name in ("degree1", "simulated"):
        graph = calibrate([trace], MASK, block_length=4, budget=2, objective_name=objective_name)
        assert graph.position_order == "nearest" and graph.nodes == (F((1, 1)), F((1, 1), (2, 1)))
        assert graph.meta["replayed_nfe_reduction"]["nearest"] == 2.0
        assert graph.meta["replayed_nfe_reduction"]["confidence"] < 2.0


def test_dynamic_pruning_keeps_likely_reachable_nodes():
    graph = DraftGraph((F((1, 1)), F((2, 1)), F((1, 1), (2, 1)), F((3, 1))), block_length=4)
    probs = torch.full((4, VOCAB), 0.01)
    probs[0, 5], probs[1, 6], probs[2, 7] = 0.3, 0.2, 0.9  # by confidence: position 2, then 0, then 1
    block = torch.tensor([MASK, MASK, MASK, 9])
    ranks = StepRanks.of(probs, 2)
    positions = ranked_positions(block, ranks, MASK)
    assert positions == [2, 0, 1]
    # (1, 1) has probability 0.9, (2, 1) 0.3, (3, 1) 0.2; the pair's geometric mean sqrt(0.27) beats (2, 1) alone.
    assert prune(graph, ranks, positions, 1) == [F((1, 1))]
    assert prune(graph, ranks, positions, 2) == [F((1, 1)), F((1, 1), (2, 1))]
    assert prune(graph, ranks, positions, 3) == [F((1, 1)), F((1, 1), (2, 1)), F((2, 1))]
    assert prune(graph, ranks, positions[:2], 9) == [F((1, 1)), F((1, 1), (2, 1)), F((2, 1))]  # no 3rd position
    # A node is never kept without one of its parents, however likely.
    chain = DraftGraph((F((2, 1)), F((1, 1), (2, 1))), block_length=4)
    assert prune(chain, ranks, positions, 1) == [F((2, 1))]
    assert prune(chain, ranks, positions, 2) == [F((2, 1)), F((1, 1), (2, 1))]


def test_unmask_rules():
    probs = torch.full((4, VOCAB), 0.01)
    probs[0, 3], probs[1, 4], probs[2, 5], probs[3, 6] = 0.5, 0.9, 0.95, 0.2
    block = torch.tensor([MASK, MASK, 9, MASK])
    assert unmask(block, probs, MASK, 1).tolist() == [MASK, 4, 9, MASK]  # position 2 is already unmasked
    assert unmask(block, probs, MASK, 2).tolist() == [3, 4, 9, MASK]
    assert unmask(block, probs, MASK, 1, threshold=0.4).tolist() == [3, 4, 9, MASK]
    assert unmask(block, probs, MASK, 1, threshold=0.99).tolist() == [MASK, 4, 9, MASK]  # at least one


def test_graph_file_round_trip_and_refusals(tmp_path):
    graph = DraftGraph((F((1, 1)), F((1, 1), (2, 1))), block_length=16, counts=(9, 4), meta={"model": "x"})
    path = tmp_path / "draft_graph.json"
    graph.save(path)
    assert DraftGraph.load(path, block_length=16) == graph
    with pytest.raises(RecipeError, match="block length 16, decoding uses 32"):
        DraftGraph.load(path, block_length=32)
    raw = json.loads(path.read_text())
    for change, message in [({"version": 1}, "version 1, expected 2"), ({"budget": 5}, "budget 5 does not match"),
                            ({"position_order": "random"}, "position_order 'random' is not one of"),
                            ({"nodes": [[[1, 1]], [[2, 1], [3, 1]]]}, "node 1 has no parent"),
                            ({"nodes": "nope"}, "malformed nodes")]:
        path.write_text(json.dumps({**raw, **change}))
        with pytest.raises(RecipeError, match=message):
            DraftGraph.load(path)
    path.write_text("{not json")
    with pytest.raises(RecipeError, match="not a readable JSON"):
        DraftGraph.load(path)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads cost more than they give
    yield
    torch.set_num_threads(threads)


ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def tiny_dllm(arch, bidirectional, seed):
    config_class, model_class = ARCHS[arch]
    torch.manual_seed(seed)
    config = config_class(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if bidirectional:
        config.is_causal = False
    model = model_class(config).eval()
    # Sharpen the output so that the model has confident, structured preferences (as a trained dLLM does), which is
    # what makes drafts match; random weights alone give near-uniform distributions.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("arch, shift, attention", [
    ("llama", 0, "block_causal"), ("qwen2", 1, "block_causal"), ("llama", 0, "bidirectional"),
    ("qwen2", 1, "bidirectional"),
])
def test_spiffy_outputs_equal_vanilla(arch, shift, attention, one_thread):
    model = tiny_dllm(arch, attention == "bidirectional", seed=0)
    spec = DrafterSpec(MASK, shift, attention)
    prompts = [torch.tensor([[1, 2, 3, 4]]), torch.tensor([[7, 7, 8]]), torch.tensor([[11, 3, 5, 9, 2]])]
    traces = []
    for prompt in prompts:
        dllm_generate(model, spec, prompt, 16, 8, trace=traces)
    graph = calibrate(traces, MASK, block_length=8, budget=5)
    assert graph.budget == 5 and all(graph.parents(k) for k in range(graph.budget))
    total_vanilla, total_spiffy = 0, 0
    for prompt in [torch.tensor([[2, 2, 6]]), torch.tensor([[30, 1]]), *prompts]:
        for threshold in (None, 0.5):
            expected, vanilla = dllm_generate(model, spec, prompt, 16, 8, threshold=threshold)
            tokens, stats = spiffy_generate(model, spec, prompt, graph, 16, threshold=threshold)
            assert tokens == expected, (prompt.tolist(), threshold)
            pruned, pruned_stats = spiffy_generate(model, spec, prompt, graph, 16, threshold=threshold, active=2)
            assert pruned == expected and pruned_stats.nfe <= vanilla.nfe, (prompt.tolist(), threshold)
            # Each step is a block forward or an accepted draft (a block-causal model's context-cache extension rides
            # in the block's first forward; an encoder-decoder's would be counted in context_forwards).
            assert stats.nfe - stats.context_forwards + stats.accepted_drafts == stats.steps == vanilla.steps
            assert stats.context_forwards == vanilla.context_forwards
            total_vanilla, total_spiffy = total_vanilla + vanilla.nfe, total_spiffy + stats.nfe
    assert total_spiffy < total_vanilla  # the graph does save forwards on these models


@pytest.mark.slow
def test_calibrate_and_dllm_eval_stages(toy_family, tmp_path, capsys):
    from align.cli import main

    root, _ = toy_family
    common = [f"drafter.path={root / 'ck' / 'drafter-base'}", f"data.dir={root / 'data'}", "calibrate.block_length=8",
              "decode.max_new_tokens=16"]
    assert main(["calibrate", "recipes/tiny/spiffy.yaml", *common, f"calibrate.out={tmp_path}", "calibrate.num_prompts=3",
                 "calibrate.budget=4"]) == 0
    # 3 prompts run, as asked, and it is said that a graph from so few may fit them alone (issue 35)
    assert "align calibrate: warning: 3 prompt(s) to calibrate from" in capsys.readouterr().err
    graph = DraftGraph.load(tmp_path / "draft_graph.json", block_length=8)
    assert graph.budget == 4 and graph.meta["num_prompts"] == 3 and graph.meta["prompts"].endswith("train.jsonl")
    out = tmp_path / "eval"
    assert main(["eval", "recipes/tiny/spiffy.yaml", *common, f"calibrate.graph={tmp_path / 'draft_graph.json'}",
                 f"eval.out={out}", "eval.num_prompts=2", "eval.warmup=0", "eval.spiffy_budgets=[2,4]",
                 "eval.spiffy_active=[1]"]) == 0
    result = json.loads((out / "eval.json").read_text())
    assert set(result["methods"]) == {"vanilla", "threshold", "spiffy_d2", "threshold_spiffy_d2", "spiffy_d4",
                                      "threshold_spiffy_d4", "pruned_spiffy_d4_a1"}
    assert result["meta"]["position_order"] == graph.position_order
    report = (out / "report.md").read_text()
    assert "Vanilla output for the first prompt" in report
    # Spiffy's batched forward is not bitwise the single forward: what is claimed is what was measured.
    claim = result["meta"]["exactness"]
    assert claim.startswith("identical outputs measured: 10/10 runs") and "exact:" not in claim
    assert claim in report
    for name, m in result["methods"].items():
        assert m["exact_match"] == 1.0, name
        assert m["nfe_reduction"] >= 1.0 and m["nfe"] > 0
        # The block-causal drafter extends its context cache inside each block's first forward: no forward of its own.
        assert m["context_forwards"] == sum(r["context_forwards"] for r in m["records"]) == 0, name
    # A budget the graph cannot serve, and a graph for another block length, are refused before any work.
    capsys.readouterr()
    assert main(["eval", "recipes/tiny/spiffy.yaml", *common, f"calibrate.graph={tmp_path / 'draft_graph.json'}",
                 f"eval.out={out}", "eval.spiffy_budgets=[9]"]) == 2
    assert "9 is not in 1..4" in capsys.readouterr().err
    assert main(["eval", "recipes/tiny/spiffy.yaml", *common, f"calibrate.graph={tmp_path / 'draft_graph.json'}",
                 "calibrate.block_length=16", f"eval.out={out}"]) == 2
    assert "calibrated for block length 8, decoding uses 16" in capsys.readouterr().err
    # A graph calibrated on other weights (the drafter trained further, here one weight moved) is refused before any
    # work, by eval and by export (issue 35: it was exported and used without a word).
    from safetensors.torch import load_file, save_file

    from align.checkpoint import weights_sha256

    assert graph.meta["drafter_weights_sha256"] == weights_sha256(root / "ck" / "drafter-base")
    moved = shutil.copytree(root / "ck" / "drafter-base", tmp_path / "drafter-moved")
    weights = load_file(moved / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1e-3
    save_file(weights, moved / "model.safetensors", metadata={"format": "pt"})
    (moved / "sha256.json").unlink(missing_ok=True)
    other = [f"drafter.path={moved}", *common[1:], f"calibrate.graph={tmp_path / 'draft_graph.json'}"]
    assert main(["eval", "recipes/tiny/spiffy.yaml", *other, f"eval.out={tmp_path / 'eval-other'}"]) == 2
    assert "was calibrated on the drafter" in capsys.readouterr().err
    assert main(["export", "recipes/tiny/spiffy.yaml", *other, f"export.out={tmp_path / 'export'}"]) == 2
    assert "was calibrated on the drafter" in capsys.readouterr().err
    assert not (tmp_path / "eval-other").exists() and not (tmp_path / "export").exists()


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_nfe_counts_every_model_forward(attention, one_thread):
    # Every model call is an NFE; a block-causal model's context-cache extension rides in its block's first one.
    model = tiny_dllm("llama", attention == "bidirectional", seed=0)
    spec = DrafterSpec(MASK, 1, attention)
    prompt = torch.tensor([[1, 2, 3, 4]])
    traces = []
    dllm_generate(model, spec, prompt, 16, 8, trace=traces)
    graph = calibrate(traces, MASK, block_length=8, budget=3)
    forwards = [0]
    handle = model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    try:
        for decode in (lambda: dllm_generate(model, spec, prompt, 16, 8),
                       lambda: dllm_generate(model, spec, prompt, 16, 8, threshold=0.5),
                       lambda: spiffy_generate(model, spec, prompt, graph, 16),
                       lambda: spiffy_generate(model, spec, prompt, graph, 16, threshold=0.5, active=1)):
            forwards[0] = 0
            _, stats = decode()
            assert stats.nfe == forwards[0]
            if attention == "block_causal":
                assert stats.context_forwards == 0  # the cache grows inside each block's first forward
        _, vanilla = dllm_generate(model, spec, prompt, 16, 8)
        assert vanilla.nfe == vanilla.steps == 16  # one forward per transition, nothing else
    finally:
        handle.remove()


def test_decoding_never_unmasks_to_the_mask_token(one_thread):
    # An undertrained dLLM can rank the mask token first at masked positions; unmasking to it made no progress and
    # the vanilla loop never ended.
    model = tiny_dllm("llama", False, seed=0)
    favour_mask = torch.nn.functional.one_hot(torch.tensor(MASK), VOCAB) * 100.0
    model.lm_head.register_forward_hook(lambda module, inputs, logits: logits + favour_mask)
    spec = DrafterSpec(MASK, 0, "block_causal")
    tokens, stats = dllm_generate(model, spec, torch.tensor([[1, 2, 3, 4]]), 16, 8)
    assert len(tokens) == 16 and MASK not in tokens and stats.steps == 16


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_replayed_nfe_reduction_is_what_decoding_the_calibration_prompts_measures(attention, one_thread):
    # Replaying the graph on its own traces follows the decoder's rule, so on the calibration prompts the estimate is
    # the measured reduction, context-cache forwards included on both sides.
    model = tiny_dllm("llama", attention == "bidirectional", seed=1)
    spec = DrafterSpec(MASK, 0, attention)
    prompts = [torch.tensor([[1, 2, 3, 4]]), torch.tensor([[7, 7, 8]]), torch.tensor([[11, 3, 5, 9, 2]])]
    traces, vanilla_nfe, context_forwards = [], 0, 0
    for prompt in prompts:
        stats = dllm_generate(model, spec, prompt, 16, 8, trace=traces)[1]
        vanilla_nfe, context_forwards = vanilla_nfe + stats.nfe, context_forwards + stats.context_forwards
    # No forward of their own: a block-causal LM extends its cache in each block's first forward, a bidirectional
    # one has no cache.
    assert context_forwards == 0
    graph = calibrate(traces, MASK, block_length=8, budget=4, orders=("confidence",),
                      context_forwards=context_forwards)
    spiffy_nfe = sum(spiffy_generate(model, spec, prompt, graph, 16)[1].nfe for prompt in prompts)
    assert spiffy_nfe < vanilla_nfe
    assert graph.meta["replayed_nfe_reduction"]["confidence"] == round(vanilla_nfe / spiffy_nfe, 3)
