"""Attention masks align builds and hands to models: additive 4-D masks in the form each model reads them (per layer
type, with transformers' sliding windows), the block-causal and block-diffusion patterns drafters read, and the
keyword that carries a mask into a model's forward (remote code takes other ones).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, get_layer_types_and_kwargs
from transformers.masking_utils import (find_first_full_attention_index, sliding_window_bidirectional_overlay,
                                       sliding_window_overlay)

from align.config import RecipeError
from align.models import forward_parameters
from align.remote_code import masks_ignored


def full_mask_kwargs(model: Any, mask: Optional[torch.Tensor]) -> dict[str, Optional[torch.Tensor]]:
    """The keyword that carries a 4-D additive mask (B, 1, q, k) into `model`'s forward: `attention_mask` for
    transformers models and Dream; LLaDA reads `attention_mask` as a 2-D padding mask and takes 4-D masks as
    `attention_bias`."""
    key = "attention_bias" if "attention_bias" in forward_parameters(model) else "attention_mask"
    if mask is not None and masks_ignored(model) and bool((mask < 0).any()):
        raise ValueError(f"{type(model).__name__} ignores attention masks: a batch that needs one (padding, blocks) "
                         "cannot be read from it; send rows unpadded")
    return {key: mask}


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
