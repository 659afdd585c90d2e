"""The target-conditioned block-diffusion drafter (DFlash kind, DESIGN §3), laid out as speculators'
`DFlashDraftModel` and vLLM's `qwen3_dflash` define it, so that its weights load there unchanged.

A few Qwen3-style decoder layers denoise the block `[anchor] ⊕ MASK×γ` in one forward. The anchor is the newest
token (the verifier's last bonus/correction token, not yet run through the verifier); block slot i predicts the token
at anchor position + i, so slots 1..γ are the draft. The block's queries attend bidirectionally to the block and to
the *context*: the verifier's hidden states at `aux_hidden_state_layer_ids` for every position before the anchor,
concatenated, projected by `fc` and normalised by `hidden_norm`. Context K/V are the draft layers' own k/v
projections of that projected state (with q/k RMS norms and RoPE at the context positions), never the verifier's
K/V. Token embeddings are the verifier's, and so is the LM head unless the drafter has a pruned draft vocabulary:
align reads them from the verifier (they are not stored in an align checkpoint); the speculators export
(align/drafters/speculators_format.py) writes copies, as speculators does.

A pruned draft vocabulary (`draft_vocab_size`, EAGLE-3's and speculators' `d2t`/`t2d`) gives the drafter its own LM
head over the verifier's most frequent output tokens, started as the verifier's rows for them. On SmolLM2 (576 wide,
49,152 tokens) the full head is most of the drafter's cost: 8,192 rows cover 99.0% of the verifier's trajectory
tokens, and a training step took 0.71 s against 1.11 s. A token outside it is never drafted; the runtime gives it
zero draft probability, which speculative sampling allows (the residual max(p − q, 0) covers it), so decoding stays
lossless.

Layer ids follow speculators/vLLM: id k is the residual stream entering verifier layer k, which is
`hidden_states[k]` of a transformers forward with `output_hidden_states=True` (0 is the embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel

from align.drafters.base import aux_hidden

MODEL_TYPE = "align_dflash"


class DFlashConfig(PretrainedConfig):
    """The drafter's shape (a Qwen3 decoder layer's fields), where it reads the verifier, and its DrafterSpec."""

    model_type = MODEL_TYPE

    def __init__(self, vocab_size: int = 32000, hidden_size: int = 512, intermediate_size: int = 1024,
                 num_hidden_layers: int = 1, num_attention_heads: int = 8, num_key_value_heads: int = 8,
                 head_dim: Optional[int] = None, rms_norm_eps: float = 1e-6, rope_theta: float = 10000.0,
                 max_position_embeddings: int = 2048, hidden_act: str = "silu", initializer_range: float = 0.02,
                 target_hidden_size: Optional[int] = None, aux_hidden_state_layer_ids: Optional[list[int]] = None,
                 block_size: int = 8, mask_token_id: int = 0, draft_vocab_size: Optional[int] = None,
                 layer_types: Optional[list[str]] = None, sliding_window: Optional[int] = None, causal: bool = False,
                 **kwargs: Any) -> None:
        self.vocab_size = vocab_size
        # None or vocab_size: the verifier's own LM head; fewer: the drafter's pruned head over that many tokens
        self.draft_vocab_size = None if draft_vocab_size in (None, vocab_size) else draft_vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        self.target_hidden_size = target_hidden_size or hidden_size
        self.aux_hidden_state_layer_ids = list(aux_hidden_state_layer_ids or [1])
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        # How each draft layer attends, as vLLM's qwen3_dflash serves a speculators folder: "sliding_attention"
        # layers see the last `sliding_window` positions only, and `causal` (vLLM's dflash_config.causal, every layer)
        # lets a block slot see the slots before it only. align trains the defaults (full, bidirectional: DFlash's);
        # the others are read from folders speculators' trainer wrote (its default since 0.9 is sliding, causal).
        self.layer_types = list(layer_types or ["full_attention"] * num_hidden_layers)
        self.sliding_window = sliding_window
        self.causal = causal
        # The runtime reads every drafter through its DrafterSpec: anchor slot i predicts position anchor+i (no shift),
        # the block attends to its context and to itself (block-causal), and the kind routes it to the code below.
        kwargs["drafter_spec"] = {"mask_token_id": mask_token_id, "logits_shift": 0, "attention": "block_causal",
                                  "kind": "dflash"}
        super().__init__(**kwargs)


def default_aux_layers(num_verifier_layers: int, count: int = 3) -> list[int]:
    """`count` layer ids spread from the first layer's output to the last layer's input (as DFlash picks them)."""
    if num_verifier_layers < 2:
        return [0]  # a one-layer verifier: its embeddings are the only stream entering a layer
    last = num_verifier_layers - 1
    return sorted({1 + round(i * (last - 1) / max(count - 1, 1)) for i in range(count)})


def config_for_verifier(verifier_config: Any, mask_token_id: int, num_layers: int = 1,
                        intermediate_size: Optional[int] = None, aux_layer_ids: Optional[list[int]] = None,
                        block_size: int = 8, draft_vocab_size: Optional[int] = None) -> DFlashConfig:
    """A DFlash drafter shaped to share `verifier_config`'s embeddings and LM head (same width and vocabulary), or
    with its own head over `draft_vocab_size` of the verifier's tokens."""
    v = verifier_config.get_text_config() if hasattr(verifier_config, "get_text_config") else verifier_config
    rope = getattr(v, "rope_parameters", None) or {}
    heads = v.num_attention_heads
    return DFlashConfig(
        vocab_size=v.vocab_size, hidden_size=v.hidden_size, intermediate_size=intermediate_size or v.intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=getattr(v, "num_key_value_heads", None) or heads,
        head_dim=getattr(v, "head_dim", None) or v.hidden_size // heads, rms_norm_eps=v.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", getattr(v, "rope_theta", 10000.0))),
        max_position_embeddings=v.max_position_embeddings, target_hidden_size=v.hidden_size,
        aux_hidden_state_layer_ids=aux_layer_ids or default_aux_layers(v.num_hidden_layers), block_size=block_size,
        mask_token_id=mask_token_id, draft_vocab_size=draft_vocab_size)


