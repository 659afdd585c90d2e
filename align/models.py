"""The model layer: load verifier, diffusion drafter, AR drafter and tokenizer; the DrafterSpec; attention masks
and noise. Reading a drafter (its draft logits, its training windows) is align/drafters/'s.

A diffusion drafter is a masked discrete-diffusion LM: given `context ⊕ [MASK]×γ` it returns a distribution for every
masked position in one forward pass. Three facts describe how to read it, and getting any of them wrong silently
destroys acceptance, so they live in one place (`DrafterSpec`) and one package reads logits for all of them
(align/drafters, `drafter_for`):

- `mask_token_id`: the token that marks a masked position (from the tokenizer, never a literal);
- `logits_shift`: 0 when the prediction for position t is at logits[t] (LLaDA); 1 when it is at logits[t-1] (Dream,
  DiffuCoder and other models adapted from AR checkpoints);
- `attention`: `bidirectional` (every position sees every other: the context is re-encoded for each draft) or
  `block_causal` (the context is causal and the block attends to the context and to itself: the context KV cache is
  exact, so a draft costs O(γ) rather than O(context));
- `noise`: what the model reads at a noised position: the mask token, or (DiffusionGemma) a token drawn uniformly
  from the vocabulary. align marks noised positions with `mask_token_id` everywhere and `noise_fill` swaps in the
  family's fill where the model reads a block.

DiffusionGemma (`DiffusionGemmaForBlockDiffusion`) is block-causal in two modules that share their weights: a causal
encoder writes the context KV cache and a bidirectional decoder denoises a canvas reading that cache without writing
it (the CANVAS_DECODER_FAMILIES; align/drafters/canvas.py reads it).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from typing import Any, Iterator, Optional, Union

import torch
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer,
                          DynamicCache)
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache, get_layer_types_and_kwargs
from transformers.masking_utils import (find_first_full_attention_index, sliding_window_bidirectional_overlay,
                                       sliding_window_overlay)

from align.checkpoint import adapter_base, is_adapter_folder, merge_adapter
from align.config import ModelSection, RecipeError
from align.disk import verify_checksums
# Remote code written for transformers 4 (Dream, DiffuCoder, LLaDA) goes through named compatibility shims as it loads.
from align.remote_code import MASKS_IGNORED, honours_attention_masks, masks_ignored
from align.remote_code import install as install_remote_code_shims
# Registers the DFlash drafter's config and model with transformers' Auto classes, so that `_load` reads it.
from align.dflash import DFlashDrafter, config_for_verifier, is_dflash
# The DrafterSpec and its checks need no torch, so that cli can check a drafter's config before loading anything; they
# live in align/families.py and align/preflight.py and are part of this module's interface.
from align.families import (ATTENTION_MODES, CANVAS_DECODER_FAMILIES, KNOWN_DLLMS, Attention, DrafterSpec,  # noqa: F401
                            drafter_spec_from_config)
from align.preflight import check_vocab_compatible, context_length  # noqa: F401

install_remote_code_shims()

# --------------------------------------------------------------------------------------------------------------------
# devices, dtypes
# --------------------------------------------------------------------------------------------------------------------
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """The device a model goes to. CUDA means this rank's GPU, cuda:LOCAL_RANK (a bare "cuda" is whatever device is
    current, GPU 0 unless set: every rank of `align trajectories --num_gpus 8` would stack its model there)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RecipeError("device: cuda was asked for, but no CUDA device is visible (use device=auto or cpu)")
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    # On CPU fp32 is the default: batch-1 decoding is no faster in bf16 there, and fp32 keeps greedy checks exact.
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


# --------------------------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------------------------
def load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def _load(section: ModelSection, **config_overrides: Any) -> PreTrainedModel:
    if os.path.isdir(section.path):  # a folder align wrote is read only if its files match their checksums
        verify_checksums(section.path)  # (already done, and cached, where cli checked the models)
        if is_adapter_folder(section.path):
            # A LoRA step_<N>/ of align train: its base drafter (checked unchanged), with the adapter merged in memory.
            base = _load(section.model_copy(update={"path": adapter_base(section.path)}), **config_overrides)
            return merge_adapter(base, section.path)
    device = resolve_device(section.device)
    kwargs = dict(
        dtype=resolve_dtype(section.dtype, device),
        trust_remote_code=section.trust_remote_code,
        **_attention_kwargs(section, config_overrides.get("config")),
        **config_overrides,
    )
    try:
        model = AutoModelForCausalLM.from_pretrained(section.path, **kwargs)
    except ValueError:
        try:
            # DiffusionGemmaForBlockDiffusion is registered under AutoModelForImageTextToText only (AutoModel would
            # build DiffusionGemmaModel, without its LM head).
            model = AutoModelForImageTextToText.from_pretrained(section.path, **kwargs)
        except ValueError:
            # LLaDA and Dream register their LM under AutoModel only.
            model = AutoModel.from_pretrained(section.path, **kwargs)
    if section.trust_remote_code:
        _restore_computed_buffers(model)
    model.to(device).eval()
    model.requires_grad_(False)
    return model


