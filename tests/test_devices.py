"""Tensors follow the model they meet (DESIGN §3), checked without a GPU: models and inputs are built on the CPU, then
the code runs with the default device set to `meta`. A factory call without `device=` then makes a meta tensor, and
mixing it with the CPU tensors fails, as a CPU tensor would fail next to a model on a GPU."""

import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from align.config import DecodeSection
from align.decoding.dllm import dllm_generate
from align.decoding.generation import Sampling
from align.decoding.path_search import TrigramModel
from align.decoding.spiffy import spiffy_generate
from align.draft_graph import calibrate
from align.drafters.spec import DrafterSpec
from align.losses import WINDOW_LOSSES, needs_verifier_distributions, normalisation
from align.methods import METHODS, Setup
from align.windows import (WINDOW_BUILDERS, topk_window_logits, verifier_path_logits, verifier_window_logits,
                           window_logits)

VOCAB, MASK = 16, 15
TOKENIZER = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny" / "tokenizer"
PROMPT = torch.tensor([[1, 5, 2]])
# What our runtime implements (HF's own methods are HF's business).
RUNTIME_METHODS = ["ar", "sd_ar", "specdiff", "specdiff2_select", "specdiff_cps", "specdiff_adl", "specdiff_cps_adl",
                   "specdiff_tree", "specdiff_cost", "specdiff_cps_cost", "specdiff_tree_cost",
                   "specdiff_cps_tree", "specdiff_cps_tree_cost", "ngram", "ngram_cost", "specdiff_ngram_tree",
                   "specdiff_ngram_tree_cost"]