# --------------------------------------------------------------------------------------------------------------------
# modules (names and shapes are speculators'/vLLM's: layers.N.self_attn.{q,k,v,o}_proj, q_norm, k_norm, mlp.*, ...)
# --------------------------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalised in fp32, scaled in the input's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE (neox layout, as vLLM's qwen3_dflash applies it). x: (B, heads, T, d); positions: (B, T)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    freqs = positions.float()[..., None] * inv_freq  # (B, T, d/2)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, T, d)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * cos + half * sin


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.theta = config.rope_theta
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, H), (B, T) -> K, V (B, kv_heads, T, d): normed and rotated K, plain V."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, positions, self.theta), v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context_kv: tuple[torch.Tensor, torch.Tensor],
                mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Block queries x (B, Q, H) over keys `context ⊕ block`. mask: (B, 1, Q, C+Q) additive, None: see all."""
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.num_heads, self.head_dim)).transpose(1, 2)
        q = rotate(q, positions, self.theta)
        k, v = self.kv(x, positions)
        k, v = torch.cat([context_kv[0], k], dim=2), torch.cat([context_kv[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context_kv: tuple[torch.Tensor, torch.Tensor],
                mask: Optional[torch.Tensor]) -> torch.Tensor:
        # The context K/V skip input_layernorm: they come from hidden_norm(fc(aux)) directly (speculators, vLLM).
        x = x + self.self_attn(self.input_layernorm(x), positions, context_kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(PreTrainedModel):
    """The drafter's own weights: `fc`, `hidden_norm`, the layers and the final `norm`, and with a pruned draft
    vocabulary its `lm_head` (draft_vocab_size, H) with speculators' maps: `d2t` (draft_vocab_size,) the offset from
    each draft id to its verifier id, `t2d` (vocab_size,) bool, the verifier ids it covers. Embeddings (and the LM
    head otherwise) are the verifier's, passed in by the functions below."""

    config_class = DFlashConfig
    base_model_prefix = "dflash"
    _supports_sdpa = True
    _no_split_modules = ["DFlashLayer"]

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__(config)
        width = len(config.aux_hidden_state_layer_ids) * config.target_hidden_size
        self.fc = nn.Linear(width, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.draft_vocab_size is not None:
            self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.post_init()

    def get_output_embeddings(self) -> None:
        # The head over the verifier's vocabulary is the verifier's; a pruned `lm_head` covers part of it only, so
        # transformers must neither tie nor resize it, and align's vocab_size() reads the config's.
        return None

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, self.config.initializer_range)
        elif isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)

    def project_context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """(B, C, n_aux·H_verifier) concatenated verifier states -> (B, C, H) the context every layer reads."""
        return self.hidden_norm(self.fc(aux_hidden.to(self.fc.weight.dtype)))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the K/V of projected context (B, C, H) at `positions` (B, C). They depend on the context only,
        so the runtime computes them once per accepted token (vLLM precomputes them the same way)."""
        return [layer.self_attn.kv(context, positions) for layer in self.layers]

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor,
                context_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """Block embeddings (B, Q, H) at `positions` (B, Q) -> final normed hidden states (B, Q, H). mask: (B, 1, Q,
        C + Q) additive over `context ⊕ block` (None: all of it), narrowed per layer by `layer_mask`."""
        x = block_embeds.to(self.fc.weight.dtype)
        for i, (layer, kv) in enumerate(zip(self.layers, context_kv)):
            x = layer(x, positions, kv, self.layer_mask(i, positions, kv[0].shape[2], mask))
        return self.norm(x)

    def layer_mask(self, index: int, positions: torch.Tensor, context_length: int, mask: Optional[torch.Tensor]
                   ) -> Optional[torch.Tensor]:
        """`mask` narrowed to what layer `index` sees: with `causal`, the keys at or before each query's position
        (the context is all before the anchor: the block's earlier slots); with a sliding window W, the keys after
        position − W, as vLLM's sliding-window attention counts it (speculators' trainer counts W back from the
        anchor instead: the two differ only past W − block_size positions of context). The context's positions are
        0..C−1: the runtime's and the trainer's contexts both start at the first token."""
        window = self.config.sliding_window if self.config.layer_types[index] == "sliding_attention" else None
        if not self.config.causal and window is None:
            return mask
        B, Q = positions.shape
        context_positions = torch.arange(context_length, device=positions.device).expand(B, -1)
        key_positions = torch.cat([context_positions, positions], dim=1)[:, None, :]  # (B, 1, C + Q)
        query_positions = positions[:, :, None]  # (B, Q, 1)
        allowed = torch.ones(B, Q, context_length + Q, dtype=torch.bool, device=positions.device)
        if self.config.causal:
            allowed &= key_positions <= query_positions
        if window is not None:
            allowed &= key_positions > query_positions - window
        zero = torch.zeros((), dtype=self.fc.weight.dtype, device=positions.device)
        base = zero if mask is None else mask
        return torch.where(allowed[:, None], base, torch.finfo(zero.dtype).min)


AutoConfig.register(MODEL_TYPE, DFlashConfig)
AutoModel.register(DFlashConfig, DFlashDrafter)


def is_dflash(model: Any) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) == MODEL_TYPE


@dataclass
class DFlashContext:
    """A DFlash drafter's context: per layer the K/V of every verified position before the anchor. Only ever
    extended with positions the verifier accepted, so it is exact and never cropped."""

    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    length: int = 0

    def extend(self, drafter: DFlashDrafter, aux: torch.Tensor) -> None:
        """Append the verifier states (B, m, n_aux·H) of the next m positions."""
        m = aux.shape[1]
        if m == 0:
            return
        positions = torch.arange(self.length, self.length + m, device=aux.device).expand(aux.shape[0], -1)
        new = drafter.context_kv(drafter.project_context(aux), positions)
        self.kv = new if not self.kv else [(torch.cat([k, nk], 2), torch.cat([v, nv], 2))
                                           for (k, v), (nk, nv) in zip(self.kv, new)]
        self.length += m


# --------------------------------------------------------------------------------------------------------------------
# the pruned draft vocabulary
# --------------------------------------------------------------------------------------------------------------------
def most_frequent_tokens(completions: Any, prompts: Any, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` verifier token ids a pruned draft vocabulary keeps, ascending (speculators' d2t order): the most
    frequent in `completions` (iterables of token ids: what the verifier writes, so what the drafter drafts), ties and
    the rest filled by frequency in `prompts`, then by id."""
    def counts(seqs: Any) -> np.ndarray:
        ids = [np.asarray(s, dtype=np.int64) for s in seqs]
        flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        return np.bincount(flat[(flat >= 0) & (flat < vocab_size)], minlength=vocab_size)

    # lexsort orders by the last key first: completion count, then prompt count, then the lower id
    order = np.lexsort((np.arange(vocab_size), -counts(prompts), -counts(completions)))
    return torch.from_numpy(np.sort(order[:size]))