def _restore_computed_buffers(model: PreTrainedModel) -> None:
    """Recompute the non-persistent buffers of remote code written for transformers 4.

    transformers 5 builds a model on the meta device and fills what the checkpoint holds and what the model's
    `_init_weights` sets; a non-persistent buffer that the code computes in `__init__` (Dream's and DiffuCoder's rotary
    `inv_freq`) is left as uninitialised memory, and the model silently reads garbage positions. A skeleton built with
    its parameters on the meta device (no memory) and its buffers on the CPU gives the values `__init__` computes."""
    computed = dict(model.named_non_persistent_buffers())
    if not computed:
        return
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        skeleton = type(model)(model.config)
    for name, value in skeleton.named_non_persistent_buffers():
        if name in computed:
            module_name, _, leaf = name.rpartition(".")
            old = computed[name]
            model.get_submodule(module_name).register_buffer(leaf, value.to(old.device, old.dtype), persistent=False)


def _attention_kwargs(section: ModelSection, config: Any = None) -> dict[str, str]:
    """`attn_implementation` for transformers to honour, unless the model is remote code that does not declare it:
    LLaDA calls scaled_dot_product_attention itself and never tells transformers, which then refuses "sdpa"."""
    if section.attn_implementation == "sdpa" and section.trust_remote_code:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        config = config or AutoConfig.from_pretrained(section.path, trust_remote_code=True)
        auto_map = getattr(config, "auto_map", None) or {}
        reference = auto_map.get("AutoModelForCausalLM") or auto_map.get("AutoModel")
        if reference and not getattr(get_class_from_dynamic_module(reference, section.path), "_supports_sdpa", False):
            return {}
    return {"attn_implementation": section.attn_implementation}


def load_verifier(section: ModelSection) -> PreTrainedModel:
    """The frozen AR verifier, in eval mode."""
    return _load(section)


def load_ar_drafter(section: ModelSection) -> PreTrainedModel:
    return _load(section)


@contextlib.contextmanager
def partitioned_loading(deepspeed_config: Optional[dict[str, Any]]) -> Iterator[None]:
    """While inside, under a ZeRO-3 DeepSpeed config, each parameter `from_pretrained` builds is partitioned across
    the ranks as it is created and filled from the checkpoint one tensor at a time (transformers' `deepspeed.zero.Init`
    path, switched on while an HfDeepSpeedConfig object lives: it keeps a weak reference only): no rank holds the
    whole model, on its device or in host memory. The drafter's loading only: a frozen verifier runs outside the
    engine and must be whole. A no-op for None or another stage."""
    if not deepspeed_config or deepspeed_config["zero_optimization"]["stage"] != 3:
        yield
        return
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    switch = HfDeepSpeedConfig(deepspeed_config)
    try:
        yield
    finally:
        del switch
        unset_hf_deepspeed_config()


