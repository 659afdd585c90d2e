"""The standalone masked drafter (Dream, DiffuCoder, LLaDA, the tiny drafters): `context ⊕ [MASK]×γ` in, a
distribution for every masked position out, in one forward.

Bidirectional: every position sees every other, so the context is re-encoded for each draft. Block-causal: the
context is causal and the block attends to the context and to itself, so the context KV cache is exact
(`DrafterContext`) and a draft costs O(γ) rather than O(context).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch
from transformers import DynamicCache, PreTrainedModel

from align.drafters.base import HiddenTap, VerifiedRows, Windows, with_padding_forwards
from align.drafters.noise import model_input
from align.drafters.spec import REFUSED_METHODS, DrafterSpec
from align.masks import attention_masks, block_causal_allowed, full_mask_kwargs
from align.models import forward_parameters, rollback_cache
from align.remote_code import masks_ignored


@dataclass
class DrafterContext:
    """Encoded context of a block-causal drafter: its exact KV cache and the logits of its last position."""

    cache: DynamicCache
    length: int
    last_logits: Optional[torch.Tensor]  # (B, V): what a shifted drafter predicts for the first block position

    @classmethod
    def empty(cls, model: PreTrainedModel) -> "DrafterContext":
        return cls(rollback_cache(model), 0, None)


@functools.lru_cache(maxsize=None)
def _takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def keep_logits(model: PreTrainedModel, count: int) -> dict[str, int]:
    """`logits_to_keep=count` for a forward whose caller reads only its last `count` positions, where the model takes
    it (transformers' own models do; some remote code does not). The LM head then runs on those positions alone, not
    on every new context token: for a 150k-token vocabulary, a large part of a long context's forward."""
    return {"logits_to_keep": count} if _takes_logits_to_keep(type(model)) else {}


def encode_context(
    model: PreTrainedModel, context_ids: torch.Tensor, state: Optional[DrafterContext] = None
) -> DrafterContext:
    """Extend a block-causal drafter's context cache to cover `context_ids` (B, n) — only the new tokens are run.

    The context part of a block-causal drafter is an ordinary causal LM, so its KV cache is exact and can grow
    token by token as the verifier accepts them.
    """
    if state is None:
        state = DrafterContext.empty(model)
    n = context_ids.shape[1]
    if state.length > n:
        raise ValueError(f"context shrank from {state.length} to {n} tokens; crop the DrafterContext first")
    if state.length < n:
        new = context_ids[:, state.length:]
        positions = torch.arange(state.length, n, device=context_ids.device).unsqueeze(0)
        out = model(input_ids=new, position_ids=positions, cache=state.cache, use_cache=True, **keep_logits(model, 1))
        state.length, state.last_logits = n, out.logits[:, -1]
    return state


def crop_context(state: DrafterContext, length: int) -> None:
    """Drop cached context beyond `length` tokens (after the verifier rejected part of a draft). Where a sliding-window
    layer no longer holds the keys that would leave it (`_crop_keeps_the_window`), the cache is emptied instead
    (state.length 0): the next forward re-encodes the whole context, which gives the same keys."""
    if length < state.length:
        if _crop_keeps_the_window(state.cache, state.length - length):
            state.cache.crop(length - state.length)
            state.length = length
        else:
            state.cache.reset()
            state.length = 0
        state.last_logits = None  # re-encoding the last token restores it


def _crop_keeps_the_window(cache: DynamicCache, tokens: int) -> bool:
    """Whether dropping the last `tokens` leaves every sliding-window layer the keys its next forward reads (the last
    window−1 of what remains). transformers cuts a sliding layer back to its last window−1 keys at every crop, past
    recording or not: the blocks' crop in `_cached_blocks_forward` does, so a later crop reaching further back would
    leave the layer short of keys its mask still counts."""
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) and getattr(layer, "is_initialized", False):
            remaining = layer.get_seq_length() - tokens
            if layer.keys.shape[-2] - tokens < min(remaining, layer.get_max_length() - 1):
                return False
    return True


