"""DiffusionGemma (transformers' `DiffusionGemmaForBlockDiffusion`) as an align drafter and as a dLLM, with a Gemma 4
verifier sharing its vocabulary: tiny random models of the real architectures, built in the test, on the tiny
tokenizer's vocabulary.

DiffusionGemma's causal encoder writes the context KV cache and its bidirectional decoder denoises a canvas reading
it; its noise is uniform random tokens, not a mask token. align reads it through `canvas_logits` (encoder cache, one
decoder step, no self-conditioning), fills noised positions with one fixed uniform draw (`noise_fill`), trains it on
windows read the same way, exports it, decodes it as a dLLM with Spiffy, and evaluates it with `align eval`.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import (DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DiffusionGemmaTextConfig, Gemma4Config,
                          Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig)
from transformers.models.gemma4 import Gemma4VisionConfig

from conftest import checkout_env

from align.checkpoint import merged_model, save_merged
from align.cli import main as align
from align.config import DecodeSection, DrafterSection
from align.decoding.ar import ar_generate
from align.decoding.dllm import dllm_generate
from align.decoding.generation import Sampling
from align.decoding.path_search import TrigramModel
from align.decoding.spiffy import spiffy_generate
from align.draft_graph import calibrate
from align.drafters.canvas import canvas_context, canvas_logits
from align.drafters.loading import load_drafter
from align.drafters.noise import noise_fill
from align.drafters.spec import drafter_spec_from_config, DrafterSpec
from align.launch import free_port
from align.losses import streak
from align.methods import METHODS, Setup
from align.models import load_tokenizer
from align.windows import WINDOW_BUILDERS, window_logits

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = str(ROOT / "checkpoints/tiny/tokenizer")
VOCAB = 8192  # the tiny tokenizer's
SLIDING_WINDOW = 8  # small, so that prompts and drafts run past it
FAVOURED = slice(10, 14)
SPECULATIVE = ["specdiff", "specdiff2_select", "specdiff_cps", "specdiff_adl", "specdiff_cps_adl"]


def favour_few_tokens(model):
    """Random models of one vocabulary agree on almost nothing; with a few favoured tokens (their output rows made
    long) drafter and verifier pick among the same handful, so that some drafts are accepted and some rejected."""
    with torch.no_grad():
        model.get_output_embeddings().weight[FAVOURED].mul_(4.0)
    return model.eval()


def tiny_diffusion_gemma(seed: int) -> DiffusionGemmaForBlockDiffusion:
    """A tiny random DiffusionGemma: always MoE (experts set small), with the small Gemma 4 vision tower it wants."""
    text = DiffusionGemmaTextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, global_head_dim=8, num_experts=4, top_k_experts=2, moe_intermediate_size=16,
        sliding_window=SLIDING_WINDOW, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=512, pad_token_id=1, eos_token_id=0, bos_token_id=None)
    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8)
    config = DiffusionGemmaConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), canvas_length=8)
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    return favour_few_tokens(model)


def tiny_gemma4_verifier(seed: int) -> Gemma4ForCausalLM:
    config = Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8, sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=1, eos_token_id=0, bos_token_id=None)
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(config).eval()
    return favour_few_tokens(model)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def drafter():
    return tiny_diffusion_gemma(0)


@pytest.fixture(scope="module")
def spec(drafter, tokenizer) -> DrafterSpec:
    return drafter_spec_from_config(drafter.config, tokenizer)


def test_the_family_is_known_unshifted_block_causal_with_uniform_noise(spec, tokenizer):
    assert spec == DrafterSpec(tokenizer.mask_token_id, 0, "block_causal", "uniform", 0)


def test_noised_positions_read_one_fixed_uniform_draw_never_the_marker(spec):
    block = torch.full((1, 40), spec.mask_token_id)
    fill = noise_fill(spec, VOCAB, block)
    assert torch.equal(fill, noise_fill(spec, VOCAB, block))  # deterministic: reproducible drafts
    assert torch.equal(noise_fill(spec, VOCAB, block[:, :7]), fill[:, :7])  # shorter drafts (ADL) share its prefix
    assert len(set(fill[0].tolist())) > 30  # uniform over the vocabulary, not a mask token
    partly = block.clone()
    partly[0, 3] = 5
    assert noise_fill(spec, VOCAB, partly)[0, 3] == 5  # decoded positions stay as they are
    other = DrafterSpec(spec.mask_token_id, 0, "block_causal", "uniform", noise_seed=1)
    assert not torch.equal(noise_fill(other, VOCAB, block), fill)
    masked = DrafterSpec(spec.mask_token_id, 0, "block_causal")
    assert torch.equal(noise_fill(masked, VOCAB, block), block)


def test_canvas_position_i_is_the_models_own_prediction_for_token_n_plus_i(drafter, spec):
    """Shift 0: align's row i is what DiffusionGemma's own forward gives at canvas position i, which its generate()
    appends as token n + i."""
    context = torch.randint(3, VOCAB, (1, 13), generator=torch.Generator().manual_seed(1))
    block = torch.full((1, 5), spec.mask_token_id)
    with torch.no_grad():
        own = drafter(input_ids=context, decoder_input_ids=noise_fill(spec, VOCAB, block)).logits
        ours = canvas_logits(drafter, spec, context, block)
    torch.testing.assert_close(ours, own, rtol=0, atol=0)


@pytest.mark.slow
def test_the_context_cache_grows_exactly_past_the_sliding_window(drafter, spec):
    """Drafting from a cache that grew token by token (as the verifier accepts them) equals re-encoding the context;
    K candidate blocks after one context (Spiffy) equal each block drafted alone."""
    tokens = torch.randint(3, VOCAB, (1, 3 * SLIDING_WINDOW), generator=torch.Generator().manual_seed(2))
    block = torch.full((1, 4), spec.mask_token_id)
    state = canvas_context(drafter)
    with torch.no_grad():
        for n in (3, 4, 9, 10, 17, 3 * SLIDING_WINDOW):
            cached = canvas_logits(drafter, spec, tokens[:, :n], block, state)
            assert state.length == n
            torch.testing.assert_close(cached, canvas_logits(drafter, spec, tokens[:, :n], block), rtol=1e-5,
                                       atol=1e-5)
        blocks = torch.stack([block[0], torch.tensor([7, spec.mask_token_id, 9, spec.mask_token_id]),
                              torch.tensor([11, 12, 13, 14])])
        shared = canvas_logits(drafter, spec, tokens, blocks, state)
        for k in range(len(blocks)):
            torch.testing.assert_close(shared[k], canvas_logits(drafter, spec, tokens, blocks[k : k + 1])[0],
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_greedy_speculative_outputs_equal_ar_with_a_gemma4_verifier(drafter, spec):
    verifier = tiny_gemma4_verifier(1)
    new_tokens = 2 * SLIDING_WINDOW  # prompt and output run past both models' sliding window
    proxy = TrigramModel.fit(np.random.default_rng(0).integers(0, VOCAB, 2000), VOCAB)
    decode = DecodeSection(gamma=4, max_new_tokens=new_tokens, num_candidates=3)
    setup = Setup(verifier, drafter, spec, None, None, frozenset(), decode, proxy)
    accepted = []
    for prompt in ([5, 6, 7, 8, 9], [100, 200, 300]):
        prompt_ids = torch.tensor([prompt])
        expected = ar_generate(verifier, prompt_ids, new_tokens)[0]
        for name in SPECULATIVE:
            tokens, stats = METHODS[name](setup, prompt_ids, Sampling(), None)
            assert tokens == expected, (prompt, name)
            accepted.append(stats.drafter_forwards < new_tokens - 1)
    assert any(accepted)  # some drafts were accepted, not only rejected: both branches of verification ran


@pytest.mark.slow
def test_one_training_step_on_windows_reads_windows_as_drafts_and_learns(spec):
    model = tiny_diffusion_gemma(3).train()
    rng = np.random.default_rng(0)
    rows = [{"prompt_ids": rng.integers(3, VOCAB, 5).tolist(), "completion_ids": rng.integers(3, VOCAB, 14).tolist()}
            for _ in range(2)]
    batch = WINDOW_BUILDERS[spec.attention](rows, spec, 4, 3, 1, np.random.default_rng(0))
    # A window reads exactly as a draft of the same context does.
    with torch.no_grad():
        logits = window_logits(model, spec, batch)
        start = int(batch.starts[0, 0])
        draft = canvas_logits(model, spec, batch.clean_ids[:1, :start], torch.full((1, 4), spec.mask_token_id))
    torch.testing.assert_close(logits[0, 0], draft[0], rtol=1e-5, atol=1e-5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        logits = window_logits(model, spec, batch).float().flatten(0, 1)  # (B·W, γ, V)
        loss = streak(logits, batch.targets.flatten(0, 1), batch.target_mask.flatten(0, 1),
                      num_windows=batch.num_windows)
        optimizer.zero_grad()
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        assert sum(float(g.abs().sum()) for g in grads) > 0
        optimizer.step()
        losses.append(loss.item())
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_micro_batchs_windows_are_one_encoder_and_one_decoder_pass_that_read_as_drafts(spec, implementation):
    """Under ZeRO-3 every pass gathers the whole drafter: a micro-batch makes one encoder and one decoder pass however
    many windows it trains, and each window's logits are still its draft's (contexts past the sliding window too)."""
    model = tiny_diffusion_gemma(6)
    model.set_attn_implementation(implementation)
    rng = np.random.default_rng(1)
    rows = [{"prompt_ids": rng.integers(3, VOCAB, 5).tolist(), "completion_ids": rng.integers(3, VOCAB, n).tolist()}
            for n in (30, 12, 22)]
    batch = WINDOW_BUILDERS[spec.attention](rows, spec, 4, 5, 1, np.random.default_rng(0))
    passes = {"encoder": 0, "decoder": 0}
    for name, module in (("encoder", model.get_encoder()), ("decoder", model.model.get_decoder())):
        module.register_forward_hook(lambda *_, name=name: passes.__setitem__(name, passes[name] + 1))
    with torch.no_grad():
        logits = window_logits(model, spec, batch)
    assert passes == {"encoder": 1, "decoder": 1} and batch.num_windows > 5
    assert max(int(s) for s in batch.starts[batch.target_mask[:, :, 0]]) > SLIDING_WINDOW + 4
    block = torch.full((1, 4), spec.mask_token_id)
    for b, w in batch.target_mask[:, :, 0].nonzero().tolist():
        with torch.no_grad():
            draft = canvas_logits(model, spec, batch.clean_ids[b : b + 1, : int(batch.starts[b, w])], block)
        torch.testing.assert_close(logits[b, w], draft[0], rtol=1e-5, atol=1e-5)
    assert not logits[~batch.target_mask[:, :, 0]].any()  # unused slots: zero logits


def test_export_round_trip_keeps_logits_and_dtype(spec, tokenizer, tmp_path):
    """A bf16 run's drafter, merged and saved as `align train` and `align export` do, reloads (with align's loader)
    as the same class, in bf16, with the same spec and bit-identical draft logits."""
    tiny_diffusion_gemma(4).save_pretrained(tmp_path / "base")
    section = DrafterSection(path=str(tmp_path / "base"), dtype="bfloat16", device="cpu")
    model, _ = load_drafter(section, tokenizer)
    save_merged(merged_model(model, model.state_dict()), tokenizer, tmp_path / "step_1", {"meta.json": "{}"})
    saved = safe_open(str(tmp_path / "step_1" / "model.safetensors"), "pt")
    assert {saved.get_tensor(k).dtype for k in saved.keys()} == {torch.bfloat16}
    reloaded, reloaded_spec = load_drafter(section.model_copy(update={"path": str(tmp_path / "step_1")}), tokenizer)
    assert type(reloaded) is DiffusionGemmaForBlockDiffusion and reloaded.dtype == torch.bfloat16
    assert reloaded_spec == spec
    context, block = torch.tensor([[5, 6, 7, 8]]), torch.full((1, 4), spec.mask_token_id)
    with torch.no_grad():
        torch.testing.assert_close(canvas_logits(reloaded, spec, context, block),
                                   canvas_logits(model, spec, context, block), rtol=0, atol=0)


@pytest.mark.slow
def test_spiffy_decoding_equals_vanilla_dllm_decoding(drafter, spec):
    traces = []
    prompts = [torch.tensor([[5, 6, 7]]), torch.tensor([[40, 50, 60, 70]])]
    expected = [dllm_generate(drafter, spec, p, 16, 4, trace=traces)[0] for p in prompts]
    assert all(spec.mask_token_id not in tokens for tokens in expected)
    graph = calibrate(traces, spec.mask_token_id, block_length=4, budget=3)
    for prompt, tokens in zip(prompts, expected):
        assert spiffy_generate(drafter, spec, prompt, graph, 16)[0] == tokens
        assert spiffy_generate(drafter, spec, prompt, graph, 16, active=1)[0] == tokens


@pytest.mark.slow
def test_the_draft_and_window_paths_create_their_tensors_on_the_models_device(drafter, spec):
    verifier = tiny_gemma4_verifier(1)
    setup = Setup(verifier, drafter, spec, None, None, frozenset(), DecodeSection(gamma=3, max_new_tokens=6), None)
    prompt = torch.tensor([[5, 6, 7]])
    expected = METHODS["specdiff"](setup, prompt, Sampling(), None)[0]
    rows = [{"prompt_ids": [3, 4, 5], "completion_ids": [6, 7, 8, 9, 10, 11]}] * 2
    batch = WINDOW_BUILDERS[spec.attention](rows, spec, 3, 2, 1, np.random.default_rng(0))
    with torch.no_grad():
        windows = window_logits(drafter, spec, batch)
    traces = []
    vanilla = dllm_generate(drafter, spec, prompt, 8, 4, trace=traces)[0]
    graph = calibrate(traces, spec.mask_token_id, block_length=4, budget=3)
    trained = tiny_diffusion_gemma(5).train()
    with torch.device("meta"):
        with torch.no_grad():
            assert METHODS["specdiff"](setup, prompt, Sampling(), None)[0] == expected
            assert dllm_generate(drafter, spec, prompt, 8, 4)[0] == vanilla
            assert spiffy_generate(drafter, spec, prompt, graph, 8)[0] == vanilla
            on_meta = window_logits(drafter, spec, batch)
        # one training step's forward and backward
        logits = window_logits(trained, spec, batch).flatten(0, 1)
        loss = streak(logits, batch.targets.flatten(0, 1), batch.target_mask.flatten(0, 1),
                      num_windows=batch.num_windows)
        loss.backward()
    assert on_meta.device.type == "cpu" and loss.device.type == "cpu" and torch.isfinite(loss)
    torch.testing.assert_close(on_meta, windows, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------------------------
# the stages, through the command line, with tiny random models saved where Hub ids would be
# --------------------------------------------------------------------------------------------------------------------
def tiny_gemma4_multimodal_verifier(seed: int) -> Gemma4ForConditionalGeneration:
    """The architecture of google/gemma-4-*-it checkpoints (Gemma4ForConditionalGeneration), tiny."""
    text = Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, global_head_dim=8, max_position_embeddings=512,
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=1, eos_token_id=0, bos_token_id=None)
    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                                        audio_config=None))
    return favour_few_tokens(model)


def save_with_tokenizer(model, tokenizer, folder) -> str:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def prompt_file(folder, texts) -> str:
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in texts))
    return str(path)


PROMPTS = ["def add(a, b):\n    return", "import os\n\nfor name in", "class Stack:\n    def push(self, item):"]


@pytest.mark.slow
def test_align_eval_with_a_diffusion_gemma_drafter_and_a_gemma4_verifier_is_exact(drafter, tokenizer, tmp_path):
    verifier = save_with_tokenizer(tiny_gemma4_verifier(1), tokenizer, tmp_path / "verifier")
    drafter_path = save_with_tokenizer(drafter, tokenizer, tmp_path / "drafter")
    assert align(["eval", "recipes/tiny/eval.yaml", f"verifier.path={verifier}", f"drafter.path={drafter_path}",
                  f"eval.prompts={prompt_file(tmp_path, PROMPTS)}", f"eval.out={tmp_path / 'eval'}",
                  "eval.methods=[specdiff]", "eval.warmup=0", "eval.sampling_temperature=0",
                  "decode.max_new_tokens=12", "decode.gamma=4"]) == 0
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert result["methods"]["specdiff"]["exact_match"] == 1.0
    assert result["meta"]["drafter_spec"]["noise"] == "uniform"


RECIPE = "recipes/gemma4-diffusiongemma.yaml"


@pytest.mark.slow
def test_the_recipe_validates_and_runs_its_architectures_at_tiny_size(drafter, tokenizer, tmp_path, capsys):
    """The recipe as written validates; with its two Hub ids swapped for tiny random models of the same
    architectures it evaluates losslessly, makes trajectories and trains one ZeRO-3 bf16 step (its own settings),
    and the checkpoint reloads as a DiffusionGemma drafter. LoRA is refused."""
    assert align(["validate", RECIPE]) == 0
    assert "google/diffusiongemma-26B-A4B-it" in capsys.readouterr().out
    verifier = save_with_tokenizer(tiny_gemma4_multimodal_verifier(1), tokenizer, tmp_path / "gemma-4-31B-it")
    drafter_path = save_with_tokenizer(drafter, tokenizer, tmp_path / "diffusiongemma-26B-A4B-it")
    prompts = prompt_file(tmp_path, PROMPTS)
    tiny = [f"verifier.path={verifier}", f"drafter.path={drafter_path}", "verifier.dtype=float32",
            "drafter.dtype=float32", f"data.train_prompts={prompts}", "data.train_split=train",
            "data.prompt_column=prompt", f"eval.prompts={prompts}", "eval.prompt_column=prompt",
            "eval.num_prompts=3", "trajectories.num_prompts=3",
            f"trajectories.out={tmp_path / 'trajectories'}", "trajectories.max_new_tokens=12",
            "trajectories.completions_per_prompt=1", "trajectories.batch_size=3", f"train.out={tmp_path / 'run'}",
            "train.gamma=4", "train.windows_per_sequence=2", "train.max_steps=1", "train.micro_batch_size=2",
            "train.gradient_accumulation_steps=1", "train.warmup_steps=0", f"eval.out={tmp_path / 'eval'}",
            "eval.warmup=0", "eval.sampling_temperature=0", "decode.max_new_tokens=12", "decode.gamma=4"]
    assert align(["eval", RECIPE, *tiny]) == 0
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert {result["methods"][name]["exact_match"] for name in ("specdiff", "specdiff_adl")} == {1.0}
    assert align(["trajectories", RECIPE, *tiny]) == 0
    env = checkout_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    train = [sys.executable, "align/train.py", RECIPE, *tiny]
    done = subprocess.run(train, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics and all(np.isfinite(m["loss"]) for m in metrics if "loss" in m)
    step = tmp_path / "run" / "step_1"
    saved = safe_open(str(step / "model.safetensors"), "pt")
    assert {saved.get_tensor(k).dtype for k in saved.keys()} == {torch.bfloat16}  # the run's dtype
    model, spec = load_drafter(DrafterSection(path=str(step), device="cpu"), tokenizer)
    assert type(model) is DiffusionGemmaForBlockDiffusion and spec.noise == "uniform"
    # The trained drafter exported, then used as a dLLM: Spiffy calibrated on it and decoding exactly as vanilla.
    exported = tmp_path / "export"
    # No export.eval: the eval above measured the base, and its rows are not this drafter's (export refuses them).
    assert align(["export", RECIPE, *tiny, f"drafter.path={step}", f"export.out={exported}"]) == 0
    model, spec = load_drafter(DrafterSection(path=str(exported), device="cpu"), tokenizer)
    assert type(model) is DiffusionGemmaForBlockDiffusion and spec.noise == "uniform"
    dllm = [*tiny, f"drafter.path={exported}", f"calibrate.prompts={prompts}", "calibrate.prompt_column=prompt", "calibrate.num_prompts=3",
            "calibrate.block_length=4", "calibrate.budget=3", f"calibrate.out={tmp_path / 'spiffy'}"]
    assert align(["calibrate", RECIPE, *dllm]) == 0
    assert align(["eval", RECIPE, *dllm, "eval.mode=dllm", f"calibrate.graph={tmp_path / 'spiffy' / 'draft_graph.json'}",
                  "eval.spiffy_budgets=[3]", f"eval.out={tmp_path / 'dllm'}"]) == 0
    result = json.loads((tmp_path / "dllm" / "eval.json").read_text())
    spiffy = [m for name, m in result["methods"].items() if "spiffy" in name]
    assert spiffy and all(m["exact_match"] == 1.0 for m in spiffy)
    lora = subprocess.run([*train, "train.lora_r=8", f"train.out={tmp_path / 'lora'}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert lora.returncode == 2 and "train.lora_r" in lora.stderr, lora.stderr[-2000:]
    assert not (tmp_path / "lora").exists()  # refused from the drafter's config, before any model loads
    assert align(["train", RECIPE, *tiny, "train.lora_r=8",
                  f"train.out={tmp_path / 'lora'}"]) == 2