def is_partitioned(model: Any) -> bool:
    """Whether `model`'s parameters are ZeRO-3 partitions (DeepSpeed marks each with `ds_id`; `.data` is then empty
    between forwards and the full shape is `ds_shape`)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def load_drafter(
    section: Any, tokenizer: Optional[PreTrainedTokenizerBase] = None
) -> tuple[PreTrainedModel, DrafterSpec]:
    """The diffusion drafter and its spec. `section` is a DrafterSection (its spec fields override the config's).
    Inside `partitioned_loading` the weights come partitioned, and the check that remote code reads its masks (a
    forward, which needs whole weights) is left to `check_masks_are_read` once DeepSpeed's engine gathers them."""
    config = AutoConfig.from_pretrained(section.path, trust_remote_code=section.trust_remote_code)
    spec = drafter_spec_from_config(
        config, tokenizer, section.mask_token_id, section.logits_shift, section.attention
    )
    # A bidirectional drafter must never get transformers' default causal mask; a block-causal one keeps the causal
    # default for its context and receives an explicit block mask where it is read (align/drafters/masked.py). The flag is set on the config
    # object rather than passed as a `from_pretrained` kwarg: configs without an `is_causal` attribute (Llama, Qwen2)
    # would hand the kwarg to the model's __init__, which rejects it.
    overrides = {}
    if spec.attention == "bidirectional":
        config.is_causal = False
        overrides["config"] = config
    model = _load(section, **overrides)
    if spec.mask_token_id >= vocab_size(model):
        raise RecipeError(f"drafter.mask_token_id: {spec.mask_token_id} is outside the vocabulary ({vocab_size(model)})")
    # A canvas decoder and a DFlash drafter build their own masks; every other drafter reads the masks align builds.
    reads_align_masks = not is_canvas_decoder(model) and not is_dflash(model)
    if spec.attention == "block_causal" and reads_align_masks:
        check_mask_layer_types(model, "drafter")  # its block mask is align's: refused now, not at the first draft
    if section.trust_remote_code and reads_align_masks and not is_partitioned(model):
        check_masks_are_read(model, spec)
    return model, spec


def check_masks_are_read(model: PreTrainedModel, spec: DrafterSpec) -> None:
    """Remote code may drop the masks it is handed (LLaDA's attention hard-codes `attn_mask=None`). Such a drafter is
    marked (`MASKS_IGNORED`) so that no padded batch relies on one (`full_mask_kwargs` refuses, the training windows
    run row by row unpadded); a block-causal drafter, whose every forward needs its block mask, is refused. Two
    forwards in eval mode (dropout would tell the two apart): under ZeRO-3 every rank must make them (collectives)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        honoured = honours_attention_masks(model, full_mask_kwargs, vocab_size(model))
    model.train(was_training)
    if honoured:
        return
    if spec.attention == "block_causal":
        raise RecipeError(f"drafter.attention: {type(model).__name__} ignores attention masks, and block_causal "
                          "drafting needs one; use drafter.attention=bidirectional")
    setattr(model, MASKS_IGNORED, True)


def new_dflash_drafter(verifier: ModelSection, settings: Any, drafter: ModelSection, mask_token_id: int,
                       gamma: int) -> tuple[PreTrainedModel, DrafterSpec]:
    """A DFlash drafter with random weights, shaped to the verifier at `verifier.path` (settings: a DFlashSection),
    on `drafter`'s device and dtype, marking masked positions with `mask_token_id` (mask_token.dflash_mask_token)."""
    verifier_config = AutoConfig.from_pretrained(verifier.path, trust_remote_code=verifier.trust_remote_code)
    num_layers = verifier_config.get_text_config().num_hidden_layers
    if settings.aux_layer_ids and max(settings.aux_layer_ids) >= num_layers:
        raise RecipeError(f"dflash.aux_layer_ids: {settings.aux_layer_ids} must be below the verifier's {num_layers} "
                          "layers (id k is the input of layer k)")
    config = config_for_verifier(verifier_config, mask_token_id, settings.num_layers,
                                 settings.intermediate_size, settings.aux_layer_ids, settings.block_size or gamma + 1)
    device = resolve_device(drafter.device)
    model = DFlashDrafter(config).to(device=device, dtype=resolve_dtype(drafter.dtype, device))
    return model, drafter_spec_from_config(config)


def vocab_size(model: PreTrainedModel) -> int:
    if is_dflash(model):  # it has no LM head of its own: it uses the verifier's
        return int(model.config.vocab_size)
    weight = model.get_output_embeddings().weight
    return getattr(weight, "ds_shape", weight.shape)[0]  # a ZeRO-3 partition's own shape is empty


def config_vocab_size(model: PreTrainedModel) -> int:
    """The vocabulary the model's config declares (on its text part for multimodal configs): unlike the output
    embeddings' shape, it is known under ZeRO-3, which partitions the weights away between forwards."""
    return int(model.config.get_text_config().vocab_size)


def forward_parameters(model: Any) -> set[str]:
    """The keyword arguments `model`'s forward takes (through a peft wrapper): remote code takes other ones."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # through a peft wrapper
    return set(inspect.signature(base.forward).parameters)


def full_mask_kwargs(model: Any, mask: Optional[torch.Tensor]) -> dict[str, Optional[torch.Tensor]]:
    """The keyword that carries a 4-D additive mask (B, 1, q, k) into `model`'s forward: `attention_mask` for
    transformers models and Dream; LLaDA reads `attention_mask` as a 2-D padding mask and takes 4-D masks as
    `attention_bias`."""
    key = "attention_bias" if "attention_bias" in forward_parameters(model) else "attention_mask"
    if mask is not None and masks_ignored(model) and bool((mask < 0).any()):
        raise ValueError(f"{type(model).__name__} ignores attention masks: a batch that needs one (padding, blocks) "
                         "cannot be read from it; send rows unpadded")
    return {key: mask}


# --------------------------------------------------------------------------------------------------------------------
# attention masks
# --------------------------------------------------------------------------------------------------------------------
def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (..., q, k) -> float (..., 1, q, k) with 0 where allowed and the dtype's minimum elsewhere.

    Float rather than bool: 4-D bool masks are not handled alike by every attention kernel (flex_attention crashed).
    """
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, blocked).unsqueeze(-3)