def block_logits(
    model: PreTrainedModel,
    spec: DrafterSpec,
    context_ids: torch.Tensor,
    block_ids: torch.Tensor,
    state: Optional[DrafterContext] = None,
) -> torch.Tensor:
    """Logits predicting every position of a block that follows the context, whatever the drafter's spec.

    context_ids: (B, n) clean tokens. block_ids: (B, γ) the block, with `spec.mask_token_id` at masked positions.
    state: for a block-causal drafter, its context cache (extended here as needed); None re-encodes the context.
    Returns (B, γ, V): row i is the drafter's distribution (logits) for block position i.
    """
    n, block_len = context_ids.shape[1], block_ids.shape[1]
    if spec.logits_shift and n == 0:
        raise ValueError("a shifted drafter needs at least one context token to predict the first block position")
    block_ids = model_input(model, spec, block_ids)
    if spec.attention == "block_causal" and state is not None:
        return _cached_blocks_forward(model, spec, context_ids, block_ids.unsqueeze(1), state)[:, 0]
    ids = torch.cat([context_ids, block_ids], dim=1)
    mask = None
    if spec.attention == "block_causal":
        positions = torch.arange(n + block_len, device=ids.device)
        mask = attention_masks(model, block_causal_allowed(n, block_len, ids.device), positions)
    kept = block_len + spec.logits_shift  # positions n - shift .. n + γ - 1: the block's predictions and one more
    logits = model(input_ids=ids, attention_mask=mask, **keep_logits(model, kept)).logits[:, -kept:]
    return logits[:, :block_len]


def _cached_blocks_forward(
    model: PreTrainedModel, spec: DrafterSpec, context_ids: torch.Tensor, blocks: torch.Tensor,
    state: DrafterContext,
) -> torch.Tensor:
    """One forward for the context tokens not yet cached and K candidate blocks after them: (B, n) context,
    (B, K, b) model-input blocks -> (B, K, b, V). The new context tokens are causal and stay cached; each block sees
    the whole context and itself only, at the same positions, and never stays in the cache. Folding the context's
    extension into the blocks' forward makes a draft, or a dLLM block's first step, one model call instead of two."""
    if spec.logits_shift and state.last_logits is None and state.length == context_ids.shape[1]:
        crop_context(state, state.length - 1)  # the last logits were dropped by a crop: re-encode one token
    if state.length > context_ids.shape[1]:
        raise ValueError(f"context shrank from {state.length} to {context_ids.shape[1]} tokens; crop first")
    cached, n = state.length, context_ids.shape[1]
    batch, num_blocks, block_len = blocks.shape
    new, device = n - cached, context_ids.device
    ids = torch.cat([context_ids[:, cached:], blocks.reshape(batch, -1)], dim=1)
    positions = torch.cat([torch.arange(cached, n, device=device),
                           torch.arange(n, n + block_len, device=device).repeat(num_blocks)]).unsqueeze(0)
    # Rows and columns: new context, then the blocks side by side. A new context token sees the new ones up to itself
    # (the blocks come after it); a block token all the new context and its own block. Every row also sees the cached
    # context, through a sliding layer's window where the model has them (`attention_masks`).
    rows = ids.shape[1]
    block_of = torch.arange(num_blocks, device=device).repeat_interleave(block_len)
    allowed = torch.ones(rows, rows, dtype=torch.bool, device=device)
    allowed[:new] = allowed[:new].tril()
    allowed[new:, new:] = block_of[:, None] == block_of[None, :]
    mask = attention_masks(model, allowed, positions[0], state.cache)
    kept = num_blocks * block_len + (new > 0)  # the blocks' logits, and the last new context token's
    out = model(input_ids=ids, position_ids=positions.expand(batch, -1), attention_mask=mask, cache=state.cache,
                use_cache=True, **keep_logits(model, kept))
    state.cache.crop(-num_blocks * block_len)  # the blocks are guesses: they never stay in the context cache
    if new:
        state.length, state.last_logits = n, out.logits[:, -kept]
    logits = out.logits[:, -num_blocks * block_len:].view(batch, num_blocks, block_len, -1)
    if not spec.logits_shift:
        return logits
    # Shifted: block position 0 is predicted by the last context position, position i by block position i-1.
    first = state.last_logits[:, None, None].expand(-1, num_blocks, -1, -1)
    return torch.cat([first, logits[:, :, :-1]], dim=2)