def tiny(seed: int, bidirectional: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    if bidirectional:
        config.is_causal = False
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def setup() -> Setup:
    decode = DecodeSection(gamma=3, max_new_tokens=8, num_candidates=3, adl_min_len=1, adl_max_len=4, adl_delta=1)
    proxy = TrigramModel.fit(np.random.default_rng(0).integers(0, VOCAB, 500), VOCAB)
    # The cost-aware methods' costs fixed (a rising curve): their choices then depend on no clock.
    return Setup(tiny(0), tiny(1), DrafterSpec(MASK, 1, "block_causal"), tiny(2), None, frozenset(), decode, proxy,
                 verify_costs=[1.0 + 0.3 * n for n in range(decode.tree_nodes + 1)], draft_cost=0.5)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("name", RUNTIME_METHODS)
def test_every_runtime_method_creates_its_tensors_on_the_models_device(setup, name, temperature):
    sampling = Sampling(temperature, top_k=5 if temperature else 0)
    setup.forget()  # both runs start from nothing learnt (a cost-aware method's choices carry to its next prompt)
    expected = METHODS[name](setup, PROMPT, sampling, torch.Generator().manual_seed(0))[0]
    setup.forget()
    with torch.device("meta"):
        tokens = METHODS[name](setup, PROMPT, sampling, torch.Generator().manual_seed(0))[0]
    assert tokens == expected


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_dllm_and_spiffy_decoding_create_their_tensors_on_the_models_device(attention):
    model, spec = tiny(0, attention == "bidirectional"), DrafterSpec(MASK, 1, attention)
    traces = []
    expected = dllm_generate(model, spec, PROMPT, 8, 4, trace=traces)[0]
    graph = calibrate(traces, MASK, block_length=4, budget=3)
    with torch.device("meta"):
        assert dllm_generate(model, spec, PROMPT, 8, 4)[0] == expected
        assert spiffy_generate(model, spec, PROMPT, graph, 8)[0] == expected
        assert spiffy_generate(model, spec, PROMPT, graph, 8, active=1)[0] == expected


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_windows_and_losses_create_their_tensors_on_the_models_device(attention):
    drafter, verifier, spec = tiny(0, attention == "bidirectional"), tiny(3), DrafterSpec(MASK, 1, attention)
    rows = [{"prompt_ids": [1, 2, 3], "completion_ids": [4, 5, 6, 7, 8, 9], "topk_ids": [[4, 5]] * 6,
             "topk_logprobs": [[-0.1, -2.4]] * 6}] * 2
    batch = WINDOW_BUILDERS[attention](rows, spec, 3, 2, 0, np.random.default_rng(0)).to(torch.device("cpu"))
    with torch.device("meta"):
        draft_logits = window_logits(drafter, spec, batch).float().flatten(0, 1)
        online = verifier_window_logits(verifier, batch).float().flatten(0, 1)
        stored = topk_window_logits(rows, batch, VOCAB).flatten(0, 1)
        on_policy = verifier_path_logits(verifier, batch, batch.targets, 0)
        targets, mask = batch.targets.flatten(0, 1), batch.target_mask.flatten(0, 1)
        values = []
        for name, (loss, _) in WINDOW_LOSSES.items():
            for verifier_logits in (online, stored):
                against = verifier_logits if needs_verifier_distributions(name) else targets
                values.append(loss(draft_logits, against, mask, **normalisation(name, 4, 10)))
    assert {t.device.type for t in (draft_logits, online, stored, on_policy, *values)} == {"cpu"}
    assert all(torch.isfinite(v) for v in values)


def block_causal_drafter(folder):
    """A tiny random block-causal Llama drafter folder on the tiny tokenizer (the shipped drafter's kind)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    config.drafter_spec = {"mask_token_id": tokenizer.mask_token_id, "logits_shift": 1, "attention": "block_causal"}
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_a_whole_training_step_creates_its_tensors_on_the_models_device(tmp_path, monkeypatch):
    """The train stage's own step (DeepSpeed engine, LoRA, windows, online and on-policy verifier labels, every kind
    of loss, the optimiser) and its held-out metric, with the default device set to `meta` around the calls, for a
    block-causal drafter and both remote-code dLLM families (one process group: DeepSpeed keeps its groups for the
    process's life)."""
    import torch.distributed as dist

    from align.recipe_files import load_recipe
    from align.dist import collective_timeout, init_distributed
    from align.batches import step_batches
    from align.stages.train import TrainData, build_trainer, held_out_streak, train_step
    from remote_code_families import write_family, write_qwen2

    verifier = write_qwen2(tmp_path / "verifier", seed=3)
    rows = [{"prompt_ids": [5, 6, 7], "completion_ids": [8 + i, 9, 10, 11, 12, 13], "prompt_index": i}
            for i in range(6)]
    data = TrainData(rows, train_rows=[1, 2, 3, 4, 5], held_out=[0], online=True)
    # One process of one, as `python align/train.py` runs outside a launcher (the variables are restored after).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port)).items():
        monkeypatch.setenv(name, value)
    rank, world = init_distributed(collective_timeout(load_recipe("recipes/tiny/align.yaml")))
    try:
        for drafter, data_mode in [("block_causal", "online"), ("dream", "on_policy"), ("llada", "online")]:
            folder = (block_causal_drafter(tmp_path / "drafter") if drafter == "block_causal"
                      else write_family(drafter, tmp_path / drafter, seed=1))
            recipe = load_recipe(None, [
                f"drafter.path={folder}", "drafter.trust_remote_code=true", "drafter.device=cpu",
                f"verifier.path={verifier}", "verifier.device=cpu",
                "train.losses={ce_streak: 1.0, fkl: 0.5, streak_tv: 0.5}", f"train.data_mode={data_mode}",
                "train.bf16=false", "train.lora_r=4", "train.micro_batch_size=2", "train.gradient_accumulation_steps=2",
                "train.gamma=3", "train.windows_per_sequence=2", "train.max_steps=2"])
            trainer = build_trainer(recipe, data, rank, world)
            with torch.device("meta"):
                built = step_batches(data, recipe, trainer.build, trainer.spec, trainer.pad_id, rank, world, None,
                                     0)
                record = train_step(trainer, built, recipe, 0, 0.0)
                streak = held_out_streak(trainer, data, recipe)
            assert record is not None and all(np.isfinite(v) for v in record.values()), drafter
            assert np.isfinite(streak["expected_streak"]), drafter
            assert {p.device.type for p in trainer.engine.module.parameters()} == {"cpu"}, drafter
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_dflash_drafting_and_training_windows_create_their_tensors_on_the_models_device(temperature):
    from align.decoding.specdiff import specdiff_generate
    from align.drafters.dflash import DFlashDrafter, config_for_verifier, dflash_window_logits

    torch.manual_seed(0)
    verifier = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                            num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                                            max_position_embeddings=128)).eval()
    drafter = DFlashDrafter(config_for_verifier(verifier.config, MASK, intermediate_size=24)).eval()
    spec = DrafterSpec(MASK, 0, "block_causal", kind="dflash")
    sampling = Sampling(temperature, top_k=5 if temperature else 0)
    expected = specdiff_generate(verifier, drafter, spec, PROMPT, 3, 8, sampling,
                                 generator=torch.Generator().manual_seed(0))[0]
    clean, starts = torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), torch.tensor([[2, 4]])
    with torch.device("meta"):
        tokens = specdiff_generate(verifier, drafter, spec, PROMPT, 3, 8, sampling,
                                   generator=torch.Generator().manual_seed(0))[0]
        draft_logits, verifier_logits = dflash_window_logits(drafter, verifier, clean, starts, 3)
    assert tokens == expected
    assert {draft_logits.device.type, verifier_logits.device.type} == {"cpu"}


@pytest.mark.slow
def test_every_host_copy_to_numpy_goes_through_cpu():
    """`.numpy()` raises on a GPU tensor, and the checks above cannot see it (their models are on the CPU, where it
    works): every `.numpy()` in align/ is taken of a `.cpu()` somewhere in its chain of calls. (`launch/gpu_check.sh`
    on an H200 found one that was not, in the causal path search.)"""
    import ast

    def calls_cpu(node: ast.AST) -> bool:
        while isinstance(node, (ast.Call, ast.Attribute, ast.Subscript)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "cpu":
                return True
            node = node.func if isinstance(node, ast.Call) else node.value
        return False

    offenders = []
    for path in sorted((Path(__file__).resolve().parents[1] / "align").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "numpy"
                    and not calls_cpu(node.func.value)):
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, f"`.numpy()` without `.cpu()`: {offenders}"