# Layer types align builds attention masks for: full causal attention, and a sliding window over positions.
MASK_LAYER_TYPES = ("full_attention", "sliding_attention")


def attention_layer_types(model: PreTrainedModel) -> list[str]:
    """Each layer's attention type, as transformers' own cache and masks read the model: the config's `layer_types`,
    or, for a config without them (Mistral, Phi-3, StarCoder2), "sliding_attention" for every layer when
    `sliding_window` is set. Asked of `get_layer_types_and_kwargs`, the function `DynamicCache(config=)` builds its
    layers with, rather than re-derived: the sliding cache layers are what hand a forward fewer keys, and those
    models mask with a window exactly when it says so (Mistral: iff `config.sliding_window` is set)."""
    text_config = model.config.get_text_config(decoder=True)
    declared = getattr(text_config, "layer_types", None)
    return list(declared) if declared else get_layer_types_and_kwargs(text_config)[0]


def check_mask_layer_types(model: PreTrainedModel, who: str) -> None:
    """Refuse, with a one-line RecipeError naming `who`, a model whose layers take masks `attention_masks` cannot
    build (chunked attention, linear attention, ...)."""
    unknown = set(attention_layer_types(model)) - set(MASK_LAYER_TYPES)
    if unknown:
        raise RecipeError(f"{who}: the model has {', '.join(sorted(unknown))} layers; align builds attention masks "
                          f"for {' and '.join(MASK_LAYER_TYPES)} only")


def attention_masks(
    model: PreTrainedModel, allowed: torch.Tensor, positions: torch.Tensor, cache: Optional[Cache] = None
) -> Union[torch.Tensor, dict[str, torch.Tensor]]:
    """The additive masks of a forward of q new tokens over what `cache` holds, in the form `model` reads them.

    allowed: bool (q, q) or (B, q, q), which new tokens each new token attends to; positions: (q,) or (B, q), their
    positions. Every new token also sees the cached keys its layer's cache hands back (`get_mask_sizes`: all of a full
    layer's, the last window−1 of a sliding layer's), all before it. A sliding-window layer's mask hides, on top, every
    key `sliding_window` or more positions before the query (transformers' own `sliding_window_overlay`; for a model
    made bidirectional, `config.is_causal` false, its `sliding_window_bidirectional_overlay`, every key more than the
    window away), so a forward with these masks computes what the model's own masks would for the same keys at the
    same positions; a 4-D mask is used as given, so without that the window would be lost (and the mask's width would
    not match a sliding layer's keys once the cache holds more than the window).

    Returns (B, 1, q, kv) additive masks: one tensor for a model without `layer_types` (Llama; Mistral, whose layers
    all slide), else a dict per layer type, which such models take (Qwen2, Gemma).
    """
    check_mask_layer_types(model, type(model).__name__)
    text_config = model.config.get_text_config(decoder=True)
    layer_types = attention_layer_types(model)
    if allowed.dim() == 2:
        allowed, positions = allowed[None], positions[None]
    batch, q = allowed.shape[0], allowed.shape[-1]
    overlay = sliding_window_overlay if getattr(text_config, "is_causal", True) else sliding_window_bidirectional_overlay

    def mask_for(layer_type: str) -> torch.Tensor:
        sliding = layer_type == "sliding_attention"
        cached_keys, offset = 0, 0
        if cache is not None:
            # The cache layer transformers' own mask functions size the mask of this layer type by.
            if sliding:
                layer_idx = cache.is_sliding.index(True) if True in cache.is_sliding else 0
            else:
                layer_idx = find_first_full_attention_index(cache)
            kv_length, offset = cache.get_mask_sizes(q, layer_idx)
            cached_keys = kv_length - q
        cached_positions = torch.arange(offset, offset + cached_keys, device=positions.device).expand(batch, -1)
        key_positions = torch.cat([cached_positions, positions], dim=-1)  # (B, kv)
        sees = torch.cat([allowed.new_ones(batch, q, cached_keys), allowed], dim=-1)  # (B, q, kv)
        if sliding:
            in_window = overlay(text_config.sliding_window)
            sees = sees & in_window(None, None, positions[:, :, None], key_positions[:, None, :])
        return additive_mask(sees, model.dtype)

    if getattr(text_config, "layer_types", None):
        return {layer_type: mask_for(layer_type) for layer_type in set(layer_types)}
    if len(set(layer_types)) > 1:
        raise RecipeError(f"{type(model).__name__}: layers of types {sorted(set(layer_types))} without `layer_types` "
                          "in its config; align cannot tell which mask each layer reads")
    return mask_for(layer_types[0])


