"""The canvas decoder (DiffusionGemma, `DiffusionGemmaForBlockDiffusion`): block-causal in two modules that share their
weights. A causal encoder writes the context KV cache (`model.get_encoder()`); a bidirectional decoder denoises a
canvas reading that cache without writing it (`model(decoder_input_ids=..., cache=...)`). Canvas position i predicts
token n + i (no shift); noised positions read the family's uniform fill (`models.noise_fill`).
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from transformers import DynamicCache, PreTrainedModel

from align.drafters.base import HiddenTap, VerifiedRows, Windows, with_padding_forwards
from align.drafters.masked import DrafterContext
from align.drafters.noise import model_input
from align.drafters.spec import REFUSED_METHODS, DrafterSpec
from align.masks import additive_mask, attention_layer_types


def canvas_context(model: PreTrainedModel) -> DrafterContext:
    """An empty context: a plain cache, as DiffusionGemma's own generate() uses. Its decoder concatenates a sliding
    layer's cached keys with the canvas and must find exactly the last window−1 tokens its mask describes (past
    recording keeps more). Drafts never enter this cache, so it is never cropped back past the window."""
    with torch.device(model.device):  # sliding layers make a tensor of their window size at construction
        return DrafterContext(DynamicCache(config=model.config.get_text_config(decoder=True)), 0, None)


def encode_canvas_context(model: PreTrainedModel, context_ids: torch.Tensor, state: DrafterContext) -> DrafterContext:
    """The encoder brings the context cache up to `context_ids` (B, n), running only the new tokens. The encoder has
    no LM head: last_logits stays None, which an unshifted drafter never reads."""
    n = context_ids.shape[1]
    if state.length > n:
        raise ValueError(f"context shrank from {state.length} to {n} tokens; crop the DrafterContext first")
    if state.length < n:
        positions = torch.arange(state.length, n, device=context_ids.device).unsqueeze(0)
        model.get_encoder()(input_ids=context_ids[:, state.length:], position_ids=positions, cache=state.cache,
                            use_cache=True)
        state.length = n
    return state


def canvas_logits(
    model: PreTrainedModel,
    spec: DrafterSpec,
    context_ids: torch.Tensor,
    canvas_ids: torch.Tensor,
    state: Optional[DrafterContext] = None,
) -> torch.Tensor:
    """The encoder brings the context cache up to `context_ids`, then the decoder denoises the canvas reading that
    cache (read-only). (B, n) or (1, n), (K, γ) -> (K, γ, V); with a (1, n) context the K canvases share its cache.
    Canvas position i predicts token n + i (no shift).

    One denoising step, as a draft needs: no self-conditioning logits, which is what DiffusionGemma's own generate()
    passes at the first step of every canvas. `state` None re-encodes the context in a fresh cache.
    """
    if spec.logits_shift and context_ids.shape[1] == 0:
        raise ValueError("a shifted drafter needs at least one context token to predict the first block position")
    if state is None:
        state = canvas_context(model)
    encode_canvas_context(model, context_ids, state)
    n, (num_canvases, canvas_len) = state.length, canvas_ids.shape
    canvas = model_input(model, spec, canvas_ids)
    positions = torch.arange(n, n + canvas_len, device=canvas.device).unsqueeze(0).expand(num_canvases, -1)
    cache = state.cache if context_ids.shape[0] == num_canvases else _shared_cache(state.cache, num_canvases)
    return model(decoder_input_ids=canvas, cache=cache, decoder_position_ids=positions).logits  # (K, γ, V)


def _shared_cache(cache: DynamicCache, batch: int) -> DynamicCache:
    """A view of a batch-1 cache as a batch of `batch` rows, for a decoder that only reads it (no copy is made here;
    the decoder concatenates the canvas keys onto new tensors). The layers' bookkeeping (lengths, windows) is kept."""
    view = copy.copy(cache)
    view.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in view.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys.expand(batch, -1, -1, -1)
            layer.values = layer.values.expand(batch, -1, -1, -1)
    return view


