"""The speculators format of a DFlash drafter: the folder `vllm serve --speculative-config` loads (config.json with a
Qwen3 `transformer_layer_config`, model.safetensors under speculators' names, the tokenizer), written by `align
export` and `align serve-check`, and read back, checked field by field, as align's `DFlashDrafter`
(align/drafters/dflash.py), whether align or speculators' own trainer wrote it."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from align.drafters.dflash import DFlashConfig, DFlashDrafter

SPECULATORS_CONFIG_VERSION = "0.9.0"  # the speculators release whose DFlash config this matches


def speculators_config(config: DFlashConfig, verifier_path: str, verifier_architectures: list[str],
                       dtype: torch.dtype, speculative_tokens: Optional[int] = None) -> dict[str, Any]:
    """config.json of speculators' `DFlashSpeculatorConfig` for this drafter. The draft layers are described as a
    Qwen3 config (vLLM's qwen3_dflash reads it: always q/k norms, no attention bias). speculative_tokens: the draft
    tokens a step serves (`vllm serve <folder>` reads them from the proposal method); None: all a block drafts."""
    if speculative_tokens is None:
        speculative_tokens = config.block_size - 1
    if not 1 <= speculative_tokens <= config.block_size - 1:
        raise ValueError(f"speculative_tokens {speculative_tokens}: the drafter's blocks draft 1 to "
                         f"{config.block_size - 1} tokens")
    layer = {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim, "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps, "max_position_embeddings": config.max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta}, "rope_theta": config.rope_theta,
        "attention_bias": False, "tie_word_embeddings": False, "mask_token_id": config.mask_token_id,
    }
    if any(t != "full_attention" for t in config.layer_types):  # as read from a folder speculators wrote
        layer.update(layer_types=list(config.layer_types), sliding_window=config.sliding_window,
                     use_sliding_window=True)
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_CONFIG_VERSION,
        "transformer_layer_config": layer,
        # vLLM gives the drafter a head of this many rows, and maps them to the verifier's ids by the weights' `d2t`
        "draft_vocab_size": config.draft_vocab_size or config.vocab_size,
        "block_size": config.block_size,
        "target_hidden_size": config.target_hidden_size,
        "aux_hidden_state_layer_ids": list(config.aux_hidden_state_layer_ids),
        "mask_token_id": config.mask_token_id,
        # Full-attention draft layers attend bidirectionally within the block (as align trains them). vLLM reads
        # `causal = not sliding_window_non_causal` for every layer, so true here keeps every layer non-causal there.
        "sliding_window_non_causal": not config.causal,
        # The anchor is the verifier's bonus token: only the MASK slots draft (block_size - 1 tokens), as in DFlash.
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_path, "architectures": list(verifier_architectures)},
        },
        "dtype": str(dtype).removeprefix("torch."),
    }


def speculators_weights(drafter: DFlashDrafter, verifier: Any) -> dict[str, torch.Tensor]:
    """The drafter's weights under the names speculators saves and vLLM's qwen3_dflash loads (its own modules keep
    those names: a pruned drafter's `lm_head`, `d2t` and `t2d` too), plus copies of the verifier's `embed_tokens` and,
    without a pruned head, its `lm_head`, which speculators checkpoints carry."""
    dtype = drafter.fc.weight.dtype
    weights = {name: t.detach().contiguous() for name, t in drafter.state_dict().items()}
    weights["embed_tokens.weight"] = verifier.get_input_embeddings().weight.detach().to(dtype).clone()
    if drafter.config.draft_vocab_size is None:
        weights["lm_head.weight"] = verifier.get_output_embeddings().weight.detach().to(dtype).clone()
    return weights


def write_speculators_folder(drafter: DFlashDrafter, verifier: Any, verifier_path: str, tokenizer: Any,
                             folder: Any, speculative_tokens: Optional[int] = None) -> dict[str, Any]:
    """The files vLLM loads, as speculators saves them: config.json, model.safetensors (`speculators_weights`) and the
    tokenizer, into the existing `folder`; speculative_tokens as `speculators_config`'s. Returns the config
    (`align export` and `align serve-check` both write it)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(folder)
    config = speculators_config(drafter.config, verifier_path, list(verifier.config.architectures or []),
                                drafter.fc.weight.dtype, speculative_tokens)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.cpu() for k, v in speculators_weights(drafter, verifier).items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
    return config


def speculators_type(folder: str) -> Optional[str]:
    """The `speculators_model_type` of a local folder's config.json (dflash, eagle3, ...): None for any other folder.
    speculators' configs carry no transformers model_type, so AutoConfig cannot read them."""
    import json
    from pathlib import Path

    config = Path(folder) / "config.json"
    if not config.is_file():
        return None
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    kind = raw.get("speculators_model_type") if isinstance(raw, dict) else None
    return str(kind) if kind is not None else None


# A speculators folder is not align's: nothing in it is trusted until its config and its weights' headers say that
# align's loader and runtime can read it. Each check below names the key and what was expected, in one line, before
# any model is built (an edited folder otherwise ended in a KeyError, a size mismatch from torch, or an IndexError at
# the first draft, after the verifier had loaded).
def _speculators_problem(folder: str, key: Optional[str], where: str, problem: str) -> Any:
    from align.config import RecipeError

    prefix = f"{key}: " if key else ""
    return RecipeError(f"{prefix}{folder}: {where} {problem}")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and 0 < value < 1e30


def _read_speculators_json(folder: str, key: Optional[str]) -> dict[str, Any]:
    import json
    from pathlib import Path

    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _speculators_problem(folder, key, "config.json", f"cannot be read ({type(e).__name__})") from None
    if not isinstance(raw, dict):
        raise _speculators_problem(folder, key, "config.json", "is not a JSON object")
    return raw


# transformer_layer_config fields align reads: name -> (required, check, what is expected)
_LAYER_FIELDS: dict[str, tuple[bool, Any, str]] = {
    "vocab_size": (True, _positive_int, "a positive integer"),
    "hidden_size": (True, _positive_int, "a positive integer"),
    "intermediate_size": (True, _positive_int, "a positive integer"),
    "num_hidden_layers": (True, _positive_int, "a positive integer"),
    "num_attention_heads": (True, _positive_int, "a positive integer"),
    "num_key_value_heads": (False, _positive_int, "a positive integer"),
    "head_dim": (False, _positive_int, "a positive integer"),
    "rms_norm_eps": (False, _positive_number, "a positive number"),
    "rope_theta": (False, _positive_number, "a positive number"),
    "max_position_embeddings": (False, _positive_int, "a positive integer"),
}


def speculators_dflash_config(folder: str, key: Optional[str] = None) -> DFlashConfig:
    """A speculators-format DFlash folder's config.json as align's DFlashConfig (its DrafterSpec included), checked
    against speculators' DFlashSpeculatorConfig for the fields align reads. A field missing, of the wrong type or out
    of range is a one-line RecipeError naming it (prefixed by `key`, the recipe key naming the folder)."""
    raw = _read_speculators_json(folder, key)

    def bad(field: str, problem: str) -> Any:
        return _speculators_problem(folder, key, f"config.json's {field}", problem)

    if raw.get("speculators_model_type") != "dflash":
        raise bad("speculators_model_type", f"is {raw.get('speculators_model_type')!r}; align reads 'dflash' here")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise bad("transformer_layer_config", "is missing (expected an object: the draft layers' Qwen3 config)"
                  if layer is None else f"is {type(layer).__name__} (expected an object)")
    for name, (required, ok, expected) in _LAYER_FIELDS.items():
        value = layer.get(name)
        if value is None and not required:
            continue
        if not ok(value):
            raise bad(f"transformer_layer_config.{name}",
                      f"is {'missing' if value is None else repr(value)[:40]} (expected {expected})")
    heads, kv_heads = layer["num_attention_heads"], layer.get("num_key_value_heads") or layer["num_attention_heads"]
    if heads % kv_heads:
        raise bad("transformer_layer_config.num_key_value_heads",
                  f"is {kv_heads}, which does not divide num_attention_heads {heads}")
    if layer.get("head_dim") is None and layer["hidden_size"] % heads:
        raise bad("transformer_layer_config.head_dim",
                  f"is missing and hidden_size {layer['hidden_size']} is not a multiple of {heads} heads")
    # align's draft layer is a Qwen3 layer as vLLM's qwen3_dflash runs it: SiLU MLP, no attention bias, full or
    # sliding attention (below). Another activation would be read without error and draft other tokens.
    if layer.get("hidden_act", "silu") != "silu":
        raise bad("transformer_layer_config.hidden_act", f"is {layer['hidden_act']!r}; align's DFlash layers run silu")
    if layer.get("attention_bias"):
        raise bad("transformer_layer_config.attention_bias", "is true; align's DFlash layers have no attention bias")
    layer_types, window = layer.get("layer_types"), layer.get("sliding_window")
    if layer_types is not None:
        if not (isinstance(layer_types, list) and len(layer_types) == layer["num_hidden_layers"]):
            raise bad("transformer_layer_config.layer_types", f"is {repr(layer_types)[:40]} (expected a list of "
                      f"{layer['num_hidden_layers']} layer types, one a draft layer)")
        odd = [t for t in layer_types if t not in ("full_attention", "sliding_attention")]
        if odd:
            raise bad("transformer_layer_config.layer_types", f"holds {odd[0]!r}; align's DFlash layers run "
                      "full_attention and sliding_attention")
        if "sliding_attention" in layer_types and not _positive_int(window):
            raise bad("transformer_layer_config.sliding_window", f"is {window!r:.40} (expected a positive integer: "
                      "the window of its sliding_attention layers)")
    # vLLM's reading (its speculators config: dflash_config.causal = not sliding_window_non_causal, for every layer)
    causal = not raw.get("sliding_window_non_causal", True)
    if causal and "full_attention" in (layer_types or ["full_attention"]):
        warnings.warn(f"{folder}: sliding_window_non_causal is false, so vLLM serves its full_attention layers "
                      "block-causal, as align reads them; speculators' trainer trains full_attention layers "
                      "bidirectionally whatever the flag: if speculators trained this folder, set it true",
                      stacklevel=2)
    rope = layer.get("rope_parameters") or {}
    if not isinstance(rope, dict) or (rope.get("rope_theta") is not None and not _positive_number(rope["rope_theta"])):
        raise bad("transformer_layer_config.rope_parameters", "is not an object with a positive rope_theta")
    if rope.get("rope_type", "default") != "default":
        raise bad("transformer_layer_config.rope_parameters.rope_type",
                  f"is {rope['rope_type']!r}; align's DFlash layers apply default RoPE")
    vocab = layer["vocab_size"]
    ids = raw.get("aux_hidden_state_layer_ids")
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                  for i in ids)):
        raise bad("aux_hidden_state_layer_ids", f"is {'missing' if ids is None else repr(ids)[:40]} (expected a "
                  "non-empty list of verifier layer ids >= 0)")
    mask = raw.get("mask_token_id")
    if not (isinstance(mask, int) and not isinstance(mask, bool) and 0 <= mask < vocab):
        raise bad("mask_token_id", f"is {'missing' if mask is None else repr(mask)[:40]} (expected a token id "
                  f"below vocab_size {vocab})")
    for name, low in (("target_hidden_size", 1), ("block_size", 2)):
        value = raw.get(name)
        if value is not None and not (_positive_int(value) and value >= low):
            raise bad(name, f"is {value!r:.40} (expected an integer >= {low})")
    draft_vocab = raw.get("draft_vocab_size")
    if draft_vocab is not None and not (_positive_int(draft_vocab) and draft_vocab <= vocab):
        raise bad("draft_vocab_size", f"is {draft_vocab!r:.40} (expected an integer in [1, vocab_size {vocab}])")
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    rope_theta = rope.get("rope_theta", layer.get("rope_theta", 1000000.0))
    return DFlashConfig(
        vocab_size=vocab, hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"],
        num_hidden_layers=layer["num_hidden_layers"], num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=layer.get("head_dim"), rms_norm_eps=layer.get("rms_norm_eps", 1e-6), rope_theta=float(rope_theta),
        max_position_embeddings=layer.get("max_position_embeddings", 2048),
        target_hidden_size=raw.get("target_hidden_size"), aux_hidden_state_layer_ids=ids,
        block_size=raw.get("block_size", 8), mask_token_id=mask, draft_vocab_size=draft_vocab,
        layer_types=layer_types, sliding_window=window if layer_types and "sliding_attention" in layer_types else None,
        causal=causal, **({"dtype": dtype} if isinstance(dtype, str) else {}))