def block_causal_allowed(context_len: int, block_len: int, device: torch.device | None = None) -> torch.Tensor:
    """bool (context_len + block_len, context_len + block_len): causal context, block sees context and itself."""
    total = context_len + block_len
    allowed = torch.ones(total, total, dtype=torch.bool, device=device).tril()
    allowed[context_len:, context_len:] = True
    return allowed


def block_diffusion_allowed(seq_len: int, block_size: int, device: torch.device | None = None) -> torch.Tensor:
    """bool (2L, 2L) for training a block-causal drafter on `clean ⊕ noised` copies of one sequence at once.

    The clean copy is causal (it plays the cached context); a noised block sees the clean tokens of the blocks before
    it and its own noised block, exactly what it sees at draft time, so every block of the sequence trains in one pass
    (as block-diffusion LMs train).
    """
    idx = torch.arange(seq_len, device=device)
    block = idx // block_size
    clean_clean = idx[None, :] <= idx[:, None]
    noised_clean = idx[None, :] < (block * block_size)[:, None]
    noised_noised = block[None, :] == block[:, None]
    top = torch.cat([clean_clean, torch.zeros_like(clean_clean)], dim=1)
    bottom = torch.cat([noised_clean, noised_noised], dim=1)
    return torch.cat([top, bottom], dim=0)


# --------------------------------------------------------------------------------------------------------------------
# noise: what the model reads at a noised position
# --------------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _uniform_fill(vocab: int, seed: int, length: int, device: torch.device) -> torch.Tensor:
    # Drawn on the CPU, whatever the model's device: the fill is a constant of the spec, like a mask token id, and a
    # CUDA generator draws other numbers from the same seed. So windows (built on the CPU) train on exactly the
    # canvas that drafts on a GPU read, and a draft is reproducible across machines. A CPU draw of `length` tokens is
    # the prefix of any longer draw from the same seed, so drafts of different lengths (ADL) share their fill.
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=generator, device="cpu").to(device)


def noise_fill(spec: DrafterSpec, vocab: int, block_ids: torch.Tensor) -> torch.Tensor:
    """What the model reads for a block: (..., L) with `spec.mask_token_id` at noised positions -> (..., L).

    noise "mask": the block as it is. noise "uniform" (DiffusionGemma, whose generate() initialises and renoises its
    canvas with torch.randint over the vocabulary): block position i, when noised, reads token i of one fixed uniform
    draw (seed `spec.noise_seed`). Fixed, so that drafts are deterministic and training noises exactly as drafting
    does; uniform, so that it is a sample of the noise the model was trained to denoise.
    """
    if spec.noise == "mask":
        return block_ids
    fill = _uniform_fill(vocab, spec.noise_seed, block_ids.shape[-1], block_ids.device)
    return torch.where(block_ids == spec.mask_token_id, fill, block_ids)


def model_input(model: PreTrainedModel, spec: DrafterSpec, block_ids: torch.Tensor) -> torch.Tensor:
    """`noise_fill` for `model`'s vocabulary (read only for uniform noise: remote-code configs may not name it)."""
    return block_ids if spec.noise == "mask" else noise_fill(spec, config_vocab_size(model), block_ids)


# --------------------------------------------------------------------------------------------------------------------
# a model's family and caches
# --------------------------------------------------------------------------------------------------------------------
def is_canvas_decoder(model: PreTrainedModel) -> bool:
    """DiffusionGemma-style (config.CANVAS_DECODER_FAMILIES): a causal encoder writes the context cache
    (`model.get_encoder()`), a bidirectional decoder reads it to denoise the canvas (`model(decoder_input_ids=...,
    cache=...)`)."""
    return getattr(model.config, "model_type", None) in CANVAS_DECODER_FAMILIES


def rollback_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty KV cache for `model` that speculative decoding can crop back after a rejection. Sliding-window layers
    (Gemma, Mistral-style) otherwise drop what falls out of the window, and refuse to crop once it is full."""
    with torch.device(model.device):  # sliding layers make a tensor of their window size at construction
        cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    return cache