def shared_context_block_logits(
    model: PreTrainedModel,
    spec: DrafterSpec,
    context_ids: torch.Tensor,
    blocks: torch.Tensor,
    state: Optional[DrafterContext] = None,
) -> torch.Tensor:
    """Logits for K candidate blocks that follow the same context, in one forward. (1, n), (K, b) -> (K, b, V).

    For a cached block-causal drafter the K blocks are laid side by side in a single row after the context (and
    after any context tokens not cached yet, which this forward caches): each sees the context and itself only, at
    the same positions, so every row of the result is exactly what `block_logits` gives for that block alone (Spiffy
    evaluates the real state and all its draft states this way). Other drafters batch the K blocks, each with its
    own copy of the context.
    """
    num_blocks = blocks.shape[0]
    if spec.attention != "block_causal" or state is None:
        return block_logits(model, spec, context_ids.expand(num_blocks, -1), blocks)
    return _cached_blocks_forward(model, spec, context_ids, model_input(model, spec, blocks)[None], state)[0]


# --------------------------------------------------------------------------------------------------------------------
# training windows
# --------------------------------------------------------------------------------------------------------------------
def masked_window_logits(model: Any, spec: DrafterSpec, batch: Windows, forwards: int = 0) -> torch.Tensor:
    """(B, W, γ, V): every window of the batch in one forward, each masked block read at the positions it replaces
    (the builders' layouts: align/windows.py); a drafter that drops masks, a forward per row (`rows_read_alone`).

    forwards: make at least this many forwards of the model (see `masked_window_forwards`)."""
    if spec.noise != "mask":
        raise ValueError(f"windows fill noised positions with the mask token; noise {spec.noise!r} is read only by "
                         "the canvas-decoder families (DiffusionGemma)")
    mask = batch.attention_mask.to(model.dtype) if model.dtype != torch.float32 else batch.attention_mask
    decoder = model.get_decoder()
    if "position_ids" not in forward_parameters(decoder):
        return _whole_model_window_logits(model, spec, batch, mask, forwards)
    # Per layer type: a sliding layer's window applies in training as it does when drafting (a 4-D mask is used as
    # given, so the window must be in it).
    masks = attention_masks(model, batch.attention_mask[:, 0] == 0, batch.position_ids)
    hidden = decoder(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=masks).last_hidden_state
    B, W, gamma = batch.targets.shape
    width = hidden.shape[-1]
    index = (batch.block_index[..., None] + torch.arange(gamma, device=hidden.device)).view(B, -1)  # (B, W·γ)
    window_hidden = hidden.gather(1, index[..., None].expand(-1, -1, width)).view(B, W, gamma, width)
    if spec.logits_shift:
        # Position start+i is predicted at start+i-1: the clean token before the window, then the window's own.
        before = hidden.gather(1, (batch.starts - 1).clamp_min(0)[..., None].expand(-1, -1, width))
        window_hidden = torch.cat([before.unsqueeze(2), window_hidden[:, :, :-1]], dim=2)
    return model.get_output_embeddings()(window_hidden)


def _whole_model_window_logits(model: Any, spec: DrafterSpec, batch: Windows, mask: torch.Tensor,
                               forwards: int = 0) -> torch.Tensor:
    """(B, W, γ, V) through the whole model, for drafters whose decoder takes no position ids and returns logits
    (LLaDA: RoPE positions are always 0..T-1, which is what a bidirectional window uses)."""
    B, W, gamma = batch.targets.shape
    offsets = torch.arange(gamma, device=batch.input_ids.device)
    if not torch.equal(batch.position_ids, torch.arange(batch.input_ids.shape[1], device=offsets.device).expand(
            batch.input_ids.shape[0], -1)):
        raise ValueError(f"{type(model).__name__} takes no position ids; only windows at positions 0..T-1 "
                         "(bidirectional windows) can be read from it")
    if masks_ignored(model):
        logits = _unpadded_rows_logits(model, batch.input_ids, mask, forwards)
    else:
        logits = model(input_ids=batch.input_ids, **full_mask_kwargs(model, mask)).logits  # (B, T, V)
    # Position start+i is read at start+i-shift; a shifted window's first position at the clean token before it.
    index = batch.block_index[..., None] + offsets - spec.logits_shift  # (B, W, γ)
    if spec.logits_shift:
        index[..., 0] = (batch.starts - 1).clamp_min(0)
    return logits.gather(1, index.view(B, -1, 1).expand(-1, -1, logits.shape[-1])).view(B, W, gamma, -1)


