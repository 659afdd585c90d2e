"""Tests of align/models.py and align/masks.py on real tiny transformers models (Llama, Qwen2, Mistral; fp32, CPU).

The central claim of the model layer is that `block_logits` reads the right logits for every DrafterSpec. It is tested
semantically: tiny drafters are trained on a counting task with their targets placed as each spec says, and then the
helper must recover the true continuation, while reading the same model with the other logits_shift must not.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

from align.config import DrafterSection, RecipeError, VerifierSection
from align.decoding.dllm import dllm_generate
from align.decoding.spiffy import spiffy_generate
from align.draft_graph import calibrate
from align.drafters.loading import load_drafter
from align.drafters.masked import block_logits, crop_context, encode_context, shared_context_block_logits
from align.drafters.spec import KNOWN_DLLMS, DrafterSpec, drafter_spec_from_config
from align.masks import additive_mask, attention_masks, block_causal_allowed, block_diffusion_allowed
from align.models import load_verifier
from align.preflight import check_vocab_compatible

VOCAB = 40
MASK = VOCAB - 1  # the mask token: the last id of the vocabulary
FIRST_DIGIT, NUM_DIGITS = 4, 10  # the counting task's "digit" tokens are ids 4..13
GAMMA = 4  # draft block length

SLIDING_WINDOW = 4  # shorter than the contexts below, so that sliding layers drop keys
# name -> (config class, model class, config fields). Sliding windows set both ways configs set them: `sliding_window`
# alone (Mistral: every layer slides) and Qwen2's `use_sliding_window` (layers from `max_window_layers` on slide).
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "mistral_sliding": (MistralConfig, MistralForCausalLM, {"sliding_window": SLIDING_WINDOW}),
    "qwen2_sliding": (Qwen2Config, Qwen2ForCausalLM,
                      {"use_sliding_window": True, "sliding_window": SLIDING_WINDOW, "max_window_layers": 1}),
}
SLIDING_ARCHS = ["mistral_sliding", "qwen2_sliding"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny models gain nothing from threads, and the test machine is small and shared.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(arch: str, seed: int = 0, vocab: int = VOCAB, bidirectional: bool = False, **config_kwargs):
    """A random tiny causal LM; `bidirectional` sets config.is_causal=False, as load_drafter does."""
    config_cls, model_cls, arch_kwargs = ARCHS[arch]
    config_kwargs = {**arch_kwargs, **config_kwargs}
    if bidirectional:
        config_kwargs["is_causal"] = False
    config = config_cls(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **config_kwargs,
    )
    torch.manual_seed(seed)
    return model_cls(config).to(torch.float32)


# --------------------------------------------------------------------------------------------------------------------
# 1. block_logits reads the right logits: trained on a task where a wrong read fails
# --------------------------------------------------------------------------------------------------------------------
def counting_batch(gen: torch.Generator, batch: int, context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that count up mod NUM_DIGITS from a random digit: (context (B, n), its true continuation (B, γ))."""
    start = torch.randint(0, NUM_DIGITS, (batch, 1), generator=gen)
    seq = FIRST_DIGIT + (start + torch.arange(context_len + GAMMA)) % NUM_DIGITS
    return seq[:, :context_len], seq[:, context_len:]


def masked_block(batch: int) -> torch.Tensor:
    return torch.full((batch, GAMMA), MASK)