def canvas_window_logits(model: Any, spec: DrafterSpec, batch: Windows, forwards: int = 0) -> torch.Tensor:
    """(B, W, γ, V), with gradients, exactly as it drafts, in one encoder and one decoder pass for the whole batch:
    under ZeRO-3 each pass gathers the drafter (~52 GB for DiffusionGemma 26B), so one pass a window would gather it
    2 × windows times a micro-batch.

    The encoder runs once over each row's context (B, n), keeping every layer's keys whole. The decoder then
    denoises all the rows' window canvases at once (B, W·γ; noised positions filled by `noise_fill`, no
    self-conditioning), each canvas at its own positions and masked to read what its draft would: on full-attention
    layers the context before its start, on sliding layers the last sliding_window − 1 tokens of it (what a draft's
    sliding cache keeps), and its own canvas, bidirectionally. Unused window slots (padding) get zero logits, masked
    out of every loss.

    forwards: make at least this many pass pairs (with_padding_forwards: ranks agree on the count under ZeRO-3; this
    path always makes one).
    """
    B, W, gamma = batch.targets.shape
    device = batch.clean_ids.device
    used = batch.target_mask[:, :, 0]  # (B, W)
    starts = torch.where(used, batch.starts.to(device), 0)  # (B, W); an unused slot reads nothing of the context
    n = max(int(starts.max()), 1)  # (one token at least: a batch of no windows still makes its passes)
    cache = DynamicCache()  # without a config every layer keeps all its keys: the windows read different spans
    model.get_encoder()(input_ids=batch.clean_ids[:, :n], position_ids=torch.arange(n, device=device).unsqueeze(0),
                        cache=cache, use_cache=True)
    block = torch.full((1, gamma), spec.mask_token_id, dtype=torch.long, device=device)
    canvas = model_input(model, spec, block)
    offsets = torch.arange(gamma, device=device)
    positions = (starts[:, :, None] + offsets).flatten(1)  # (B, W·γ)
    logits = model(decoder_input_ids=canvas.repeat(B, W), cache=cache, decoder_position_ids=positions,
                   decoder_attention_mask=_window_masks(model, starts, gamma, n)).logits
    logits = torch.where(used[:, :, None, None], logits.view(B, W, gamma, -1), 0.0)
    return with_padding_forwards(logits, forwards - 1,
                                 lambda: canvas_logits(model, spec, batch.clean_ids[:1, :1], block))


def _window_masks(model: Any, starts: torch.Tensor, gamma: int, n: int) -> dict[str, torch.Tensor]:
    """The decoder's additive masks, by layer type, for canvases of `gamma` tokens drafting at `starts` (B, W) over a
    context cache of `n` tokens: (B, 1, W·γ, n + W·γ)."""
    text = model.config.get_text_config(decoder=True)
    B, W = starts.shape
    window_start = starts.repeat_interleave(gamma, dim=1)[:, :, None]  # (B, W·γ, 1): each query's window's start
    context = torch.arange(n, device=starts.device)  # (n,)
    own = torch.arange(W, device=starts.device).repeat_interleave(gamma)
    own_canvas = (own[:, None] == own[None, :]).expand(B, -1, -1)  # (B, W·γ, W·γ)
    before = context < window_start  # (B, W·γ, n)
    out = {}
    for layer_type in set(attention_layer_types(model)):
        reads = (before & (context >= window_start - (text.sliding_window - 1)) if layer_type == "sliding_attention"
                 else before)
        out[layer_type] = additive_mask(torch.cat([reads, own_canvas], dim=-1), model.dtype)
    return out


class CanvasDecoder:
    """DiffusionGemma as a drafter (the `Drafter` interface): its encoder's context cache grows across a generation
    (drafts never enter it), and each draft is one decoder forward over a canvas."""

    verifier_states: Optional[HiddenTap] = None
    refused_methods: tuple[str, ...] = REFUSED_METHODS["standalone"]

    def __init__(self, model: PreTrainedModel, spec: DrafterSpec) -> None:
        self.model, self.spec = model, spec
        self.state: Optional[DrafterContext] = None

    def begin(self) -> None:
        self.state = canvas_context(self.model) if self.spec.attention == "block_causal" else None

    def propose(self, verifier: PreTrainedModel, context_ids: torch.Tensor, length: int) -> torch.Tensor:
        block = context_ids.new_full((1, length), self.spec.mask_token_id)
        return canvas_logits(self.model, self.spec, context_ids, block, self.state)[0]

    def verified(self, rows: VerifiedRows) -> None:
        """Nothing to keep: the encoder's cache grows by the accepted tokens at the next draft."""

    def encode(self, context_ids: torch.Tensor) -> int:
        """The encoder's forward over the new context tokens, one of its own (0 when nothing is new)."""
        if self.state is None:
            return 0
        encoded = self.state.length
        encode_canvas_context(self.model, context_ids, self.state)
        return int(self.state.length > encoded)

    def block_logits(self, context_ids: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        return canvas_logits(self.model, self.spec, context_ids, blocks, self.state)  # one decoder forward, batch K

    def window_forwards(self, batch: Windows) -> int:
        return 1  # one encoder and one decoder pass for the whole batch (canvas_window_logits)

    def window_logits(self, batch: Windows, verifier: Any = None,
                      forwards: int = 0) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return canvas_window_logits(self.model, self.spec, batch, forwards), None