# Weights a speculators folder may carry that are the verifier's (align reads them from the verifier, speculators
# reloads them from it): never loaded, never required.
VERIFIER_COPIES = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")


def speculators_weight_shapes(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every weight align's DFlashDrafter loads, by speculators' name, and its shape: what `load_state_dict` needs,
    computed from the config alone (no module is built)."""
    h, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(config.aux_hidden_state_layer_ids) * config.target_hidden_size),
        "hidden_norm.weight": (h,), "norm.weight": (h,),
    }
    for i in range(config.num_hidden_layers):
        for name, shape in (("self_attn.q_proj.weight", (q, h)), ("self_attn.k_proj.weight", (kv, h)),
                            ("self_attn.v_proj.weight", (kv, h)), ("self_attn.o_proj.weight", (h, q)),
                            ("self_attn.q_norm.weight", (hd,)), ("self_attn.k_norm.weight", (hd,)),
                            ("mlp.gate_proj.weight", (inter, h)), ("mlp.up_proj.weight", (inter, h)),
                            ("mlp.down_proj.weight", (h, inter)), ("input_layernorm.weight", (h,)),
                            ("post_attention_layernorm.weight", (h,))):
            shapes[f"layers.{i}.{name}"] = shape
    if config.draft_vocab_size is not None:
        shapes.update({"lm_head.weight": (config.draft_vocab_size, h), "d2t": (config.draft_vocab_size,),
                       "t2d": (config.vocab_size,)})
    return shapes


def _header(folder: str, key: Optional[str]) -> tuple[dict[str, tuple[tuple[int, ...], str, str]], list[str]]:
    """name -> (shape, safetensors dtype, file) of every tensor of the folder's safetensors files, from their headers
    alone, and the files."""
    from pathlib import Path

    from safetensors import safe_open

    found: dict[str, tuple[tuple[int, ...], str, str]] = {}
    files = sorted(Path(folder).glob("*.safetensors"))
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    found[name] = (tuple(piece.get_shape()), str(piece.get_dtype()), path.name)
        except Exception as e:  # safetensors raises its own SafetensorError for a torn or foreign file
            raise _speculators_problem(folder, key, path.name, f"is not a readable safetensors file "
                                       f"({type(e).__name__})") from None
    return found, [p.name for p in files]


def check_speculators_weights(folder: str, config: DFlashConfig, key: Optional[str] = None) -> None:
    """The folder's weights hold every tensor align's DFlashDrafter loads, by name, shape and kind (from the
    safetensors headers: no tensor is read, but for the pruned vocabulary's small d2t/t2d maps, whose values index
    the verifier's vocabulary), and nothing else but the verifier's copies. One-line RecipeError naming the weight."""
    found, files = _header(folder, key)
    if not files:
        raise _speculators_problem(folder, key, "the folder", "has no *.safetensors weights")
    expected = speculators_weight_shapes(config)
    optional = {"t2d"}  # vLLM reads d2t alone; the loader rebuilds t2d from it
    if config.draft_vocab_size is None:
        optional.add("lm_head.weight")  # the verifier's head, which speculators may carry a copy of
        expected["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    expected["embed_tokens.weight"] = (config.vocab_size, config.hidden_size)
    optional.add("embed_tokens.weight")
    where = f"{files[0]}'s" if len(files) == 1 else "the weights'"
    for name, shape in expected.items():
        if name not in found:
            if name in optional:
                continue
            why = " (the map of its draft_vocab_size draft ids to the verifier's)" if name == "d2t" else ""
            raise _speculators_problem(folder, key, f"{where} {name}", f"is missing{why}; a DFlash drafter of "
                                       f"this config.json holds {len(expected) - len(optional)} weights")
        if found[name][0] != shape:
            raise _speculators_problem(folder, key, f"{found[name][2]}'s {name}", f"is {list(found[name][0])}; "
                                       f"config.json gives {list(shape)}{_shape_reason(name, config)}")
        kind = found[name][1]
        want = {"d2t": ("I64", "I32"), "t2d": ("BOOL", "U8")}.get(name, ("F32", "F16", "BF16", "F64"))
        if kind not in want:
            raise _speculators_problem(folder, key, f"{found[name][2]}'s {name}", f"is {kind} (expected "
                                       f"{' or '.join(want)})")
    unknown = sorted(n for n in found if n not in expected and n not in VERIFIER_COPIES)
    if unknown:
        raise _speculators_problem(folder, key, f"{found[unknown[0]][2]}'s {unknown[0]}", "is no weight of a "
                                   f"DFlash drafter of this config.json ({config.num_hidden_layers} draft layers, "
                                   f"draft_vocab_size {config.draft_vocab_size or config.vocab_size})")
    if config.draft_vocab_size is not None:
        _check_vocab_maps(folder, config, found, key)


def _shape_reason(name: str, config: DFlashConfig) -> str:
    if name == "fc.weight":
        return (f" (aux_hidden_state_layer_ids names {len(config.aux_hidden_state_layer_ids)} layers of "
                f"target_hidden_size {config.target_hidden_size})")
    return ""


def _check_vocab_maps(folder: str, config: DFlashConfig, found: dict[str, Any], key: Optional[str]) -> None:
    """d2t gives ascending verifier ids inside the vocabulary (DraftVocab maps targets to draft ids by a running
    count over them), and t2d, when there, marks exactly those."""
    from pathlib import Path

    from safetensors import safe_open

    def tensor(name: str) -> torch.Tensor:
        with safe_open(str(Path(folder) / found[name][2]), framework="pt") as f:
            return f.get_tensor(name)

    targets = torch.arange(config.draft_vocab_size) + tensor("d2t").long()
    if bool((targets < 0).any() or (targets >= config.vocab_size).any()):
        raise _speculators_problem(folder, key, f"{found['d2t'][2]}'s d2t", "maps a draft id outside the verifier's "
                                   f"vocabulary (d2t[i] + i must be in [0, {config.vocab_size}))")
    if bool((targets[1:] <= targets[:-1]).any()):
        raise _speculators_problem(folder, key, f"{found['d2t'][2]}'s d2t", "does not map draft ids to ascending, "
                                   "distinct verifier ids (speculators' order)")
    if "t2d" in found:
        t2d = tensor("t2d").bool()
        if int(t2d.sum()) != config.draft_vocab_size or not bool(t2d[targets].all()):
            raise _speculators_problem(folder, key, f"{found['t2d'][2]}'s t2d", "does not mark the verifier ids d2t "
                                       "maps to")


def check_speculators_folder(folder: str, key: Optional[str] = None) -> DFlashConfig:
    """A speculators-format DFlash folder checked against its format before any model is built: config.json
    (`speculators_dflash_config`) and its weights' names, shapes and kinds (`check_speculators_weights`). Returns the
    config. What it does not know, the verifier's depth and width, is `check_dflash_verifier`'s."""
    config = speculators_dflash_config(folder, key)
    check_speculators_weights(folder, config, key)
    return config


def check_dflash_verifier(config: DFlashConfig, verifier_config: Any, key: str, folder: str) -> None:
    """A DFlash drafter (speculators' or align's) against the verifier it drafts for, from their configs: it reads
    the verifier's hidden states at layers it has, of its width, and its embeddings. Called right after the
    verifier's config.json is read (preflight.check_models), before any weight loads."""
    from align.config import RecipeError

    text = verifier_config.get_text_config() if hasattr(verifier_config, "get_text_config") else verifier_config
    layers, width = text.num_hidden_layers, text.hidden_size
    beyond = [i for i in config.aux_hidden_state_layer_ids if i >= layers]
    if beyond:
        raise RecipeError(f"{key}: {folder}: aux_hidden_state_layer_ids {list(config.aux_hidden_state_layer_ids)} "
                          f"must be below the verifier's {layers} layers (id k is the input of layer k)")
    for name, value in (("target_hidden_size", config.target_hidden_size), ("hidden_size", config.hidden_size)):
        if value != width:
            raise RecipeError(f"{key}: {folder}: {name} {value} differs from the verifier's hidden_size {width} "
                              "(a DFlash drafter reads the verifier's hidden states and embeddings)")


def load_speculators_dflash(folder: str, device: Optional[torch.device] = None,
                            key: Optional[str] = None) -> DFlashDrafter:
    """A speculators-format DFlash folder (align's export, or speculators' own) as align's DFlash drafter, checked
    first (`check_speculators_folder`). The verifier's embeddings and LM head in it are not kept: align reads them
    from the verifier; a pruned head (a `draft_vocab_size` below the vocabulary, with `d2t`/`t2d`) is the drafter's
    own and is kept."""
    from pathlib import Path

    from safetensors.torch import load_file

    config = check_speculators_folder(folder, key)
    weights = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        weights.update(load_file(str(path)))
    dtype = weights["fc.weight"].dtype
    drafter = DFlashDrafter(config).to(dtype)
    ignored = VERIFIER_COPIES + (() if config.draft_vocab_size else ("lm_head.weight",))
    if config.draft_vocab_size and "t2d" not in weights:  # vLLM reads d2t alone; speculators writes both
        weights["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool)
        weights["t2d"][torch.arange(config.draft_vocab_size) + weights["d2t"]] = True
    drafter.load_state_dict({k: v for k, v in weights.items() if k not in ignored})
    return drafter.to(device or torch.device("cpu")).eval()
