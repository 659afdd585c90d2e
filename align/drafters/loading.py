"""Loading a diffusion drafter with its DrafterSpec, and building a new DFlash drafter on a verifier.

A diffusion drafter is a masked discrete-diffusion LM: given `context ⊕ [MASK]×γ` it returns a distribution for every
masked position in one forward pass. Three facts describe how to read it, and getting any of them wrong silently
destroys acceptance, so they live in one place (`DrafterSpec`, align/drafters/spec.py, torch-free so that the CLI checks
a drafter's config before loading anything) and one package reads logits for all of them (align/drafters,
`drafter_for`):

- `mask_token_id`: the token that marks a masked position (from the tokenizer, never a literal);
- `logits_shift`: 0 when the prediction for position t is at logits[t] (LLaDA); 1 when it is at logits[t-1] (Dream,
  DiffuCoder and other models adapted from AR checkpoints);
- `attention`: `bidirectional` (every position sees every other: the context is re-encoded for each draft) or
  `block_causal` (the context is causal and the block attends to the context and to itself: the context KV cache is
  exact, so a draft costs O(γ) rather than O(context));
- `noise`: what the model reads at a noised position (align/drafters/noise.py).

DiffusionGemma (`DiffusionGemmaForBlockDiffusion`) is block-causal in two modules that share their weights: a causal
encoder writes the context KV cache and a bidirectional decoder denoises a canvas reading that cache without writing
it (the CANVAS_DECODER_FAMILIES; align/drafters/canvas.py reads it).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from align.config import ModelSection, Recipe, RecipeError
# Registers the DFlash drafter's config and model with transformers' Auto classes, so that `_load` reads it.
from align.drafters.dflash import DFlashDrafter, config_for_verifier, is_dflash
from align.drafters.speculators_format import load_speculators_dflash, speculators_type
from align.drafters.spec import CANVAS_DECODER_FAMILIES, DrafterSpec, drafter_spec_from_config
from align.drafters.mask_token import dflash_mask_token
from align.masks import check_mask_layer_types, full_mask_kwargs
from align.models import (_load, is_partitioned, load_tokenizer, partitioned_loading, resolve_device, resolve_dtype,
                          vocab_size)
from align.remote_code import MASKS_IGNORED, honours_attention_masks


def load_drafter(
    section: Any, tokenizer: Optional[PreTrainedTokenizerBase] = None
) -> tuple[PreTrainedModel, DrafterSpec]:
    """The diffusion drafter and its spec. `section` is a DrafterSection (its spec fields override the config's).
    Inside `partitioned_loading` the weights come partitioned, and the check that remote code reads its masks (a
    forward, which needs whole weights) is left to `check_masks_are_read` once DeepSpeed's engine gathers them. A
    speculators-format DFlash folder (align's export, or speculators' own) loads as align's DFlash drafter."""
    if speculators_type(section.path) == "dflash":
        device = resolve_device(section.device)
        dtype = resolve_dtype(section.dtype, device, section.path)
        model = load_speculators_dflash(section.path, device).to(dtype=dtype)
        return model, drafter_spec_from_config(model.config, tokenizer, section.mask_token_id, section.logits_shift,
                                               section.attention)
    config = AutoConfig.from_pretrained(section.path, trust_remote_code=section.trust_remote_code)
    spec = drafter_spec_from_config(
        config, tokenizer, section.mask_token_id, section.logits_shift, section.attention
    )
    # A bidirectional drafter must never get transformers' default causal mask; a block-causal one keeps the causal
    # default for its context and receives an explicit block mask where it is read (align/drafters/masked.py). The flag
    # is set on the config object rather than passed as a `from_pretrained` kwarg: configs without an `is_causal`
    # attribute (Llama, Qwen2) would hand the kwarg to the model's __init__, which rejects it.
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
    if honours_attention_masks(model, full_mask_kwargs, vocab_size(model)):
        return
    if spec.attention == "block_causal":
        raise RecipeError(f"drafter.attention: {type(model).__name__} ignores attention masks, and block_causal "
                          "drafting needs one; use drafter.attention=bidirectional")
    setattr(model, MASKS_IGNORED, True)


def new_dflash_drafter(verifier: ModelSection, settings: Any, drafter: ModelSection, mask_token_id: int,
                       gamma: int) -> tuple[PreTrainedModel, DrafterSpec]:
    """A DFlash drafter with random weights, shaped to the verifier at `verifier.path` (settings: a DFlashSection),
    on `drafter`'s device and dtype, marking masked positions with `mask_token_id` (mask_token.dflash_mask_token).
    A pruned draft vocabulary is shaped here and filled by `dflash.set_draft_vocab` from the training data."""
    verifier_config = AutoConfig.from_pretrained(verifier.path, trust_remote_code=verifier.trust_remote_code)
    check_aux_layer_ids(verifier_config, settings.aux_layer_ids)
    check_draft_vocab_size(verifier_config, settings.draft_vocab_size)
    config = config_for_verifier(verifier_config, mask_token_id, settings.num_layers,
                                 settings.intermediate_size, settings.aux_layer_ids, settings.block_size or gamma + 1,
                                 settings.draft_vocab_size)
    model = DFlashDrafter(config)
    if settings.init_from_layers:
        copy_verifier_layers(model, verifier, verifier_config, settings.init_from_layers)
    device = resolve_device(drafter.device)
    # "auto" (the checkpoint's dtype): a new drafter has none of its own, and takes the verifier's it is built from.
    model = model.to(device=device, dtype=resolve_dtype(drafter.dtype, device, verifier.path,
                                                        verifier.trust_remote_code))
    return model, drafter_spec_from_config(config)


# Verifier families whose decoder layers are the DFlash layer's (Llama's: RMSNorm scaling by its weight, SwiGLU MLP,
# q/k/v/o projections); Gemma's norms scale by 1 + weight, and its layers hold more norms.
LAYER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
LAYER_WEIGHTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight")


def check_init_layers(verifier_config: Any, layer_ids: list[int]) -> None:
    """dflash.init_from_layers against the verifier's config: a family whose layers are the draft layer's, and
    layers it has. A one-line RecipeError otherwise (the train stage checks before launching)."""
    text = verifier_config.get_text_config()
    key = "dflash.init_from_layers"
    if text.model_type not in LAYER_FAMILIES:
        raise RecipeError(f"{key}: the verifier's layers ({text.model_type}) are not shaped as a DFlash draft layer "
                          f"(those of {', '.join(LAYER_FAMILIES)} are); leave it unset")
    if max(layer_ids) >= text.num_hidden_layers:
        raise RecipeError(f"{key}: {layer_ids} must be below the verifier's {text.num_hidden_layers} layers")


def check_aux_layer_ids(verifier_config: Any, aux_layer_ids: Optional[list[int]]) -> None:
    """dflash.aux_layer_ids against the verifier's depth: a one-line RecipeError for an id past its last layer."""
    num_layers = verifier_config.get_text_config().num_hidden_layers
    if aux_layer_ids and max(aux_layer_ids) >= num_layers:
        raise RecipeError(f"dflash.aux_layer_ids: {aux_layer_ids} must be below the verifier's {num_layers} layers "
                          "(id k is the input of layer k)")


def check_draft_vocab_size(verifier_config: Any, draft_vocab_size: Optional[int]) -> None:
    """dflash.draft_vocab_size against the verifier's vocabulary: a one-line RecipeError when it is larger."""
    vocab = verifier_config.get_text_config().vocab_size
    if draft_vocab_size and draft_vocab_size > vocab:
        raise RecipeError(f"dflash.draft_vocab_size: {draft_vocab_size} is more than the verifier's {vocab} tokens")


def check_new_dflash(recipe: Recipe) -> None:
    """A new DFlash drafter's recipe before any launcher starts (`align train`): its mask token chosen (or the
    recipe's checked), its layer ids and vocabulary against the verifier's config, its block against train.gamma."""
    from align.preflight import load_model_config

    section, t = recipe.dflash, recipe.train
    dflash_mask_token(recipe)
    verifier_config = load_model_config("verifier.path", recipe.verifier)
    if section.init_from_layers:
        check_init_layers(verifier_config, section.init_from_layers)
    check_aux_layer_ids(verifier_config, section.aux_layer_ids)
    check_draft_vocab_size(verifier_config, section.draft_vocab_size)
    block = section.block_size
    if block is not None and t.gamma > block - 1:  # trained positions vLLM and eval never draft
        raise RecipeError(f"train.gamma: {t.gamma} draft positions, but a block of dflash.block_size {block} drafts "
                          f"{block - 1}; set train.gamma={block - 1} or less, or a larger block")
    if t.activation_checkpointing:  # said before any folder is written, not once the models are built
        raise RecipeError("train.activation_checkpointing: the DFlash drafter does not support gradient "
                          "checkpointing (two layers: little to save); set train.activation_checkpointing=false")


def copy_verifier_layers(model: DFlashDrafter, verifier: ModelSection, verifier_config: Any,
                         layer_ids: list[int]) -> None:
    """Start draft layer i as verifier layer layer_ids[i] (dflash.init_from_layers): its projections and norms, read
    from the verifier's safetensors files alone (not the whole model). Qwen3's q/k norms are copied too; other
    families' start at 1, as the DFlash layer's do. A projection bias (Qwen2's q/k/v) has no place in the draft layer
    and is left out."""
    import json

    from huggingface_hub import snapshot_download
    from safetensors import safe_open

    check_init_layers(verifier_config, layer_ids)
    key = "dflash.init_from_layers"
    folder = Path(verifier.path)
    if not folder.is_dir():
        folder = Path(snapshot_download(verifier.path, allow_patterns=["*.safetensors", "*.json"]))
    index = folder / "model.safetensors.index.json"
    files = (json.loads(index.read_text())["weight_map"] if index.is_file() else None)
    wanted = {f"model.layers.{source}.{name}": (draft, name) for draft, source in enumerate(layer_ids)
              for name in LAYER_WEIGHTS + ("self_attn.q_norm.weight", "self_attn.k_norm.weight")}
    found: dict[tuple[int, str], torch.Tensor] = {}
    for file in sorted({files[k] for k in wanted if k in files} if files else {"model.safetensors"}):
        with safe_open(str(folder / file), framework="pt") as f:
            for name in set(f.keys()) & set(wanted):
                found[wanted[name]] = f.get_tensor(name)
    missing = [f"model.layers.{layer_ids[d]}.{n}" for d in range(len(layer_ids)) for n in LAYER_WEIGHTS
               if (d, n) not in found]
    if missing:
        raise RecipeError(f"{key}: the verifier's weights at {verifier.path} have no {missing[0]}")
    parameters = dict(model.layers.named_parameters())
    with torch.no_grad():
        for (draft, name), tensor in found.items():
            target = parameters[f"{draft}.{name}"]
            if target.shape != tensor.shape:
                raise RecipeError(f"{key}: verifier layer {layer_ids[draft]}'s {name} is {tuple(tensor.shape)}, the "
                                  f"draft layer's {tuple(target.shape)} (dflash.intermediate_size must be unset)")
            target.copy_(tensor)


def is_canvas_decoder(model: PreTrainedModel) -> bool:
    """DiffusionGemma-style (config.CANVAS_DECODER_FAMILIES): a causal encoder writes the context cache
    (`model.get_encoder()`), a bidirectional decoder reads it to denoise the canvas (`model(decoder_input_ids=...,
    cache=...)`)."""
    return getattr(model.config, "model_type", None) in CANVAS_DECODER_FAMILIES


# --------------------------------------------------------------------------------------------------------------------
# the drafter a training run starts from
# --------------------------------------------------------------------------------------------------------------------
def drafter_reads(recipe: Recipe) -> tuple[str, ...]:
    """The model keys whose weights the drafter `align train` starts from is: drafter.path, or, for a new DFlash
    drafter (a recipe with a dflash section), the verifier it is built on and reads in every step."""
    return ("verifier.path",) if recipe.dflash is not None else ("drafter.path",)


def build_drafter(recipe: Recipe, partition: Optional[dict[str, Any]] = None
                  ) -> tuple[PreTrainedModel, DrafterSpec, PreTrainedTokenizerBase, Optional[str]]:
    """The drafter `align train` starts from, its spec and tokenizer, and the mask token chosen for it (None when the
    drafter brings its own): a new DFlash drafter shaped to the verifier, whose tokenizer it shares, or drafter.path
    loaded, by ZeRO-3 partitions when `partition` (a DeepSpeed config) is given."""
    if recipe.dflash is not None:
        tokenizer = load_tokenizer(recipe.verifier.path, recipe.verifier.trust_remote_code)
        mask_token_id, mask_token = dflash_mask_token(recipe)
        model, spec = new_dflash_drafter(recipe.verifier, recipe.dflash, recipe.drafter, mask_token_id,
                                         recipe.train.gamma)
        return model, spec, tokenizer, mask_token
    tokenizer = load_tokenizer(recipe.drafter.path, recipe.drafter.trust_remote_code)
    with partitioned_loading(partition) if partition is not None else contextlib.nullcontext():
        model, spec = load_drafter(recipe.drafter, tokenizer)
    return model, spec, tokenizer, None