def set_draft_vocab(drafter: DFlashDrafter, verifier_head: torch.Tensor, token_ids: torch.Tensor) -> None:
    """Fill a pruned drafter's maps for `token_ids` (draft_vocab_size,) ascending verifier ids, and start its head as
    the verifier's LM head rows for them (`verifier_head`: (V, H), the verifier's output embedding weight)."""
    with torch.no_grad():
        ids = token_ids.to(drafter.d2t.device)
        drafter.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        drafter.t2d.zero_()
        drafter.t2d[ids] = True
        drafter.lm_head.weight.copy_(verifier_head[token_ids.to(verifier_head.device)])


@dataclass
class DraftVocab:
    """A pruned drafter's vocabulary, read from its `d2t`/`t2d` buffers: maps between draft and verifier ids."""

    target_ids: torch.Tensor  # (Vd,) the verifier id of each draft id, ascending
    covered: torch.Tensor  # (V,) bool, the verifier ids it holds
    draft_ids: torch.Tensor  # (V,) the draft id of each covered verifier id (0 elsewhere: read with `covered`)

    @classmethod
    def of(cls, model: Any) -> Optional["DraftVocab"]:
        """The vocabulary of a pruned DFlash drafter; None for any other drafter."""
        d2t = getattr(model, "d2t", None)
        if d2t is None:
            return None
        # Kept on the model while its buffers stay the same (a draft asks at every step; the cumsum over the
        # verifier's vocabulary cost 0.24 ms of a 50 ms SmolLM2 step): an in-place change (set_draft_vocab,
        # load_state_dict) bumps a tensor's _version, a move to another device changes its data_ptr.
        key = tuple((t.data_ptr(), t._version) for t in (d2t, model.t2d))
        cached = model.__dict__.get("_draft_vocab")
        if cached is not None and cached[0] == key:
            return cached[1]
        target_ids = torch.arange(len(d2t), device=d2t.device) + d2t
        covered = model.t2d.bool()
        vocab = cls(target_ids, covered, (torch.cumsum(covered.long(), 0) - 1).clamp_min(0))
        model.__dict__["_draft_vocab"] = (key, vocab)
        return vocab

    def training_targets(self, targets: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Verifier-id targets (..., γ) and their mask -> draft-id targets and a mask that also drops every position
        from the first uncovered target on: the drafter cannot draft that token, so no greedy streak reaches past it."""
        covered = self.covered[targets]
        return self.draft_ids[targets], mask & (covered.long().cumprod(-1) > 0)

    def columns(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the verifier's vocabulary (..., V) -> over the draft vocabulary (..., Vd)."""
        return logits.index_select(-1, self.target_ids)

    def to_verifier(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits (..., Vd) -> (..., V), the lowest finite value at uncovered tokens: probability 0 after a
        softmax, yet finite, so that p·log p and KL terms stay 0 rather than NaN."""
        out = logits.new_full((*logits.shape[:-1], len(self.covered)), torch.finfo(logits.dtype).min)
        return out.index_copy(-1, self.target_ids, logits)


def lm_head_logits(verifier: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The verifier's LM head over drafter states (..., H) -> logits (..., V), on a fresh 2-D copy of the rows.

    Why the copy: on this CPU (torch 2.13) `F.linear` over a strided view such as `hidden[:, 1:]` takes a slow path.
    With SmolLM2's 49k-token head, a training step's window logits (2 rows of 32 windows) took 4.3 s against 2.4 s
    in fp32 and 16.5 s against 0.66 s in bf16; a draft's 8 rows in bf16, 130 ms against 5 ms, which made a 2-layer
    drafter's step cost more than the 30-layer verifier's. `.contiguous()` is not enough: a (1, k, H) slice of
    (1, k+1, H) counts as contiguous (the stride of a size-1 dimension is not checked), yet takes the slow path. The
    copy costs nothing beside the head.
    """
    rows = hidden.reshape(-1, hidden.shape[-1]).to(verifier.dtype).clone(memory_format=torch.contiguous_format)
    return verifier.get_output_embeddings()(rows).view(*hidden.shape[:-1], -1)


def draft_head_logits(drafter: DFlashDrafter, verifier: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Drafter states (..., H) -> logits over the drafter's vocabulary: its pruned head's (..., Vd), else the
    verifier's (..., V). The same 2-D copy as `lm_head_logits`, for the same reason."""
    if drafter.config.draft_vocab_size is None:
        return lm_head_logits(verifier, hidden)
    rows = hidden.reshape(-1, hidden.shape[-1]).to(drafter.lm_head.weight.dtype)
    return drafter.lm_head(rows.clone(memory_format=torch.contiguous_format)).view(*hidden.shape[:-1], -1)


def dflash_block_logits(drafter: DFlashDrafter, verifier: Any, anchor_ids: torch.Tensor, num_draft: int,
                        context: DFlashContext) -> torch.Tensor:
    """Logits for the `num_draft` tokens after the anchor, in one drafter forward.

    anchor_ids: (B, 1) the newest token, at position `context.length`. Returns (B, num_draft, V) over the
    verifier's vocabulary, also for a pruned drafter (its uncovered tokens at probability 0).
    """
    B = anchor_ids.shape[0]
    mask_id = drafter.config.mask_token_id
    block = torch.cat([anchor_ids, anchor_ids.new_full((B, num_draft), mask_id)], dim=1)  # (B, 1 + γ)
    positions = torch.arange(context.length, context.length + 1 + num_draft, device=block.device).expand(B, -1)
    embeds = verifier.get_input_embeddings()(block)
    kv = context.kv or [(embeds.new_zeros(B, layer.self_attn.num_kv_heads, 0, layer.self_attn.head_dim),) * 2
                        for layer in drafter.layers]
    hidden = drafter(embeds, positions, kv)  # no mask: the block sees the whole context and itself
    logits = draft_head_logits(drafter, verifier, hidden[:, 1:])
    vocab = DraftVocab.of(drafter)
    return logits if vocab is None else vocab.to_verifier(logits)


@torch.no_grad()
def verifier_states(verifier: Any, clean_ids: torch.Tensor, layer_ids: list[int], with_last: bool = False
                    ) -> torch.Tensor:
    """(B, L) token ids -> (B, L, n_aux·H): the verifier's hidden states a DFlash drafter reads, from its decoder.
    with_last: also its final (normed) state, (B, L, (n_aux + 1)·H), from which KD losses' verifier logits come."""
    out = verifier.get_decoder()(input_ids=clean_ids, output_hidden_states=True)
    aux = aux_hidden(out.hidden_states, layer_ids)
    return torch.cat([aux, out.last_hidden_state.to(aux.dtype)], dim=-1) if with_last else aux


@torch.no_grad()
def window_verifier_logits(drafter: DFlashDrafter, verifier: Any, last: torch.Tensor, starts: torch.Tensor,
                           gamma: int) -> torch.Tensor:
    """The verifier's logits at every window position, (B, W, γ, V) over the drafter's vocabulary, from its final
    states last (B, L, H). The LM head runs on the window positions only (over all L it costs as much as the rest)."""
    B, L, _ = last.shape
    W = starts.shape[1]
    index = (starts[..., None] - 1 + torch.arange(gamma, device=starts.device)).clamp(0, L - 1)  # (B, W, γ)
    at_windows = last.gather(1, index.view(B, -1, 1).expand(-1, -1, last.shape[-1])).to(verifier.dtype)
    head = verifier.get_output_embeddings()
    vocab = DraftVocab.of(drafter)
    if vocab is None:
        return head(at_windows).view(B, W, gamma, -1)
    # the head's rows for the draft vocabulary alone: a sixth of the work on SmolLM2
    bias = None if head.bias is None else head.bias[vocab.target_ids]
    return F.linear(at_windows, head.weight[vocab.target_ids], bias).view(B, W, gamma, -1)


def dflash_window_logits(drafter: DFlashDrafter, verifier: Any, clean_ids: torch.Tensor, starts: torch.Tensor,
                         gamma: int, aux: Optional[torch.Tensor] = None
                         ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Training: every window of every row in one drafter forward, from one verifier forward.

    clean_ids: (B, L) prompt ⊕ completion; starts: (B, W) each window's first drafted position s (its anchor is s−1,
    its context the positions before s−1, exactly what the runtime gives it). Returns the drafter's logits and the
    verifier's (for KD losses, from the same forward), both (B, W, γ, V) over the drafter's vocabulary: a pruned
    drafter's draft ids (`DraftVocab` maps targets to them), where the verifier's logits are its logits for those
    tokens alone. aux: the rows' verifier states when the trainer has them already (its cache), (B, L, n_aux·H), or
    (B, L, (n_aux + 1)·H) with the final states (`verifier_states(with_last=True)`); the verifier does not run then,
    and its logits come from the final states, or are None without them.
    """
    B, L = clean_ids.shape
    W = starts.shape[1]
    aux_width = len(drafter.config.aux_hidden_state_layer_ids) * drafter.config.target_hidden_size
    verifier_logits = None
    if aux is None:  # both functions run without grad: the verifier is frozen
        aux = verifier_states(verifier, clean_ids, drafter.config.aux_hidden_state_layer_ids, with_last=True)
    if aux.shape[-1] > aux_width:
        verifier_logits = window_verifier_logits(drafter, verifier, aux[..., aux_width:], starts, gamma)
        aux = aux[..., :aux_width]
    ctx_positions = torch.arange(L, device=clean_ids.device).expand(B, -1)
    context_kv = drafter.context_kv(drafter.project_context(aux), ctx_positions)
    anchors = (starts - 1).clamp_min(0)  # (B, W)
    offsets = torch.arange(gamma + 1, device=starts.device)
    positions = (anchors[..., None] + offsets).view(B, -1)  # (B, W·(γ+1))
    block = torch.full((B, W, gamma + 1), drafter.config.mask_token_id, dtype=torch.long, device=clean_ids.device)
    block[..., 0] = clean_ids.gather(1, anchors)
    # Block w sees the context strictly before its anchor (the anchor's own state is not computed yet when it
    # drafts) and its own block, bidirectionally; never another block.
    q_window = torch.arange(W, device=starts.device).repeat_interleave(gamma + 1)  # (Q,)
    sees_context = torch.arange(L, device=starts.device)[None, None, :] < anchors[:, q_window, None]  # (B, Q, L)
    sees_block = (q_window[:, None] == q_window[None, :]).expand(B, -1, -1)
    allowed = torch.cat([sees_context, sees_block], dim=-1)
    zero = torch.zeros((), dtype=drafter.fc.weight.dtype, device=allowed.device)
    mask = torch.where(allowed, zero, torch.finfo(zero.dtype).min)[:, None]  # (B, 1, Q, L + Q)
    embeds = verifier.get_input_embeddings()(block.view(B, -1))
    hidden = drafter(embeds, positions, context_kv, mask).view(B, W, gamma + 1, -1)
    draft_logits = draft_head_logits(drafter, verifier, hidden[:, :, 1:])
    return draft_logits, verifier_logits