def rows_read_alone(model: Any) -> bool:
    """Whether `masked_window_logits` reads `model`'s windows a row at a time: a model that drops attention masks
    and takes no position ids (LLaDA), whose padded rows must each run alone, cut to their real tokens."""
    return masks_ignored(model) and "position_ids" not in forward_parameters(model.get_decoder())


def masked_window_forwards(model: Any, batch: Windows) -> int:
    """How many forwards `masked_window_logits` makes of `model` for `batch`: one, or one per row where rows are read
    alone. A bidirectional batch has a row per window, so ranks' counts differ; under ZeRO-3, where each forward is a
    collective, ranks agree on the most before any runs."""
    return batch.input_ids.shape[0] if rows_read_alone(model) else 1


def _unpadded_rows_logits(model: Any, input_ids: torch.Tensor, mask: torch.Tensor, forwards: int = 0) -> torch.Tensor:
    """(B, T, V) logits of right-padded rows for a model that drops attention masks (LLaDA): each row alone, cut to
    its real tokens, needs no mask; the padding positions get zero logits (no window reads them).

    input_ids: (B, T); mask: (B, 1, T, T) additive, which must hide exactly each row's right padding from its tokens.
    forwards: make at least this many forwards, the ones beyond B on the first row's first token
    (with_padding_forwards: a rank with fewer rows makes as many collectives under ZeRO-3).
    """
    B, T = input_ids.shape
    lengths = (mask[:, 0, 0] == 0).sum(-1)  # the keys a row's first token attends to: its real tokens
    for b, n in enumerate(lengths.tolist()):
        real = torch.arange(T, device=mask.device) < n
        if not torch.equal(mask[b, 0, :n] == 0, real.expand(n, -1)):  # what the real tokens see, and only that
            raise ValueError(f"{type(model).__name__} ignores attention masks, and this batch's mask is more than "
                             "right padding")
    rows = [model(input_ids=input_ids[b : b + 1, : int(n)]).logits[0] for b, n in enumerate(lengths)]
    out = torch.stack([torch.nn.functional.pad(row, (0, 0, 0, T - row.shape[0])) for row in rows])
    return with_padding_forwards(out, forwards - B, lambda: model(input_ids=input_ids[:1, :1]).logits)


# --------------------------------------------------------------------------------------------------------------------
# the drafter
# --------------------------------------------------------------------------------------------------------------------
class MaskedDrafter:
    """A standalone masked drafter (the `Drafter` interface). A block-causal one keeps an exact context cache across
    a generation, which only ever grows (drafts never enter it); a bidirectional one re-reads its context each time."""

    verifier_states: Optional[HiddenTap] = None
    refused_methods: tuple[str, ...] = REFUSED_METHODS["standalone"]

    def __init__(self, model: PreTrainedModel, spec: DrafterSpec) -> None:
        self.model, self.spec = model, spec
        self.state: Optional[DrafterContext] = None

    def begin(self) -> None:
        self.state = DrafterContext.empty(self.model) if self.spec.attention == "block_causal" else None

    def propose(self, verifier: PreTrainedModel, context_ids: torch.Tensor, length: int) -> torch.Tensor:
        block = context_ids.new_full((1, length), self.spec.mask_token_id)
        return block_logits(self.model, self.spec, context_ids, block, self.state)[0]

    def verified(self, rows: VerifiedRows) -> None:
        """Nothing to keep: the context cache grows by the accepted tokens at the next draft."""

    def encode(self, context_ids: torch.Tensor) -> int:
        return 0  # a block's first forward brings the context cache up to date (`_cached_blocks_forward`)

    def block_logits(self, context_ids: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        return shared_context_block_logits(self.model, self.spec, context_ids, blocks, self.state)

    def window_forwards(self, batch: Windows) -> int:
        return masked_window_forwards(self.model, batch)

    def window_logits(self, batch: Windows, verifier: Any = None,
                      forwards: int = 0) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return masked_window_logits(self.model, self.spec, batch, forwards), None