def train_counting_drafter(arch: str, logits_shift: int, attention: str, steps: int = 150):
    """Train a tiny drafter to fill `context ⊕ MASK×γ` with the counting continuation.

    Written independently of `block_logits`: the target of block position i is placed at output index n+i (shift 0)
    or n+i-1 (shift 1); block_causal training uses the explicit block-causal mask, bidirectional the model's own
    full attention (config.is_causal=False).
    """
    model = tiny_model(arch, seed=0, bidirectional=attention == "bidirectional")
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / steps)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        n = int(torch.randint(2, 9, (1,), generator=gen))
        context, target = counting_batch(gen, 32, n)
        ids = torch.cat([context, masked_block(32)], dim=1)
        mask = None
        if attention == "block_causal":
            mask = additive_mask(block_causal_allowed(n, GAMMA), torch.float32).unsqueeze(0)
        logits = model(input_ids=ids, attention_mask=mask).logits
        target_positions = torch.arange(GAMMA) + n - logits_shift
        loss = F.cross_entropy(logits[:, target_positions].reshape(-1, VOCAB), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    model.requires_grad_(False)
    return model


def read_accuracy(model, spec: DrafterSpec, use_cache: bool = False) -> float:
    """Fraction of block positions whose argmax under `spec` is the true continuation, on fresh contexts."""
    gen = torch.Generator().manual_seed(1234)
    correct = total = 0
    for n in range(2, 9):
        context, target = counting_batch(gen, 16, n)
        state = encode_context(model, context[:, : n // 2]) if use_cache else None
        predicted = block_logits(model, spec, context, masked_block(16), state).argmax(-1)
        correct += int((predicted == target).sum())
        total += target.numel()
    return correct / total


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["bidirectional", "block_causal"])
@pytest.mark.parametrize("logits_shift", [0, 1])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_block_logits_reads_the_trained_positions(arch, logits_shift, attention):
    model = train_counting_drafter(arch, logits_shift, attention)
    right = DrafterSpec(MASK, logits_shift, attention)
    wrong = DrafterSpec(MASK, 1 - logits_shift, attention)

    assert read_accuracy(model, right) >= 0.95
    # The same model read with the other shift is off by one position: the counting task makes that visibly wrong.
    assert read_accuracy(model, wrong) < 0.5
    if attention == "block_causal":
        # The cached path (the one speculative decoding uses) reads the same positions.
        assert read_accuracy(model, right, use_cache=True) >= 0.95
        assert read_accuracy(model, wrong, use_cache=True) < 0.5


# --------------------------------------------------------------------------------------------------------------------
# 2. a block-causal drafter's context cache gives exactly the logits of re-encoding
# --------------------------------------------------------------------------------------------------------------------
def assert_same_logits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def cache_len(state) -> int:
    return state.cache.get_seq_length()


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("logits_shift", [0, 1])
@pytest.mark.parametrize("arch", ["llama", "qwen2", *SLIDING_ARCHS])
def test_block_causal_cache_equals_reencoding(arch, logits_shift, attn_implementation):
    model = tiny_model(arch, seed=1, attn_implementation=attn_implementation).eval()
    spec = DrafterSpec(MASK, logits_shift, "block_causal")
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(0, MASK, (2, 12), generator=gen)
    block = masked_block(2)
    block[:, 1] = torch.randint(0, MASK, (2,), generator=gen)  # a partly unmasked block, as in later denoising steps

    def reencoded(ctx: torch.Tensor) -> torch.Tensor:
        return block_logits(model, spec, ctx, block, state=None)

    # Grow the context cache in two steps, the second inside block_logits.
    state = encode_context(model, context[:, :4])
    assert state.length == cache_len(state) == 4
    cached = block_logits(model, spec, context[:, :7], block, state)
    assert_same_logits(cached, reencoded(context[:, :7]))
    assert state.length == cache_len(state) == 7  # the block never stays in the cache
    assert cached.shape == (2, GAMMA, VOCAB)

    # The verifier rejects part of the draft: crop back, and the accepted tokens then differ from the old ones.
    crop_context(state, 5)
    # A sliding layer kept only its window after the blocks' crop: the cache starts over rather than lose keys.
    restarted = arch in SLIDING_ARCHS
    assert state.length == cache_len(state) == (0 if restarted else 5)
    context2 = context.clone()
    context2[:, 5:] = (context[:, 5:] + 1) % MASK
    cached = block_logits(model, spec, context2[:, :9], block, state)
    expected = reencoded(context2[:, :9])
    assert_same_logits(cached, expected)
    assert state.length == cache_len(state) == 9
    # The crop mattered: the stale tokens would have given other logits.
    assert not torch.allclose(expected, reencoded(context[:, :9]), atol=1e-3)

    # Calling again with the same context reuses the cache and gives identical logits (equal to rounding after a
    # restart: a sliding layer then reads its window of cached keys, where the restart's forward had them all).
    again = block_logits(model, spec, context2[:, :9], block, state)
    if restarted:
        assert_same_logits(again, cached)
    else:
        assert torch.equal(again, cached)
    assert state.length == cache_len(state) == 9

    # Cropping to exactly the next context length (the last position's logits were dropped with the crop).
    crop_context(state, 6)
    assert state.length == cache_len(state) == (0 if restarted else 6)
    assert_same_logits(block_logits(model, spec, context2[:, :6], block, state), reencoded(context2[:, :6]))
    assert state.length == cache_len(state) == 6

    # A context shorter than the cache without a crop is a caller's error, not a silent misread.
    with pytest.raises(ValueError, match="crop"):
        block_logits(model, spec, context2[:, :3], block, state)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("logits_shift", [0, 1])
@pytest.mark.parametrize("arch", ["llama", *SLIDING_ARCHS])
def test_shared_context_blocks_extend_the_cache_in_the_same_forward(arch, logits_shift, attn_implementation):
    # A dLLM block's first step (and Spiffy's batched steps) run the context tokens not cached yet and the candidate
    # blocks in one model call: every block's logits are those of re-encoding its context, and the context stays cached.
    model = tiny_model(arch, seed=2, attn_implementation=attn_implementation).eval()
    spec = DrafterSpec(MASK, logits_shift, "block_causal")
    gen = torch.Generator().manual_seed(3)
    context = torch.randint(0, MASK, (1, 11), generator=gen)
    blocks = masked_block(3)
    blocks[1, 0], blocks[2, 2] = 5, 9  # three candidate states of one block
    calls = [0]
    handle = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        state = encode_context(model, context[:, :4])
        for n in (8, 11, 11):  # new context tokens, more of them, then none
            calls[0] = 0
            shared = shared_context_block_logits(model, spec, context[:, :n], blocks, state)
            assert calls[0] == 1 and state.length == cache_len(state) == n
            for k in range(3):
                assert_same_logits(shared[k], block_logits(model, spec, context[:, :n], blocks[k:k + 1])[0])
    finally:
        handle.remove()


@pytest.mark.parametrize("logits_shift", [0, 1])
def test_block_logits_empty_context(logits_shift):
    model = tiny_model("llama", seed=2).eval()
    spec = DrafterSpec(MASK, logits_shift, "block_causal")
    empty, block = torch.zeros(1, 0, dtype=torch.long), masked_block(1)
    fresh_state = encode_context(model, empty)
    if logits_shift:
        # Nothing predicts the first block position of a shifted drafter: both paths refuse.
        for state in (None, fresh_state):
            with pytest.raises(ValueError, match="context token"):
                block_logits(model, spec, empty, block, state)
    else:
        assert_same_logits(block_logits(model, spec, empty, block, fresh_state), block_logits(model, spec, empty, block))
        assert fresh_state.length == cache_len(fresh_state) == 0


@pytest.mark.parametrize("arch", SLIDING_ARCHS)
def test_a_sliding_window_drafter_reads_as_its_own_forward_does(arch):
    # With a one-token block holding a real token, the block-causal mask is the causal one: block_logits, cached or
    # not, must then give the model's own forward's logits, whose sliding layers leave out keys a window back.
    model = tiny_model(arch, seed=5).eval()
    context = torch.randint(0, MASK, (1, 11), generator=torch.Generator().manual_seed(5))  # past the window of 4
    prefix, token = context[:, :-1], context[:, -1:]
    with torch.no_grad():
        plain = model(input_ids=context).logits  # (1, 11, V)
        # The window matters here: the model's layers under a causal 4-D mask (no window: such a mask is used as
        # given) read otherwise.
        unwindowed = model(input_ids=context, attention_mask=additive_mask(
            torch.ones(11, 11, dtype=torch.bool).tril(), torch.float32)[None]).logits
        assert not torch.allclose(plain[:, -1], unwindowed[:, -1], atol=1e-3)
        for shift, expected in ((0, plain[:, -1]), (1, plain[:, -2])):  # shifted: block position 0 is read at n - 1
            spec = DrafterSpec(MASK, shift, "block_causal")
            assert_same_logits(block_logits(model, spec, prefix, token)[:, 0], expected)
            state = encode_context(model, prefix[:, :7])
            assert_same_logits(block_logits(model, spec, prefix, token, state)[:, 0], expected)
            assert_same_logits(block_logits(model, spec, prefix, token, state)[:, 0], expected)  # all cached now


@pytest.mark.parametrize("arch", SLIDING_ARCHS)
def test_dllm_and_spiffy_decoding_of_a_sliding_window_model_runs_past_its_window(arch):
    # Vanilla dLLM decoding and Spiffy's batched draft states both read blocks through the cached forward.
    model = tiny_model(arch, seed=6).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # confident preferences, so that Spiffy's drafts are accepted now and then
    spec = DrafterSpec(MASK, 0, "block_causal")
    prompt, traces = torch.tensor([[1, 2, 3, 4, 5]]), []
    expected, _ = dllm_generate(model, spec, prompt, 12, 4, trace=traces)
    assert len(expected) == 12  # a context of 17 tokens, past the window of 4
    graph = calibrate(traces, MASK, block_length=4, budget=3)
    assert spiffy_generate(model, spec, prompt, graph, 12)[0] == expected


def test_attention_masks_follow_each_layer_types_cache_and_window():
    # A cache holding 10 tokens; two new tokens at positions 10 and 11, the second seeing the first.
    new_allowed = torch.tensor([[True, False], [True, True]])
    positions = torch.tensor([10, 11])

    def masks(arch):
        model = tiny_model(arch).eval()
        state = encode_context(model, torch.arange(10)[None])
        return attention_masks(model, new_allowed, positions, state.cache)

    full = masks("llama")
    assert torch.equal(full[0, 0] == 0, torch.cat([torch.ones(2, 10, dtype=torch.bool), new_allowed], 1))
    # Mistral sets `sliding_window` alone: one mask, over the window−1 = 3 keys its sliding cache hands back
    # (positions 7..9) and the new ones, a key 4 or more positions before the query hidden.
    sliding = masks("mistral_sliding")
    assert isinstance(sliding, torch.Tensor) and sliding.shape == (1, 1, 2, 5)
    assert (sliding[0, 0] == 0).int().tolist() == [[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]]
    # Qwen2 with `use_sliding_window`: its `layer_types` name a full and a sliding layer, one mask for each.
    hybrid = masks("qwen2_sliding")
    assert set(hybrid) == {"full_attention", "sliding_attention"}
    assert torch.equal(hybrid["full_attention"], full) and torch.equal(hybrid["sliding_attention"], sliding)


def test_a_block_causal_drafter_with_layers_align_cannot_mask_is_refused_at_load(tmp_path):
    model = tiny_model("qwen2", seed=3)
    model.config.layer_types = ["chunked_attention"] * 2
    model.config.drafter_spec = DrafterSpec(MASK, 0, "block_causal").to_dict()
    model.save_pretrained(tmp_path / "drafter")
    with pytest.raises(RecipeError, match="drafter: the model has chunked_attention layers"):
        load_drafter(section(str(tmp_path / "drafter")))


# --------------------------------------------------------------------------------------------------------------------
# 3. loading a drafter and resolving its spec
# --------------------------------------------------------------------------------------------------------------------
def save_drafter(path, spec: DrafterSpec | None, arch: str = "llama") -> str:
    model = tiny_model(arch, seed=3)
    if spec is not None:
        model.config.drafter_spec = spec.to_dict()
    model.save_pretrained(path)
    return str(path)


def section(path: str, **overrides) -> DrafterSection:
    return DrafterSection(path=path, device="cpu", dtype="float32", **overrides)


def first_position_sees_last_token(model) -> bool:
    ids = torch.arange(4, 12).unsqueeze(0)
    changed = ids.clone()
    changed[0, -1] = 20
    with torch.no_grad():
        return not torch.allclose(model(input_ids=ids).logits[0, 0], model(input_ids=changed).logits[0, 0])


def test_load_drafter_reads_spec_from_config(tmp_path):
    spec = DrafterSpec(MASK, 0, "block_causal")
    path = save_drafter(tmp_path / "drafter", spec)
    model, loaded = load_drafter(section(path))
    assert loaded == spec
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert model.dtype == torch.float32
    # Block-causal: the context stays causal.
    assert getattr(model.config, "is_causal", True) is True
    assert not first_position_sees_last_token(model)


def test_recipe_overrides_win_over_config(tmp_path):
    path = save_drafter(tmp_path / "drafter", DrafterSpec(MASK, 0, "block_causal"))
    _, spec = load_drafter(section(path, logits_shift=1))
    assert spec == DrafterSpec(MASK, 1, "block_causal")
    _, spec = load_drafter(section(path, mask_token_id=7, attention="bidirectional"))
    assert spec == DrafterSpec(7, 0, "bidirectional")


def test_config_without_spec_needs_overrides(tmp_path):
    path = save_drafter(tmp_path / "plain", None)
    with pytest.raises(RecipeError) as err:
        load_drafter(section(path))
    for key in ("mask_token_id", "logits_shift", "attention"):
        assert f"drafter.{key}" in str(err.value)

    with pytest.raises(RecipeError) as err:
        load_drafter(section(path, mask_token_id=MASK))
    message = str(err.value)
    assert "drafter.logits_shift" in message and "drafter.attention" in message
    assert "mask_token_id" not in message

    _, spec = load_drafter(section(path, mask_token_id=MASK, logits_shift=1, attention="block_causal"))
    assert spec == DrafterSpec(MASK, 1, "block_causal")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_bidirectional_drafter_loads_non_causal(tmp_path, arch, attn_implementation):
    path = save_drafter(tmp_path / "drafter", DrafterSpec(MASK, 1, "bidirectional"), arch)
    model, spec = load_drafter(section(path, attn_implementation=attn_implementation))
    assert spec.attention == "bidirectional"
    assert model.config.is_causal is False
    assert model.config._attn_implementation == attn_implementation
    assert first_position_sees_last_token(model)  # the flag really reaches the attention


def test_mask_token_outside_vocabulary(tmp_path):
    path = save_drafter(tmp_path / "drafter", DrafterSpec(MASK, 0, "block_causal"))
    with pytest.raises(RecipeError, match="mask_token_id"):
        load_drafter(section(path, mask_token_id=VOCAB))
    _, spec = load_drafter(section(path, mask_token_id=VOCAB - 1))
    assert spec.mask_token_id == VOCAB - 1


def test_spec_resolution_order():
    # Known dLLM families supply logits_shift and attention; the mask token comes from their config or tokenizer.
    assert KNOWN_DLLMS["dream"] == (1, "bidirectional")
    dream = SimpleNamespace(model_type="Dream", mask_token_id=151666)
    assert drafter_spec_from_config(dream) == DrafterSpec(151666, 1, "bidirectional")
    llada = SimpleNamespace(model_type="llada")
    tokenizer = SimpleNamespace(mask_token_id=126336)
    assert drafter_spec_from_config(llada, tokenizer) == DrafterSpec(126336, 0, "bidirectional")
    with pytest.raises(RecipeError, match="mask_token_id") as err:
        drafter_spec_from_config(llada)
    assert "logits_shift" not in str(err.value)

    # config.drafter_spec beats the family defaults and the tokenizer; explicit arguments beat everything.
    stored = SimpleNamespace(model_type="dream", drafter_spec=DrafterSpec(5, 0, "block_causal").to_dict())
    assert drafter_spec_from_config(stored, tokenizer) == DrafterSpec(5, 0, "block_causal")
    assert drafter_spec_from_config(stored, tokenizer, mask_token_id=6, logits_shift=1, attention="bidirectional") == (
        DrafterSpec(6, 1, "bidirectional")
    )
    # An unknown family with nothing stored names all three keys.
    with pytest.raises(RecipeError, match="mask_token_id, logits_shift, attention"):
        drafter_spec_from_config(SimpleNamespace(model_type="llama"))


def test_drafter_spec_validates():
    with pytest.raises(ValueError):
        DrafterSpec(MASK, 2, "block_causal")
    with pytest.raises(ValueError):
        DrafterSpec(MASK, 0, "causal")
    with pytest.raises(ValueError):
        DrafterSpec(-1, 0, "block_causal")


# --------------------------------------------------------------------------------------------------------------------
# 4. verifier and drafter must share a vocabulary
# --------------------------------------------------------------------------------------------------------------------
def test_check_vocab_compatible(tmp_path):
    tiny_model("qwen2", seed=4).save_pretrained(tmp_path / "verifier")
    verifier = load_verifier(VerifierSection(path=str(tmp_path / "verifier"), device="cpu", dtype="float32"))
    assert not verifier.training

    check_vocab_compatible(verifier, tiny_model("llama", vocab=VOCAB))  # equal sizes pass

    with pytest.raises(RecipeError) as err:
        check_vocab_compatible(verifier, tiny_model("llama", vocab=48), drafter_key="ar_drafter.path")
    message = str(err.value)
    assert message.startswith("ar_drafter.path: vocabulary size 48")


# --------------------------------------------------------------------------------------------------------------------
# 5. attention masks
# --------------------------------------------------------------------------------------------------------------------
def test_block_causal_allowed():
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1],
            [1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(block_causal_allowed(3, 2), expected)


def test_block_diffusion_allowed():
    # Rows/columns 0-3: the clean copy (causal); 4-7: the noised copy in blocks of 2.
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0],
            [0, 0, 0, 0, 1, 1, 0, 0],  # noised block 0: no clean context, its own block
            [0, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 0, 0, 0, 0, 1, 1],  # noised block 1: clean block 0, its own block
            [1, 1, 0, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(block_diffusion_allowed(4, 2), expected)


def test_additive_mask():
    allowed = block_causal_allowed(2, 1)
    mask = additive_mask(allowed, torch.float32)
    assert mask.shape == (1, 3, 3) and mask.dtype == torch.float32
    assert torch.equal(mask[0] == 0, allowed)
    assert torch.all(mask[0][~allowed] == torch.finfo(torch.float32).min)


def test_cuda_means_this_ranks_gpu(monkeypatch):
    # Checked without a GPU: only the device's name is built, no memory is touched.
    from align.models import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("auto") == torch.device("cuda", 3) == resolve_device("cuda")
    monkeypatch.delenv("LOCAL_RANK")
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")


def test_dtype_auto_is_the_checkpoints_and_device_is_aligns_default(tmp_path):
    # "auto" as transformers and vLLM mean it: the dtype the checkpoint's config.json names (the tiny family is saved
    # in bf16); "device", the default, is float32 on a CPU.
    tiny = str(Path(__file__).resolve().parents[1] / "checkpoints" / "tiny" / "verifier")
    assert VerifierSection(path=tiny).dtype == "device"
    assert load_verifier(VerifierSection(path=tiny)).dtype == torch.float32
    assert load_verifier(VerifierSection(path=tiny, dtype="auto")).dtype == torch.bfloat16
    # A checkpoint saved in float16 loads in float16; one whose config names no dtype in float32.
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    LlamaForCausalLM(config).to(torch.float16).save_pretrained(tmp_path / "fp16")
    assert load_verifier(VerifierSection(path=str(tmp_path / "fp16"), dtype="auto")).dtype == torch.float16
